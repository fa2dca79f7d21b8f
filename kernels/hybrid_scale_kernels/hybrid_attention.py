"""Fused hybrid attention in Triton: forward, backward, exact for any window, length, padding and mode.

Each program of the forward takes one packed query tile of `block` rows for one (batch, KV head): the (position,
query head) pairs of the KV head's G query heads, position-major, so a tile holds block / G positions of every head
of the group (GQA: keys, values, phi_k and the LA state exist once per KV head, and each tile of them is read once
for the whole group, as in fla's and FlashAttention's packed GQA). For a query tile of positions [m0, m1] it
  1. streams the key tiles [lo, m1] with lo = the tile start at or before m0 - w + 1: online softmax over the
     window keys (the exact per-query max c_n over real keys: the running max ends as that max; its argmax is kept
     for the backward), and the masked intra-tile LA terms of keys j <= n - w; a tile with no window key (or no LA
     key) for any of its queries skips that part;
  2. adds the sinks (swa_sinks, and the hybrid with its sinks: the first S real keys once they have left the window,
     gamma-weighted in the hybrid, whose LA leaves them out: the wrapper zeroes their phi_k; sinks_only: all of them);
  3. adds the LA numerator and denominator of every key before lo from the fp32 prefix state of whole key tiles
     (one [F, D] matrix and one [F] vector per KV head and tile boundary, made by `_states_fwd`, one program per
     KV head and feature chunk walking the tiles in order);
  4. writes y = (gamma sum E v + sum L v) / (gamma sum E + sum L + EPS), with one shared normaliser, and saves c_n,
     the denominator and the argmax per query for the backward.
The backward recomputes (the states too) and is split so that few tiles are live in any kernel: `_bwd_dq` (dq of
the softmax terms, gamma's per-query sum), `_bwd_dfq` (dphi_q per feature chunk), `_states_bwd` (the gradient of
every key tile's share of the state, per KV head and feature chunk, in reverse time over the packed query tiles),
`_bwd_dkv` (dk, dv of the window terms; then dv of the LA terms and the state; per key tile, over the packed query
tiles that reach it), `_bwd_dfk` (dphi_k per feature chunk) and `_bwd_sinks`. The gradient through c_n (which is
not detached, docs/design.md §2) reaches only the argmax key and is added outside the kernels. The feature dim is
always walked in chunks (`fchunk`), so no [tile, F] or [F, D] tile stays in registers.

Rows whose real tokens are one contiguous span [start, end) are handled in place (left padding, right padding, no
padding); other masks are packed first. Half inputs run q.k, p.v and the feature-map dots on the tensor cores in
their dtype with fp32 accumulation, and the state dots in tf32 on fp32; fp32 inputs run IEEE fp32 under the
interpreter and on a GPU (`_precision`). Tiles per dtype: `GPU_TILES`, checked by
tools/kernel_compile.py for sm_80 and sm_90.
The kernels are in forward_kernels.py and backward_kernels.py; the backward kernels recompute exactly what `_fwd`
computes, through the same jit helpers (jit_helpers.py). This file holds what runs on the host: the tiles per dtype,
the launch settings, and the autograd Function that launches the forward and the backward kernels and saves what
the backward reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .backward_kernels import SINK_TILES, _bwd_dfk, _bwd_dfq, _bwd_dkv, _bwd_dq, _bwd_sinks, _states_bwd
from .chunk_backward import chunked_path
from .forward_kernels import _fwd, _states_fwd
from .jit_helpers import EPS, MODES, mode_parts


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(x)))


def _real_index(attention_mask, batch, length, device):
    """Each token's index among its row's real tokens [B, T] (padding: -1)."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    real = attention_mask.bool()
    return torch.where(real, real.long().cumsum(-1) - 1, -1)


def _spans(attention_mask, batch, length, device):
    """(start, end) int32 [B] of each row's real tokens if they form one contiguous span in every row, else None."""
    if attention_mask is None:
        full = torch.full((batch,), length, dtype=torch.int32, device=device)
        return torch.zeros_like(full), full
    real = attention_mask.bool()
    count = real.sum(-1)
    first = torch.where(count > 0, real.int().argmax(-1), 0)
    pos = torch.arange(length, device=device)
    contiguous = (real == ((pos >= first[:, None]) & (pos < (first + count)[:, None]))).all()
    if not bool(contiguous):
        return None
    return first.to(torch.int32), (first + count).to(torch.int32)


