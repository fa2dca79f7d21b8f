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
benchmarks/kernel_compile.py for sm_80 and sm_90.
The backward kernels recompute exactly what `_fwd` computes, through the same jit helpers (_dot, _span,
_packed, _query_tile, _gammas, _cols, _state, _la_scores); the autograd Function that launches the forward and
the backward kernels, and saves what the backward reads, follows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EPS = 1e-12  # must equal hybrid_scale.attention.naive.EPS (checked by the tests)
_EPS = tl.constexpr(EPS)

# mode -> (window softmax, linear attention, sinks, gamma used)
MODE_PARTS = {
    "hybrid": (True, True, False, True),
    "swa_only": (True, False, False, False),
    "swa_sinks": (True, False, True, False),
    "la_only": (False, True, False, False),
    "sinks_only": (False, False, True, False),
}
MODES = (*MODE_PARTS, "none")


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _span(first, start, end, BLOCK: tl.constexpr):
    """Token indices first..first+BLOCK-1, their real-token index, and whether they are real tokens."""
    idx = first + tl.arange(0, BLOCK)
    return idx, idx - start, (idx >= start) & (idx < end)


@triton.jit
def _cols(PTR, row, ok, width, c0, BLOCK_C: tl.constexpr):
    """Columns c0..c0+BLOCK_C-1 of rows `row` (int64 row numbers of a [rows, width] tensor), 0 where not ok."""
    o = c0 + tl.arange(0, BLOCK_C)
    return tl.load(PTR + row[:, None] * width + o[None, :], mask=ok[:, None] & (o < width)[None, :], other=0.0)


@triton.jit
def _store_cols(PTR, row, ok, width, c0, x, BLOCK_C: tl.constexpr):
    o = c0 + tl.arange(0, BLOCK_C)
    tl.store(
        PTR + row[:, None] * width + o[None, :], x.to(PTR.dtype.element_ty), mask=ok[:, None] & (o < width)[None, :]
    )


@triton.jit
def _rows(PTR, row, ok, width, BLOCK_W: tl.constexpr):
    return _cols(PTR, row, ok, width, 0, BLOCK_W)


@triton.jit
def _store_rows(PTR, row, ok, width, x, BLOCK_W: tl.constexpr):
    _store_cols(PTR, row, ok, width, 0, x, BLOCK_W)


@triton.jit
def _state(STATE_KV, STATE_K, st, F, D, f0, BLOCK_FC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Features f0..f0+BLOCK_FC-1 of the fp32 LA state number st: kv [BLOCK_FC, BLOCK_D] and k [BLOCK_FC]."""
    of = f0 + tl.arange(0, BLOCK_FC)
    kv = _rows(STATE_KV + st * F * D, of.to(tl.int64), of < F, D, BLOCK_D)
    return kv, tl.load(STATE_K + st * F + of, mask=of < F, other=0.0)


@triton.jit
def _la_scores(FQ, FK, q_row, row_ok, k_row, k_ok, F, BLOCK: tl.constexpr, BLOCK_FC: tl.constexpr,
               DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """phi_q . phi_k of a query tile and a key tile, summed over feature chunks (no [BLOCK, F] tile stays live)."""
    s = tl.zeros([BLOCK, BLOCK], tl.float32)
    for f0 in range(0, F, BLOCK_FC):
        s += _dot(
            _cols(FQ, q_row, row_ok, F, f0, BLOCK_FC), tl.trans(_cols(FK, k_row, k_ok, F, f0, BLOCK_FC)), DT, PREC
        )
    return s


@triton.jit
def _online(m_i, num, den, a, v, DT: tl.constexpr, PREC: tl.constexpr):
    """One step of the online softmax: scores a (-inf where masked) and values v join the running max, numerator
    and denominator."""
    m_new = tl.maximum(m_i, tl.max(a, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(a - m_safe[:, None])
    return m_new, num * alpha[:, None] + _dot(p, v, DT, PREC), den * alpha + tl.sum(p, 1)


@triton.jit
def _packed(i, b, hk, start, end, T, H, G, BLOCK: tl.constexpr):
    """Packed tile i of the (position, query head) pairs of KV head hk's G query heads, position-major (the G heads
    of a position are adjacent rows; GQA: every key, value, phi_k and state tile is read once for the whole group):
    each row's query head, position, real-token index, whether it is a real token, and row number in [B * H * T];
    the tile's first and last position."""
    p = i * BLOCK + tl.arange(0, BLOCK)
    pos = p // G
    head = hk * G + p % G
    q_row = (b * H + head).to(tl.int64) * T + pos
    return head, pos, pos - start, (pos >= start) & (pos < end), q_row, i * BLOCK // G, ((i + 1) * BLOCK - 1) // G


