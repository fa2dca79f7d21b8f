"""The chunked hybrid attention's backward (chunk_prefill.py has the forward and the host code both share): its
kernels, the autograd Function `ChunkAttention`, `chunk_attention` (its entry, for the cases chunk_prefill takes) and
`chunked_path`, what triton_hybrid_attention calls: the chunked forward without gradients, ChunkAttention with them,
None where neither takes the case (the caller then runs the fused kernels).

The backward (`ChunkAttention`). Per row n: Z_n the normaliser, do_n = dy_n / Z_n (rounded to the inputs' dtype for
the products, as hybrid_attention._delta rounds it), and dlz_n = delta_n / Z_n = do_n . y_n (y the forward's fp32
output); every term p_nj of the numerator (g E or L) has dp_nj = do_n . v_j - dlz_n. The window and sink terms give
ds = p dp (dq, dk through s q.k), the L terms dphi through dp times their weight, and c_n (not detached) gives
-sum_j ds_nj to its argmax key. The launches: `_chunk_states` (the forward's states again), `_chunk_bwd_dq` (per
query head and chunk: dq, dphi_q, dlz, the row sums of ds, the sinks' ds and E per row, whose dk, dv the host sums),
`_chunk_dstates` (the reverse scan: the gradient of every state, summed over the KV head's query heads),
`_chunk_bwd_dkv` twice (per KV head, key chunk and head-dim block, looping over its query heads: dk, then dv) and
`_chunk_bwd_dfk` (per KV head and key chunk: dphi_k). Every [64, D] operand is walked in head-dim chunks and every
transposed operand is loaded transposed (so it goes through shared memory, not registers): no kernel spills at the
presets' shapes. rho's gradient is taken term by term where each weight is made (no position-weighted sums that
cancel): the intra-chunk L terms (-e p dp, in `_chunk_bwd_dfk`), a query's lag on its state, each state's carry
alpha^CHUNK in the scan, and each key's weight inside its chunk.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from .chunk_backward_kernels import _chunk_bwd_dfk, _chunk_bwd_dkv, _chunk_bwd_dq, _chunk_dstates
from .chunk_prefill import (
    _DT,
    CHUNK,
    _forward,
    _parts,
    _pow2,
    _prepare,
    _regs,
    _settings,
    _states,
    answer,
    chunk_prefill,
)


class ChunkAttention(torch.autograd.Function):
    """chunk_prefill's forward with a backward (training): the forward keeps y in fp32 (for dlz, as the fused path
    does) and c_n, Z_n and c_n's argmax per row; the backward recomputes the states and every score tile. Gradients of
    q, k, v, phi_q, phi_k in their dtype, of gamma (the hybrid's only) and of rho (the decay)."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, gamma, rho, window, mode, sinks, hybrid_sinks, scale):
        r = None if rho is None else rho.detach().float().contiguous()
        y, (m, zs, idx) = _forward(q, k, v, fq, fk, gamma, r, window=window, mode=mode, sinks=sinks,
                                   hybrid_sinks=hybrid_sinks, scale=scale, stats=True)  # fmt: skip
        ctx.save_for_backward(q, k, v, fq, fk, gamma, rho, y, m, zs, idx)
        ctx.opts = (window, mode, sinks, hybrid_sinks, scale)
        return y.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        q, k, v, fq, fk, gamma, rho, y, m, zs, idx = ctx.saved_tensors
        window, mode, sinks, hybrid_sinks, scale = ctx.opts
        B, H, T, D = q.shape
        Hkv, F = k.shape[1], fq.shape[-1]
        G = H // Hkv
        r = None if rho is None else rho.detach().float().contiguous()
        soft, lin, sink, gamma_on, decay, n_excl, lin_off, sink_off, n_sinks = _parts(
            mode, window, sinks, hybrid_sinks, r
        )
        r = r if decay else None
        nc = triton.cdiv(T, CHUNK)
        ns = nc - 1
        cfg = _settings(q, D, F)
        dt, prec = _DT[q.dtype], ("ieee" if q.dtype == torch.float32 else "tf32")
        f32 = dict(dtype=torch.float32, device=q.device)
        dy = dy.contiguous()
        g = gamma.detach().float().contiguous()
        rp = g if r is None else r  # (a pointer not read without a decay)
        hkv = hk = None
        if lin and ns > 0:
            hkv, hk = _states(fk, v, r, n_excl, ns, cfg, dt, prec)
        none = g.to(torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
        hkv_p, hk_p = (none, g) if hkv is None else (hkv, hk)
        bs, bd = (_pow2(max(int(sinks), 1)) if sink else 16), _pow2(D)
        dq = torch.empty_like(q)
        dfq = torch.empty_like(fq) if lin else torch.zeros_like(fq)
        dlz = torch.empty(B, H, T, **f32)
        rsum = torch.empty(B, H, T, **f32) if gamma_on else g
        rrow = torch.zeros(B, H, T, **f32) if decay else g
        dks, dvs = (torch.empty(B, H, T, bs, **f32) for _ in range(2)) if sink else (g, g)
        bdk, bfc = min(bd, cfg["bwd_dchunk"]), cfg["bwd_fchunk"]
        common = dict(CHUNK=CHUNK, BLOCK_D=bd, BLOCK_DK=bdk, BLOCK_FC=bfc, SOFT=soft, LIN=lin, SINKS=sink,
                      HYBRID=gamma_on, DECAY=decay, DT=dt, PREC=prec, num_stages=cfg["stages"])  # fmt: skip
        _chunk_bwd_dq[(B * H, nc)](
            q, k, v, fq, fk, g, rp, hkv_p, hk_p, dy, y, m, zs, idx, dq, dfq, dlz, rsum, rrow, dks, dvs,
            T, H, G, D, F, max(ns, 0), nc, int(window), lin_off, sink_off, n_sinks, n_excl, scale,
            BLOCK_S=bs, num_warps=cfg["dq_warps"], **_regs(cfg, "dq"), **common,
        )  # fmt: skip
        dhkv, dhk, rscan = none, g, None
        if lin and ns > 1:  # (key chunk c reads dh_{c+1}: some key chunk has a state gradient)
            dhkv, dhk = torch.empty_like(hkv), torch.empty_like(hk)
            bf, bdv = cfg["block_f"], min(cfg["block_dv"], _pow2(D))
            grid = (triton.cdiv(F, bf), triton.cdiv(D, bdv), B * Hkv)
            rscan = torch.zeros(grid[0] * grid[1] * grid[2], **f32) if decay else None
            _chunk_dstates[grid](
                fq, dy, zs, dlz, rp, hkv, hk, dhkv, dhk, g if rscan is None else rscan, T, H, G, D, F, ns, Hkv,
                int(window), DECAY=decay, CHUNK=CHUNK, BLOCK_F=bf, BLOCK_DV=bdv, DT=dt, PREC=prec,
                num_warps=cfg["state_warps"],
            )  # fmt: skip
        del hkv, hk
        if sink:  # the sinks' dk (unscaled), dv: ds^T q and E^T do over every row of every query head of a KV head
            do = (dy.float() / zs[..., None]).to(q.dtype).float()  # (as the kernels round it)
            dks, dvs = (torch.einsum("bhts,bhtd->bhsd", t, x.float()).view(B, Hkv, G, bs, D).sum(2)
                        for t, x in ((dks, q), (dvs, do)))  # fmt: skip
            if D != bd:
                dks, dvs = (torch.nn.functional.pad(t, (0, bd - D)) for t in (dks, dvs))
            dks, dvs = (t.reshape(B * Hkv, bs, bd).contiguous() for t in (dks, dvs))
        dk = torch.empty_like(k) if soft else torch.zeros_like(k)  # (no window term: no dk but the sinks')
        dv = torch.empty_like(v) if soft or lin else torch.zeros_like(v)
        if sink and not (soft or lin):  # sinks_only: the sinks' dk, dv are the host's sums
            s_eff = min(n_sinks, T)
            dk[:, :, :s_eff] = (dks.view(B, Hkv, bs, bd)[:, :, :s_eff, :D] * scale).to(k.dtype)
            dv[:, :, :s_eff] = dvs.view(B, Hkv, bs, bd)[:, :, :s_eff, :D].to(v.dtype)
        bdo = min(bd, cfg["bwd_dout"])
        passes = ((False,) if soft else ()) + ((True,) if soft or lin else ())  # (dk from the window terms only)
        for dv_pass in passes:
            _chunk_bwd_dkv[(B * Hkv, nc, triton.cdiv(D, bdo))](
                q, k, v, fq, fk, g, rp, dy, m, zs, dlz, idx, rsum, dhkv, dks, dvs, dk, dv,
                T, H, G, D, F, max(ns, 0), nc, int(window), lin_off, n_sinks, n_excl, scale, BLOCK_DO=bdo, BLOCK_S=bs,
                DV_PASS=dv_pass, num_warps=cfg["dkv_warps"], **_regs(cfg, "dkv"), **common,
            )  # fmt: skip
        dfk = torch.zeros(B, Hkv, T, F, **f32) if lin else torch.zeros_like(fk)
        rkey = torch.zeros(B * Hkv * nc, **f32) if decay else g
        if lin:
            _chunk_bwd_dfk[(B * Hkv, nc)](
                fq, fk, v, rp, dy, zs, dlz, dhkv, dhk, dfk, rkey, T, H, G, D, F, max(ns, 0), nc, int(window), lin_off,
                n_excl, CHUNK=CHUNK, BLOCK_DK=bdk, BLOCK_FC=bfc, DECAY=decay, DT=dt, PREC=prec,
                num_warps=cfg["dfk_warps"], num_stages=cfg["stages"], **_regs(cfg, "dfk"),
            )  # fmt: skip
        dgamma = drho = None
        if ctx.needs_input_grad[5]:
            dgamma = torch.zeros_like(gamma)
            if gamma_on:  # d/dgamma of every E term g exp(.): ds / g
                dgamma = (rsum.sum((0, 2)) / g).to(gamma.dtype)
        if rho is not None and ctx.needs_input_grad[6]:
            drho = torch.zeros_like(rho)
            if decay:
                f64 = torch.float64
                total = rrow.to(f64).view(B, Hkv, G * T).sum((0, 2)) + rkey.to(f64).view(B, Hkv, nc).sum((0, 2))
                if rscan is not None:
                    total = total + rscan.to(f64).view(B, Hkv, -1).sum((0, 2))
                drho = total.to(rho.dtype)
        return dq, dk, dv, dfq, dfk.to(fk.dtype), dgamma, drho, None, None, None, None, None


def chunk_attention(
    q, k, v, fq, fk, gamma, *, window, mode, sinks, hybrid_sinks=False, scale=None, la_decay=None
) -> torch.Tensor | None:
    """chunk_prefill's y with autograd (ChunkAttention: the inputs' gradients by the chunked backward), for the same
    cases; None where it does not take the case. mode "none": zeros (no gradient)."""
    what, ready = _prepare(q, k, v, fq, fk, window=window, mode=mode, sinks=sinks, hybrid_sinks=hybrid_sinks,
                           scale=scale, la_decay=la_decay)  # fmt: skip
    if ready is None:
        return answer(what, q, v)
    q, k, v, fq, fk, scale = ready
    return ChunkAttention.apply(q, k, v, fq, fk, gamma, la_decay, int(window), mode, int(sinks), bool(hybrid_sinks),
                                scale)  # fmt: skip


def chunked_path(q, k, v, fq, fk, gamma, *, attention_mask=None, initial_state=None, **options):
    """triton_hybrid_attention's chunked path where there is no padding mask and no initial state (else None):
    chunk_prefill's y when nothing needs a gradient (autograd off, or no input requires one), else chunk_attention's
    (ChunkAttention: the chunked backward); None where they do not take the case (the caller runs the fused kernels)."""
    if attention_mask is not None or initial_state is not None:
        return None
    inputs = (q, k, v, fq, fk, gamma, options.get("la_decay"))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return chunk_attention(q, k, v, fq, fk, gamma, **options)
    return chunk_prefill(q, k, v, fq, fk, gamma, **options)
