"""The chunked hybrid attention's output kernel (fla's `chunk_o`): one program per (batch x query head, chunk), the
state term plus the masked, decayed intra-chunk terms, with the window's softmax sharing the LA's normaliser
(docs/design.md section 2, hybrid_scale/attention/hedgehog/naive.py):

    y_n = (gamma sum_{W(n) u S(n)} E_nj v_j + sum_{P(n) \\ S(n)} L_nj v_j) / (gamma sum E_nj + sum L_nj + EPS)

with E_nj = exp(s q_n.k_j - c_n), c_n the exact max over the row's real window (and sink) keys, and L_nj =
phi_q(q_n).phi_k(k_j) alpha^max(0, n - w - j) (alpha = exp(-rho) of the KV head; 1 without a decay).

Positions are cut into chunks of CHUNK = 64 tokens. Query n of chunk c finds its window keys (n - w, n] in chunks
c - NB .. c, NB = ceil(w / 64) (utils.blocks_back), and every key before chunk c - NB has left its window: one
program needs the (NB + 1) 64-key blocks from lo = max(c - NB, 0) CHUNK, the sinks, and the LA state of the keys
before lo (`chunk_h.py`'s state number max(c - NB, 0); with an initial state, state 0 is it). In two passes over
the blocks: the first finds c_n, the exact max of the row's window scores s q.k (and of its sink scores: one tile
of the first S keys, those that have left the window, or all of them for sinks_only); the second recomputes the
scores of each block and sums, in one [64, 64] tile, gamma E on the window keys and L = phi_q phi_k^T (masked,
decayed) on the LA keys (they never share a key), then multiplies it by the block's values. The state is read as
phi_q h times alpha^(n - w - (lo - 1)). The row sums of gamma E and L make the one normaliser, and (DENS) are
stored apart: the denominators of `return_denominators` (the sum of gamma E as the normaliser less the L sum:
exact to fp32's rounding of the normaliser; summing it apart spilled).

A query head reads its KV head's keys, values, phi_k and state (GQA): one program computes GF query heads of a KV head
in turn (`chunk_h.fold`: all G where the grid still gives every SM two programs), so it reads those tiles once for GF
heads; the rest of a group are adjacent programs, which read them from L2. Every product is a tl.dot with 64 rows (wgmma
on sm_90 in half precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_h import heads_per_program
from .utils import TL_EPS, argmax_update, pow2, scores, state_lag


@triton.jit
def _o_head(
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK, Y, YLO, M, ZS, IDX, DE, DL, pid_bh, c,
    T, H, G, D, F, NS, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, STATS: tl.constexpr, HAS_INIT: tl.constexpr, DENS: tl.constexpr,
    LO: tl.constexpr,
):  # fmt: skip
    """`_chunk_output` for one query head pid_bh (batch x H) and chunk c (inlined in an unfolded launch; called, not
    inlined, once per head in a folded one: `_o_head_call`)."""
    head = pid_bh % H
    bk = (pid_bh // H) * (H // G) + head // G  # batch x KV head
    kv_base = bk.to(tl.int64) * T  # its first row in [B * Hkv * T]
    q_base = pid_bh.to(tl.int64) * T
    n = c * CHUNK + tl.arange(0, CHUNK)  # query positions
    row_ok = n < T
    st0 = tl.maximum(c - NB, 0)  # the state read: the keys before lo
    lo = st0 * CHUNK
    hi = tl.minimum((c + 1) * CHUNK, T)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    num = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    den = tl.zeros([CHUNK], tl.float32)
    if LIN:
        rho = 0.0
        if DECAY:
            rho = tl.load(RHO + head // G).to(tl.float32)
        if HAS_INIT or c >= NB + 1:  # the state of the keys before lo (h_0 is empty without an initial state)
            st = bk.to(tl.int64) * NS + st0
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
                lag = state_lag(rho, n, window, st0, CHUNK)
                num = num * lag[:, None]
                den = den * lag
    den_l = den  # (DENS: the L terms' sum, the state's so far)
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = 1.0
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    arg = tl.zeros([CHUNK], tl.int32)  # (STATS: the key of the row max, the first where several are equal)
    if SOFT:  # the first pass: the exact row max over the window
        for kb in range(lo, hi, CHUNK):
            j = kb + tl.arange(0, CHUNK)
            a = scores(Q, K, q_base + n, row_ok, kv_base + j, j < T, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
            a = tl.where((j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window), a, float("-inf"))
            if STATS:
                arg = argmax_update(a, j, m, arg)
            m = tl.maximum(m, tl.max(a, 1))
    if SINKS:
        js = tl.arange(0, BLOCK_S)
        s_ok = (js < n_sinks) & (js < T)
        a_s = scores(Q, K, q_base + n, row_ok, kv_base + js, s_ok, D, BLOCK_DK, CHUNK, BLOCK_S, DT, PREC) * scale
        a_s = tl.where(s_ok[None, :] & (js[None, :] <= n[:, None] - sink_off), a_s, float("-inf"))
        if STATS:
            arg = argmax_update(a_s, js, m, arg)
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
            if LIN:  # (only a key block with L terms: the chunk's last query at least lin_off past its first key)
                if c * CHUNK + CHUNK - 1 - kb >= lin_off:
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
                    if DENS:
                        den_l += tl.sum(p, 1)
            if SOFT:
                a = scores(Q, K, q_base + n, row_ok, kv_base + j, k_ok, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
                win = (j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window)
                p = tl.where(win, g * tl.exp(a - m[:, None]), p)
            v = tl.load(V + (kv_base + j)[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
            num += tl.dot(p.to(DT), v.to(DT), input_precision=PREC)
            den += tl.sum(p, 1)
    y = num / (den + TL_EPS)[:, None]
    out = (q_base + n)[:, None] * D + od[None, :]
    y_out = y.to(Y.dtype.element_ty)
    tl.store(Y + out, y_out, mask=row_ok[:, None] & dm[None, :])
    if LO:  # (for the backward's dlz: Y + YLO holds y to about 16 bits)
        tl.store(YLO + out, (y - y_out.to(tl.float32)).to(YLO.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    if DENS:
        tl.store(DE + q_base + n, den - den_l, mask=row_ok)
        tl.store(DL + q_base + n, den_l, mask=row_ok)
    if STATS:
        tl.store(M + q_base + n, m, mask=row_ok)
        tl.store(ZS + q_base + n, den + TL_EPS, mask=row_ok)
        tl.store(IDX + q_base + n, arg, mask=row_ok)


# One head of a folded launch, called (as `_chunk_bwd_dq`'s `_dq_head_call`): inlined in the heads loop, it spilled 8-32
# bytes at head dim 64 under triton 3.6 (SmolLM2-135M's shapes at 16k, 3 heads a program).
_o_head_call = triton.jit(noinline=True)(_o_head.fn)


@triton.jit
def _chunk_output(
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK,  # inputs (HKV, HK: _chunk_states' states)
    Y, YLO,  # output [B, H, T, D] in Y's dtype (the call's); LO: y's rounding error y - Y in YLO's (Y's) dtype
    M, ZS, IDX,  # with STATS (for the backward), per row [B, H, T]: c_n, the normaliser Z_n (EPS in), c_n's argmax key
    DE, DL,  # with DENS, per row [B, H, T] (fp32): the sums of gamma E (sinks in) and of L (the state's in)
    T, H, G, GF, D, F, NS, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, STATS: tl.constexpr = False, HAS_INIT: tl.constexpr = False,
    DENS: tl.constexpr = False, LO: tl.constexpr = False, FOLD: tl.constexpr = False,
):  # fmt: skip
    """y of the CHUNK queries n of chunk c (grid axis 1) of GF query heads of one KV head (axis 0: batch x H / GF),
    one head after the other (their KV head's tiles are read once for the GF heads: `chunk_h.fold`).

    The keys j of chunks c - NB .. c (from lo = max(c - NB, 0) CHUNK), a CHUNK-key block at a time:
      E terms (SOFT): n - window < j <= n, scores s q.k; c_n their exact row max, with the sink terms' (a first pass
        over the blocks finds it, the second recomputes the scores: no [CHUNK, 2 CHUNK] tile stays live);
      sink terms (SINKS): the keys j < n_sinks with j <= n - sink_off, from one tile of the first BLOCK_S keys;
      L terms (LIN): n_excl <= j <= n - lin_off, phi_q.phi_k alpha^max(0, n - window - j) (phi_q phi_k^T summed over
        feature chunks of BLOCK_FC), and the state h_{c-NB} of every key before lo (all in the row's LA, none a sink
        of the hybrid; HAS_INIT: state 0 is the initial state), which query n sees times alpha^(n - window - (lo -
        1)) (exponent clamped at 0);
      y_n = (g sum E v + sum L v) / (g sum E + sum L + EPS), g = gamma of the head in the hybrid (HYBRID), else 1.
    Per key block, g E and L (they never share a key) are one [CHUNK, CHUNK] tile and one product with v."""
    if not FOLD:  # (GF = 1: the body inline)
        _o_head(Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK, Y, YLO, M, ZS, IDX, DE, DL, tl.program_id(0), tl.program_id(1),
                T, H, G, D, F, NS, NB, window, lin_off, sink_off, n_sinks, n_excl, scale, CHUNK, BLOCK_D, BLOCK_DK,
                BLOCK_FC, BLOCK_S, SOFT, LIN, SINKS, HYBRID, DECAY, DT, PREC, STATS, HAS_INIT, DENS, LO)  # fmt: skip
    else:  # (FOLD: GF > 1)
        for hh in range(GF):  # (the GF query heads of one KV head in turn: its keys, values, phi_k and state read once)
            _o_head_call(Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK, Y, YLO, M, ZS, IDX, DE, DL, tl.program_id(0) * GF + hh,
                         tl.program_id(1), T, H, G, D, F, NS, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
                         CHUNK, BLOCK_D, BLOCK_DK, BLOCK_FC, BLOCK_S, SOFT, LIN, SINKS, HYBRID, DECAY, DT, PREC, STATS,
                         HAS_INIT, DENS, LO)  # fmt: skip


def chunk_fwd_o(q, k, v, fq, fk, gamma, rho, state, case, *, stats=False, dens=False, out_dtype=None):
    """y [B, H, T, D] of the call `case` (chunk.Case) on contiguous inputs of one dtype, rho the fp32 decay or None,
    state (h, z) the states before every chunk (chunk_h.states) or None. y in out_dtype (default q's), stored once;
    stats: (c_n, Z_n, argmax) per row for the backward, and y's rounding error in out_dtype (None for fp32): the
    backward's dlz = do . y reads y + that error (from y alone, gamma's gradient lost a factor of 15 in bf16 at window
    64: tools/kernel_grad_precision.py); dens: (sum of gamma E, sum of L) per row (fp32). Returns (y, stats or None,
    dens or None)."""
    B, H, T, D = q.shape
    Hkv, F = k.shape[1], fq.shape[-1]
    nc = triton.cdiv(T, case.chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    g = gamma.detach().float().contiguous()
    y = torch.empty(B, H, T, D, dtype=out_dtype or q.dtype, device=q.device)
    m = zs = idx = de = dl = g
    lo = stats and y.dtype != torch.float32
    y_lo = torch.empty_like(y) if lo else None
    if stats:
        m, zs = (torch.empty(B, H, T, **f32) for _ in range(2))
        idx = torch.empty(B, H, T, dtype=torch.int32, device=q.device)
    if dens:
        de, dl = (torch.empty(B, H, T, **f32) for _ in range(2))
    hkv, hk = state if state is not None else (g.to(torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32), g)
    cfg = case.cfg
    gf = heads_per_program(q, B * H * nc, H // Hkv, cfg)
    _chunk_output[(B * H // gf, nc)](
        q, k, v, fq, fk, g, g if rho is None else rho, hkv, hk, y, y if y_lo is None else y_lo, m, zs, idx, de, dl,
        T, H, H // Hkv, gf, D, F, hkv.shape[2] if state is not None else 0, case.nb, case.window, case.lin_off,
        case.sink_off, case.n_sinks, case.n_excl, case.scale,
        CHUNK=case.chunk, BLOCK_D=pow2(D), BLOCK_DK=min(pow2(D), cfg["dchunk"]), BLOCK_FC=cfg["fchunk"],
        BLOCK_S=case.block_s, SOFT=case.soft, LIN=case.lin, SINKS=case.sink, HYBRID=case.gamma_on,
        DECAY=case.decay, DT=case.dt, PREC=case.prec, STATS=stats, HAS_INIT=case.has_init, DENS=dens, LO=lo,
        FOLD=gf > 1, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return y, ((m, zs, idx, y_lo) if stats else None), ((de, dl) if dens else None)
