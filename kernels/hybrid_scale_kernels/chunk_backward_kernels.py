"""The chunked backward's Triton kernels (chunk_backward.py launches them; what they compute is in its docstring)."""

from __future__ import annotations

import triton
import triton.language as tl


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
