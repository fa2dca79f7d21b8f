"""The chunked hybrid attention's backward kernels (chunk.py launches them; what they compute is in its docstring):
`_chunk_bwd_dq` per query chunk (dq, dphi_q, the row terms, the sinks' dk and dv summed over every query row) and
`_chunk_bwd_dkv` per key chunk (dk, dv and dphi_k together, each score tile computed once). The reverse state scan is
chunk_h.py's `_chunk_dstates`. (Over 500 lines: the key side reads the rows the query side writes, dlz, the row sums
and the sinks' ds and E, so both kernels and their launches are kept where they can be read side by side.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_h import heads_per_program
from .settings import regs
from .utils import pow2, state_lag


@triton.jit
def _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j, kv_base, q_base, T, D, window, lin_off, n_excl, scale, g,
                 rho, CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr,
                 DECAY: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One key block j [CHUNK] of a query chunk's backward: (ds [CHUNK, CHUNK] in DT, its row sums, dp times the L
    weights [CHUNK, CHUNK] in DT for dphi_q). dp = do . v - dlz and the scores q . k walk the head dim in chunks of
    BLOCK_DK (no [CHUNK, D] operand stays in registers). (rho's share of the intra-chunk L terms is
    `_chunk_bwd_dkv`'s, which has their phi_k . phi_q.)"""
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
def _dq_head(
    Q, K, V, FK, GAMMA, RHO, HKV, HK, DY, Y, YLO, M, ZS, IDX, DQ, DFQ, DLZ, RSUM, SINK_DS, SINK_E, DQ32, DFQ32,
    pid_bh, c, T, H, G, D, F, NS, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr, MULTI: tl.constexpr, Y_LO: tl.constexpr,
    OWN_L: tl.constexpr,
):  # fmt: skip
    """`_chunk_bwd_dq` for one query head pid_bh (batch x H) and chunk c (inlined in an unfolded launch; called, not
    inlined, once per head in a folded one: `_dq_head_call`)."""
    head = pid_bh % H
    bk = (pid_bh // H) * (H // G) + head // G  # batch x KV head
    kv_base = bk.to(tl.int64) * T
    q_base = pid_bh.to(tl.int64) * T
    n = c * CHUNK + tl.arange(0, CHUNK)
    row_ok = n < T
    rows = q_base + n
    od_all = tl.arange(0, BLOCK_D)
    dm_all = od_all < D
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
                if (NB - kb) * CHUNK + CHUNK - 1 >= lin_off:  # (a block with L terms: not all within lin_off)
                    for f0 in range(0, F, BLOCK_FC):
                        of = f0 + tl.arange(0, BLOCK_FC)
                        fm = of < F
                        fkx = tl.load(FK + kv_base * F + jb[:, None] * F + of[None, :],
                                      mask=jb_ok[:, None] & fm[None, :], other=0.0)  # fmt: skip
                        ptr = DFQ32 + q_base * F + n[:, None] * F + of[None, :]
                        rm = row_ok[:, None] & fm[None, :]
                        part = tl.dot(dpwb, fkx.to(DT), input_precision=PREC)
                        tl.store(ptr, tl.load(ptr, mask=rm, other=0.0) + part, mask=rm)
            tl.debug_barrier()  # (the next block reads these rows back)
    else:
        j0 = (c - 1) * CHUNK + tl.arange(0, CHUNK)
        j1 = c * CHUNK + tl.arange(0, CHUNK)
        ds0, rs0, dpw0 = _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j0, kv_base, q_base, T, D, window,
                                      lin_off, n_excl, scale, g, rho, CHUNK, BLOCK_DK, SOFT, LIN, DECAY, DT,
                                      PREC)  # fmt: skip
        ds1, rs1, dpw1 = _bwd_q_block(Q, K, V, DY, zs, dlz, m, n, row_ok, j1, kv_base, q_base, T, D, window,
                                      lin_off, n_excl, scale, g, rho, CHUNK, BLOCK_DK, SOFT, LIN, DECAY, DT,
                                      PREC)  # fmt: skip
        rsum = rs0 + rs1
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
    if SINKS:  # the sinks' ds and E [rows, BLOCK_S] in DT (the key-side kernel makes their dk, dv)
        part = rows[:, None] * BLOCK_S + js[None, :]
        tl.store(SINK_DS + part, dsk.to(DT), mask=row_ok[:, None])
        tl.store(SINK_E + part, ps.to(DT), mask=row_ok[:, None])
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
        dy = tl.load(DY + q_base * D + n[:, None] * D + od_all[None, :], mask=row_ok[:, None] & dm_all[None, :],
                     other=0.0)  # fmt: skip
        do = (dy.to(tl.float32) / zs[:, None]).to(DT)  # (whole: one product per feature chunk of the state)
        for f0 in range(0, F, BLOCK_FC):
            of = f0 + tl.arange(0, BLOCK_FC)
            fm = of < F
            if MULTI:
                acc = tl.load(DFQ32 + q_base * F + n[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                              other=0.0)  # fmt: skip
            else:
                fk0 = tl.load(FK + kv_base * F + j0[:, None] * F + of[None, :],
                              mask=(j0 >= 0)[:, None] & fm[None, :], other=0.0)  # fmt: skip
                acc = tl.dot(dpw0, fk0.to(DT), input_precision=PREC)
                if OWN_L:  # (chunk c's own keys have L terms)
                    fk1 = tl.load(FK + kv_base * F + j1[:, None] * F + of[None, :],
                                  mask=(j1 < T)[:, None] & fm[None, :], other=0.0)  # fmt: skip
                    acc += tl.dot(dpw1, fk1.to(DT), input_precision=PREC)
            if HAS_INIT or c >= NB + 1:  # the state before chunk c - NB: phi_q's gradient lag (h do - z dlz)
                ht = tl.load(HKV + st * F * D + od_all[:, None] + of[None, :] * D,
                             mask=dm_all[:, None] & fm[None, :], other=0.0)  # fmt: skip
                if HKV.dtype.element_ty == DT:
                    sp = tl.dot(do, ht, input_precision=PREC)
                else:
                    sp = tl.dot(do.to(tl.float32), ht.to(tl.float32), input_precision=PREC)
                z = tl.load(HK + st * F + of, mask=fm, other=0.0)
                sp = (sp - dlz[:, None] * z[None, :]) * lag[:, None]
                acc += sp
            tl.store(DFQ + q_base * F + n[:, None] * F + of[None, :], acc.to(DFQ.dtype.element_ty),
                     mask=row_ok[:, None] & fm[None, :])  # fmt: skip


# One head of a folded launch, called: inlined in the heads loop, its index vectors and constants were hoisted out of
# the loop and spilled (40-176 bytes on sm_90 with the sinks and the decay at head dim 128, 256-1072 on sm_80); called,
# they are made per head and nothing spills. ptxas then serializes the callee's wgmma (C7510): a device measures
# whether the fold still pays (DEVICE_SPEED_TILES' `unfolded` variant).
_dq_head_call = triton.jit(noinline=True)(_dq_head.fn)


@triton.jit
def _chunk_bwd_dq(
    Q, K, V, FK, GAMMA, RHO, HKV, HK, DY, Y, YLO, M, ZS, IDX,  # inputs: the forward's (Y: the output; YLO: its
    # rounding error, with Y_LO)
    DQ, DFQ, DLZ, RSUM, SINK_DS, SINK_E,  # outputs
    DQ32, DFQ32,  # (MULTI) fp32 scratch [B, H, T, D] and [B, H, T, F], zeroed: the sums over the key blocks
    T, H, G, GF, D, F, NS, NC, NB, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr = False, MULTI: tl.constexpr = False,
    Y_LO: tl.constexpr = False, FOLD: tl.constexpr = False, OWN_L: tl.constexpr = True,
):  # fmt: skip
    """The backward of the CHUNK queries of chunk c (axis 1) of GF query heads of one KV head in turn (axis 0: batch x H
    / GF; `chunk_h.fold`), for each: dq and dphi_q [B, H, T, *] in the inputs' dtype; dlz [B, H, T] (do . y, read by the
    next launches); RSUM, the row sums of ds over the window and sink terms (HYBRID: -dc_n, and gamma's gradient times
    gamma); SINK_DS, SINK_E [B, H, T, BLOCK_S] (SINKS, in DT):
    the sinks' ds (c_n's gradient in) and E terms per row, which `_chunk_bwd_dkv` turns into their dk, dv (products over
    the rows here spilled on sm_80). The keys are chunks c - NB .. c (`_bwd_q_block` each, those before 0 empty) and the
    sinks. NB = 1 (windows up to CHUNK): the two blocks' ds tiles [CHUNK, keys] stay in registers (in DT) and dq is then
    made and stored a head-dim chunk of BLOCK_DK at a time (no [CHUNK, D] accumulator), c_n's gradient to the argmax
    key; dphi_q walks the features in chunks of BLOCK_FC: the blocks' dp times the L weights against phi_k, plus the
    state before chunk c - NB (one product of do [CHUNK, D] with each feature chunk of the state; state 0 is the initial
    state with HAS_INIT). MULTI (NB > 1, longer windows): each block's share of dq and dphi_q is added to fp32 scratch
    rows that only this program touches, and read back for the rest. OWN_L: chunk c's own keys have L terms (lin_off <
    CHUNK: la_only, windows under 64); without, their dp times the L weights is zero, and its product with phi_k is
    left out (as a runtime test on lin_off it spilled 16-24 bytes on sm_80 with the sinks under triton 3.6)."""
    if not FOLD:  # (GF = 1: the body inline)
        _dq_head(Q, K, V, FK, GAMMA, RHO, HKV, HK, DY, Y, YLO, M, ZS, IDX, DQ, DFQ, DLZ, RSUM, SINK_DS, SINK_E,
                 DQ32, DFQ32, tl.program_id(0), tl.program_id(1), T, H, G, D, F, NS, NB, window, lin_off,
                 sink_off, n_sinks, n_excl, scale, CHUNK, BLOCK_D, BLOCK_DK, BLOCK_FC, BLOCK_S, SOFT, LIN, SINKS,
                 HYBRID, DECAY, DT, PREC, HAS_INIT, MULTI, Y_LO, OWN_L)  # fmt: skip
    else:  # (FOLD: GF > 1)
        for hh in range(GF):  # (the GF query heads of one KV head in turn: its keys, values, phi_k and state read once)
            _dq_head_call(Q, K, V, FK, GAMMA, RHO, HKV, HK, DY, Y, YLO, M, ZS, IDX, DQ, DFQ, DLZ, RSUM, SINK_DS,
                          SINK_E, DQ32, DFQ32, tl.program_id(0) * GF + hh, tl.program_id(1), T, H, G, D, F, NS,
                          NB, window, lin_off, sink_off, n_sinks, n_excl, scale, CHUNK, BLOCK_D, BLOCK_DK, BLOCK_FC,
                          BLOCK_S, SOFT, LIN, SINKS, HYBRID, DECAY, DT, PREC, HAS_INIT, MULTI, Y_LO,
                          OWN_L)  # fmt: skip


@triton.jit
def _chunk_bwd_dkv(
    Q, K, V, FQ, FK, GAMMA, RHO, DY, M, ZS, DLZ, IDX, RSUM, DHKV, DHK, SINK_DS, SINK_E,  # inputs
    DK, DV, DFK, RKEY,  # outputs
    SINK_DKV, COUNT,  # (SINKS) fp32 sums [B Hkv, 2, BLOCK_S, BLOCK_D] and int32 counts [B Hkv], zeroed
    T, H, G, D, F, NS, NC, NB, window, lin_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_FC: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr,
    SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dk (the window terms; SOFT), dv (window and L terms, and the state) and dphi_k (LIN: the L terms and the state),
    in the inputs' dtype, of the CHUNK keys j of chunk c (axis 1) of one KV head (axis 0: batch x Hkv), over the
    whole head dim and feature dim, summed over its G query heads in this one program.

    First (LIN, c <= NS - 2) the keys' share of the state h_{c+1} that holds them, each key weighted alpha^(CHUNK c +
    CHUNK - 1 - j): dv from dh_{c+1} (over feature chunks of BLOCK_FC), dphi_k from dh_{c+1} v^T + dz_{c+1} (over
    head-dim chunks of BLOCK_DC), and rho's share through those weights. Then, for each query head and each block of
    BLOCK_Q queries of chunks c .. c + NB (the only ones whose window or intra-chunk L terms reach chunk c), in tiles
    [queries, keys], once each: dp = do.v - dlz and the scores q.k (SOFT) over head-dim chunks, phi_q.phi_k (LIN)
    over feature chunks; from them ds^T q into dk (c_n's gradient where its argmax is one of these keys in the row's
    window), (g E + L)^T do into dv, phi_q^T (dp times the L weights) into dphi_k^T, and rho's share of the L terms
    (-e L dp). (Tiles of BLOCK_Q query rows and dphi_k as [features, keys]: Triton lays square [64, 64] tiles of
    chained products over 8 warps with rows copied across warps, which spilled on sm_80.) dk, dv, dphi_k stored.
    Last (SINKS) the sinks' terms of chunk c's query rows, q^T ds and do^T E from `_chunk_bwd_dq`'s rows, added to
    the KV head's fp32 sums; the program that counts last for its KV head (acquire-release) adds the sums to the sink
    keys' rows of dk and dv (the chunk-0 program stored them first). RKEY (DECAY): the program's share of rho's
    gradient."""
    pid_bk = tl.program_id(0)
    c = tl.program_id(1)
    Hkv = H // G
    kv_base = pid_bk.to(tl.int64) * T
    j = c * CHUNK + tl.arange(0, CHUNK)
    k_ok = j < T
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    km = k_ok[:, None] & dm[None, :]
    of = tl.arange(0, BLOCK_F)
    fm = of < F
    acc_k = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    acc_v = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    acc_f = tl.zeros([BLOCK_F, CHUNK], tl.float32)  # dphi_k^T (features x keys: no square tile at head dim 64)
    rkey = 0.0  # (rho's share, summed over the program)
    rho = 0.0
    if DECAY:
        rho = tl.load(RHO + pid_bk % Hkv).to(tl.float32)
    if LIN:
        if c <= NS - 2:  # these keys' share of h_{c+1}: weight alpha^(e - j), e the chunk's last key
            st = pid_bk.to(tl.int64) * NS + c + 1
            e = c * CHUNK + CHUNK - 1
            wk = tl.where(k_ok & (j >= n_excl), 1.0, 0.0)
            if DECAY:
                wk = wk * tl.exp(-rho * (e - j).to(tl.float32))
            for f0 in range(0, F, BLOCK_FC):  # dv += (wk phi_k) dh
                ofc = f0 + tl.arange(0, BLOCK_FC)
                fcm = ofc < F
                fk = tl.load(FK + (kv_base + j)[:, None] * F + ofc[None, :], mask=k_ok[:, None] & fcm[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
                dh = tl.load(DHKV + (st * F + ofc)[:, None] * D + od[None, :], mask=fcm[:, None] & dm[None, :],
                             other=0.0)  # fmt: skip
                if DHKV.dtype.element_ty == DT:
                    acc_v += tl.dot((fk * wk[:, None]).to(DT), dh, input_precision=PREC)
                else:
                    acc_v += tl.dot(fk * wk[:, None], dh.to(tl.float32), input_precision=PREC)
            for d0 in range(0, D, BLOCK_DC):  # dphi_k^T += (dh v^T + dz) wk
                odc = d0 + tl.arange(0, BLOCK_DC)
                dcm = odc < D
                vt = tl.load(V + (kv_base + j)[None, :] * D + odc[:, None], mask=dcm[:, None] & k_ok[None, :],
                             other=0.0)  # fmt: skip
                dh = tl.load(DHKV + (st * F + of)[:, None] * D + odc[None, :], mask=fm[:, None] & dcm[None, :],
                             other=0.0)  # fmt: skip
                if DHKV.dtype.element_ty == DT:
                    acc_f += tl.dot(dh, vt.to(DT), input_precision=PREC)
                else:
                    acc_f += tl.dot(dh.to(tl.float32), vt.to(tl.float32), input_precision=PREC)
            dz = tl.load(DHK + st * F + of, mask=fm, other=0.0)
            acc_f = (acc_f + dz[:, None]) * wk[None, :]
            if DECAY:
                fkt = tl.load(FK + (kv_base + j)[None, :] * F + of[:, None], mask=fm[:, None] & k_ok[None, :],
                              other=0.0)  # fmt: skip
                rkey -= tl.sum((e - j).to(tl.float32) * tl.sum(fkt.to(tl.float32) * acc_f, 0), 0)
    if SOFT or LIN:
        for hh in range(0, G):
            head = (pid_bk % Hkv) * G + hh
            q_base = ((pid_bk // Hkv) * H + head).to(tl.int64) * T
            if HYBRID:
                g = tl.load(GAMMA + head).to(tl.float32)
            else:
                g = 1.0
            for q0 in range(c * CHUNK, tl.minimum((c + NB + 1) * CHUNK, T), BLOCK_Q):
                n = q0 + tl.arange(0, BLOCK_Q)  # (tiles [queries, keys]: BLOCK_Q rows, no tile copied across warps)
                q_ok = n < T
                rows = q_base + n
                qm = q_ok[:, None] & dm[None, :]
                both = q_ok[:, None] & k_ok[None, :]
                zs = tl.load(ZS + rows, mask=q_ok, other=1.0)
                dlz = tl.load(DLZ + rows, mask=q_ok, other=0.0)
                dp = tl.zeros([BLOCK_Q, CHUNK], tl.float32)  # do . v - dlz
                a = tl.zeros([BLOCK_Q, CHUNK], tl.float32)  # the scores q . k
                for d0 in range(0, D, BLOCK_DC):  # (head-dim chunks: few operand tiles per product)
                    odc = d0 + tl.arange(0, BLOCK_DC)
                    qc = q_ok[:, None] & (odc < D)[None, :]
                    kc = (odc < D)[:, None] & k_ok[None, :]
                    dyc = tl.load(DY + rows[:, None] * D + odc[None, :], mask=qc, other=0.0)
                    vt = tl.load(V + odc[:, None] + (kv_base + j)[None, :] * D, mask=kc, other=0.0)
                    dp += tl.dot((dyc.to(tl.float32) / zs[:, None]).to(DT), vt.to(DT), input_precision=PREC)
                    if SOFT:
                        qc_ = tl.load(Q + rows[:, None] * D + odc[None, :], mask=qc, other=0.0)
                        kt = tl.load(K + odc[:, None] + (kv_base + j)[None, :] * D, mask=kc, other=0.0)
                        a += tl.dot(qc_.to(DT), kt.to(DT), input_precision=PREC)
                dp = dp - dlz[:, None]
                dy = tl.load(DY + rows[:, None] * D + od[None, :], mask=qm, other=0.0)
                do = (dy.to(tl.float32) / zs[:, None]).to(DT)
                p = tl.zeros([BLOCK_Q, CHUNK], tl.float32)  # the weights of these keys' values: g E and L
                if SOFT:
                    q = tl.load(Q + rows[:, None] * D + od[None, :], mask=qm, other=0.0).to(DT)
                    m = tl.load(M + rows, mask=q_ok, other=0.0)
                    win = both & (j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window)
                    p = tl.where(win, g * tl.exp(a * scale - m[:, None]), 0.0)
                    ds = p * dp
                    if HYBRID:  # (c_n's argmax key: a window key where it is past n - window, else a sink)
                        idx = tl.load(IDX + rows, mask=q_ok, other=-1)
                        idx = tl.where(idx > n - window, idx, -1)
                        rsum = tl.load(RSUM + rows, mask=q_ok, other=0.0)
                        ds -= tl.where(j[None, :] == idx[:, None], rsum[:, None], 0.0)
                    acc_k += tl.dot(tl.trans(ds.to(DT)), q, input_precision=PREC)
                if LIN:  # (only where the block has L terms: its last query at least lin_off past the first key)
                    if q0 + BLOCK_Q - 1 - c * CHUNK >= lin_off:
                        s = tl.zeros([BLOCK_Q, CHUNK], tl.float32)  # phi_q . phi_k
                        for f0 in range(0, F, BLOCK_FC):
                            ofc = f0 + tl.arange(0, BLOCK_FC)
                            fcm = ofc < F
                            fq = tl.load(FQ + rows[:, None] * F + ofc[None, :], mask=q_ok[:, None] & fcm[None, :],
                                         other=0.0)  # fmt: skip
                            fkt = tl.load(FK + ofc[:, None] + (kv_base + j)[None, :] * F,
                                          mask=fcm[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                            s += tl.dot(fq.to(DT), fkt.to(DT), input_precision=PREC)
                        lin = both & (j[None, :] <= n[:, None] - lin_off) & (j[None, :] >= n_excl)
                        w = tl.where(lin, 1.0, 0.0)
                        if DECAY:
                            e = tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32)
                            w = w * tl.exp(-rho * e)
                        dpw = dp * w
                        p += s * w  # (an L key is never a window key of the same query)
                        if DECAY:  # (rho's share of the L terms: -e L dp)
                            rkey -= tl.sum(tl.sum(s * dpw * e, 1), 0)
                        fqt = tl.load(FQ + rows[None, :] * F + of[:, None], mask=fm[:, None] & q_ok[None, :], other=0.0)
                        acc_f += tl.dot(fqt.to(DT), dpw.to(DT), input_precision=PREC)
                acc_v += tl.dot(tl.trans(p.to(DT)), do, input_precision=PREC)
    out = (kv_base + j)[:, None] * D + od[None, :]
    tl.store(DK + out, (acc_k * scale).to(DK.dtype.element_ty), mask=km)
    tl.store(DV + out, acc_v.to(DV.dtype.element_ty), mask=km)
    if LIN:
        tl.store(DFK + (kv_base + j)[None, :] * F + of[:, None], acc_f.to(DFK.dtype.element_ty),
                 mask=fm[:, None] & k_ok[None, :])  # fmt: skip
        if DECAY:
            tl.store(RKEY + pid_bk * NC + c, rkey)
    if SINKS:  # the sink terms of this chunk's query rows, every query head: q^T ds and do^T E, to the sums
        js = tl.arange(0, BLOCK_S)
        skt = tl.zeros([BLOCK_D, BLOCK_S], tl.float32)  # (transposed: 64-row products)
        svt = tl.zeros([BLOCK_D, BLOCK_S], tl.float32)
        for hh in range(0, G):
            q_base = ((pid_bk // Hkv) * H + (pid_bk % Hkv) * G + hh).to(tl.int64) * T
            for q0 in range(c * CHUNK, tl.minimum((c + 1) * CHUNK, T), BLOCK_Q):
                n = q0 + tl.arange(0, BLOCK_Q)
                q_ok = n < T
                rows = q_base + n
                qmt = dm[:, None] & q_ok[None, :]
                ds_s = tl.load(SINK_DS + rows[:, None] * BLOCK_S + js[None, :], mask=q_ok[:, None], other=0.0)
                e_s = tl.load(SINK_E + rows[:, None] * BLOCK_S + js[None, :], mask=q_ok[:, None], other=0.0)
                qt = tl.load(Q + od[:, None] + rows[None, :] * D, mask=qmt, other=0.0)
                dyt = tl.load(DY + od[:, None] + rows[None, :] * D, mask=qmt, other=0.0)
                zs = tl.load(ZS + rows, mask=q_ok, other=1.0)
                skt += tl.dot(qt.to(DT), ds_s, input_precision=PREC)
                svt += tl.dot((dyt.to(tl.float32) / zs[None, :]).to(DT), e_s, input_precision=PREC)
        s_ok = dm[:, None] & (js < n_sinks)[None, :]
        sums = SINK_DKV + (pid_bk.to(tl.int64) * 2 * BLOCK_S + js)[None, :] * BLOCK_D + od[:, None]
        tl.atomic_add(sums, skt, mask=s_ok, sem="relaxed")
        tl.atomic_add(sums + BLOCK_S * BLOCK_D, svt, mask=s_ok, sem="relaxed")
        tl.debug_barrier()  # (every thread's adds before the count)
        if tl.atomic_add(COUNT + pid_bk, 1, sem="acq_rel") == NC - 1:  # the KV head's last program: every sum is in
            whole = ((js < n_sinks) & (js < T))[:, None] & dm[None, :]
            total = SINK_DKV + (pid_bk.to(tl.int64) * 2 * BLOCK_S + js)[:, None] * BLOCK_D + od[None, :]
            rows_s = (kv_base + js)[:, None] * D + od[None, :]
            dks = tl.load(total, mask=whole, other=0.0, cache_modifier=".cg") * scale
            dvs = tl.load(total + BLOCK_S * BLOCK_D, mask=whole, other=0.0, cache_modifier=".cg")
            dks += tl.load(DK + rows_s, mask=whole, other=0.0, cache_modifier=".cg").to(tl.float32)
            dvs += tl.load(DV + rows_s, mask=whole, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(DK + rows_s, dks.to(DK.dtype.element_ty), mask=whole)
            tl.store(DV + rows_s, dvs.to(DV.dtype.element_ty), mask=whole)


def _common(case) -> dict:
    """The constants both backward launches of the call share."""
    return dict(CHUNK=case.chunk, BLOCK_D=pow2(case.head_dim), BLOCK_S=case.block_s, SOFT=case.soft, LIN=case.lin,
                SINKS=case.sink, HYBRID=case.gamma_on, DECAY=case.decay, DT=case.dt, PREC=case.prec,
                num_stages=case.cfg["stages"])  # fmt: skip


def bwd_dq(saved, dy, state, case):
    """`_chunk_bwd_dq`'s launch: saved = (q, k, v, fq, fk, g, rho, (y, its rounding error or None), (c_n, Z_n,
    argmax)). Returns dict(dq, dfq (inputs' dtype), dlz, rsum (HYBRID), sink_ds, sink_e (SINKS: the
    sinks' ds and E per row, in the inputs' dtype, for bwd_dkv))."""
    q, k, v, fq, fk, g, rho, (y, y_lo), (m, zs, idx) = saved
    B, H, T, D = q.shape
    F = fq.shape[-1]
    nc = triton.cdiv(T, case.chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    hkv, hk = state if state is not None else (g.to(torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32), g)
    out = dict(dq=torch.empty_like(q), dfq=torch.empty_like(fq) if case.lin else torch.zeros_like(fq))
    out["dlz"] = torch.empty(B, H, T, **f32)
    out["rsum"] = torch.empty(B, H, T, **f32) if case.gamma_on else g
    sinks = (torch.empty(B, H, T, case.block_s, dtype=q.dtype, device=q.device) for _ in range(2))
    out["sink_ds"], out["sink_e"] = sinks if case.sink else (g, g)
    multi = case.nb > 1
    scratch = (torch.zeros(B, H, T, D, **f32), torch.zeros(B, H, T, F, **f32)) if multi else (g, g)
    cfg = case.cfg
    gf = heads_per_program(q, B * H * nc, H // k.shape[1], cfg)
    _chunk_bwd_dq[(B * H // gf, nc)](
        q, k, v, fk, g, g if rho is None else rho, hkv, hk, dy, y, y if y_lo is None else y_lo, m, zs, idx,
        out["dq"], out["dfq"], out["dlz"], out["rsum"], out["sink_ds"], out["sink_e"], *scratch,
        T, H, H // k.shape[1], gf, D, F, hkv.shape[2] if state is not None else 0, nc, case.nb, case.window,
        case.lin_off, case.sink_off, case.n_sinks, case.n_excl, case.scale,
        BLOCK_DK=min(pow2(D), cfg["bwd_dchunk"]), BLOCK_FC=cfg["bwd_fchunk"], HAS_INIT=case.has_init, MULTI=multi,
        Y_LO=y_lo is not None, FOLD=gf > 1, OWN_L=case.lin_off < case.chunk, num_warps=cfg["dq_warps"],
        **regs(cfg, "dq"), **_common(case),
    )  # fmt: skip
    return out


def bwd_dkv(saved, dy, grads, dstate, case):
    """dk, dv and dphi_k (the inputs' dtype; dphi_k zero without an LA) and rho's share through the keys' weights
    (DECAY, else None): one `_chunk_bwd_dkv` launch over the KV heads' key chunks. grads: bwd_dq's dict; dstate (dh,
    dz) or None."""
    q, k, v, fq, fk, g, rho, _, (m, zs, idx) = saved
    B, Hkv, T, D = k.shape
    F = fk.shape[-1]
    nc = triton.cdiv(T, case.chunk)
    dfk = torch.empty_like(fk) if case.lin else torch.zeros_like(fk)
    rkey = torch.empty(B * Hkv * nc, dtype=torch.float32, device=k.device) if case.decay else None
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dhkv, dhk = dstate if dstate is not None else (g, g)
    sums = count = g
    if case.sink:  # (the sinks' dk, dv: summed over the programs of a KV head, written by its last)
        sums = torch.zeros(B * Hkv, 2, case.block_s, pow2(D), dtype=torch.float32, device=k.device)
        count = torch.zeros(B * Hkv, dtype=torch.int32, device=k.device)
    cfg = case.cfg
    _chunk_bwd_dkv[(B * Hkv, nc)](
        q, k, v, fq, fk, g, g if rho is None else rho, dy, m, zs, grads["dlz"], idx, grads["rsum"], dhkv, dhk,
        grads["sink_ds"], grads["sink_e"], dk, dv, dfk, g if rkey is None else rkey, sums, count,
        T, q.shape[1], q.shape[1] // Hkv, D, F, dhkv.shape[2] if dstate else 0, nc, case.nb, case.window,
        case.lin_off, case.n_sinks, case.n_excl, case.scale, BLOCK_F=pow2(F), BLOCK_FC=min(pow2(F), cfg["dkv_fchunk"]),
        BLOCK_DC=min(pow2(D), cfg["dkv_dchunk"]), BLOCK_Q=cfg["dkv_qblock"], num_warps=cfg["dkv_warps"],
        **regs(cfg, "dkv"), **_common(case),
    )  # fmt: skip
    return dk, dv, dfk, rkey