def chunk_states(fk, v, start, end, block, init_kv=None, init_k=None, tiles=None, rho=None):
    """Exclusive prefix LA state at each key-block boundary: kv [B,Hkv,NC,F,D], k [B,Hkv,NC,F] (fp32),
    state c = sum over real keys in blocks 0..c-1 of phi_k(k) v^T and phi_k(k), plus the initial state if given
    (kv [B,Hkv,F,D], k [B,Hkv,F]: keys before the sequence). rho [Hkv] (fp32): the LA's decay, state c kept as
    token max(c * block, start) - 1 sees it (`_ref`). One Triton program per feature chunk and KV head."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    nc = triton.cdiv(T, block)
    tiles = tiles or Tiles(block, 4, min(_pow2(F), 64))
    fchunk = tiles.of("_states_fwd")[1]
    kv = torch.empty(B, Hkv, nc, F, D, dtype=torch.float32, device=fk.device)
    ks = torch.empty(B, Hkv, nc, F, dtype=torch.float32, device=fk.device)
    has_init = init_kv is not None and init_kv.numel() > 0
    init_kv, init_k = (init_kv.float().contiguous(), init_k.float().contiguous()) if has_init else (kv, ks)
    decay = rho is not None and rho.numel() > 0
    _states_fwd[(triton.cdiv(F, fchunk), B * Hkv)](
        fk.contiguous(), v.contiguous(), start, end, init_kv, init_k, rho if decay else ks, kv, ks, T, Hkv, F, D, nc,
        HAS_INIT=has_init, DECAY=decay, BLOCK=block, BLOCK_FC=fchunk, BLOCK_D=_pow2(D), DT=_DT[fk.dtype],
        PREC=_precision(fk), **tiles.launch("_states_fwd"),
    )  # fmt: skip
    return kv, ks


_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _precision(x: torch.Tensor) -> str:
    """tl.dot's input precision. Half inputs: their products on the tensor cores, and the fp32 state dots in tf32
    (exact for values that came from half). fp32 inputs: IEEE fp32 (three TF32 passes, "tf32x3", need three times
    the operand registers and spill far more at these tiles: checked with tools/kernel_compile.py)."""
    return "tf32" if x.dtype in (torch.float16, torch.bfloat16) else "ieee"


def _settings(q, k, fq, window, mode, sinks, block, hybrid_sinks=False, decay=False):
    """The launch settings of a call. lin_off: an L term needs j <= n - lin_off (the hybrid: the window; la_only: 0).
    st_off: a query tile streams its keys from the tile at or before its first query - st_off + 1 and takes the rest
    from the state: the window in the hybrid, and in la_only with a decay, whose keys inside the window must count 1
    (without a decay la_only streams only its own tile). DECAY: the LA decays (rho given, a mode with an LA)."""
    soft, lin, sink, hybrid = mode_parts(mode, hybrid_sinks)
    B, H, T, D = q.shape
    F = fq.shape[-1]
    lin_off = int(window) if mode == "hybrid" else 0
    decay = bool(decay) and lin
    return dict(
        T=T, H=H, G=H // k.shape[1], D=D, F=F, window=int(window), lin_off=lin_off,
        st_off=int(window) if (mode == "hybrid" or decay) else 0, DECAY=decay, SPLIT=decay and mode == "la_only",
        BLOCK=block, BLOCK_D=_pow2(D), SOFT=soft, LIN=lin, HYBRID=hybrid,
        sink_off=int(window) if soft and sink else 0, n_sinks=int(sinks) if sink else 0, SINKS=sink,
        DT=_DT[q.dtype], PREC=_precision(q),
    )  # fmt: skip


class _HybridAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fq, fk, gamma, rho, init_kv, init_k, start, end, window, mode, sinks, hybrid_sinks,
                scale, tiles):  # fmt: skip
        block = tiles.block
        B, H, T, D = q.shape
        s = _settings(q, k, fq, window, mode, sinks, block, hybrid_sinks, rho.numel() > 0)
        r = rho.detach().float().contiguous() if s["DECAY"] else None
        nm = triton.cdiv(T, block)
        nq = triton.cdiv(T * s["G"], block)  # packed query tiles (GQA: all heads of a KV head at once)
        f32 = dict(dtype=torch.float32, device=q.device)
        # for a backward, y in fp32 (its delta, _delta), returned in q's dtype; else y in q's dtype directly
        y = torch.empty(B, H, T, D, **f32) if any(ctx.needs_input_grad) else torch.empty_like(q)
        c, z, den_e, den_l = (torch.empty(B, H, T, **f32) for _ in range(4))
        idx = torch.empty(B, H, T, dtype=torch.int32, device=q.device)
        if s["LIN"]:
            state_kv, state_k = chunk_states(fk, v, start, end, block, init_kv, init_k, tiles, r)
        else:
            state_kv = state_k = c  # unused
        g = gamma.detach().to(torch.float32).contiguous()
        fchunk = tiles.of("_fwd")[1]
        _fwd[(nq, B * k.shape[1])](
            q, k, v, fq, fk, g, g if r is None else r, state_kv, state_k, start, end, y, c, z, den_e, den_l, idx,
            s["T"], s["H"], s["G"], s["D"], s["F"], nm, s["window"], s["lin_off"], s["st_off"], s["sink_off"],
            s["n_sinks"], scale, BLOCK=block, BLOCK_D=s["BLOCK_D"], BLOCK_FC=fchunk, BLOCK_S=_pow2(max(sinks, 1)),
            SOFT=s["SOFT"], LIN=s["LIN"], SINKS=s["SINKS"], HYBRID=s["HYBRID"], DECAY=s["DECAY"], DT=s["DT"],
            PREC=s["PREC"], **tiles.launch("_fwd"),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, fq, fk, gamma, rho, init_kv, init_k, start, end, y, c, z, idx)
        ctx.opts = (window, mode, sinks, hybrid_sinks, scale, tiles)
        ctx.mark_non_differentiable(den_e, den_l)
        return y.to(q.dtype), den_e, den_l

    @staticmethod
    @once_differentiable  # (a second derivative would need kernels of its own: refused, not silently partial)
    def backward(ctx, dy, _de, _dl):
        q, k, v, fq, fk, gamma, rho, init_kv, init_k, start, end, y, c, z, idx = ctx.saved_tensors
        window, mode, sinks, hybrid_sinks, scale, tiles = ctx.opts
        block = tiles.block
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        s = _settings(q, k, fq, window, mode, sinks, block, hybrid_sinks, rho.numel() > 0)
        r = rho.detach().float().contiguous() if s["DECAY"] else None
        nm, F, G = triton.cdiv(T, block), s["F"], s["G"]
        nq = triton.cdiv(T * G, block)
        f32 = dict(dtype=torch.float32, device=q.device)
        dy = dy.contiguous()
        delta = _delta(dy, y, z, q.dtype)
        g = gamma.detach().to(torch.float32).contiguous()

        def common(kernel, decay=s["DECAY"]):
            """The launch settings of one kernel, and its feature chunk (a decayed LA's own where Tiles has one)."""
            kernel = tiles.name(kernel, decay)
            opts = dict(BLOCK=block, BLOCK_D=s["BLOCK_D"], DT=s["DT"], PREC=s["PREC"], **tiles.launch(kernel))
            return opts, tiles.of(kernel)[1]

        dq = torch.empty(B, H, T, D, **f32)
        rsum = torch.empty(B, H, T, **f32)
        opts, _ = common("_bwd_dq")
        parts = [p for p in ("SOFT", "SINKS") if s[p]] or ["SOFT"]  # (la_only: one launch writes the zeros)
        for i, part in enumerate(parts):  # the window terms, then the sinks' added to dq
            _bwd_dq[(nq, B * Hkv)](
                q, k, v, g, start, end, dy, c, z, delta, dq, rsum,
                T, H, G, D, s["window"], s["sink_off"], s["n_sinks"], scale, BLOCK_S=_pow2(max(sinks, 1)),
                SOFT=part == "SOFT" and s["SOFT"], SINKS=part == "SINKS", HYBRID=s["HYBRID"], ACC=i > 0, **opts,
            )  # fmt: skip
        has_init = init_kv.numel() > 0
        d_init = (torch.zeros_like(init_kv), torch.zeros_like(init_k)) if has_init else (None, None)
        rp = g if r is None else r  # (a pointer the kernels do not read without a decay)
        if s["LIN"]:
            # la_only with a decay (SPLIT): its L terms past the window are the hybrid's (lin_off = w), and its
            # window terms (weight 1) a second launch of the same kernel: rho's gradient takes the first part alone
            lin_off = s["window"] if s["SPLIT"] else s["lin_off"]
            state_kv, state_k = chunk_states(fk, v, start, end, block, init_kv, init_k, tiles, r)
            dfq = torch.empty(B, H, T, F, **f32)
            dfq_w = torch.empty(B, H, T, F, **f32) if s["SPLIT"] else None
            opts, fc = common("_bwd_dfq")
            for out, window_part in ((dfq, False), (dfq_w, True)):
                if out is not None:
                    _bwd_dfq[(nq, B * Hkv, triton.cdiv(F, fc))](
                        fq, fk, v, rp, state_kv, state_k, start, end, dy, z, delta, out, T, H, G, D, F, nm,
                        s["window"], 0 if window_part else lin_off, s["st_off"], BLOCK_FC=fc,
                        DECAY=s["DECAY"] and not window_part, WINDOW=window_part, **opts,
                    )  # fmt: skip
            del state_kv, state_k
            g_kv = torch.empty(B, Hkv, nm, F, D, **f32)
            g_k = torch.empty(B, Hkv, nm, F, **f32)
            opts, fc = common("_states_bwd")
            _states_bwd[(triton.cdiv(F, fc), B * Hkv)](
                fq, start, end, dy, z, delta, rp, g_kv, g_k, *(d_init if has_init else (g_kv, g_k)),
                T, H, G, D, F, nm, nq, s["window"], s["st_off"], HAS_INIT=has_init, DECAY=s["DECAY"], BLOCK=block,
                BLOCK_D=s["BLOCK_D"], BLOCK_FC=fc, PREC=s["PREC"], **tiles.launch("_states_bwd"),
            )  # fmt: skip
            dfk = torch.empty(B, Hkv, T, F, **f32)
            dfk_w = torch.empty(B, Hkv, T, F, **f32) if s["SPLIT"] else None
            opts, fc = common("_bwd_dfk")
            for out, window_part in ((dfk, False), (dfk_w, True)):
                if out is not None:
                    _bwd_dfk[(nm, B * Hkv, triton.cdiv(F, fc))](
                        fq, v, rp, start, end, dy, z, delta, g_kv, g_k, out, T, H, G, D, F, nm, s["window"],
                        0 if window_part else lin_off, s["st_off"], BLOCK_FC=fc, DECAY=s["DECAY"] and not window_part,
                        WINDOW=window_part, **opts,
                    )  # fmt: skip
        else:
            dfq = torch.zeros(B, H, T, F, **f32)
            dfk = torch.zeros(B, Hkv, T, F, **f32)
            g_kv = rsum  # unused
        dk = torch.zeros(B, Hkv, T, D, **f32) if not s["SOFT"] else torch.empty(B, Hkv, T, D, **f32)
        dv = torch.zeros_like(dk) if not (s["SOFT"] or s["LIN"]) else torch.empty_like(dk)
        for part in ("SOFT", "LIN"):  # the window terms, then the LA terms added to dv
            if s[part]:
                opts, fc = common("_bwd_dkv", s["DECAY"] and part == "LIN")
                _bwd_dkv[(nm, B * Hkv)](
                    q, k, v, fq, fk, g, rp, start, end, dy, c, z, delta, g_kv, dk, dv,
                    T, H, G, D, F, nm, s["window"], s["lin_off"], s["st_off"], scale, BLOCK_FC=fc,
                    SOFT=part == "SOFT", LIN=part == "LIN", HYBRID=s["HYBRID"], ACC=part == "LIN" and s["SOFT"],
                    DECAY=s["DECAY"] and part == "LIN", **opts,
                )  # fmt: skip
        if s["SINKS"]:
            bs = _pow2(max(sinks, 1))
            nsplit = triton.cdiv(nm, SINK_TILES)
            dks, dvs = (torch.empty(nsplit, B, Hkv, bs, D, **f32) for _ in range(2))
            z_sinks, delta_sinks = z, delta
            if s["HYBRID"]:  # the hybrid's sinks: gamma-weighted (delta rounded as the sinks' dots round dy/Z)
                z_sinks = (z / g.view(1, H, 1)).contiguous()
                delta_sinks = _delta(dy, y, z_sinks, q.dtype)
            for out, is_dk in ((dks, True), (dvs, False)):
                _bwd_sinks[(nsplit, B * Hkv)](
                    q, k, v, start, end, dy, c, z_sinks, delta_sinks, out, T, H, G, D, s["sink_off"], s["n_sinks"],
                    scale, SINK_TILES, BLOCK_S=bs, DK=is_dk, **common("_bwd_sinks")[0],
                )  # fmt: skip
            dks, dvs = dks.sum(0), dvs.sum(0)
            pos = (start.long()[:, None] + torch.arange(bs, device=q.device)).clamp(max=T - 1)
            ok = (torch.arange(bs, device=q.device)[None] < sinks) & (pos < end.long()[:, None])
            index = pos[:, None, :, None].expand(B, Hkv, bs, D)
            dk.scatter_add_(2, index, dks * ok[:, None, :, None])
            dv.scatter_add_(2, index, dvs * ok[:, None, :, None])
        dgamma = None
        if s["HYBRID"]:
            # the gradient through c_n = max over the window reaches the argmax key only: dc_n = -sum_j dE_nj E_nj
            dc = -rsum
            index = idx.long()
            per_kv = index.view(B, Hkv, G * T)[..., None].expand(-1, -1, -1, D)
            dq += scale * dc[..., None] * k.float().gather(2, per_kv).view(B, H, T, D)
            dk.scatter_add_(2, per_kv, (scale * dc[..., None] * q.float()).view(B, Hkv, -1, D))
            if gamma.requires_grad:
                dgamma = (rsum.sum((0, 2)) / gamma.detach().float()).to(gamma.dtype)
        elif gamma.requires_grad:
            dgamma = torch.zeros_like(gamma)
        drho = None
        if rho.requires_grad:
            drho = torch.zeros_like(rho)
            if s["DECAY"]:
                init = (init_kv, init_k) if has_init else None
                drho = _rho_grad(fq, fk, dfq, dfk, dy, z, delta, start, end, window, r, init).to(rho.dtype)
        if s["LIN"] and s["SPLIT"]:  # (after rho's gradient, which takes the terms past the window alone)
            dfq += dfq_w
            dfk += dfk_w
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dfq.to(fq.dtype), dfk.to(fk.dtype), dgamma, drho,
            *d_init, None, None, None, None, None, None, None, None,
        )  # fmt: skip


