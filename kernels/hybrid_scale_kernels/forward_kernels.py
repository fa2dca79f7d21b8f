"""The forward kernels of the hybrid attention (hybrid_attention.py describes the algorithm): `_states_fwd`, the fp32
prefix LA state at every key-tile boundary, one program per KV head and feature chunk; `_fwd`, one program per
(batch, KV head, packed query tile): window softmax, sinks, LA from the state, one shared normaliser.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import (
    _EPS,
    _cols,
    _decayed,
    _dot,
    _gammas,
    _la_scores,
    _lag,
    _online,
    _query_tile,
    _ref,
    _rho,
    _rows,
    _span,
    _state,
    _store_rows,
)


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
