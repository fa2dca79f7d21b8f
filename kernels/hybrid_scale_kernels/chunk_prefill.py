"""The hybrid attention with flash-linear-attention's chunk structure (a state scan, then one output kernel per
chunk), forward and backward: no denominators, no padding, no initial state, window <= 64.

Positions are cut into chunks of CHUNK = 64 tokens. With a window w <= 64, query n of chunk c (n in [64c, 64c + 64))
finds its window keys (n - w, n] in chunks c - 1 and c, and every key before chunk c - 1 has left its window (it is
at most 64c - 65 <= n - w - 1). So one program of `_chunk_output` needs the 128 keys of chunks c - 1 and c, the
sinks, and the LA state of the keys before chunk c - 1; `_chunk_states` makes those states. This is the structure of
fla's `chunk_h` (a scan over chunks per head and state block) and `chunk_o` (one program per chunk: the state term
plus masked intra-chunk terms), with two changes: the intra part reaches one chunk back (the window), and the softmax
of the window shares the LA's normaliser (docs/design.md section 2, hybrid_scale/attention/naive.py):

    y_n = (gamma sum_{W(n) u S(n)} E_nj v_j + sum_{P(n) \\ S(n)} L_nj v_j) / (gamma sum E_nj + sum L_nj + EPS)

with E_nj = exp(s q_n.k_j - c_n), c_n the exact max over the row's real window (and sink) keys, and L_nj =
phi_q(q_n).phi_k(k_j) alpha^max(0, n - w - j) (alpha = exp(-rho) of the KV head; 1 without a decay).

- `_chunk_states` (chunk_scan.py) makes h_c = sum over the LA keys j < 64c of alpha^(64c - 1 - j) phi_k(k_j) v_j^T
  and z_c, per KV head, in 64-token chunks (split over the sequence where the GPU's SMs would idle).
- `_chunk_output`, one program per (batch x query head, chunk): 64 query rows against the keys of chunks c - 1 and c,
  one 64-key block at a time, in two passes. The first finds c_n, the exact max of the row's window scores s q.k
  (and of its sink scores: one separate tile of the first S keys, those that have left the window, or all of them
  for sinks_only). The second recomputes the scores of each block and sums, in one [64, 64] tile, gamma E on the
  window keys and L = phi_q phi_k^T (masked, decayed) on the LA keys (they never share a key), then multiplies it by
  the block's values; the LA keys before chunk c - 1 come from phi_q h_{c-1}, times alpha^(n - w - (64c - 65)) as
  query n sees a state kept for key 64c - 65. The row sums of gamma E and L make the one normaliser. (Recomputing
  q.k costs about a sixth more products than keeping the [64, 128] score tile of both chunks, which spilled.)

A query head reads its KV head's keys, values, phi_k and state (GQA); the query heads of a KV head are adjacent
programs, so they read the same tiles from L2. Every product is a tl.dot with 64 rows (wgmma on sm_90 in half
precision). Modes: hybrid (with or without its sinks), swa_only, swa_sinks, la_only, sinks_only, none; bf16 and
fp16 on a GPU (fp32 in Triton's interpreter only: its FMA products spill kilobytes at 64-row tiles). The caller
(`triton_hybrid_attention`, through `chunked_path`) falls back to the fused kernels of hybrid_attention.py for
anything `chunk_prefill` / `chunk_attention` does not take (they return None).

The backward (`ChunkAttention`, `chunk_attention`, and `chunked_path`, what triton_hybrid_attention calls) is in
chunk_backward.py, its kernels in chunk_backward_kernels.py; this file holds the host code both share.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .chunk_scan import states
from .jit_helpers import _EPS, MODE_PARTS

CHUNK = 64  # tokens per chunk; also the largest window taken (the window keys lie in this chunk and the previous one)
_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _scores(Q, K, q_row, q_ok, k_row, k_ok, D, BLOCK_DK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
            DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """q . k [ROWS, COLS] (unscaled, fp32) of query rows q_row and key rows k_ok (int64 row numbers of [rows, D]
    tensors), the head dim walked in chunks of BLOCK_DK (small operand tiles: no [ROWS, D] q stays in registers)."""
    a = tl.zeros([ROWS, COLS], tl.float32)
    for d0 in range(0, D, BLOCK_DK):
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        q = tl.load(Q + q_row[:, None] * D + od[None, :], mask=q_ok[:, None] & dm[None, :], other=0.0)
        k = tl.load(K + k_row[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
        a += tl.dot(q.to(DT), tl.trans(k.to(DT)), input_precision=PREC)
    return a


@triton.jit
def _chunk_output(
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK,  # inputs (HKV, HK: _chunk_states' states)
    Y,  # output [B, H, T, D] in q's dtype (fp32 for a backward)
    M, ZS, IDX,  # with STATS (for the backward), per row [B, H, T]: c_n, the normaliser Z_n (EPS in), c_n's argmax key
    T, H, G, D, F, NS, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, STATS: tl.constexpr = False,
):  # fmt: skip
    """y of the CHUNK queries n of chunk c (grid axis 1) of one query head (axis 0: batch x H), window <= CHUNK.

    The keys j of chunks c - 1 and c (from lo = max(c - 1, 0) CHUNK), a CHUNK-key block at a time:
      E terms (SOFT): n - window < j <= n, scores s q.k; c_n their exact row max, with the sink terms' (a first pass
        over the blocks finds it, the second recomputes the scores: no [CHUNK, 2 CHUNK] tile stays live);
      sink terms (SINKS): the keys j < n_sinks with j <= n - sink_off, from one tile of the first BLOCK_S keys;
      L terms (LIN): n_excl <= j <= n - lin_off, phi_q.phi_k alpha^max(0, n - window - j) (phi_q phi_k^T summed over
        feature chunks of BLOCK_FC), and the state h_{c-1} of every key before lo (all in the row's LA, none a sink
        of the hybrid), which query n sees times alpha^(n - window - (lo - 1));
      y_n = (g sum E v + sum L v) / (g sum E + sum L + EPS), g = gamma of the head in the hybrid (HYBRID), else 1.
    Per key block, g E and L (they never share a key) are one [CHUNK, CHUNK] tile and one product with v."""
    pid_bh = tl.program_id(0)
    c = tl.program_id(1)
    head = pid_bh % H
    bk = (pid_bh // H) * (H // G) + head // G  # batch x KV head
    kv_base = bk.to(tl.int64) * T  # its first row in [B * Hkv * T]
    q_base = pid_bh.to(tl.int64) * T
    n = c * CHUNK + tl.arange(0, CHUNK)  # query positions
    row_ok = n < T
    lo = tl.maximum(c - 1, 0) * CHUNK
    hi = tl.minimum((c + 1) * CHUNK, T)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    num = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    den = tl.zeros([CHUNK], tl.float32)
    if LIN:
        rho = 0.0
        if DECAY:
            rho = tl.load(RHO + head // G).to(tl.float32)
        if c >= 2:  # the state of the keys before lo = (c - 1) CHUNK: h_{c-1} (h_0 is empty)
            st = bk.to(tl.int64) * NS + c - 1
            for f0 in range(0, F, BLOCK_FC):
                of = f0 + tl.arange(0, BLOCK_FC)
                fm = of < F
                fq = tl.load(FQ + (q_base + n)[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                             other=0.0)  # fmt: skip
                h = tl.load(HKV + (st * F + of)[:, None] * D + od[None, :], mask=fm[:, None] & dm[None, :], other=0.0)
                if HKV.dtype.element_ty == DT:
                    num += tl.dot(fq.to(DT), h, input_precision=PREC)
                else:  # (fp32 state, half inputs: tf32)
                    num += tl.dot(fq.to(tl.float32), h, input_precision=PREC)
                z = tl.load(HK + st * F + of, mask=fm, other=0.0)
                den += tl.sum(fq.to(tl.float32) * z[None, :], 1)
            if DECAY:
                lag = tl.exp(-rho * tl.maximum(n - window - (lo - 1), 0).to(tl.float32))
                num = num * lag[:, None]
                den = den * lag
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = 1.0
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    arg = tl.zeros([CHUNK], tl.int32)  # (STATS: the key of the row max, the first where several are equal)
    if SOFT:  # the first pass: the exact row max over the window
        for kb in range(lo, hi, CHUNK):
            j = kb + tl.arange(0, CHUNK)
            a = _scores(Q, K, q_base + n, row_ok, kv_base + j, j < T, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
            a = tl.where((j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window), a, float("-inf"))
            if STATS:
                arg = _argmax_update(a, j, m, arg)
            m = tl.maximum(m, tl.max(a, 1))
    if SINKS:
        js = tl.arange(0, BLOCK_S)
        s_ok = (js < n_sinks) & (js < T)
        a_s = _scores(Q, K, q_base + n, row_ok, kv_base + js, s_ok, D, BLOCK_DK, CHUNK, BLOCK_S, DT, PREC) * scale
        a_s = tl.where(s_ok[None, :] & (js[None, :] <= n[:, None] - sink_off), a_s, float("-inf"))
        if STATS:
            arg = _argmax_update(a_s, js, m, arg)
        m = tl.maximum(m, tl.max(a_s, 1))
        m = tl.where(m == float("-inf"), 0.0, m)  # (rows without an E term: past T)
        p_s = g * tl.exp(a_s - m[:, None])
        vs = tl.load(V + (kv_base + js)[:, None] * D + od[None, :], mask=s_ok[:, None] & dm[None, :], other=0.0)
        num += tl.dot(p_s.to(DT), vs.to(DT), input_precision=PREC)
        den += tl.sum(p_s, 1)
    else:
        m = tl.where(m == float("-inf"), 0.0, m)  # (rows without an E term: la_only, and rows past T)
    if SOFT or LIN:  # the second pass: g E + L per key block, times v
        for kb in range(lo, hi, CHUNK):
            j = kb + tl.arange(0, CHUNK)
            k_ok = j < T
            p = tl.zeros([CHUNK, CHUNK], tl.float32)
            if LIN:
                s = tl.zeros([CHUNK, CHUNK], tl.float32)
                for f0 in range(0, F, BLOCK_FC):
                    of = f0 + tl.arange(0, BLOCK_FC)
                    fm = of < F
                    fq = tl.load(FQ + (q_base + n)[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    fk = tl.load(FK + (kv_base + j)[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    s += tl.dot(fq.to(DT), tl.trans(fk.to(DT)), input_precision=PREC)
                lin = (j[None, :] <= n[:, None] - lin_off) & (j[None, :] >= n_excl)  # (n_excl >= 0)
                if DECAY:
                    s = s * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))
                p = tl.where(lin, s, 0.0)
            if SOFT:
                a = _scores(Q, K, q_base + n, row_ok, kv_base + j, k_ok, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
                win = (j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window)
                p = tl.where(win, g * tl.exp(a - m[:, None]), p)
            v = tl.load(V + (kv_base + j)[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
            num += tl.dot(p.to(DT), v.to(DT), input_precision=PREC)
            den += tl.sum(p, 1)
    y = num / (den + _EPS)[:, None]
    tl.store(Y + (q_base + n)[:, None] * D + od[None, :], y.to(Y.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    if STATS:
        tl.store(M + q_base + n, m, mask=row_ok)
        tl.store(ZS + q_base + n, den + _EPS, mask=row_ok)
        tl.store(IDX + q_base + n, arg, mask=row_ok)


@triton.jit
def _argmax_update(a, j, m, arg):
    """The argmax of the row max after the scores a [rows, cols] of keys j [cols], given the max m and argmax arg so
    far: a block's first key at its max, where that max exceeds m (the earlier key wins a tie)."""
    bm = tl.max(a, 1)
    bi = tl.min(tl.where(a == bm[:, None], j[None, :], 2147483647), 1)
    return tl.where(bm > m, bi, arg)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(x)))