def _delta(dy: torch.Tensor, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta [B,H,T] for the backward kernels, whose window and sink terms form dp = (dy/Z) . v_j - delta/Z with dy/Z
    rounded to the inputs' dtype for their dots: delta = Z ((dy/Z) rounded the same way) . y, y the forward's fp32
    output. Where the softmax makes up the whole output (no LA yet) the two halves of dp cancel, so delta must carry
    the same rounding: dy . y (fp32 products of the bf16 output) left bf16's rounding differences, and gamma's
    gradient came out 13 % off at window 1 on an H200 (docs/results/gpu_check.md). (The LA state dots take dy/Z in
    tf32, a finer rounding than this delta's: a gap of bf16's size there, as before.) Padding rows (Z = EPS, y = 0)
    get 0."""
    zs = torch.where(z > EPS, z, torch.ones_like(z))[..., None]
    return (zs * ((dy.float() / zs).to(dtype).float() * y.float())).sum(-1).contiguous()


def _rho_grad(fq, fk, dfq, dfk, dy, z, delta, start, end, window, rho, init):
    """rho's gradient [Hkv] from the kernels' outputs. An L term of query n and key j weighted alpha^e, e = n - w - j,
    has d/drho = -e times its share of the loss, and its share is in both phi_q . dphi_q (row n) and phi_k . dphi_k
    (key j); so the sum of -e over every term is -sum_n n (phi_q . dphi_q)_n + sum_j (w + j)(phi_k . dphi_k)_j. Two
    kinds of term are not of that form: la_only's keys inside the window (weight 1), which the caller leaves out of
    dfq and dfk (a separate launch computes them: subtracting them after would cancel), and the initial state's
    terms (exponent max(0, n - w + 1)), whose share per row is recomputed here from the state and moved. Sums in
    fp64: the two position-weighted sums nearly cancel at long lengths."""
    B, H, T, _ = fq.shape
    Hkv = fk.shape[1]
    f64 = torch.float64
    pos = torch.arange(T, device=fq.device)[None] - start.long()[:, None]  # real index (padding: outside [0, n))
    real = (pos >= 0) & (pos < (end - start).long()[:, None])
    xq = (dfq.to(f64) * fq.to(f64)).sum(-1)  # [B, H, T]
    xk = (dfk.to(f64) * fk.to(f64)).sum(-1)  # [B, Hkv, T]
    n = torch.where(real, pos, 0).to(f64)[:, None]
    drho = (-(n * xq)).view(B, Hkv, H // Hkv, T).sum((0, 2, 3)) + ((window + n) * xk).sum((0, 2))
    if init is not None:  # the initial state's share per row: alpha^e(n) phi_q . (kv dy / Z - k delta / Z)
        group = H // Hkv
        kv, ksum = (t.to(f64).repeat_interleave(group, dim=1) for t in init)
        e = (pos - (window - 1)).clamp(min=0).to(f64)[:, None]
        lag = torch.exp(-rho.to(f64).repeat_interleave(group).view(1, H, 1) * e)
        zz = z.to(f64)
        fq64 = fq.to(f64)
        share = ((fq64 @ kv) * dy.to(f64)).sum(-1) / zz - (fq64 @ ksum[..., None])[..., 0] * delta.to(f64) / zz
        share = torch.where(real[:, None], lag * share, 0.0)
        drho = drho + ((n - e) * share).view(B, Hkv, group, T).sum((0, 2, 3))
    return drho


@dataclass(frozen=True)
class Tiles:
    """The tile rows every kernel of one call shares (the LA state is kept per tile), and each kernel's warps,
    feature chunk and register cap: `warps` / `fchunk` / none unless `per_kernel` ((name, warps, fchunk, maxnreg),
    ...) says otherwise (maxnreg None: ptxas chooses)."""

    block: int
    warps: int = 4
    fchunk: int = 32
    per_kernel: tuple = ()

    def name(self, kernel: str, decay: bool) -> str:
        """The entry a kernel's launch takes: "<kernel>+decay" for a decayed LA where per_kernel has one."""
        own = kernel + "+decay"
        return own if decay and any(entry[0] == own for entry in self.per_kernel) else kernel

    def of(self, kernel: str) -> tuple[int, int, int | None]:
        """(num_warps, feature chunk, maxnreg) of one kernel."""
        for name, warps, fchunk, maxnreg in self.per_kernel:
            if name == kernel:
                return warps, fchunk, maxnreg
        return self.warps, self.fchunk, None

    def launch(self, kernel: str) -> dict:
        """The launch options of one kernel."""
        warps, _, maxnreg = self.of(kernel)
        return dict(num_warps=warps) if maxnreg is None else dict(num_warps=warps, maxnreg=maxnreg)


# On a GPU, by dtype and head dim (<= 64, <= 128): what tools/kernel_compile.py (--tune) found to compile
# without register spills (fp32: within its budget) and within shared memory on sm_80 and sm_90 at every preset's
# head shapes (docs/results/kernel_compile.md; a test fails if that changes). 64-row tiles would turn the half dots
# into wgmma on sm_90 but spill in the backward (docs/results/kernel_tiles.md): 32 rows until a GPU weighs the two.
# A decayed LA's backward (attention.la_decay) holds the decay weights besides the same tiles: at head dim 128 in half
# precision its _bwd_dfq, _bwd_dfk and LA launch of _bwd_dkv spill 16-80 bytes on sm_90 with 32-wide feature chunks
# and none with 16 (tools/kernel_compile.py); the undecayed launches keep theirs.
_DECAYED_HALF_128 = tuple((name + "+decay", 8, 16, None) for name in ("_bwd_dfq", "_bwd_dfk", "_bwd_dkv"))
# fmt: off
GPU_TILES = {
    ("half", 64): Tiles(32, 8, 32, per_kernel=(("_bwd_sinks", 4, 32, None),)),
    ("half", 128): Tiles(32, 8, 32, per_kernel=(("_bwd_sinks", 8, 32, 255), *_DECAYED_HALF_128)),
    ("fp32", 64): Tiles(16, 8, 32),
    ("fp32", 128): Tiles(16, 8, 32, per_kernel=(("_bwd_dfk", 4, 32, None), ("_bwd_dfq", 8, 16, None))),
}
# fmt: on


def default_tiles(device: torch.device, head_dim: int, feature_dim: int, dtype=torch.bfloat16) -> Tiles:
    """16 rows under the interpreter (CPU tensors: tiny test shapes still cross several tiles); on a GPU (and on the
    meta device, which stands for one in the compile check) GPU_TILES by dtype and head dim."""
    if device.type == "cpu":
        return Tiles(16, 4, min(_pow2(feature_dim), 64))
    return GPU_TILES["fp32" if dtype == torch.float32 else "half", 64 if head_dim <= 64 else 128]


def triton_hybrid_attention(
    q,
    k,
    v,
    fq,
    fk,
    gamma,
    *,
    window,
    mode="hybrid",
    sinks=8,
    hybrid_sinks=False,
    scale=None,
    attention_mask=None,
    chunk_size=None,
    initial_state=None,
    return_denominators=False,
    la_decay=None,
    block=None,
    num_warps=None,
    fchunk=None,
):
    """The attention backend contract of hybrid_scale/attention/backends.py, computed by the fused kernels.
    chunk_size is ignored (the tile is `block`, the feature chunk `fchunk`: by default_tiles). initial_state: optional
    (kv [B,Hkv,F,D], k [B,Hkv,F]) sums over keys that precede the sequence by more than the window (differentiable;
    with la_decay as query w - 1 of the sequence sees them). la_decay: rho [Hkv] >= 0, the LA's decay (naive.py's
    spec; differentiable), None = off."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode '{mode}'; available: {', '.join(MODES)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    tiles = default_tiles(q.device, q.shape[-1], fq.shape[-1], q.dtype)
    if block or num_warps or fchunk:  # asked for: every kernel gets them
        tiles = Tiles(block or tiles.block, num_warps or tiles.warps, fchunk or tiles.fchunk)
    hybrid_sinks = bool(hybrid_sinks) and mode == "hybrid"
    if sinks > 64 and (mode in ("swa_sinks", "sinks_only") or hybrid_sinks):
        raise ValueError(f"the triton backend keeps at most 64 sinks in one tile, got {sinks}")
    B, H, T, D = q.shape
    if mode == "none" or T == 0:
        y = q.new_zeros(B, H, T, v.shape[-1])
        zero = q.new_zeros(B, H, T, dtype=torch.float32)
        return (y, zero, zero.clone()) if return_denominators else y
    if v.shape[-1] != D:
        raise ValueError(f"the triton backend needs value dim == head dim, got {v.shape[-1]} and {D}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dtype = q.dtype
    k, v, fq, fk = (t.to(dtype) for t in (k, v, fq, fk))
    if not (return_denominators or block or num_warps or fchunk):  # chunk_prefill.py where it takes the case
        y = chunked_path(q, k, v, fq, fk, gamma, window=window, mode=mode, sinks=sinks, scale=scale,
                         hybrid_sinks=hybrid_sinks, la_decay=la_decay, attention_mask=attention_mask,
                         initial_state=initial_state)  # fmt: skip
        if y is not None:
            return y
    if hybrid_sinks:  # the hybrid's LA leaves its sinks out: their phi_k is 0 (and so is its gradient)
        fk = fk * (_real_index(attention_mask, B, T, q.device) >= sinks)[:, None, :, None].to(dtype)
    spans = _spans(attention_mask, B, T, q.device)
    order = None
    if spans is None:  # padding not in one span per row: move real tokens to the front (stable), then back
        real = attention_mask.bool()
        order = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)
        q, k, v, fq, fk = (_gather(t, order) for t in (q, k, v, fq, fk))
        count = real.sum(-1).to(torch.int32)
        spans = (torch.zeros_like(count), count)
    q, k, v, fq, fk = (t.contiguous() for t in (q, k, v, fq, fk))
    options = (window, mode, sinks, hybrid_sinks, scale, tiles)
    if initial_state is None:
        init = (q.new_zeros(0), q.new_zeros(0))
    else:
        init = tuple(t.float().contiguous() for t in initial_state)
    if la_decay is not None and tuple(la_decay.shape) != (k.shape[1],):
        raise ValueError(f"la_decay must hold one rho per KV head ({k.shape[1]}), got shape {tuple(la_decay.shape)}")
    rho = q.new_zeros(0, dtype=torch.float32) if la_decay is None else la_decay
    y, den_e, den_l = _HybridAttention.apply(q, k, v, fq, fk, gamma, rho, *init, *spans, *options)
    if order is not None:
        inverse = torch.argsort(order, dim=-1)
        y, den_e, den_l = (
            _gather(y, inverse),
            _gather(den_e[..., None], inverse)[..., 0],
            _gather(den_l[..., None], inverse)[..., 0],
        )
    return (y, den_e, den_l) if return_denominators else y


def _gather(x, index):
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))
