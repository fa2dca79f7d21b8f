"""The chunked hybrid attention's backward kernels (chunk.py launches them; what they compute is in its docstring):
`_chunk_bwd_dq` per query chunk, `_chunk_bwd_dkv` and `_chunk_bwd_dfk` per key chunk. The reverse state scan is
chunk_h.py's `_chunk_dstates`. (Over 500 lines: the three kernels share `_bwd_q_block` and `_bwd_kv_dp`, which must
recompute exactly what each other does; splitting them would cross private jit helpers between modules.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import regs
from .utils import pow2, state_lag


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
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK, DY, Y, YLO, M, ZS, IDX,  # inputs: the forward's (Y: the output; YLO: its
    # rounding error, with Y_LO)
    DQ, DFQ, DLZ, RSUM, RROW, DKS, DVS,  # outputs
    DQ32, DFQ32,  # (MULTI) fp32 scratch [B, H, T, D] and [B, H, T, F], zeroed: the sums over the key blocks
    T, H, G, D, F, NS, NC, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr = False, MULTI: tl.constexpr = False,
    Y_LO: tl.constexpr = False,
):  # fmt: skip
    """The backward of the CHUNK queries of chunk c (axis 1) of one query head (axis 0: batch x H): dq and dphi_q [B,
    H, T, *] in the inputs' dtype; dlz [B, H, T] (do . y, read by the next launches); RSUM, the row sums of ds over
    the window and sink terms (HYBRID: -dc_n, and gamma's gradient times gamma); RROW (DECAY) rho's share of the row's
    lag on the state; DKS, DVS [B, H, T, BLOCK_S] (SINKS, fp32): the sinks' ds (c_n's gradient in) and E terms per
    row, which the host turns into their dk, dv (products over every row, in the inputs' dtype: keeping the [BLOCK_S,
    D] products in this kernel spilled on sm_80). The
    keys are chunks c - NB .. c (`_bwd_q_block` each, those before 0 empty) and the sinks. NB = 1 (windows up to
    CHUNK): the two blocks' ds tiles [CHUNK, keys] stay in registers (in DT) and dq is then made and stored a
    head-dim chunk of BLOCK_DK at a time (no [CHUNK, D] accumulator), c_n's gradient to the argmax key; dphi_q walks
    the features in chunks of BLOCK_FC: the blocks' dp times the L weights against phi_k, plus the state before
    chunk c - NB (its product with do over head-dim chunks; state 0 is the initial state with HAS_INIT). MULTI (NB >
    1, longer windows): each block's share of dq and dphi_q is added to fp32 scratch rows that only this program
    touches, and read back for the rest."""
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
    for d0 in range(0, D, BLOCK_DK):  # dlz = do . y (do rounded to DT, as the products see it; y in its dtype)
        od = d0 + tl.arange(0, BLOCK_DK)
        rm = row_ok[:, None] & (od < D)[None, :]
        dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
        y = tl.load(Y + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0).to(tl.float32)
        if Y_LO:
            y += tl.load(YLO + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0).to(tl.float32)
        dlz += tl.sum((dy.to(tl.float32) / zs[:, None]).to(DT).to(tl.float32) * y, 1)
    tl.store(DLZ + rows, dlz, mask=row_ok)
    m = tl.load(M + rows, mask=row_ok, other=0.0)
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = 1.0
    rho = 0.0
    if DECAY:
        rho = tl.load(RHO + head // G).to(tl.float32)
    if MULTI:  # each key block's dq and dphi_q added to this program's own fp32 rows
        rsum = tl.zeros([CHUNK], tl.float32)
        for kb in range(0, NB + 1):
            jb = (c - NB + kb) * CHUNK + tl.arange(0, CHUNK)
            jb_ok = (jb >= 0) & (jb < T)
            dsb, rsb, dpwb = _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, jb, kv_base, q_base, T, D, window,
                                          lin_off, n_excl, scale, g, rho, CHUNK, BLOCK_DK, SOFT, LIN, DECAY, DT,
                                          PREC)  # fmt: skip
            rsum += rsb
            for d0 in range(0, D, BLOCK_DK):
                od = d0 + tl.arange(0, BLOCK_DK)
                dm = od < D
                kx = tl.load(K + kv_base * D + jb[:, None] * D + od[None, :], mask=jb_ok[:, None] & dm[None, :],
                             other=0.0)  # fmt: skip
                ptr = DQ32 + q_base * D + n[:, None] * D + od[None, :]
                rm = row_ok[:, None] & dm[None, :]
                part = tl.dot(dsb, kx.to(DT), input_precision=PREC)
                tl.store(ptr, tl.load(ptr, mask=rm, other=0.0) + part, mask=rm)
            if LIN:
                for f0 in range(0, F, BLOCK_FC):
                    of = f0 + tl.arange(0, BLOCK_FC)
                    fm = of < F
                    fkx = tl.load(FK + kv_base * F + jb[:, None] * F + of[None, :], mask=jb_ok[:, None] & fm[None, :],
                                  other=0.0)  # fmt: skip
                    ptr = DFQ32 + q_base * F + n[:, None] * F + of[None, :]
                    rm = row_ok[:, None] & fm[None, :]
                    part = tl.dot(dpwb, fkx.to(DT), input_precision=PREC)
                    tl.store(ptr, tl.load(ptr, mask=rm, other=0.0) + part, mask=rm)
            tl.debug_barrier()  # (the next block reads these rows back)
    else:
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
    for d0 in range(0, D, BLOCK_DK):  # dq a head-dim chunk at a time
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        rm = row_ok[:, None] & dm[None, :]
        if MULTI:
            dq = tl.load(DQ32 + q_base * D + n[:, None] * D + od[None, :], mask=rm, other=0.0)
        else:
            k0 = tl.load(K + kv_base * D + j0[:, None] * D + od[None, :], mask=(j0 >= 0)[:, None] & dm[None, :],
                         other=0.0)  # fmt: skip
            k1 = tl.load(K + kv_base * D + j1[:, None] * D + od[None, :], mask=(j1 < T)[:, None] & dm[None, :],
                         other=0.0)  # fmt: skip
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
        st0 = tl.maximum(c - NB, 0)
        lag = state_lag(rho, n, window, st0, CHUNK)
        st = bk.to(tl.int64) * NS + st0
        for f0 in range(0, F, BLOCK_FC):
            of = f0 + tl.arange(0, BLOCK_FC)
            fm = of < F
            if MULTI:
                acc = tl.load(DFQ32 + q_base * F + n[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                              other=0.0)  # fmt: skip
            else:
                fk0 = tl.load(FK + kv_base * F + j0[:, None] * F + of[None, :],
                              mask=(j0 >= 0)[:, None] & fm[None, :], other=0.0)  # fmt: skip
                fk1 = tl.load(FK + kv_base * F + j1[:, None] * F + of[None, :],
                              mask=(j1 < T)[:, None] & fm[None, :], other=0.0)  # fmt: skip
                acc = tl.dot(dpw0, fk0.to(DT), input_precision=PREC)
                acc += tl.dot(dpw1, fk1.to(DT), input_precision=PREC)
            if HAS_INIT or c >= NB + 1:  # the state before chunk c - NB: phi_q's gradient lag (h do - z dlz)
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
                if DECAY:  # d lag / d rho = -max(n - window - lo + 1, 0) lag
                    fq = tl.load(FQ + q_base * F + n[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    e = tl.maximum(n - window - st0 * CHUNK + 1, 0).to(tl.float32)
                    rrow -= e * tl.sum(fq.to(tl.float32) * sp, 1)
            tl.store(DFQ + q_base * F + n[:, None] * F + of[None, :], acc.to(DFQ.dtype.element_ty),
                     mask=row_ok[:, None] & fm[None, :])  # fmt: skip
        if DECAY:
            tl.store(RROW + rows, rrow, mask=row_ok)


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
    T, H, G, D, F, NS, NC, NB, window, lin_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr,
    HYBRID: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dk (the window terms; SOFT) and dv (window and L terms, and the state), in the inputs' dtype, of the CHUNK keys
    j of chunk c (axis 1) of one KV head (axis 0: batch x Hkv), head-dim columns BLOCK_DO (axis 2) of them, summed
    over its G query heads: for each, the query chunks c .. c + NB (the only ones whose window or intra-chunk L terms
    reach chunk c), in tiles [keys, queries] (their products over the whole head dim, in chunks of BLOCK_DK): ds^T q
    into dk and E^T do into dv from one computation of the scores and dp; c_n's gradient where its argmax is one of
    these keys in the row's window; then (c <= NS - 2) dv's share of the state h_{c+1} that holds these keys, from
    dh_{c+1} (each key's weight alpha^(CHUNK c + CHUNK - 1 - j)); then (c = 0) the sinks' dk, dv (the host's sums).
    One launch, two accumulators; dphi_k is `_chunk_bwd_dfk`'s."""
    pid_bk = tl.program_id(0)
    c = tl.program_id(1)
    Hkv = H // G
    kv_base = pid_bk.to(tl.int64) * T
    j = c * CHUNK + tl.arange(0, CHUNK)
    k_ok = j < T
    od = tl.program_id(2) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dm = od < D
    km = k_ok[:, None] & dm[None, :]
    acc_k = tl.zeros([CHUNK, BLOCK_DO], tl.float32)
    acc_v = tl.zeros([CHUNK, BLOCK_DO], tl.float32)
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
        for qb in range(c, tl.minimum(c + NB + 1, NC)):
            n = qb * CHUNK + tl.arange(0, CHUNK)
            q_ok = n < T
            rows = q_base + n
            qm = q_ok[:, None] & dm[None, :]
            zs = tl.load(ZS + rows, mask=q_ok, other=1.0)
            both = k_ok[:, None] & q_ok[None, :]
            dy = tl.load(DY + q_base * D + n[:, None] * D + od[None, :], mask=qm, other=0.0)
            do = (dy.to(tl.float32) / zs[:, None]).to(DT)
            if SOFT:  # the window terms: dv from E^T, then dk from ds^T (one [keys, queries] product live at a time)
                dlz = tl.load(DLZ + rows, mask=q_ok, other=0.0)
                _, at = _bwd_kv_dp(Q, K, V, DY, zs, dlz, j, k_ok, n, q_ok, q_base, kv_base, D, CHUNK, BLOCK_DK, True,
                                   False, DT, PREC)  # fmt: skip
                m = tl.load(M + rows, mask=q_ok, other=0.0)
                win = both & (j[:, None] <= n[None, :]) & (j[:, None] > n[None, :] - window)
                pt = tl.where(win, g * tl.exp(at * scale - m[None, :]), 0.0)
                acc_v += tl.dot(pt.to(DT), do, input_precision=PREC)
                dpt, _ = _bwd_kv_dp(Q, K, V, DY, zs, dlz, j, k_ok, n, q_ok, q_base, kv_base, D, CHUNK, BLOCK_DK, False,
                                    True, DT, PREC)  # fmt: skip
                dst = pt * dpt
                if HYBRID:  # (c_n's argmax key: a window key where it is past n - window, else a sink)
                    idx = tl.load(IDX + rows, mask=q_ok, other=-1)
                    idx = tl.where(idx > n - window, idx, -1)
                    rsum = tl.load(RSUM + rows, mask=q_ok, other=0.0)
                    dst -= tl.where(j[:, None] == idx[None, :], rsum[None, :], 0.0)
                q = tl.load(Q + q_base * D + n[:, None] * D + od[None, :], mask=qm, other=0.0)
                acc_k += tl.dot(dst.to(DT), q.to(DT), input_precision=PREC)
            if LIN:
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
                acc_v += tl.dot((st_ * wt).to(DT), do, input_precision=PREC)
    if LIN:
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
                    acc_v += tl.dot((fk * wk[:, None]).to(DT), dh, input_precision=PREC)
                else:
                    acc_v += tl.dot(fk * wk[:, None], dh.to(tl.float32), input_precision=PREC)
    part = (pid_bk.to(tl.int64) * BLOCK_S + j)[:, None] * BLOCK_D + od[None, :]
    out = (kv_base + j)[:, None] * D + od[None, :]
    if SINKS:  # (chunk 0: the sinks' shares from every query, summed on the host; n_sinks <= CHUNK)
        acc_v += tl.load(DVS + part, mask=(k_ok & (j < n_sinks))[:, None] & dm[None, :], other=0.0)
        acc_k += tl.load(DKS + part, mask=(k_ok & (j < n_sinks))[:, None] & dm[None, :], other=0.0)
    tl.store(DV + out, acc_v.to(DV.dtype.element_ty), mask=km)
    if SOFT:
        tl.store(DK + out, (acc_k * scale).to(DK.dtype.element_ty), mask=km)