@triton.jit
def _query_tile(START, END, T, H, G, BLOCK: tl.constexpr):
    """This program's packed query tile (grid axis 0, `_packed`) of batch x KV head (axis 1): each row's head, the
    first row of the KV head's keys, the batch row's real span, the tile's first and last position, each row's
    position, real-token index, whether it is real, and row number in [B * H * T]."""
    pid_bkv = tl.program_id(1)
    b, hk = pid_bkv // (H // G), pid_bkv % (H // G)
    start, end = tl.load(START + b), tl.load(END + b)
    head, rows, n, row_ok, q_row, m0, m1 = _packed(tl.program_id(0), b, hk, start, end, T, H, G, BLOCK)
    return head, pid_bkv.to(tl.int64) * T, start, end, m0, m1, rows, n, row_ok, q_row


@triton.jit
def _gammas(GAMMA, head, HYBRID: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's gamma (its head's; 1 unless the hybrid)."""
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = tl.full([BLOCK], 1.0, tl.float32)
    return g


@triton.jit
def _rho(RHO, hk):
    """The LA's decay rate rho >= 0 of KV head hk (alpha = exp(-rho))."""
    return tl.load(RHO + hk).to(tl.float32)


@triton.jit
def _decayed(s, rho, n, j, window):
    """L terms s [queries, keys] of queries n and keys j (real indices) times alpha^max(0, n - w - j): a key that has
    left the query's window by d counts alpha^d, one inside it (la_only) 1. The exponent is clamped at 0 everywhere,
    so masked entries (0) never meet an overflow."""
    return s * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))


@triton.jit
def _ref(st, start, BLOCK: tl.constexpr):
    """The token position the decayed LA state number st is kept for: its keys j count alpha^(ref - j). The state of
    the keys before block st is kept as its last key sees it; one before the first real token (the initial state
    only) as token start - 1 sees it, which is how an initial state is given (as query w - 1 of the sequence sees
    it). Never below a real key of the state, so no weight exceeds 1."""
    return tl.maximum(st * BLOCK, start) - 1


@triton.jit
def _lag(rho, rows, offset):
    """alpha^max(0, rows - offset) per row: how a query (or a key) at token position `rows` sees a state kept for
    position offset - w (the caller adds the window)."""
    return tl.exp(-rho * tl.maximum(rows - offset, 0).to(tl.float32))