# Launch settings on a GPU (and on the meta device, which stands for one in the compile gate), half precision, by
# head dim (<= 64, <= 128): _chunk_states' feature and value blocks and warps; _chunk_output's head-dim chunk of the
# q.k products, feature chunk, warps and pipeline stages. Found with tools/kernel_compile.py at the presets'
# shapes, every mode, bf16 and fp16: 4 warps (one warpgroup on the 64 rows; with 8, Triton's layouts replicate the
# rows or the operands and spill), one stage (2 spilled on sm_80 at head dim 128), head-dim chunks of 32 at 128 (64
# spilled 60-300 bytes: a [64, 64] q operand in registers) and 16 at 64 (64 and 32 spilled 8-16 bytes on sm_80).
# The backward's (ChunkAttention), found the same way (tools/kernel_compile.py, and a script that compiles only
# the backward's launches): head-dim chunks of 16 (bwd_dchunk: at 32 the operands of mma.sync's B, whole in every warp
# on sm_80, spilled 40-160 bytes), feature chunks of 16 (bwd_fchunk: 32 spilled 40-160 bytes in dq with the sinks),
# _chunk_bwd_dkv over head-dim blocks of 64 (bwd_dout) with 8 warps (4 warps spilled 24-56 bytes on sm_80 at 64, none
# at 32 but with twice the recomputed scores), 4 warps for _chunk_bwd_dq and _chunk_bwd_dfk, and maxnreg=255 for all
# three (ptxas otherwise caps some at 128-160 registers and spills, as in decode.py). Every backward kernel then uses
# 0 spill bytes in bf16 and fp16 on sm_80 and sm_90 at both presets' head dims, every mode, with wgmma on sm_90.
# The state scan split over the sequence (chunk_scan.py, its segments' sums stored) spilled 8 bytes at 96 registers
# on sm_80 in bf16 without decay; maxnreg=128 (state_maxnreg) lets it use 127 and spill none.
GPU_SETTINGS = {
    64: dict(block_f=64, block_dv=32, state_warps=4, dchunk=16, fchunk=32, warps=4, stages=1, dq_warps=4, dkv_warps=8,
             dfk_warps=4, bwd_dchunk=16, bwd_fchunk=16, bwd_dout=64, dq_maxnreg=255, dkv_maxnreg=255, dfk_maxnreg=255,
             state_maxnreg=128),
    128: dict(block_f=64, block_dv=32, state_warps=4, dchunk=32, fchunk=32, warps=4, stages=1, dq_warps=4, dkv_warps=8,
              dfk_warps=4, bwd_dchunk=16, bwd_fchunk=16, bwd_dout=64, dq_maxnreg=255, dkv_maxnreg=255, dfk_maxnreg=255,
             state_maxnreg=128),
}  # fmt: skip


