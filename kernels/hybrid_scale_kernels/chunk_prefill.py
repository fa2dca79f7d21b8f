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

- `_chunk_states`, one program per (feature block, value block, batch x KV head): walks the chunks in order and
  stores, before adding chunk c, h_c = sum over the LA keys j < 64c of alpha^(64c - 1 - j) phi_k(k_j) v_j^T [F, D] and
  z_c the same sum of phi_k(k_j) [F] (kept as key 64c - 1 sees them: every weight alpha^(>= 0), the carry from one
  chunk to the next one multiply by alpha^64). The hybrid with its own sinks leaves the first S keys out. The
  products are tl.dot of [64 features, 64 keys] x [64 keys, BLOCK_DV values] with fp32 accumulation in registers;
  h is stored in bf16 for bf16 inputs, fp32 otherwise (fp16's range is too small for a sum over the sequence), z in
  fp32 (1/D of h's bytes, and it is the whole LA normaliser). Splitting the features and the values over programs
  gives (F / 64) (D / 32) B Hkv programs: 128 at Llama-3-8B's shape, batch 1.
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

The backward (`ChunkAttention`, `chunk_attention`: what triton_hybrid_attention trains with where it takes the case,
see chunked_path) is fla's chunk backward adapted the same way; see the comment above `_bwd_q_block`: `_chunk_states`
again, `_chunk_bwd_dq`, the reverse scan `_chunk_dstates`, `_chunk_bwd_dkv` (a dk and a dv launch) and
`_chunk_bwd_dfk`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .jit_helpers import _EPS, MODE_PARTS

CHUNK = 64  # tokens per chunk; also the largest window taken (the window keys lie in this chunk and the previous one)
_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _chunk_states(
    FK, V, RHO,  # inputs: phi_k [B, Hkv, T, F], v [B, Hkv, T, D], rho [Hkv]
    HKV, HK,  # outputs: h [B, Hkv, NS, F, D] (bf16 or fp32), z [B, Hkv, NS, F] (fp32)
    T, F, D, NS, Hkv, n_excl,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """The LA state before each of the chunks 0..NS-1, one program per (feature block, value block, batch x KV head):
    h_c[f, d] = sum over keys n_excl <= j < c CHUNK of alpha^(c CHUNK - 1 - j) phi_k(k_j)[f] v_j[d], and z_c[f] the
    same sum of phi_k(k_j)[f] (only the programs of the first value block store z). n_excl = S when the hybrid has its
    own sinks (the LA leaves them out), else 0; alpha = exp(-rho) of the KV head (DECAY), else 1. Each chunk adds one
    product phi_k^T [BLOCK_F, CHUNK] x v [CHUNK, BLOCK_DV] in DT with fp32 accumulation; the state goes to memory in
    HKV's dtype."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    pid_bh = tl.program_id(2)
    base = pid_bh.to(tl.int64)
    of = f0 + tl.arange(0, BLOCK_F)
    od = d0 + tl.arange(0, BLOCK_DV)
    both = (of < F)[:, None] & (od < D)[None, :]
    z_lim = tl.where(tl.program_id(1) == 0, F, 0)  # (z: stored by the first value block's programs only)
    h = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_F], tl.float32)
    if DECAY:
        rho = tl.load(RHO + pid_bh % Hkv).to(tl.float32)
        carry = tl.exp(-rho * CHUNK)
    for c in range(0, NS):
        st = base * NS + c
        tl.store(HKV + (st * F + of)[:, None] * D + od[None, :], h.to(HKV.dtype.element_ty), mask=both)
        tl.store(HK + st * F + of, z, mask=of < z_lim)
        j = c * CHUNK + tl.arange(0, CHUNK)
        ok = (j >= n_excl) & (j < T)
        row = base * T + j
        fk = tl.load(FK + row[:, None] * F + of[None, :], mask=ok[:, None] & (of < F)[None, :], other=0.0)
        v = tl.load(V + row[:, None] * D + od[None, :], mask=ok[:, None] & (od < D)[None, :], other=0.0)
        if DECAY:  # carried to key (c + 1) CHUNK - 1, and chunk c's keys as that key sees them
            fk = fk.to(tl.float32) * tl.exp(-rho * ((c + 1) * CHUNK - 1 - j).to(tl.float32))[:, None]
            h = h * carry
            z = z * carry
        h += tl.dot(tl.trans(fk.to(DT)), v.to(DT), input_precision=PREC)
        z += tl.sum(fk.to(tl.float32), 0)


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


# ---------------------------------------------------------------------------------------------------------------------
# The backward (`ChunkAttention`). Per row n: Z_n the normaliser, do_n = dy_n / Z_n (rounded to the inputs' dtype for
# the products, as hybrid_attention._delta rounds it), and dlz_n = delta_n / Z_n = do_n . y_n (y the forward's fp32
# output); every term p_nj of the numerator (g E or L) has dp_nj = do_n . v_j - dlz_n. The window and sink terms give
# ds = p dp (dq, dk through s q.k), the L terms dphi through dp times their weight, and c_n (not detached) gives
# -sum_j ds_nj to its argmax key. The launches: `_chunk_states` (the forward's states again), `_chunk_bwd_dq` (per
# query head and chunk: dq, dphi_q, dlz, the row sums of ds, the sinks' ds and E per row, whose dk, dv the host sums),
# `_chunk_dstates` (the reverse scan: the gradient of every state, summed over the KV head's query heads),
# `_chunk_bwd_dkv` twice (per KV head, key chunk and head-dim block, looping over its query heads: dk, then dv) and
# `_chunk_bwd_dfk` (per KV head and key chunk: dphi_k). Every [64, D] operand is walked in head-dim chunks and every
# transposed operand is loaded transposed (so it goes through shared memory, not registers): no kernel spills at the
# presets' shapes. rho's gradient is taken term by term where each weight is made (no position-weighted sums that
# cancel): the intra-chunk L terms (-e p dp, in `_chunk_bwd_dfk`), a query's lag on its state, each state's carry
# alpha^CHUNK in the scan, and each key's weight inside its chunk.


@triton.jit
def _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j, kv_base, q_base, T, D, window, lin_off, n_excl, scale, g,
                 rho, CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr,
                 DECAY: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One key block j [CHUNK] of a query chunk's backward: (ds [CHUNK, CHUNK] in DT, its row sums, dp times the L
    weights [CHUNK, CHUNK] in DT for dphi_q). dp = do . v - dlz and the scores q . k walk the head dim in chunks of
    BLOCK_DK (no [CHUNK, D] operand stays in registers). (rho's share of the intra-chunk L terms is
    `_chunk_bwd_dfk`'s, which has their phi_k . phi_q.)"""
    k_ok = (j >= 0) & (j < T)
    dp = tl.zeros([CHUNK, CHUNK], tl.float32)
    a = tl.zeros([CHUNK, CHUNK], tl.float32)
    for d0 in range(0, D, BLOCK_DK):
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)
        do = (dy.to(tl.float32) / zs[:, None]).to(DT)
        vt = tl.load(V + kv_base * D + od[:, None] + j[None, :] * D, mask=dm[:, None] & k_ok[None, :], other=0.0)
        dp += tl.dot(do, vt.to(DT), input_precision=PREC)  # (v loaded transposed: a B operand through shared memory)
        if SOFT:
            q = tl.load(Q + q_base * D + n[:, None] * D + od[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)
            kt = tl.load(K + kv_base * D + od[:, None] + j[None, :] * D, mask=dm[:, None] & k_ok[None, :], other=0.0)
            a += tl.dot(q.to(DT), kt.to(DT), input_precision=PREC)
    dp = dp - dlz[:, None]
    ds = tl.zeros([CHUNK, CHUNK], tl.float32)
    dpw = tl.zeros([CHUNK, CHUNK], tl.float32)
    both = row_ok[:, None] & k_ok[None, :]
    if SOFT:
        win = both & (j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window)
        ds = tl.where(win, g * tl.exp(a * scale - m[:, None]), 0.0) * dp
    rs = tl.sum(ds, 1)
    if LIN:
        lin = both & (j[None, :] <= n[:, None] - lin_off) & (j[None, :] >= n_excl)
        w = tl.where(lin, 1.0, 0.0)
        if DECAY:
            w = w * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))
        dpw = dp * w
    return ds.to(DT), rs, dpw.to(DT)


@triton.jit
def _chunk_bwd_dq(
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK, DY, YF, M, ZS, IDX,  # inputs (YF: y in fp32; M, ZS, IDX: the forward's)
    DQ, DFQ, DLZ, RSUM, RROW, DKS, DVS,  # outputs
    T, H, G, D, F, NS, NC, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The backward of the CHUNK queries of chunk c (axis 1) of one query head (axis 0: batch x H): dq and dphi_q [B,
    H, T, *] in the inputs' dtype; dlz [B, H, T] (do . y, read by the next launches); RSUM, the row sums of ds over
    the window and sink terms (HYBRID: -dc_n, and gamma's gradient times gamma); RROW (DECAY) rho's share of the row's
    lag on the state; DKS, DVS [B, H, T, BLOCK_S] (SINKS): the sinks' ds (c_n's gradient in) and E terms per row,
    which the host turns into their dk, dv. The keys are chunks c - 1 and c (`_bwd_q_block` each, the first empty for
    c = 0) and the sinks: their ds tiles [CHUNK, keys] stay in registers (in DT) and dq is then made and stored a
    head-dim chunk of BLOCK_DK at a time (no [CHUNK, D] accumulator), c_n's gradient to the argmax key; dphi_q walks
    the features in chunks of BLOCK_FC: the two blocks' dp times the L weights against phi_k, plus the state before
    chunk c - 1 (c >= 2, its product with do over head-dim chunks)."""
    pid_bh = tl.program_id(0)
    c = tl.program_id(1)
    head = pid_bh % H
    bk = (pid_bh // H) * (H // G) + head // G  # batch x KV head
    kv_base = bk.to(tl.int64) * T
    q_base = pid_bh.to(tl.int64) * T
    n = c * CHUNK + tl.arange(0, CHUNK)
    row_ok = n < T
    rows = q_base + n
    zs = tl.load(ZS + rows, mask=row_ok, other=1.0)
    dlz = tl.zeros([CHUNK], tl.float32)
    for d0 in range(0, D, BLOCK_DK):  # dlz = do . y (do rounded to DT, as the products see it)
        od = d0 + tl.arange(0, BLOCK_DK)
        rm = row_ok[:, None] & (od < D)[None, :]
        dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
        yf = tl.load(YF + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
        dlz += tl.sum((dy.to(tl.float32) / zs[:, None]).to(DT).to(tl.float32) * yf, 1)
    tl.store(DLZ + rows, dlz, mask=row_ok)
    m = tl.load(M + rows, mask=row_ok, other=0.0)
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = 1.0
    rho = 0.0
    if DECAY:
        rho = tl.load(RHO + head // G).to(tl.float32)
    j0 = (c - 1) * CHUNK + tl.arange(0, CHUNK)
    j1 = c * CHUNK + tl.arange(0, CHUNK)
    ds0, rs0, dpw0 = _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j0, kv_base, q_base, T, D, window, lin_off,
                                  n_excl, scale, g, rho, CHUNK, BLOCK_DK, SOFT, LIN, DECAY, DT, PREC)  # fmt: skip
    ds1, rs1, dpw1 = _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j1, kv_base, q_base, T, D, window, lin_off,
                                  n_excl, scale, g, rho, CHUNK, BLOCK_DK, SOFT, LIN, DECAY, DT, PREC)  # fmt: skip
    rsum = rs0 + rs1
    rrow = tl.zeros([CHUNK], tl.float32)
    js = tl.arange(0, BLOCK_S)
    s_ok = (js < n_sinks) & (js < T)
    if SINKS:
        a_s = tl.zeros([CHUNK, BLOCK_S], tl.float32)
        dps = tl.zeros([CHUNK, BLOCK_S], tl.float32)
        for d0 in range(0, D, BLOCK_DK):
            od = d0 + tl.arange(0, BLOCK_DK)
            dm = od < D
            rm = row_ok[:, None] & dm[None, :]
            smt = dm[:, None] & s_ok[None, :]
            q = tl.load(Q + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
            dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
            kst = tl.load(K + kv_base * D + od[:, None] + js[None, :] * D, mask=smt, other=0.0)
            vst = tl.load(V + kv_base * D + od[:, None] + js[None, :] * D, mask=smt, other=0.0)
            a_s += tl.dot(q.to(DT), kst.to(DT), input_precision=PREC)
            dps += tl.dot((dy.to(tl.float32) / zs[:, None]).to(DT), vst.to(DT), input_precision=PREC)
        smask = row_ok[:, None] & s_ok[None, :] & (js[None, :] <= n[:, None] - sink_off)
        ps = tl.where(smask, g * tl.exp(a_s * scale - m[:, None]), 0.0)
        dss = ps * (dps - dlz[:, None])
        rsum += tl.sum(dss, 1)
        dsk = dss
    if HYBRID:  # c_n's gradient -rsum_n reaches its argmax key: a sink (through dsk, for dq and dk) or a window key
        idx = tl.load(IDX + rows, mask=row_ok, other=0)
        tl.store(RSUM + rows, rsum, mask=row_ok)
        rwin = rsum
        if SINKS:
            dsk = dss - tl.where(smask & (js[None, :] == idx[:, None]), rsum[:, None], 0.0)
            rwin = tl.where((idx < n_sinks) & (idx <= n - sink_off), 0.0, rsum)  # (the sinks are not window keys)
    if SINKS:  # the sinks' ds and E [rows, BLOCK_S] (the host makes their dk, dv: products over every row)
        part = rows[:, None] * BLOCK_S + js[None, :]
        tl.store(DKS + part, dsk, mask=row_ok[:, None])
        tl.store(DVS + part, ps, mask=row_ok[:, None])
    for d0 in range(0, D, BLOCK_DK):  # dq (and the sinks' dk, dv) a head-dim chunk at a time
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        rm = row_ok[:, None] & dm[None, :]
        k0 = tl.load(K + kv_base * D + j0[:, None] * D + od[None, :], mask=(j0 >= 0)[:, None] & dm[None, :], other=0.0)
        k1 = tl.load(K + kv_base * D + j1[:, None] * D + od[None, :], mask=(j1 < T)[:, None] & dm[None, :], other=0.0)
        dq = tl.dot(ds0, k0.to(DT), input_precision=PREC)
        dq += tl.dot(ds1, k1.to(DT), input_precision=PREC)
        if SINKS:
            ks = tl.load(K + kv_base * D + js[:, None] * D + od[None, :], mask=s_ok[:, None] & dm[None, :], other=0.0)
            dq += tl.dot(dsk.to(DT), ks.to(DT), input_precision=PREC)
        if HYBRID:
            kx = tl.load(K + kv_base * D + idx[:, None] * D + od[None, :], mask=rm, other=0.0)
            dq -= rwin[:, None] * kx.to(tl.float32)
        tl.store(DQ + q_base * D + n[:, None] * D + od[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=rm)
    if LIN:
        lo = (c - 1) * CHUNK
        lag = tl.exp(-rho * tl.maximum(n - window - (lo - 1), 0).to(tl.float32))
        st = bk.to(tl.int64) * NS + c - 1
        for f0 in range(0, F, BLOCK_FC):
            of = f0 + tl.arange(0, BLOCK_FC)
            fm = of < F
            fk0 = tl.load(FK + kv_base * F + j0[:, None] * F + of[None, :], mask=(j0 >= 0)[:, None] & fm[None, :],
                          other=0.0)  # fmt: skip
            fk1 = tl.load(FK + kv_base * F + j1[:, None] * F + of[None, :], mask=(j1 < T)[:, None] & fm[None, :],
                          other=0.0)  # fmt: skip
            acc = tl.dot(dpw0, fk0.to(DT), input_precision=PREC)
            acc += tl.dot(dpw1, fk1.to(DT), input_precision=PREC)
            if c >= 2:  # the state h_{c-1}: phi_q's gradient lag (h do - z dlz)
                sp = tl.zeros([CHUNK, BLOCK_FC], tl.float32)
                for d0 in range(0, D, BLOCK_DK):
                    od = d0 + tl.arange(0, BLOCK_DK)
                    dm = od < D
                    dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=row_ok[:, None] & dm[None, :],
                                 other=0.0)  # fmt: skip
                    do = (dy.to(tl.float32) / zs[:, None]).to(DT)
                    ht = tl.load(HKV + st * F * D + od[:, None] + of[None, :] * D, mask=dm[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    if HKV.dtype.element_ty == DT:
                        sp += tl.dot(do, ht, input_precision=PREC)
                    else:
                        sp += tl.dot(do.to(tl.float32), ht.to(tl.float32), input_precision=PREC)
                z = tl.load(HK + st * F + of, mask=fm, other=0.0)
                sp = (sp - dlz[:, None] * z[None, :]) * lag[:, None]
                acc += sp
                if DECAY:  # d lag / d rho = -(n - window - lo + 1) lag
                    fq = tl.load(FQ + q_base * F + n[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    rrow -= (n - window - lo + 1).to(tl.float32) * tl.sum(fq.to(tl.float32) * sp, 1)
            tl.store(DFQ + q_base * F + n[:, None] * F + of[None, :], acc.to(DFQ.dtype.element_ty),
                     mask=row_ok[:, None] & fm[None, :])  # fmt: skip
        if DECAY:
            tl.store(RROW + rows, rrow, mask=row_ok)


@triton.jit
def _chunk_dstates(
    FQ, DY, ZS, DLZ, RHO, HKV, HK,  # inputs (HKV, HK: the forward's states, read for rho's gradient)
    DHKV, DHK, RSCAN,  # outputs: dh [B, Hkv, NS, F, D] (HKV's dtype), dz [B, Hkv, NS, F] (fp32), rho's partial sums
    T, H, G, D, F, NS, Hkv, window,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """The gradient of every state h_s, z_s (s = NS - 1 .. 1; h_0 is empty), one program per (feature block, value
    block, batch x KV head), in reverse: dh_s = sum over the G query heads and the queries n of chunk s + 1 (which
    read h_s times lag_n = alpha^(n - window - (CHUNK s - 1))) of lag_n phi_q(q_n) do_n^T, plus alpha^CHUNK dh_{s+1}
    (h_{s+1} = alpha^CHUNK h_s + chunk s's keys); dz_s the same with -dlz_n. With DECAY, RSCAN gets each program's
    share of rho's gradient through the carries: -CHUNK alpha^CHUNK <dh_{s+1}, h_s> (and z's)."""
    pf = tl.program_id(0)
    pd = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    of = pf * BLOCK_F + tl.arange(0, BLOCK_F)
    od = pd * BLOCK_DV + tl.arange(0, BLOCK_DV)
    fm = of < F
    both = fm[:, None] & (od < D)[None, :]
    z_lim = tl.where(pd == 0, F, 0)  # (z: the first value block's programs)
    dh = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    dz = tl.zeros([BLOCK_F], tl.float32)
    racc = tl.zeros([BLOCK_F], tl.float32)
    rho = 0.0
    carry = 1.0
    if DECAY:
        rho = tl.load(RHO + kvh).to(tl.float32)
        carry = tl.exp(-rho * CHUNK)
    for i in range(0, NS - 1):
        s = NS - 1 - i
        st = pid_bh.to(tl.int64) * NS + s
        if DECAY:  # dh, dz hold dh_{s+1}, dz_{s+1}: h_{s+1} = alpha^CHUNK h_s + ...
            h = tl.load(HKV + (st * F + of)[:, None] * D + od[None, :], mask=both, other=0.0).to(tl.float32)
            z = tl.load(HK + st * F + of, mask=of < z_lim, other=0.0)
            racc += tl.sum(dh * h, 1) + dz * z
            dh = dh * carry
            dz = dz * carry
        n = (s + 1) * CHUNK + tl.arange(0, CHUNK)
        row_ok = n < T
        lag = tl.where(row_ok, 1.0, 0.0)
        if DECAY:
            lag = lag * tl.exp(-rho * (n - window - s * CHUNK + 1).to(tl.float32))
        for hh in range(0, G):
            rows = (b * H + kvh * G + hh).to(tl.int64) * T + n
            fq = tl.load(FQ + rows[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :], other=0.0)
            dy = tl.load(DY + rows[:, None] * D + od[None, :], mask=row_ok[:, None] & (od < D)[None, :], other=0.0)
            zs = tl.load(ZS + rows, mask=row_ok, other=1.0)
            dlz = tl.load(DLZ + rows, mask=row_ok, other=0.0)
            do = (dy.to(tl.float32) / zs[:, None]).to(DT)
            fql = fq.to(tl.float32) * lag[:, None]
            dh += tl.dot(tl.trans(fql.to(DT)), do, input_precision=PREC)
            dz -= tl.sum(fql * dlz[:, None], 0)
        tl.store(DHKV + (st * F + of)[:, None] * D + od[None, :], dh.to(DHKV.dtype.element_ty), mask=both)
        tl.store(DHK + st * F + of, dz, mask=of < z_lim)
    if DECAY:
        pid = (pid_bh * tl.num_programs(0) + pf) * tl.num_programs(1) + pd
        tl.store(RSCAN + pid, -CHUNK * carry * tl.sum(racc, 0))


@triton.jit
def _bwd_kv_dp(Q, K, V, DY, zs, dlz, j, k_ok, n, q_ok, q_base, kv_base, D, CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr,
               SCORES: tl.constexpr, DP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """[keys, queries] tiles of one query block: (DP) dp^T = v . do - dlz and (SCORES) the unscaled scores k . q, the
    head dim walked in chunks of BLOCK_DK (do and q loaded transposed: B operands through shared memory)."""
    dpt = tl.zeros([CHUNK, CHUNK], tl.float32)
    at = tl.zeros([CHUNK, CHUNK], tl.float32)
    for d0 in range(0, D, BLOCK_DK):
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        km = k_ok[:, None] & dm[None, :]
        qm = dm[:, None] & q_ok[None, :]
        if DP:
            v = tl.load(V + kv_base * D + j[:, None] * D + od[None, :], mask=km, other=0.0)
            dyt = tl.load(DY + q_base * D + od[:, None] + n[None, :] * D, mask=qm, other=0.0)
            dpt += tl.dot(v.to(DT), (dyt.to(tl.float32) / zs[None, :]).to(DT), input_precision=PREC)
        if SCORES:
            k = tl.load(K + kv_base * D + j[:, None] * D + od[None, :], mask=km, other=0.0)
            qt = tl.load(Q + q_base * D + od[:, None] + n[None, :] * D, mask=qm, other=0.0)
            at += tl.dot(k.to(DT), qt.to(DT), input_precision=PREC)
    return dpt - dlz[None, :], at


@triton.jit
def _chunk_bwd_dkv(
    Q, K, V, FQ, FK, GAMMA, RHO, DY, M, ZS, DLZ, IDX, RSUM, DHKV, DKS, DVS,  # inputs
    DK, DV,  # outputs
    T, H, G, D, F, NS, NC, window, lin_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr,
    HYBRID: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, DV_PASS: tl.constexpr,
):  # fmt: skip
    """dk (DV_PASS false: the window terms only) or dv (DV_PASS: window and L terms, and the state), in the inputs'
    dtype, of the CHUNK keys j of chunk c (axis 1) of one KV head (axis 0: batch x Hkv), head-dim columns BLOCK_DO
    (axis 2) of them, summed over its G query heads: for each, the query chunks c and c + 1 (the only ones whose
    window or intra-chunk L terms reach chunk c), in tiles [keys, queries] (their products over the whole head dim,
    in chunks of BLOCK_DK); c_n's gradient where its argmax is one of these keys in the row's window; then (c <= NS
    - 2) dv's share of the state h_{c+1} that holds these keys, from dh_{c+1} (each key's weight alpha^(CHUNK c +
    CHUNK - 1 - j)); then (c = 0) the sinks' dk, dv (the host's sums). Two launches (one accumulator each: the
    scores are recomputed); dphi_k is `_chunk_bwd_dfk`'s."""
    pid_bk = tl.program_id(0)
    c = tl.program_id(1)
    Hkv = H // G
    kv_base = pid_bk.to(tl.int64) * T
    j = c * CHUNK + tl.arange(0, CHUNK)
    k_ok = j < T
    od = tl.program_id(2) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dm = od < D
    km = k_ok[:, None] & dm[None, :]
    acc = tl.zeros([CHUNK, BLOCK_DO], tl.float32)
    rho = 0.0
    if DECAY:
        rho = tl.load(RHO + pid_bk % Hkv).to(tl.float32)
    for hh in range(0, G):
        head = (pid_bk % Hkv) * G + hh
        q_base = ((pid_bk // Hkv) * H + head).to(tl.int64) * T
        if HYBRID:
            g = tl.load(GAMMA + head).to(tl.float32)
        else:
            g = 1.0
        for qb in range(c, tl.minimum(c + 2, NC)):
            n = qb * CHUNK + tl.arange(0, CHUNK)
            q_ok = n < T
            rows = q_base + n
            qm = q_ok[:, None] & dm[None, :]
            zs = tl.load(ZS + rows, mask=q_ok, other=1.0)
            both = k_ok[:, None] & q_ok[None, :]
            if SOFT:  # the window terms: dk from ds^T, dv from E^T
                dlz = tl.load(DLZ + rows, mask=q_ok, other=0.0)
                dpt, at = _bwd_kv_dp(Q, K, V, DY, zs, dlz, j, k_ok, n, q_ok, q_base, kv_base, D, CHUNK, BLOCK_DK, True,
                                     not DV_PASS, DT, PREC)  # fmt: skip
                m = tl.load(M + rows, mask=q_ok, other=0.0)
                win = both & (j[:, None] <= n[None, :]) & (j[:, None] > n[None, :] - window)
                pt = tl.where(win, g * tl.exp(at * scale - m[None, :]), 0.0)
                if DV_PASS:
                    dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=qm, other=0.0)
                    acc += tl.dot(pt.to(DT), (dy.to(tl.float32) / zs[:, None]).to(DT), input_precision=PREC)
                else:
                    dst = pt * dpt
                    if HYBRID:  # (c_n's argmax key: a window key where it is past n - window, else a sink)
                        idx = tl.load(IDX + rows, mask=q_ok, other=-1)
                        idx = tl.where(idx > n - window, idx, -1)
                        rsum = tl.load(RSUM + rows, mask=q_ok, other=0.0)
                        dst -= tl.where(j[:, None] == idx[None, :], rsum[None, :], 0.0)
                    q = tl.load(Q + q_base * D + n[:, None] * D + od[None, :], mask=qm, other=0.0)
                    acc += tl.dot(dst.to(DT), q.to(DT), input_precision=PREC)
            if LIN and DV_PASS:
                st_ = tl.zeros([CHUNK, CHUNK], tl.float32)
                for f0 in range(0, F, BLOCK_FC):
                    of = f0 + tl.arange(0, BLOCK_FC)
                    fm = of < F
                    fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    fqt = tl.load(FQ + q_base * F + of[:, None] + n[None, :] * F, mask=fm[:, None] & q_ok[None, :],
                                  other=0.0)  # fmt: skip
                    st_ += tl.dot(fk.to(DT), fqt.to(DT), input_precision=PREC)
                lin = both & (j[:, None] <= n[None, :] - lin_off) & (j[:, None] >= n_excl)
                wt = tl.where(lin, 1.0, 0.0)
                if DECAY:
                    wt = wt * tl.exp(-rho * tl.maximum(n[None, :] - window - j[:, None], 0).to(tl.float32))
                dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=qm, other=0.0)
                acc += tl.dot((st_ * wt).to(DT), (dy.to(tl.float32) / zs[:, None]).to(DT), input_precision=PREC)
    if LIN and DV_PASS:
        if c <= NS - 2:  # these keys' share of h_{c+1}: weight alpha^(e - j), e the chunk's last key
            st = pid_bk.to(tl.int64) * NS + c + 1
            wk = tl.where(k_ok & (j >= n_excl), 1.0, 0.0)
            if DECAY:
                wk = wk * tl.exp(-rho * (c * CHUNK + CHUNK - 1 - j).to(tl.float32))
            for f0 in range(0, F, BLOCK_FC):
                of = f0 + tl.arange(0, BLOCK_FC)
                fm = of < F
                fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
                dh = tl.load(DHKV + st * F * D + of[:, None] * D + od[None, :], mask=fm[:, None] & dm[None, :],
                             other=0.0)  # fmt: skip
                if DHKV.dtype.element_ty == DT:
                    acc += tl.dot((fk * wk[:, None]).to(DT), dh, input_precision=PREC)
                else:
                    acc += tl.dot(fk * wk[:, None], dh.to(tl.float32), input_precision=PREC)
    part = (pid_bk.to(tl.int64) * BLOCK_S + j)[:, None] * BLOCK_D + od[None, :]
    out = (kv_base + j)[:, None] * D + od[None, :]
    if DV_PASS:
        if SINKS:  # (chunk 0: the sinks' shares from every query, summed on the host; n_sinks <= CHUNK)
            acc += tl.load(DVS + part, mask=(k_ok & (j < n_sinks))[:, None] & dm[None, :], other=0.0)
        tl.store(DV + out, acc.to(DV.dtype.element_ty), mask=km)
    else:
        if SINKS:
            acc += tl.load(DKS + part, mask=(k_ok & (j < n_sinks))[:, None] & dm[None, :], other=0.0)
        tl.store(DK + out, (acc * scale).to(DK.dtype.element_ty), mask=km)