@triton.jit
def _chunk_bwd_dfk(
    FQ, FK, V, RHO, DY, ZS, DLZ, DHKV, DHK,  # inputs
    DFK, RKEY,  # outputs (DFK: fp32, zeroed; its rows of these keys are this program's alone: added to, no atomics)
    T, H, G, D: tl.constexpr, F: tl.constexpr, NS, NC, NB, window, lin_off, n_excl,
    CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """dphi_k (fp32, added) of the CHUNK keys j of chunk c (axis 1) of one KV head (axis 0: batch x Hkv), the LA
    modes only: per query head of the KV head and query chunk c .. c + NB, dp^T [keys, queries] (over head-dim chunks)
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
        for qb in range(c, tl.minimum(c + NB + 1, NC)):
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
                ptr = DFK + kv_base * F + j[:, None] * F + of[None, :]
                km = k_ok[:, None] & fm[None, :]
                part = tl.dot(dpw.to(DT), fq.to(DT), input_precision=PREC)
                tl.store(ptr, tl.load(ptr, mask=km, other=0.0) + part, mask=km)
                if DECAY:  # (phi_k . phi_q of the L terms, for rho's share: -e L dp)
                    fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    fqt = tl.load(FQ + q_base * F + of[:, None] + n[None, :] * F, mask=fm[:, None] & q_ok[None, :],
                                  other=0.0)  # fmt: skip
                    st_ += tl.dot(fk.to(DT), fqt.to(DT), input_precision=PREC)
            if DECAY:
                e = tl.maximum(n[None, :] - window - j[:, None], 0).to(tl.float32)
                rkey -= tl.sum(st_ * dpw * e, 1)
            tl.debug_barrier()  # (the next query block reads these rows back)
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
            ptr = DFK + kv_base * F + j[:, None] * F + of[None, :]
            km = k_ok[:, None] & fm[None, :]
            tl.store(ptr, tl.load(ptr, mask=km, other=0.0) + dfs, mask=km)
            if DECAY:
                fk = tl.load(FK + kv_base * F + j[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
                rkey -= (e - j).to(tl.float32) * tl.sum(fk * dfs, 1)
    if DECAY:
        tl.store(RKEY + pid_bk * NC + c, tl.sum(rkey, 0))


def _common(case) -> dict:
    """The constants every backward launch of the call shares."""
    cfg = case.cfg
    return dict(CHUNK=case.chunk, BLOCK_D=pow2(case.head_dim), BLOCK_DK=min(pow2(case.head_dim), cfg["bwd_dchunk"]),
                BLOCK_FC=cfg["bwd_fchunk"], SOFT=case.soft, LIN=case.lin, SINKS=case.sink, HYBRID=case.gamma_on,
                DECAY=case.decay, DT=case.dt, PREC=case.prec, num_stages=cfg["stages"])  # fmt: skip


def bwd_dq(saved, dy, state, case):
    """`_chunk_bwd_dq`'s launch: saved = (q, k, v, fq, fk, g, rho, (y, its rounding error or None), (c_n, Z_n,
    argmax)). Returns dict(dq, dfq (inputs' dtype), dlz, rsum (HYBRID), rrow (DECAY), dks, dvs (SINKS: per row, for
    the host's sums))."""
    q, k, v, fq, fk, g, rho, (y, y_lo), (m, zs, idx) = saved
    B, H, T, D = q.shape
    F = fq.shape[-1]
    nc = triton.cdiv(T, case.chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    hkv, hk = state if state is not None else (g.to(torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32), g)
    out = dict(dq=torch.empty_like(q), dfq=torch.empty_like(fq) if case.lin else torch.zeros_like(fq))
    out["dlz"] = torch.empty(B, H, T, **f32)
    out["rsum"] = torch.empty(B, H, T, **f32) if case.gamma_on else g
    out["rrow"] = torch.zeros(B, H, T, **f32) if case.decay else g
    out["dks"], out["dvs"] = (torch.empty(B, H, T, case.block_s, **f32) for _ in range(2)) if case.sink else (g, g)
    multi = case.nb > 1
    scratch = (torch.zeros(B, H, T, D, **f32), torch.zeros(B, H, T, F, **f32)) if multi else (g, g)
    _chunk_bwd_dq[(B * H, nc)](
        q, k, v, fq, fk, g, g if rho is None else rho, hkv, hk, dy, y, y if y_lo is None else y_lo, m, zs, idx,
        out["dq"], out["dfq"], out["dlz"], out["rsum"], out["rrow"], out["dks"], out["dvs"], *scratch,
        T, H, H // k.shape[1], D, F, hkv.shape[2] if state is not None else 0, nc, case.nb, case.window,
        case.lin_off, case.sink_off, case.n_sinks, case.n_excl, case.scale, BLOCK_S=case.block_s,
        HAS_INIT=case.has_init, MULTI=multi, Y_LO=y_lo is not None, num_warps=case.cfg["dq_warps"],
        **regs(case.cfg, "dq"), **_common(case),
    )  # fmt: skip
    return out


def bwd_dkv(saved, dy, grads, dstate, sinks_dkv, case):
    """dk and dv (the inputs' dtype): one `_chunk_bwd_dkv` launch over the KV heads' key chunks (dk of the window
    terms; dv of the window and L terms and the state). grads: bwd_dq's dict; dstate (dh, dz) or None; sinks_dkv: the
    sinks' dk, dv summed on the host [B Hkv, BLOCK_S, BLOCK_D] fp32 (SINKS)."""
    q, k, v, fq, fk, g, rho, _, (m, zs, idx) = saved
    B, Hkv, T, D = k.shape
    nc = triton.cdiv(T, case.chunk)
    dk = torch.empty_like(k) if case.soft else torch.zeros_like(k)  # (no window term: no dk but the sinks')
    dv = torch.empty_like(v) if case.soft or case.lin else torch.zeros_like(v)
    dhkv = dstate[0] if dstate is not None else g
    dks, dvs = sinks_dkv if sinks_dkv is not None else (g, g)
    bdo = min(pow2(D), case.cfg["bwd_dout"])
    if case.soft or case.lin:  # (sinks_only: the host's sums are all there is)
        _chunk_bwd_dkv[(B * Hkv, nc, triton.cdiv(D, bdo))](
            q, k, v, fq, fk, g, g if rho is None else rho, dy, m, zs, grads["dlz"], idx, grads["rsum"], dhkv, dks,
            dvs, dk, dv, T, q.shape[1], q.shape[1] // Hkv, D, fq.shape[-1], dstate[0].shape[2] if dstate else 0, nc,
            case.nb, case.window, case.lin_off, case.n_sinks, case.n_excl, case.scale, BLOCK_DO=bdo,
            BLOCK_S=case.block_s, num_warps=case.cfg["dkv_warps"], **regs(case.cfg, "dkv"), **_common(case),
        )  # fmt: skip
    return dk, dv


def bwd_dfk(saved, dy, grads, dstate, case):
    """dphi_k (fp32) and rho's share through the keys' weights (DECAY, else None): `_chunk_bwd_dfk`."""
    q, k, v, fq, fk, g, rho, _, (_, zs, _) = saved
    B, Hkv, T, F = fk.shape
    nc = triton.cdiv(T, case.chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    dfk = torch.zeros(B, Hkv, T, F, **f32)
    rkey = torch.zeros(B * Hkv * nc, **f32) if case.decay else None
    dhkv, dhk = dstate if dstate is not None else (g, g)
    cfg = case.cfg
    _chunk_bwd_dfk[(B * Hkv, nc)](
        fq, fk, v, g if rho is None else rho, dy, zs, grads["dlz"], dhkv, dhk, dfk, g if rkey is None else rkey,
        T, q.shape[1], q.shape[1] // Hkv, k.shape[-1], F, dstate[0].shape[2] if dstate else 0, nc, case.nb,
        case.window, case.lin_off, case.n_excl, CHUNK=case.chunk, BLOCK_DK=min(pow2(k.shape[-1]), cfg["bwd_dchunk"]),
        BLOCK_FC=cfg["bwd_fchunk"], DECAY=case.decay, DT=case.dt, PREC=case.prec, num_warps=cfg["dfk_warps"],
        num_stages=cfg["stages"], **regs(cfg, "dfk"),
    )  # fmt: skip
    return dfk, rkey