def _settings(x: torch.Tensor, head_dim: int, features: int) -> dict:
    if x.device.type == "cpu":  # Triton's interpreter (tests): any tile works, these are fast there
        fchunk = min(_pow2(features), 64)
        return dict(block_f=64, block_dv=64, state_warps=4, dchunk=32, fchunk=fchunk, warps=4, stages=1, dq_warps=4,
                    dkv_warps=4, dfk_warps=4, bwd_dchunk=32, bwd_fchunk=fchunk, bwd_dout=64)  # fmt: skip
    return GPU_SETTINGS[64 if head_dim <= 64 else 128]


def _regs(cfg: dict, kernel: str) -> dict:
    """The register cap (maxnreg) of a kernel (a backward one, or the state scan) where its settings name one."""
    cap = cfg.get(kernel + "_maxnreg")
    return {"maxnreg": cap} if cap else {}


def _refused(q, k, v, fq, window, mode, sinks, hybrid_sinks, la_decay) -> bool:
    """Whether chunk_prefill (and ChunkAttention) does not take a case (see chunk_prefill)."""
    if mode not in MODE_PARTS or not 1 <= int(window) <= CHUNK:
        return True
    D, Hkv = q.shape[-1], k.shape[1]
    sink = MODE_PARTS[mode][2] or (bool(hybrid_sinks) and mode == "hybrid")
    if v.shape[-1] != D or D > 128 or fq.shape[-1] > 256 or q.shape[1] % Hkv or q.dtype not in _DT:
        return True
    if sink and sinks > 64:
        return True
    if q.dtype == torch.float32 and q.device.type != "cpu":  # (fp32 on a GPU: FMA products, which spill kilobytes
        return True  # at 64-row tiles; the fused forward's 16-row tiles take it)
    return la_decay is not None and tuple(la_decay.shape) != (Hkv,)


