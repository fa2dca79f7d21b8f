"""The backward kernels of the hybrid attention (hybrid_attention.py describes the split): `_bwd_dq`, `_bwd_dfq`,
`_states_bwd`, `_bwd_dkv`, `_bwd_dfk` and `_bwd_sinks`, each recomputing what `_fwd` computes through the same jit
helpers, so that few tiles are live in any kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import (
    _cols,
    _decayed,
    _dot,
    _gammas,
    _la_scores,
    _lag,
    _packed,
    _query_tile,
    _ref,
    _rho,
    _rows,
    _span,
    _state,
    _store_cols,
    _store_rows,
)


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