@triton.jit
def _chunk_bwd_dfk(
    FQ, FK, V, RHO, DY, ZS, DLZ, DHKV, DHK,  # inputs
    DFK, RKEY,  # outputs (DFK: fp32, zeroed, added to)
    T, H, G, D, F, NS, NC, window, lin_off, n_excl,
    CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """dphi_k (fp32, added) of the CHUNK keys j of chunk c (axis 1) of one KV head (axis 0: batch x Hkv), the LA
    modes only: per query head of the KV head and query chunk c, c + 1, dp^T [keys, queries] (over head-dim chunks)
    times the L weights, against phi_q a feature chunk at a time; then (c <= NS - 2) the state h_{c+1} that holds
    these keys, v dh_{c+1}^T + dz_{c+1} times each key's weight. RKEY (DECAY): rho's share through those weights."""
    pid_bk = tl.program_id(0)
    c = tl.program_id(1)
    Hkv = H // G
    kv_base = pid_bk.to(tl.int64) * T
    j = c * CHUNK + tl.arange(0, CHUNK)
    k_ok = j < T
    rho = 0.0
    if DECAY:
        rho = tl.load(RHO + pid_bk % Hkv).to(tl.float32)
    rkey = tl.zeros([CHUNK], tl.float32)
    for hh in range(0, G):
        q_base = ((pid_bk // Hkv) * H + (pid_bk % Hkv) * G + hh).to(tl.int64) * T
        for qb in range(c, tl.minimum(c + 2, NC)):
            n = qb * CHUNK + tl.arange(0, CHUNK)
            q_ok = n < T
            rows = q_base + n
            zs = tl.load(ZS + rows, mask=q_ok, other=1.0)
            dlz = tl.load(DLZ + rows, mask=q_ok, other=0.0)
            dpt, _ = _bwd_kv_dp(FQ, FK, V, DY, zs, dlz, j, k_ok, n, q_ok, q_base, kv_base, D, CHUNK, BLOCK_DK, False,
                                True, DT, PREC)  # fmt: skip
            lin = (k_ok[:, None] & q_ok[None, :]) & (j[:, None] <= n[None, :] - lin_off) & (j[:, None] >= n_excl)
            wt = tl.where(lin, 1.0, 0.0)
            if DECAY:
                wt = wt * tl.exp(-rho * tl.maximum(n[None, :] - window - j[:, None], 0).to(tl.float32))
            dpw = dpt * wt
            st_ = tl.zeros([CHUNK, CHUNK], tl.float32)
            for f0 in range(0, F, BLOCK_FC):
                of = f0 + tl.arange(0, BLOCK_FC)
                fm = of < F
                fq = tl.load(FQ + q_base * F + n[:, None] * F + of[None, :], mask=q_ok[:, None] & fm[None, :],
                             other=0.0)  # fmt: skip
                tl.atomic_add(DFK + kv_base * F + j[:, None] * F + of[None, :],
                              tl.dot(dpw.to(DT), fq.to(DT), input_precision=PREC), mask=k_ok[:, None] & fm[None, :],
                              sem="relaxed")  # fmt: skip
                if DECAY:  # (phi_k . phi_q of the L terms, for rho's share: -e L dp)
                    fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    fqt = tl.load(FQ + q_base * F + of[:, None] + n[None, :] * F, mask=fm[:, None] & q_ok[None, :],
                                  other=0.0)  # fmt: skip
                    st_ += tl.dot(fk.to(DT), fqt.to(DT), input_precision=PREC)
            if DECAY:
                e = tl.maximum(n[None, :] - window - j[:, None], 0).to(tl.float32)
                rkey -= tl.sum(st_ * dpw * e, 1)
    if c <= NS - 2:  # these keys' share of h_{c+1}: weight alpha^(e - j), e the chunk's last key
        st = pid_bk.to(tl.int64) * NS + c + 1
        e = c * CHUNK + CHUNK - 1
        wk = tl.where(k_ok & (j >= n_excl), 1.0, 0.0)
        if DECAY:
            wk = wk * tl.exp(-rho * (e - j).to(tl.float32))
        for f0 in range(0, F, BLOCK_FC):
            of = f0 + tl.arange(0, BLOCK_FC)
            fm = of < F
            dfs = tl.zeros([CHUNK, BLOCK_FC], tl.float32)
            for d0 in range(0, D, BLOCK_DK):
                od = d0 + tl.arange(0, BLOCK_DK)
                dm = od < D
                v = tl.load(V + kv_base * D + j[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
                dht = tl.load(DHKV + st * F * D + od[:, None] + of[None, :] * D, mask=dm[:, None] & fm[None, :],
                              other=0.0)  # fmt: skip
                if DHKV.dtype.element_ty == DT:
                    dfs += tl.dot(v.to(DT), dht, input_precision=PREC)
                else:
                    dfs += tl.dot(v.to(tl.float32), dht.to(tl.float32), input_precision=PREC)
            dz = tl.load(DHK + st * F + of, mask=fm, other=0.0)
            dfs = (dfs + dz[None, :]) * wk[:, None]
            tl.atomic_add(DFK + kv_base * F + j[:, None] * F + of[None, :], dfs, mask=k_ok[:, None] & fm[None, :],
                          sem="relaxed")  # fmt: skip
            if DECAY:
                fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
                rkey -= (e - j).to(tl.float32) * tl.sum(fk * dfs, 1)
    if DECAY:
        tl.store(RKEY + pid_bk * NC + c, tl.sum(rkey, 0))


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(x)))


# Launch settings on a GPU (and on the meta device, which stands for one in the compile gate), half precision, by
# head dim (<= 64, <= 128): _chunk_states' feature and value blocks and warps; _chunk_output's head-dim chunk of the
# q.k products, feature chunk, warps and pipeline stages. Found with benchmarks/kernel_compile.py at the presets'
# shapes, every mode, bf16 and fp16: 4 warps (one warpgroup on the 64 rows; with 8, Triton's layouts replicate the
# rows or the operands and spill), one stage (2 spilled on sm_80 at head dim 128), head-dim chunks of 32 at 128 (64
# spilled 60-300 bytes: a [64, 64] q operand in registers) and 16 at 64 (64 and 32 spilled 8-16 bytes on sm_80).
# The backward's (ChunkAttention), found the same way (benchmarks/kernel_compile.py, and a script that compiles only
# the backward's launches): head-dim chunks of 16 (bwd_dchunk: at 32 the operands of mma.sync's B, whole in every warp
# on sm_80, spilled 40-160 bytes), feature chunks of 16 (bwd_fchunk: 32 spilled 40-160 bytes in dq with the sinks),
# _chunk_bwd_dkv over head-dim blocks of 64 (bwd_dout) with 8 warps (4 warps spilled 24-56 bytes on sm_80 at 64, none
# at 32 but with twice the recomputed scores), 4 warps for _chunk_bwd_dq and _chunk_bwd_dfk, and maxnreg=255 for all
# three (ptxas otherwise caps some at 128-160 registers and spills, as in decode.py). Every backward kernel then uses
# 0 spill bytes in bf16 and fp16 on sm_80 and sm_90 at both presets' head dims, every mode, with wgmma on sm_90.
GPU_SETTINGS = {
    64: dict(block_f=64, block_dv=32, state_warps=4, dchunk=16, fchunk=32, warps=4, stages=1, dq_warps=4, dkv_warps=8,
             dfk_warps=4, bwd_dchunk=16, bwd_fchunk=16, bwd_dout=64, dq_maxnreg=255, dkv_maxnreg=255, dfk_maxnreg=255),
    128: dict(block_f=64, block_dv=32, state_warps=4, dchunk=32, fchunk=32, warps=4, stages=1, dq_warps=4, dkv_warps=8,
              dfk_warps=4, bwd_dchunk=16, bwd_fchunk=16, bwd_dout=64, dq_maxnreg=255, dkv_maxnreg=255, dfk_maxnreg=255),
}  # fmt: skip


def _settings(x: torch.Tensor, head_dim: int, features: int) -> dict:
    if x.device.type == "cpu":  # Triton's interpreter (tests): any tile works, these are fast there
        fchunk = min(_pow2(features), 64)
        return dict(block_f=64, block_dv=64, state_warps=4, dchunk=32, fchunk=fchunk, warps=4, stages=1, dq_warps=4,
                    dkv_warps=4, dfk_warps=4, bwd_dchunk=32, bwd_fchunk=fchunk, bwd_dout=64)  # fmt: skip
    return GPU_SETTINGS[64 if head_dim <= 64 else 128]


def _regs(cfg: dict, kernel: str) -> dict:
    """The register cap (maxnreg) of a backward kernel where its settings name one."""
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
    """_chunk_states' h [B, Hkv, ns, F, D] (bf16 for bf16 inputs, else fp32) and z [B, Hkv, ns, F] (fp32)."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    state_dtype = torch.bfloat16 if fk.dtype == torch.bfloat16 else torch.float32
    hkv = torch.empty(B, Hkv, ns, F, D, dtype=state_dtype, device=fk.device)
    hk = torch.empty(B, Hkv, ns, F, dtype=torch.float32, device=fk.device)
    bf, bdv = cfg["block_f"], min(cfg["block_dv"], _pow2(D))
    _chunk_states[(triton.cdiv(F, bf), triton.cdiv(D, bdv), B * Hkv)](
        fk, v, hk if rho is None else rho, hkv, hk, T, F, D, ns, Hkv, n_excl,
        DECAY=rho is not None, CHUNK=CHUNK, BLOCK_F=bf, BLOCK_DV=bdv, DT=dt, PREC=prec, num_warps=cfg["state_warps"],
    )  # fmt: skip
    return hkv, hk


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
    if mode == "none":
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    if _refused(q, k, v, fq, window, mode, sinks, hybrid_sinks, la_decay):
        return None
    if q.shape[2] == 0:
        return torch.empty_like(q)
    dtype = q.dtype
    k, v, fq, fk = (t.to(dtype).contiguous() for t in (k, v, fq, fk))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rho = None if la_decay is None else la_decay.detach().float().contiguous()
    with torch.no_grad():
        return _forward(q.contiguous(), k, v, fq, fk, gamma, rho, window=window, mode=mode, sinks=sinks,
                        hybrid_sinks=hybrid_sinks, scale=scale, stats=False)  # fmt: skip


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
    if mode == "none":
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    if _refused(q, k, v, fq, window, mode, sinks, hybrid_sinks, la_decay):
        return None
    if q.shape[2] == 0:
        return torch.empty_like(q)
    dtype = q.dtype
    k, v, fq, fk = (t.to(dtype).contiguous() for t in (k, v, fq, fk))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return ChunkAttention.apply(
        q.contiguous(), k, v, fq, fk, gamma, la_decay, int(window), mode, int(sinks), bool(hybrid_sinks), scale
    )


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