def _parts(mode, window, sinks, hybrid_sinks, la_decay):
    """The launch switches of a case: (soft, lin, sink, gamma_on, decay, n_excl, lin_off, sink_off, n_sinks)."""
    hybrid_sinks = bool(hybrid_sinks) and mode == "hybrid"
    soft, lin, sink, gamma_on = MODE_PARTS[mode]
    sink = sink or hybrid_sinks
    decay = lin and la_decay is not None
    n_excl = int(sinks) if hybrid_sinks else 0
    lin_off = int(window) if mode == "hybrid" else 0
    return soft, lin, sink, gamma_on, decay, n_excl, lin_off, int(window) if soft else 0, int(sinks) if sink else 0


def _states(fk, v, rho, n_excl, ns, cfg, dt, prec):
    """The states before chunks 0..ns-1 (chunk_scan.states, split over the sequence where SMs would idle)."""
    bdv = min(cfg["block_dv"], _pow2(v.shape[-1]))
    return states(fk, v, rho, n_excl, ns, block_f=cfg["block_f"], block_dv=bdv, warps=cfg["state_warps"], dt=dt,
                  prec=prec, options=_regs(cfg, "state"))  # fmt: skip


def _forward(q, k, v, fq, fk, gamma, rho, *, window, mode, sinks, hybrid_sinks, scale, stats):
    """The forward's launches on contiguous inputs of one dtype, rho the fp32 decay or None. Returns y in q's dtype,
    or with stats (for the backward) y in fp32 and (c_n, Z_n, argmax) per row."""
    B, H, T, D = q.shape
    Hkv, F = k.shape[1], fq.shape[-1]
    soft, lin, sink, gamma_on, decay, n_excl, lin_off, sink_off, n_sinks = _parts(
        mode, window, sinks, hybrid_sinks, rho
    )
    rho = rho if decay else None
    nc = triton.cdiv(T, CHUNK)
    ns = nc - 1  # states before chunks 0..nc-2 (chunk c reads the one before chunk c - 1)
    cfg = _settings(q, D, F)
    dt, prec = _DT[q.dtype], ("ieee" if q.dtype == torch.float32 else "tf32")
    hkv = hk = None
    if lin and ns > 0:
        hkv, hk = _states(fk, v, rho, n_excl, ns, cfg, dt, prec)
    g = gamma.detach().float().contiguous()
    y = torch.empty(B, H, T, D, dtype=torch.float32, device=q.device) if stats else torch.empty_like(q)
    m = zs = idx = g
    if stats:
        m, zs = (torch.empty(B, H, T, dtype=torch.float32, device=q.device) for _ in range(2))
        idx = torch.empty(B, H, T, dtype=torch.int32, device=q.device)
    none = g.to(torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)  # (not read: no state)
    _chunk_output[(B * H, nc)](
        q, k, v, fq, fk, g, g if rho is None else rho, none if hkv is None else hkv, g if hk is None else hk, y,
        m, zs, idx, T, H, H // Hkv, D, F, max(ns, 0), int(window), lin_off, sink_off, n_sinks, n_excl, scale,
        CHUNK=CHUNK, BLOCK_D=_pow2(D), BLOCK_DK=min(_pow2(D), cfg["dchunk"]), BLOCK_FC=cfg["fchunk"],
        BLOCK_S=_pow2(max(int(sinks), 1)) if sink else 16, SOFT=soft, LIN=lin, SINKS=sink, HYBRID=gamma_on,
        DECAY=decay, DT=dt, PREC=prec, STATS=stats, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return (y, (m, zs, idx)) if stats else y


def _prepare(q, k, v, fq, fk, *, window, mode, sinks, hybrid_sinks, scale, la_decay):
    """What chunk_prefill and chunk_attention share: ("zeros" | "refused" | "empty", None), or ("run", (q, k, v, fq,
    fk contiguous in q's dtype, the scale))."""
    if mode == "none":
        return "zeros", None
    if _refused(q, k, v, fq, window, mode, sinks, hybrid_sinks, la_decay):
        return "refused", None
    if q.shape[2] == 0:
        return "empty", None
    k, v, fq, fk = (t.to(q.dtype).contiguous() for t in (k, v, fq, fk))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return "run", (q.contiguous(), k, v, fq, fk, scale)


def answer(what: str, q, v):
    """chunk_prefill's and chunk_attention's result where _prepare did not say "run" (None: refused)."""
    if what == "zeros":
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    return torch.empty_like(q) if what == "empty" else None


def chunk_prefill(
    q, k, v, fq, fk, gamma, *, window, mode, sinks, hybrid_sinks=False, scale=None, la_decay=None
) -> torch.Tensor | None:
    """The chunked prefill forward (no autograd) of the hybrid attention, naive.masked_attention's y for queries and
    keys at positions 0..T-1 with no padding and no initial state: q [B,H,T,D], k/v [B,Hkv,T,D], fq [B,H,T,F],
    fk [B,Hkv,T,F], gamma [H], la_decay rho [Hkv] or None. Returns y [B,H,T,D] in q's dtype, or None for a case it
    does not take (the caller runs the fused forward): a window over CHUNK or under 1, a mode it has no kernel for,
    more than 64 sinks, a value dim unlike the head dim, head dim over 128, feature dim over 256, a dtype other
    than bf16 / fp16 / fp32 (fp32 only on CPU, in Triton's interpreter), a la_decay of the wrong shape. It launches
    `_chunk_states` (modes with an LA, more than one chunk) and `_chunk_output`."""
    what, ready = _prepare(q, k, v, fq, fk, window=window, mode=mode, sinks=sinks, hybrid_sinks=hybrid_sinks,
                           scale=scale, la_decay=la_decay)  # fmt: skip
    if ready is None:
        return answer(what, q, v)
    q, k, v, fq, fk, scale = ready
    rho = None if la_decay is None else la_decay.detach().float().contiguous()
    with torch.no_grad():
        return _forward(q, k, v, fq, fk, gamma, rho, window=window, mode=mode, sinks=sinks, hybrid_sinks=hybrid_sinks,
                        scale=scale, stats=False)  # fmt: skip