@triton.jit
def _states_fwd(
    FK, V, START, END, INIT_KV, INIT_K, RHO,  # inputs
    STATE_KV, STATE_K,  # outputs [B, Hkv, NC, F, D], [B, Hkv, NC, F]
    T, Hkv, F, D, NC,
    HAS_INIT: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_FC: tl.constexpr,
    BLOCK_D: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The exclusive prefix LA state at every key-block boundary, one program per (feature chunk, batch x KV head):
    state c = the initial state + sum over the real keys of blocks 0..c-1 of phi_k(k) v^T, and of phi_k(k). With a
    decay (DECAY) state c is kept as token _ref(c) sees it: each key j weighted alpha^(_ref(c) - j), the initial
    state alpha^(_ref(c) - start + 1); block c's keys join it as _ref(c + 1) sees them, after the state has been
    carried there (one multiply)."""
    f0 = tl.program_id(0) * BLOCK_FC
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    start, end = tl.load(START + b), tl.load(END + b)
    of = f0 + tl.arange(0, BLOCK_FC)
    od = tl.arange(0, BLOCK_D)
    both = (of < F)[:, None] & (od < D)[None, :]
    base = pid_bh.to(tl.int64)
    if HAS_INIT:
        kv = tl.load(INIT_KV + (base * F + of)[:, None] * D + od[None, :], mask=both, other=0.0).to(tl.float32)
        ks = tl.load(INIT_K + base * F + of, mask=of < F, other=0.0).to(tl.float32)
    else:
        kv = tl.zeros([BLOCK_FC, BLOCK_D], tl.float32)
        ks = tl.zeros([BLOCK_FC], tl.float32)
    if DECAY:
        rho = _rho(RHO, pid_bh % Hkv)
    for c in range(0, NC):
        st = base * NC + c
        tl.store(STATE_KV + (st * F + of)[:, None] * D + od[None, :], kv, mask=both)
        tl.store(STATE_K + st * F + of, ks, mask=of < F)
        cols, _, k_ok = _span(c * BLOCK, start, end, BLOCK)
        fk = _cols(FK, base * T + cols, k_ok, F, f0, BLOCK_FC)
        v = _rows(V, base * T + cols, k_ok, D, BLOCK_D)
        if DECAY:  # carried to _ref(c + 1) (>= every key of block c), then block c's keys as that token sees them
            ref = _ref(c + 1, start, BLOCK)
            carry = tl.exp(-rho * (ref - _ref(c, start, BLOCK)).to(tl.float32))
            fk = fk.to(tl.float32) * tl.exp(-rho * (ref - cols).to(tl.float32))[:, None]
            kv = kv * carry + tl.dot(tl.trans(fk), v.to(tl.float32), input_precision=PREC)
            ks = ks * carry + tl.sum(fk, 0)
        else:
            kv += _dot(tl.trans(fk), v, DT, PREC)
            ks += tl.sum(fk.to(tl.float32), 0)


@triton.jit
def _fwd(
    Q, K, V, FQ, FK, GAMMA, RHO, STATE_KV, STATE_K, START, END,  # inputs
    Y, C, Z, DEN_E, DEN_L, IDX,  # outputs
    T, H, G, D, F, NC, window, lin_off, st_off, sink_off, n_sinks, scale,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    head, kv_base, start, end, m0, m1, rows, n, row_ok, q_row = _query_tile(START, END, T, H, G, BLOCK)
    q = _rows(Q, q_row, row_ok, D, BLOCK_D)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    num_e = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    den_e = tl.zeros([BLOCK], tl.float32)
    num_l = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    den_l = tl.zeros([BLOCK], tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    if LIN:  # (st_off: the window with a decay, which must stream every key inside it; la_only without one: 0)
        lo = tl.maximum(m0 - st_off + 1, 0) // BLOCK * BLOCK
    else:
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK * BLOCK
    if DECAY:
        rho = _rho(RHO, tl.program_id(1) % (H // G))
    if SOFT or LIN:
        for kb in range(lo, tl.minimum(m1 + 1, end), BLOCK):
            cols, j, k_ok = _span(kb, start, end, BLOCK)
            v = _rows(V, kv_base + cols, k_ok, D, BLOCK_D)
            causal = row_ok[:, None] & k_ok[None, :] & (j[None, :] <= n[:, None])
            if SOFT:
                if kb + BLOCK - 1 > m0 - window:  # some key of the block is in some query's window
                    a = _dot(q, tl.trans(_rows(K, kv_base + cols, k_ok, D, BLOCK_D)), DT, PREC) * scale
                    a = tl.where(causal & (j[None, :] > n[:, None] - window), a, float("-inf"))
                    if HYBRID:  # the argmax of the window max, for its gradient
                        idx = tl.where(tl.max(a, 1) > m_i, kb + tl.argmax(a, 1).to(tl.int32), idx)
                    m_i, num_e, den_e = _online(m_i, num_e, den_e, a, v, DT, PREC)
            if LIN:
                if kb <= m1 - lin_off:  # some key of the block has left some query's window
                    s = _la_scores(FQ, FK, q_row, row_ok, kv_base + cols, k_ok, F, BLOCK, BLOCK_FC, DT, PREC)
                    s = tl.where(causal & (j[None, :] <= n[:, None] - lin_off), s, 0.0)
                    if DECAY:
                        s = _decayed(s, rho, n, j, window)
                    num_l += _dot(s, v, DT, PREC)
                    den_l += tl.sum(s, 1)
    if SINKS:
        cols, sj, s_ok = _span(start, start, end, BLOCK_S)
        s_ok = s_ok & (sj < n_sinks)
        a = _dot(q, tl.trans(_rows(K, kv_base + cols, s_ok, D, BLOCK_D)), DT, PREC) * scale
        a = tl.where(row_ok[:, None] & s_ok[None, :] & (sj[None, :] <= n[:, None] - sink_off), a, float("-inf"))
        if HYBRID:  # the hybrid with its sinks: c_n is the max over the window and the sinks
            idx = tl.where(tl.max(a, 1) > m_i, start + tl.argmax(a, 1).to(tl.int32), idx)
        m_i, num_e, den_e = _online(m_i, num_e, den_e, a, _rows(V, kv_base + cols, s_ok, D, BLOCK_D), DT, PREC)
    if LIN:  # keys before lo: the prefix state of whole blocks (exclusive), fp32, a feature chunk at a time
        st = kv_base // T * NC + lo // BLOCK
        if DECAY:  # each query sees the state kept for _ref(lo) <= its position - w
            lag = _lag(rho, rows, window + _ref(lo // BLOCK, start, BLOCK))
        for f0 in range(0, F, BLOCK_FC):
            kv, ksum = _state(STATE_KV, STATE_K, st, F, D, f0, BLOCK_FC, BLOCK_D)
            fq = _cols(FQ, q_row, row_ok, F, f0, BLOCK_FC).to(tl.float32)
            if DECAY:
                fq = fq * lag[:, None]
            num_l += tl.dot(fq, kv, input_precision=PREC)
            den_l += tl.sum(fq * ksum[None, :], 1)
    g = _gammas(GAMMA, head, HYBRID, BLOCK)
    den = g * den_e + den_l + _EPS
    out = rows < T
    _store_rows(Y, q_row, out, D, tl.where(row_ok[:, None], (g[:, None] * num_e + num_l) / den[:, None], 0.0), BLOCK_D)
    tl.store(C + q_row, tl.where(m_i == float("-inf"), 0.0, m_i), mask=out)
    tl.store(Z + q_row, den, mask=out)
    tl.store(DEN_E + q_row, tl.where(row_ok, g * den_e, 0.0), mask=out)
    tl.store(DEN_L + q_row, tl.where(row_ok, den_l, 0.0), mask=out)
    tl.store(IDX + q_row, idx, mask=out)


@triton.jit
def _grad_rows(DY, C, Z, DELTA, q_row, row_ok, D, BLOCK_D: tl.constexpr):
    """Per query row of the backward: dy / Z, delta / Z (delta = dy . y) and the max c."""
    z = tl.load(Z + q_row, mask=row_ok, other=1.0)
    dyz = _rows(DY, q_row, row_ok, D, BLOCK_D).to(tl.float32) / z[:, None]
    dz = tl.load(DELTA + q_row, mask=row_ok, other=0.0) / z
    return dyz, dz, tl.load(C + q_row, mask=row_ok, other=0.0)


@triton.jit
def _bwd_dq(
    Q, K, V, GAMMA, START, END, DY, C, Z, DELTA,  # inputs
    DQ, RSUM,  # outputs
    T, H, G, D, window, sink_off, n_sinks, scale,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, ACC: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dq of the softmax terms (window, SOFT, or sinks, SINKS) and the per-query sum of gamma's terms (window and,
    in the hybrid with its sinks, sinks), per query tile. With both, it is launched twice: the window, then the sinks
    with ACC (dq and the gamma sums added to the first launch's): fewer live tiles, no spills."""
    head, kv_base, start, end, m0, m1, rows, n, row_ok, q_row = _query_tile(START, END, T, H, G, BLOCK)
    q = _rows(Q, q_row, row_ok, D, BLOCK_D)
    dyz, dz, c = _grad_rows(DY, C, Z, DELTA, q_row, row_ok, D, BLOCK_D)
    g = _gammas(GAMMA, head, HYBRID, BLOCK)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    rsum = tl.zeros([BLOCK], tl.float32)
    if SOFT:
        for kb in range(tl.maximum(m0 - window + 1, 0) // BLOCK * BLOCK, tl.minimum(m1 + 1, end), BLOCK):
            cols, j, k_ok = _span(kb, start, end, BLOCK)
            causal = row_ok[:, None] & k_ok[None, :] & (j[None, :] <= n[:, None])
            # dL/dw for every term w_nj of the shared normaliser: (dy_n . v_j - dy_n . y_n) / Z_n
            dp = _dot(dyz, tl.trans(_rows(V, kv_base + cols, k_ok, D, BLOCK_D)), DT, PREC) - dz[:, None]
            k = _rows(K, kv_base + cols, k_ok, D, BLOCK_D)
            a = _dot(q, tl.trans(k), DT, PREC) * scale
            ds = tl.where(causal & (j[None, :] > n[:, None] - window), g[:, None] * tl.exp(a - c[:, None]), 0.0) * dp
            rsum += tl.sum(ds, 1)
            dq += _dot(ds, k, DT, PREC) * scale
    if SINKS:
        cols, sj, s_ok = _span(start, start, end, BLOCK_S)
        s_ok = s_ok & (sj < n_sinks)
        ks = _rows(K, kv_base + cols, s_ok, D, BLOCK_D)
        a = _dot(q, tl.trans(ks), DT, PREC) * scale
        ok = row_ok[:, None] & s_ok[None, :] & (sj[None, :] <= n[:, None] - sink_off)
        p = tl.where(ok, g[:, None] * tl.exp(a - c[:, None]), 0.0)  # (g = 1 unless the hybrid with its sinks)
        dp = _dot(dyz, tl.trans(_rows(V, kv_base + cols, s_ok, D, BLOCK_D)), DT, PREC) - dz[:, None]
        if HYBRID:
            rsum += tl.sum(p * dp, 1)
        dq += _dot(p * dp, ks, DT, PREC) * scale
    out = rows < T
    if ACC:
        dq += _rows(DQ, q_row, out, D, BLOCK_D)
        rsum += tl.load(RSUM + q_row, mask=out, other=0.0)
    tl.store(RSUM + q_row, rsum, mask=out)
    _store_rows(DQ, q_row, out, D, dq, BLOCK_D)


@triton.jit
def _bwd_dfq(
    FQ, FK, V, RHO, STATE_KV, STATE_K, START, END, DY, Z, DELTA,  # inputs
    DFQ,  # output
    T, H, G, D, F, NC, window, lin_off, st_off,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FC: tl.constexpr, DECAY: tl.constexpr, WINDOW: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dphi_q of the LA terms, one feature chunk per program (query tile x head x chunk): the intra terms of the
    streamed keys, then the state of the keys before them. WINDOW: only the L terms of the keys inside the window
    (la_only with a decay, whose first launch takes the keys past it as the hybrid does: rho's gradient needs that
    part apart, and one accumulator per launch keeps the registers within budget); weight 1, no state."""
    f0 = tl.program_id(2) * BLOCK_FC
    _, kv_base, start, end, m0, m1, rows, n, row_ok, q_row = _query_tile(START, END, T, H, G, BLOCK)
    z = tl.load(Z + q_row, mask=row_ok, other=1.0)
    dyz = _rows(DY, q_row, row_ok, D, BLOCK_D).to(tl.float32) / z[:, None]
    dz = tl.load(DELTA + q_row, mask=row_ok, other=0.0) / z
    if WINDOW:
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK * BLOCK
        hi = tl.minimum(m1 + 1, end)
    else:
        lo = tl.maximum(m0 - st_off + 1, 0) // BLOCK * BLOCK
        hi = tl.minimum(m1 + 1 - lin_off, end)  # blocks with some key past some window
    if DECAY:
        rho = _rho(RHO, tl.program_id(1) % (H // G))
    dfq = tl.zeros([BLOCK, BLOCK_FC], tl.float32)
    for kb in range(lo, hi, BLOCK):
        cols, j, k_ok = _span(kb, start, end, BLOCK)
        lin = row_ok[:, None] & k_ok[None, :] & (j[None, :] <= n[:, None] - lin_off)
        if WINDOW:
            lin = lin & (j[None, :] > n[:, None] - window)
        dp = _dot(dyz, tl.trans(_rows(V, kv_base + cols, k_ok, D, BLOCK_D)), DT, PREC) - dz[:, None]
        dl = tl.where(lin, dp, 0.0)
        if DECAY:
            dl = _decayed(dl, rho, n, j, window)
        dfq += _dot(dl, _cols(FK, kv_base + cols, k_ok, F, f0, BLOCK_FC), DT, PREC)
    if not WINDOW:
        kv, ksum = _state(STATE_KV, STATE_K, kv_base // T * NC + lo // BLOCK, F, D, f0, BLOCK_FC, BLOCK_D)
        ds = tl.dot(dyz, tl.trans(kv), input_precision=PREC) - dz[:, None] * ksum[None, :]
        if DECAY:
            ds = ds * _lag(rho, rows, window + _ref(lo // BLOCK, start, BLOCK))[:, None]
        dfq += ds
    _store_cols(DFQ, q_row, rows < T, F, f0, tl.where(row_ok[:, None], dfq, 0.0), BLOCK_FC)


@triton.jit
def _states_bwd(
    FQ, START, END, DY, Z, DELTA, RHO,  # inputs
    G_KV, G_K, D_INIT_KV, D_INIT_K,  # outputs [B, Hkv, NC, F, D], [B, Hkv, NC, F]; [B, Hkv, F, D], [B, Hkv, F]
    T, H, G, D, F, NC, NQ, window, st_off,
    HAS_INIT: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_FC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The gradient of every key block's share of the LA state, per (feature chunk, batch x KV head), in reverse
    time over the packed query tiles (`_packed`: all G heads at once). Query tile i reads the state of the key blocks
    before its streamed span, st(i) = lo(i) / BLOCK of them (the forward's lo); so key block c's gradient is
    g_c = sum over the tiles with st(i) >= c + 1 of X_i, X_i = phi_q(tile i)^T dy/Z (and -phi_q dz for the key
    sums), complete once the first such tile is added; blocks no tile reads get zeros. The initial state is in
    every tile's state: its gradient is the sum of every X_i. With a decay (DECAY), g_c is the gradient of the
    state as _ref(c + 1) (block c's last key) sees it: the sum runs as tile i's _ref sees it, each row weighted
    alpha^(its position - w - _ref), carried down to the next tile's _ref and to each block's as it is stored; it
    ends as the initial state's own (start - 1)."""
    f0 = tl.program_id(0) * BLOCK_FC
    pid_bhkv = tl.program_id(1)
    b, hk = pid_bhkv // (H // G), pid_bhkv % (H // G)
    start, end = tl.load(START + b), tl.load(END + b)
    of = f0 + tl.arange(0, BLOCK_FC)
    od = tl.arange(0, BLOCK_D)
    both = (of < F)[:, None] & (od < D)[None, :]
    acc = tl.zeros([BLOCK_FC, BLOCK_D], tl.float32)
    acc_k = tl.zeros([BLOCK_FC], tl.float32)
    st_last = tl.maximum((NQ - 1) * BLOCK // G - st_off + 1, 0) // BLOCK
    for c in range(st_last, NC):  # read by no query tile
        st = pid_bhkv.to(tl.int64) * NC + c
        tl.store(G_KV + (st * F + of)[:, None] * D + od[None, :], acc, mask=both)
        tl.store(G_K + st * F + of, acc_k, mask=of < F)
    if DECAY:
        rho = _rho(RHO, hk)
        ref_prev = _ref(st_last, start, BLOCK)  # (the last tile's: the sums start at 0 there)
    for r in range(0, NQ):
        i = NQ - 1 - r
        _, rows, _, row_ok, q_row, m0, _ = _packed(i, b, hk, start, end, T, H, G, BLOCK)
        z = tl.load(Z + q_row, mask=row_ok, other=1.0)
        dyz = _rows(DY, q_row, row_ok, D, BLOCK_D).to(tl.float32) / z[:, None]
        dz = tl.load(DELTA + q_row, mask=row_ok, other=0.0) / z
        fq = _cols(FQ, q_row, row_ok, F, f0, BLOCK_FC).to(tl.float32)
        st_i = tl.maximum(m0 - st_off + 1, 0) // BLOCK
        if DECAY:  # carried down to this tile's _ref (<= the last one's), then its rows as that token sees them
            ref = _ref(st_i, start, BLOCK)
            carry = tl.exp(-rho * (ref_prev - ref).to(tl.float32))
            acc = acc * carry
            acc_k = acc_k * carry
            fq = fq * _lag(rho, rows, window + ref)[:, None]
            ref_prev = ref
        acc += tl.dot(tl.trans(fq), dyz, input_precision=PREC)
        acc_k -= tl.sum(fq * dz[:, None], 0)
        st_prev = tl.maximum(tl.maximum(i - 1, 0) * BLOCK // G - st_off + 1, 0) // BLOCK
        for c in range(st_prev, st_i):  # the blocks whose first reader is tile i
            st = pid_bhkv.to(tl.int64) * NC + c
            if DECAY:  # as block c's last key sees it
                down = tl.exp(-rho * (ref - _ref(c + 1, start, BLOCK)).to(tl.float32))
                tl.store(G_KV + (st * F + of)[:, None] * D + od[None, :], acc * down, mask=both)
                tl.store(G_K + st * F + of, acc_k * down, mask=of < F)
            else:
                tl.store(G_KV + (st * F + of)[:, None] * D + od[None, :], acc, mask=both)
                tl.store(G_K + st * F + of, acc_k, mask=of < F)
    if HAS_INIT:
        st = pid_bhkv.to(tl.int64)
        tl.store(D_INIT_KV + (st * F + of)[:, None] * D + od[None, :], acc, mask=both)
        tl.store(D_INIT_K + st * F + of, acc_k, mask=of < F)


@triton.jit
def _tiles_of_key(kb, end, reach, T, G, BLOCK: tl.constexpr, LIN: tl.constexpr, lin_off, st_off):
    """The packed query tiles [first, last] whose rows reach key tile kb: LIN, those whose streamed span starts at
    or before it (the forward's lo <= kb, lo from st_off) with some query past the window of some key in it (from
    lin_off); else those with some query within `reach` of it (the window)."""
    if LIN:
        first = (kb + lin_off) * G // BLOCK
        last = ((kb + BLOCK + st_off - 1) * G - 1) // BLOCK
    else:
        first = kb * G // BLOCK
        last = ((kb + BLOCK + reach - 1) * G - 1) // BLOCK
    return first, tl.minimum(last, (tl.minimum(end, T) * G - 1) // BLOCK)


@triton.jit
def _key_tile(V, START, END, T, H, G, D, NC, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's key tile (grid axis 0) of batch x KV head (axis 1): the batch row and KV head, the real span,
    the tile's first key, its keys, their real-token index and which are real, their row numbers, its values, and
    the number of its LA state."""
    pid_bhkv = tl.program_id(1)
    b, hk = pid_bhkv // (H // G), pid_bhkv % (H // G)
    start, end = tl.load(START + b), tl.load(END + b)
    kb = tl.program_id(0) * BLOCK
    cols, j, k_ok = _span(kb, start, end, BLOCK)
    k_row = pid_bhkv.to(tl.int64) * T + cols
    st = pid_bhkv.to(tl.int64) * NC + tl.program_id(0)
    return b, hk, start, end, kb, cols, j, k_ok, k_row, _rows(V, k_row, k_ok, D, BLOCK_D), st


@triton.jit
def _bwd_dkv(
    Q, K, V, FQ, FK, GAMMA, RHO, START, END, DY, C, Z, DELTA, G_KV,  # inputs
    DK, DV,  # outputs
    T, H, G, D, F, NC, window, lin_off, st_off, scale,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FC: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, HYBRID: tl.constexpr, ACC: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dk and dv per key tile x KV head: the window terms (SOFT) or the LA terms (LIN) of the packed query tiles
    (every head of the GQA group at once) that stream this key tile, and then the LA state this tile is part of (dv
    only). The hybrid launches it twice, SOFT then LIN with ACC (dv added to the first launch's): fewer live tiles,
    no spills."""
    b, hk, start, end, kb, cols, j, k_ok, k_row, v, st = _key_tile(V, START, END, T, H, G, D, NC, BLOCK, BLOCK_D)
    k = _rows(K, k_row, k_ok, D, BLOCK_D)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    first, last = _tiles_of_key(kb, end, window, T, G, BLOCK, LIN, lin_off, st_off)
    if DECAY:
        rho = _rho(RHO, hk)
    for i in range(first, last + 1):
        head, _, n, row_ok, q_row, _, _ = _packed(i, b, hk, start, end, T, H, G, BLOCK)
        dyz, dz, c = _grad_rows(DY, C, Z, DELTA, q_row, row_ok, D, BLOCK_D)
        causal = row_ok[:, None] & k_ok[None, :] & (j[None, :] <= n[:, None])
        if SOFT:
            g = _gammas(GAMMA, head, HYBRID, BLOCK)
            dp = _dot(dyz, tl.trans(v), DT, PREC) - dz[:, None]
            q = _rows(Q, q_row, row_ok, D, BLOCK_D)
            a = _dot(q, tl.trans(k), DT, PREC) * scale
            p = tl.where(causal & (j[None, :] > n[:, None] - window), g[:, None] * tl.exp(a - c[:, None]), 0.0)
            dk += _dot(tl.trans(p * dp), q, DT, PREC) * scale
            dv += _dot(tl.trans(p), dyz, DT, PREC)
        if LIN:
            s = _la_scores(FQ, FK, q_row, row_ok, k_row, k_ok, F, BLOCK, BLOCK_FC, DT, PREC)
            s = tl.where(causal & (j[None, :] <= n[:, None] - lin_off), s, 0.0)
            if DECAY:
                s = _decayed(s, rho, n, j, window)
            dv += _dot(tl.trans(s), dyz, DT, PREC)
    out = cols < T
    if LIN:  # the state this key block is part of: every later query tile whose span starts after it
        if DECAY:  # (its gradient is kept as the block's last key sees it)
            wk = tl.exp(-rho * (_ref(kb // BLOCK + 1, start, BLOCK) - cols).to(tl.float32))
        for f0 in range(0, F, BLOCK_FC):
            of = f0 + tl.arange(0, BLOCK_FC)
            gkv = _rows(G_KV + st * F * D, of.to(tl.int64), of < F, D, BLOCK_D)
            fk = _cols(FK, k_row, k_ok, F, f0, BLOCK_FC).to(tl.float32)
            if DECAY:
                fk = fk * wk[:, None]
            dv += tl.dot(fk, gkv, input_precision=PREC)
    if SOFT:
        _store_rows(DK, k_row, out, D, dk, BLOCK_D)
    if ACC:
        dv += _rows(DV, k_row, out, D, BLOCK_D)
    _store_rows(DV, k_row, out, D, tl.where(k_ok[:, None], dv, 0.0), BLOCK_D)


@triton.jit
def _bwd_dfk(
    FQ, V, RHO, START, END, DY, Z, DELTA, G_KV, G_K,  # inputs
    DFK,  # output
    T, H, G, D, F, NC, window, lin_off, st_off,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FC: tl.constexpr, DECAY: tl.constexpr, WINDOW: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dphi_k per key tile x KV head x feature chunk: the LA terms of the packed query tiles that stream this key
    tile, then the state gradient of the tile. WINDOW: only the terms of the queries that have the key inside their
    window (as in _bwd_dfq)."""
    f0 = tl.program_id(2) * BLOCK_FC
    b, hk, start, end, kb, cols, j, k_ok, k_row, v, st = _key_tile(V, START, END, T, H, G, D, NC, BLOCK, BLOCK_D)
    dfk = tl.zeros([BLOCK, BLOCK_FC], tl.float32)
    if WINDOW:
        first, last = _tiles_of_key(kb, end, window, T, G, BLOCK, False, lin_off, st_off)
    else:
        first, last = _tiles_of_key(kb, end, lin_off, T, G, BLOCK, True, lin_off, st_off)
    if DECAY:
        rho = _rho(RHO, hk)
    for i in range(first, last + 1):
        _, _, n, row_ok, q_row, _, _ = _packed(i, b, hk, start, end, T, H, G, BLOCK)
        z = tl.load(Z + q_row, mask=row_ok, other=1.0)
        dyz = _rows(DY, q_row, row_ok, D, BLOCK_D).to(tl.float32) / z[:, None]
        dz = tl.load(DELTA + q_row, mask=row_ok, other=0.0) / z
        lin = row_ok[:, None] & k_ok[None, :] & (j[None, :] <= n[:, None] - lin_off)
        if WINDOW:
            lin = lin & (j[None, :] > n[:, None] - window)
        dl = tl.where(lin, _dot(dyz, tl.trans(v), DT, PREC) - dz[:, None], 0.0)
        if DECAY:
            dl = _decayed(dl, rho, n, j, window)
        dfk += _dot(tl.trans(dl), _cols(FQ, q_row, row_ok, F, f0, BLOCK_FC), DT, PREC)
    if not WINDOW:
        gkv, gk = _state(G_KV, G_K, st, F, D, f0, BLOCK_FC, BLOCK_D)
        ds = tl.dot(v.to(tl.float32), tl.trans(gkv), input_precision=PREC) + gk[None, :]
        if DECAY:  # (the state's gradient is kept as the block's last key sees it)
            ds = ds * tl.exp(-rho * (_ref(kb // BLOCK + 1, start, BLOCK) - cols).to(tl.float32))[:, None]
        dfk += ds
    _store_cols(DFK, k_row, cols < T, F, f0, tl.where(k_ok[:, None], dfk, 0.0), BLOCK_FC)


@triton.jit
def _bwd_sinks(
    Q, K, V, START, END, DY, C, Z, DELTA,  # inputs
    OUT,  # output [NSPLIT, B, Hkv, BLOCK_S, D]: this split's share of dk (DK) or dv of the sinks
    T, H, G, D, sink_off, n_sinks, scale, TILES,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, DK: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The sinks' dk (DK) or dv, per (split of TILES query tiles, batch x KV head): the splits run in parallel and
    are summed after; dk and dv are separate launches (fewer live tiles, no spills). The hybrid's own sinks are
    weighted by their head's gamma: the caller passes Z / gamma for Z (dk and dv are linear in dy / Z)."""
    pid_s = tl.program_id(0)
    pid_bhkv = tl.program_id(1)
    b, hk = pid_bhkv // (H // G), pid_bhkv % (H // G)
    start, end = tl.load(START + b), tl.load(END + b)
    cols, sj, s_ok = _span(start, start, end, BLOCK_S)
    s_ok = s_ok & (sj < n_sinks)
    ks = _rows(K, pid_bhkv.to(tl.int64) * T + cols, s_ok, D, BLOCK_D)
    if DK:
        vs = _rows(V, pid_bhkv.to(tl.int64) * T + cols, s_ok, D, BLOCK_D)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    first = start // BLOCK * BLOCK + pid_s * TILES * BLOCK
    for gi in range(0, G):
        for m0 in range(first, tl.minimum(first + TILES * BLOCK, end), BLOCK):
            rows, n, row_ok = _span(m0, start, end, BLOCK)
            q_row = (b * H + hk * G + gi).to(tl.int64) * T + rows
            q = _rows(Q, q_row, row_ok, D, BLOCK_D)
            dyz, dz, c = _grad_rows(DY, C, Z, DELTA, q_row, row_ok, D, BLOCK_D)
            a = _dot(q, tl.trans(ks), DT, PREC) * scale
            ok = row_ok[:, None] & s_ok[None, :] & (sj[None, :] <= n[:, None] - sink_off)
            p = tl.where(ok, tl.exp(a - c[:, None]), 0.0)
            if DK:
                dp = _dot(dyz, tl.trans(vs), DT, PREC) - dz[:, None]
                acc += _dot(tl.trans(p * dp), q, DT, PREC) * scale
            else:
                acc += _dot(tl.trans(p), dyz, DT, PREC)
    slot = (pid_s * tl.num_programs(1) + pid_bhkv).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    _store_rows(OUT, slot, slot >= 0, D, acc, BLOCK_D)


SINK_TILES = 16  # query tiles per program of _bwd_sinks


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
    the operand registers and spill far more at these tiles: checked with benchmarks/kernel_compile.py)."""
    return "tf32" if x.dtype in (torch.float16, torch.bfloat16) else "ieee"


def mode_parts(mode: str, hybrid_sinks: bool) -> tuple[bool, bool, bool, bool]:
    """(window softmax, linear attention, sinks, gamma used) of a mode; the hybrid with its sinks adds them."""
    soft, lin, sink, hybrid = MODE_PARTS[mode]
    return soft, lin, sink or (mode == "hybrid" and bool(hybrid_sinks)), hybrid


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
        y = torch.empty_like(q)
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
        return y, den_e, den_l

    @staticmethod
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
        delta = (dy.float() * y.float()).sum(-1).contiguous()
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
            z_sinks = (z / g.view(1, H, 1)).contiguous() if s["HYBRID"] else z  # the hybrid's sinks: gamma-weighted
            for out, is_dk in ((dks, True), (dvs, False)):
                _bwd_sinks[(nsplit, B * Hkv)](
                    q, k, v, start, end, dy, c, z_sinks, delta, out, T, H, G, D, s["sink_off"], s["n_sinks"], scale,
                    SINK_TILES, BLOCK_S=bs, DK=is_dk, **common("_bwd_sinks")[0],
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


# On a GPU, by dtype and head dim (<= 64, <= 128): what benchmarks/kernel_compile.py (--tune) found to compile
# without register spills (fp32: within its budget) and within shared memory on sm_80 and sm_90 at every preset's
# head shapes (docs/results/kernel_compile.md; a test fails if that changes). 64-row tiles would turn the half dots
# into wgmma on sm_90 but spill in the backward (docs/results/kernel_tiles.md): 32 rows until a GPU weighs the two.
# A decayed LA's backward (attention.la_decay) holds the decay weights besides the same tiles: at head dim 128 in half
# precision its _bwd_dfq, _bwd_dfk and LA launch of _bwd_dkv spill 16-80 bytes on sm_90 with 32-wide feature chunks
# and none with 16 (benchmarks/kernel_compile.py); the undecayed launches keep theirs.
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
