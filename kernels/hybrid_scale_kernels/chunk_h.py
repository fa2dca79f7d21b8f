"""The state scans of the chunked hybrid attention (fla's `chunk_h`): forward, the LA state before every 64-token
chunk per KV head (optionally split over the sequence, and from an initial state); backward, the gradient of every
state in reverse (`_chunk_dstates`, launched by `dstates`, split the same way).

The state before chunk c is h_c = sum over the LA keys j < 64 c of alpha^(64 c - 1 - j) phi_k(k_j) v_j^T [F, D] and
z_c the same sum of phi_k(k_j) [F] (kept as key 64 c - 1 sees them: every weight alpha^(>= 0), the carry from one
chunk to the next one multiply by alpha^64); the hybrid with its own sinks leaves the first S keys out. An initial
state (the keys before the sequence, as key -1 sees them) is h_0, and every later state carries it. `_chunk_states`
walks the chunks in order, one program per (64-feature block, 32-value block, batch x KV head): (F / 64) (D / 32) B
Hkv programs, 128 at Llama-3-8B's shape and batch 1, each a chain of T / 64 dependent steps (256 at 16k tokens). Its
products are tl.dot of [64 features, 64 keys] x [64 keys, BLOCK_DV values] with fp32 accumulation (wgmma on sm_90);
h is stored in bf16 for bf16 inputs, fp32 otherwise (fp16's range is too small for a sum over the sequence), z in
fp32 (1/D of h's bytes, and it is the whole LA normaliser).

When those programs leave SMs idle (a small model, few KV heads, batch 1; `plan`), the scan is cut into P segments of
L chunks. The scan is linear in the keys, so for chunk c of segment p (which starts at chunk c0)

    h_c = alpha^(64 (c - c0)) h_{c0} + l_c,    l_c = the same sum over the keys 64 c0 <= j < 64 c only.

Two launches: `_chunk_states` over (blocks, batch x KV head x segment), each segment scanned from zero (l_c), its
whole sum kept in fp32; then `_segment_fix` on the same grid sums h_{c0} from the earlier segments' whole sums
(h_{c0(p+1)} = alpha^(64 L) h_{c0(p)} + l_end(p): P is small) and adds alpha^(64 (c - c0)) h_{c0} to every l_c of
its segment (segment 0 starts at zero).

The reverse scan (dh_s = alpha^64 dh_{s+1} + the gradient of the queries that read h_s) is split by the same `plan`:
for state s of segment p, whose next segment starts at state e,

    dh_s = alpha^(64 (e - s)) dh_e + l_s,    l_s = the same sum over the states s .. e - 1 only.

`_chunk_dstates` scans each segment from zero (l_s; its first state's l in fp32), then `_dstates_fix` sums dh_e from
the later segments' first states and adds alpha^(64 (e - s)) dh_e to every l_s of the segment (the last segment has
nothing after it; the initial state's gradient, in the first segment, too), and, with the decay, rho's share through
the carries into dh_e, which no segment's own scan sees: -64 sum_s alpha^(64 (e - s)) <dh_e, h_s>, the segment's
states read again. The split pays where the programs leave SMs idle: sm_90's [64, 128] tiles (settings.py) make 32
programs at Llama-3-8B's shape, one an SM, which `plan` cuts into 4 segments (128 programs, one wave of 16-state
chains).
tests/unit/test_chunk_scan.py checks both split scans against the unsplit ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import regs
from .utils import CHUNK, pow2, state_lag

# The SM count `states` plans for where the tensors are not on a GPU: 0 = never split (Triton's interpreter); the
# compile gate (tools/kernel_compile.py) sets an H100/H200's 132, so it records the launches a GPU makes.
SMS_OFF_GPU = 0


@triton.jit
def _chunk_states(
    FK, V, RHO, H0, Z0,  # inputs: phi_k [B, Hkv, T, F], v [B, Hkv, T, D], rho [Hkv]; (HAS_INIT) h_0, z_0 (fp32)
    HKV, HK,  # outputs: h [B, Hkv, NS, F, D] (bf16 or fp32), z [B, Hkv, NS, F] (fp32)
    END, ZEND,  # with segments (P > 1): each segment's whole sum [B Hkv, P, F, D] and [B Hkv, P, F] (fp32)
    T, F: tl.constexpr, D: tl.constexpr, NS, Hkv, n_excl, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, HAS_INIT: tl.constexpr = False,
):  # fmt: skip
    """The LA state before each chunk c of one segment (chunks seg L .. seg L + L - 1; one segment of NS chunks
    without a split), one program per (feature block, value block, batch x KV head x segment): h_c[f, d] = sum over
    keys n_excl <= j < c CHUNK of the segment of alpha^(c CHUNK - 1 - j) phi_k(k_j)[f] v_j[d], and z_c[f] the same sum
    of phi_k(k_j)[f] (only the programs of the first value block store z). n_excl = S when the hybrid has its own
    sinks (the LA leaves them out), else 0; alpha = exp(-rho) of the KV head (DECAY), else 1. Each chunk adds one
    product phi_k^T [BLOCK_F, CHUNK] x v [CHUNK, BLOCK_DV] in DT with fp32 accumulation; the state goes to memory in
    HKV's dtype. With P > 1 the segment's whole sum also goes to END / ZEND (fp32). HAS_INIT: the first segment
    starts from the initial state [B Hkv, F, D] and [B Hkv, F] (fp32) instead of zero."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    bh = tl.program_id(2) // P
    seg = tl.program_id(2) % P
    base = bh.to(tl.int64)
    of = f0 + tl.arange(0, BLOCK_F)
    od = d0 + tl.arange(0, BLOCK_DV)
    both = (of < F)[:, None] & (od < D)[None, :]
    z_lim = tl.where(tl.program_id(1) == 0, F, 0)  # (z: stored by the first value block's programs only)
    h = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_F], tl.float32)
    if HAS_INIT:
        if seg == 0:
            h += tl.load(H0 + (base * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)
            z += tl.load(Z0 + base * F + of, mask=of < F, other=0.0)
    if DECAY:
        rho = tl.load(RHO + bh % Hkv).to(tl.float32)
        carry = tl.exp(-rho * CHUNK)
    for c in range(seg * L, tl.minimum(seg * L + L, NS)):
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
    if P > 1:
        sp = base * P + seg
        tl.store(END + (sp * F + of)[:, None] * D + od[None, :], h, mask=both)
        tl.store(ZEND + sp * F + of, z, mask=of < z_lim)


@triton.jit
def _segment_fix(
    RHO, END, ZEND, HKV, HK, NS, F, D, Hkv, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """h_c = alpha^(CHUNK (c - c0)) h_{c0} + l_c for the chunks of one segment, h_{c0} summed here from the earlier
    segments' whole sums, h_{c0(p+1)} = alpha^(CHUNK L_p) h_{c0(p)} + l_end(p) (segment 0 starts at zero: nothing
    to add)."""
    seg = tl.program_id(2) % P
    if seg > 0:
        f0 = tl.program_id(0) * BLOCK_F
        d0 = tl.program_id(1) * BLOCK_DV
        bh = tl.program_id(2) // P
        base = bh.to(tl.int64)
        of = f0 + tl.arange(0, BLOCK_F)
        od = d0 + tl.arange(0, BLOCK_DV)
        both = (of < F)[:, None] & (od < D)[None, :]
        z_lim = tl.where(tl.program_id(1) == 0, F, 0)
        if DECAY:
            rho = tl.load(RHO + bh % Hkv).to(tl.float32)
        h0 = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
        z0 = tl.zeros([BLOCK_F], tl.float32)
        for p in range(0, seg):  # (every earlier segment is whole: L chunks)
            if DECAY:
                carry = tl.exp(-rho * (CHUNK * L).to(tl.float32))
                h0 = h0 * carry
                z0 = z0 * carry
            sp = base * P + p
            h0 += tl.load(END + (sp * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)
            z0 += tl.load(ZEND + sp * F + of, mask=of < z_lim, other=0.0)
        c0 = seg * L
        for c in range(c0, tl.minimum(c0 + L, NS)):
            st = base * NS + c
            if DECAY:
                w = tl.exp(-rho * (CHUNK * (c - c0)).to(tl.float32))
            else:
                w = 1.0
            ptr = HKV + (st * F + of)[:, None] * D + od[None, :]
            tl.store(ptr, (tl.load(ptr, mask=both, other=0.0).to(tl.float32) + w * h0).to(HKV.dtype.element_ty),
                     mask=both)  # fmt: skip
            zp = HK + st * F + of
            tl.store(zp, tl.load(zp, mask=of < z_lim, other=0.0) + w * z0, mask=of < z_lim)


@triton.jit
def _chunk_dstates(
    FQ, DY, ZS, DLZ, RHO, HKV, HK,  # inputs (HKV, HK: the forward's states, read for rho's gradient)
    DHKV, DHK, DH0, DZ0, RSCAN,  # outputs: dh [B, Hkv, NS, F, D] (HKV's dtype), dz [B, Hkv, NS, F] (fp32); (HAS_INIT)
    # the initial state's gradient [B Hkv, F, D] and [B Hkv, F] (fp32); (DECAY) rho's partial sums
    END, ZEND,  # with segments (P > 1), fp32: each segment's own gradient of its first state [B Hkv, P, F, D], [B Hkv,
    # P, F]
    T, H, G, D: tl.constexpr, F: tl.constexpr, NS, Hkv, window, NB, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, HAS_INIT: tl.constexpr = False,
):  # fmt: skip
    """The gradient of every state h_s, z_s (s = NS - 1 .. 1, and 0 with an initial state; without one h_0 is
    empty) of one segment (states seg L .. seg L + L - 1; one segment of NS states without a split), one program
    per (feature block, value block, batch x KV head x segment), in reverse: dh_s = sum over the G query heads and
    the queries n that read h_s (chunk s + NB; chunks 0 .. NB for h_0) of lag_n phi_q(q_n) do_n^T, lag_n =
    alpha^(n - window - (CHUNK s - 1)), plus alpha^CHUNK dh_{s+1} (h_{s+1} = alpha^CHUNK h_s + chunk s's keys); dz_s
    the same with -dlz_n. A segment starts from zero at its last state (`_dstates_fix` adds what the later segments
    carry into it). With DECAY, RSCAN gets each program's share of rho's gradient through the carries within its
    segment, -CHUNK alpha^CHUNK <dh_{s+1}, h_s>, and through the lags of the queries that read h_s, -<sum_n e_n lag_n
    phi_q(q_n) do_n^T, h_s> (e_n = n - window - (CHUNK s - 1), d lag_n / d rho = -e_n lag_n), and z's the same way
    (with -dlz_n): the two summed into one tile (eh, ez) and taken against h_s, z_s once per state. (The share through
    the carries into a segment from the later ones is `_dstates_fix`'s, which reads the segment's states again: a
    sum of them weighted here, a third [BLOCK_F, BLOCK_DV] fp32 tile beside dh and eh, spilled 24 bytes on sm_90 at
    [64, 128] under triton 3.9.)"""
    pf = tl.program_id(0)
    pd = tl.program_id(1)
    pid_bh = tl.program_id(2) // P
    seg = tl.program_id(2) % P
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
    last = 1
    if HAS_INIT:
        last = 0
    lo = tl.maximum(seg * L, last)
    hi = tl.minimum(seg * L + L, NS)
    for i in range(0, hi - lo):
        s = hi - 1 - i
        st = pid_bh.to(tl.int64) * NS + s
        if DECAY:  # dh, dz hold dh_{s+1}, dz_{s+1}: h_{s+1} = alpha^CHUNK h_s + ...
            dh = dh * carry
            dz = dz * carry
            eh = CHUNK * dh  # (rho's share through the carry, -CHUNK alpha^CHUNK <dh_{s+1}, h_s>, and through the lags
            ez = CHUNK * dz  # of the queries that read h_s, summed below: both against h_s once, after the loop)
        for qc in range(tl.where(s > 0, s + NB, 0), s + NB + 1):
            n = qc * CHUNK + tl.arange(0, CHUNK)
            row_ok = n < T
            lag = tl.where(row_ok, 1.0, 0.0)
            if DECAY:
                lag = lag * state_lag(rho, n, window, s, CHUNK)
                el = tl.maximum(n - window - s * CHUNK + 1, 0).to(tl.float32) * lag  # (d lag / d rho = -e lag)
            for hh in range(0, G):  # (phi_q loaded transposed, [features, queries]: the product's A operand as is)
                rows = (b * H + kvh * G + hh).to(tl.int64) * T + n
                fqt = tl.load(FQ + rows[None, :] * F + of[:, None], mask=fm[:, None] & row_ok[None, :], other=0.0)
                dy = tl.load(DY + rows[:, None] * D + od[None, :], mask=row_ok[:, None] & (od < D)[None, :],
                             other=0.0)  # fmt: skip
                zs = tl.load(ZS + rows, mask=row_ok, other=1.0)
                dlz = tl.load(DLZ + rows, mask=row_ok, other=0.0)
                dol = (dy.to(tl.float32) * (lag / zs)[:, None]).to(DT)  # (do times the lag, rounded once)
                dh += tl.dot(fqt.to(DT), dol, input_precision=PREC)
                ld = lag * dlz
                dz -= tl.sum(fqt.to(tl.float32) * ld[None, :], 1)
                if DECAY:  # phi_q^T (e lag do) and -phi_q^T (e lag dlz)
                    eh += tl.dot(fqt.to(DT), (dy.to(tl.float32) * (el / zs)[:, None]).to(DT), input_precision=PREC)
                    ez -= tl.sum(fqt.to(tl.float32) * (el * dlz)[None, :], 1)
        if DECAY:  # h_s, z_s read once
            h = tl.load(HKV + (st * F + of)[:, None] * D + od[None, :], mask=both, other=0.0).to(tl.float32)
            z = tl.load(HK + st * F + of, mask=of < z_lim, other=0.0)
            racc += tl.sum(eh * h, 1) + ez * z
        if s > 0:
            tl.store(DHKV + (st * F + of)[:, None] * D + od[None, :], dh.to(DHKV.dtype.element_ty), mask=both)
            tl.store(DHK + st * F + of, dz, mask=of < z_lim)
        else:
            tl.store(DH0 + (pid_bh.to(tl.int64) * F + of)[:, None] * D + od[None, :], dh, mask=both)
            tl.store(DZ0 + pid_bh.to(tl.int64) * F + of, dz, mask=of < z_lim)
    if P > 1:
        sp = pid_bh.to(tl.int64) * P + seg
        tl.store(END + (sp * F + of)[:, None] * D + od[None, :], dh, mask=both)
        tl.store(ZEND + sp * F + of, dz, mask=of < z_lim)
    if DECAY:
        pid = (tl.program_id(2) * tl.num_programs(0) + pf) * tl.num_programs(1) + pd
        tl.store(RSCAN + pid, -tl.sum(racc, 0))


@triton.jit
def _dstates_fix(
    RHO, END, ZEND, HKV, HK,  # inputs: `_chunk_dstates`' per-segment sums (fp32); (DECAY) the forward's states
    DHKV, DHK, DH0, DZ0, RSCAN,  # its outputs, completed in place
    NS, F, D, Hkv, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_INIT: tl.constexpr = False,
):  # fmt: skip
    """dh_s += alpha^(CHUNK (e - s)) dh_e for the states s of one segment, e = (seg + 1) L the next segment's first
    state, whose whole gradient dh_e = sum over the later segments q of alpha^(CHUNK L (q - seg - 1)) END_q is summed
    here (P is small); the same for dz (and dh_0, dz_0 with an initial state). With DECAY, the share of rho's
    gradient that the segment's scan could not see, through the carries into dh_e: -CHUNK sum_s alpha^(CHUNK (e -
    s)) <dh_e, h_s> (and z's), h_s read here, added to the scan program's own RSCAN entry. The last segment has
    nothing after it."""
    seg = tl.program_id(2) % P
    if seg < P - 1:
        pf = tl.program_id(0)
        pd = tl.program_id(1)
        bh = tl.program_id(2) // P
        base = bh.to(tl.int64)
        of = pf * BLOCK_F + tl.arange(0, BLOCK_F)
        od = pd * BLOCK_DV + tl.arange(0, BLOCK_DV)
        both = (of < F)[:, None] & (od < D)[None, :]
        z_lim = tl.where(pd == 0, F, 0)
        rho = 0.0
        if DECAY:
            rho = tl.load(RHO + bh % Hkv).to(tl.float32)
        dn = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
        dzn = tl.zeros([BLOCK_F], tl.float32)
        for i in range(0, P - 1 - seg):  # segments P - 1 .. seg + 1: dh_e
            sp = base * P + P - 1 - i
            if DECAY:
                carry = tl.exp(-rho * (CHUNK * L).to(tl.float32))
                dn = dn * carry
                dzn = dzn * carry
            dn += tl.load(END + (sp * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)
            dzn += tl.load(ZEND + sp * F + of, mask=of < z_lim, other=0.0)
        last = 1
        if HAS_INIT:
            last = 0
        e = seg * L + L
        share = 0.0
        for s in range(tl.maximum(seg * L, last), e):
            wt = 1.0
            st = base * NS + s
            if DECAY:
                wt = tl.exp(-rho * (CHUNK * (e - s)).to(tl.float32))
                h = tl.load(HKV + (st * F + of)[:, None] * D + od[None, :], mask=both, other=0.0).to(tl.float32)
                z = tl.load(HK + st * F + of, mask=of < z_lim, other=0.0)
                share += wt * tl.sum(tl.sum(dn * h, 1) + dzn * z, 0)
            if s > 0:
                ptr = DHKV + (st * F + of)[:, None] * D + od[None, :]
                fixed = tl.load(ptr, mask=both, other=0.0).to(tl.float32) + wt * dn
                tl.store(ptr, fixed.to(DHKV.dtype.element_ty), mask=both)
                zp = DHK + st * F + of
            else:  # (the initial state's gradient, fp32)
                ptr0 = DH0 + (base * F + of)[:, None] * D + od[None, :]
                tl.store(ptr0, tl.load(ptr0, mask=both, other=0.0) + wt * dn, mask=both)
                zp = DZ0 + base * F + of
            tl.store(zp, tl.load(zp, mask=of < z_lim, other=0.0) + wt * dzn, mask=of < z_lim)
        if DECAY:
            pid = (tl.program_id(2) * tl.num_programs(0) + pf) * tl.num_programs(1) + pd
            tl.store(RSCAN + pid, tl.load(RSCAN + pid) - CHUNK * share)


def plan(programs: int, chunks: int, sms: int, least: int = 8, per_sm: int | None = None) -> int:
    """Segments to cut a scan of `chunks` chunks into, given `programs` programs without a split and `sms` SMs:
    enough that programs x segments fills the SMs twice, none shorter than `least` chunks; 1 = no split. per_sm (the
    programs one SM holds at once, `resident`), where given: no more than the SMs hold in one wave (a second, partly
    filled wave would run its chains after the first's, for no fewer steps)."""
    if programs >= sms or chunks < 2 * least:
        return 1
    want = -(-2 * sms // programs)
    if per_sm is not None:
        want = min(want, per_sm * sms // programs)
    return max(1, min(want, chunks // least))


def resident(warps: int, maxnreg: int | None) -> int:
    """Programs of a launch one SM holds at once on sm_80 and sm_90 (64K registers, 2048 threads, 32 blocks), from
    its warps and register cap (registers are given to a warp 256 at a time); 1 where it sets no cap."""
    if maxnreg is None:
        return 1
    per_warp = -(-maxnreg * 32 // 256) * 256
    return max(1, min(2048 // (32 * warps), 65536 // (per_warp * warps), 32))


def fold(G: int, programs: int, sms: int) -> int:
    """Query heads per program of a launch that has `programs` programs with one query head each, G query heads per
    KV head: the largest divisor of G that still leaves programs / g >= 2 sms (its programs then read the KV head's
    keys, values, phi_k and state once for g query heads, not once per head: a quarter of _chunk_output's and
    _chunk_bwd_dq's bytes at Llama-3-8B's shape); 1 where folding would leave SMs idle. sms 0 (Triton's interpreter)
    folds all G."""
    return max(g for g in range(1, G + 1) if G % g == 0 and (g == 1 or programs // g >= 2 * sms))


def heads_per_program(x: torch.Tensor, programs: int, G: int, cfg: dict) -> int:
    """`fold` for the SMs of x's device (SMS_OFF_GPU off a GPU); 1 where the launch settings `cfg` turn folding off
    (fold=0: one query head a program, what the device benchmark's tile variant `unfolded` times against)."""
    return fold(G, programs, _sms(x)) if cfg["fold"] else 1


def _sms(x: torch.Tensor) -> int:
    """The SMs `plan` plans for: the GPU's, or SMS_OFF_GPU elsewhere."""
    if x.device.type == "cuda":
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return SMS_OFF_GPU


def _segments(ns: int, segments: int) -> tuple[int, int]:
    """(L, P): a scan of ns chunks cut into P segments of L chunks (the last may be shorter), none empty."""
    P = max(1, min(int(segments), ns))
    L = -(-ns // P) if ns else 1
    return L, (-(-ns // L) if ns else 1)


def states(fk, v, rho, n_excl, ns, *, block_f, block_dv, warps, dt, prec, segments=None, options=None, init=None):
    """h [B, Hkv, ns, F, D] (bf16 for bf16 inputs, else fp32) and z [B, Hkv, ns, F] (fp32): the states before chunks
    0..ns-1 of phi_k fk [B, Hkv, T, F] and v [B, Hkv, T, D], rho [Hkv] (fp32) or None, the first n_excl keys left
    out; init None or (h_0 [B, Hkv, F, D], z_0 [B, Hkv, F]) fp32 contiguous, the keys before the sequence.
    `segments`: how many to cut the scan into (None: `plan` for the device's SMs; three launches when more than one,
    fp32 scratch of B x Hkv x segments x F x (D + 1)). `options`: more launch options of _chunk_states (its register
    cap)."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    state_dtype = torch.bfloat16 if fk.dtype == torch.bfloat16 else torch.float32
    hkv = torch.empty(B, Hkv, ns, F, D, dtype=state_dtype, device=fk.device)
    hk = torch.empty(B, Hkv, ns, F, dtype=torch.float32, device=fk.device)
    grid = (triton.cdiv(F, block_f), triton.cdiv(D, block_dv))
    if segments is None:
        segments = plan(grid[0] * grid[1] * B * Hkv, ns, _sms(fk))
    L, P = _segments(ns, segments)
    r = hk if rho is None else rho
    tiles = dict(DECAY=rho is not None, CHUNK=CHUNK, BLOCK_F=block_f, BLOCK_DV=block_dv)
    end = zend = hk
    if P > 1:
        scratch = dict(dtype=torch.float32, device=fk.device)
        end, zend = torch.empty(B * Hkv, P, F, D, **scratch), torch.empty(B * Hkv, P, F, **scratch)
    h0, z0 = init if init is not None else (hk, hk)
    _chunk_states[(*grid, B * Hkv * P)](
        fk, v, r, h0, z0, hkv, hk, end, zend, T, F, D, ns, Hkv, n_excl, L, P, **tiles, DT=dt, PREC=prec,
        HAS_INIT=init is not None, num_warps=warps, **(options or {})
    )  # fmt: skip
    if P > 1:
        _segment_fix[(*grid, B * Hkv * P)](r, end, zend, hkv, hk, ns, F, D, Hkv, L, P, **tiles, num_warps=warps)
    return hkv, hk


def dstates(fq, dy, zs, dlz, rho, state, case):
    """The reverse scan (`_chunk_dstates`) of the call `case` (chunk.Case): (dh, dz) of the states h_1.. (h_0's slot
    unused), and with an initial state its gradient (dh_0, dz_0) fp32, else (None, None); and rho's partial sums
    through the carries (DECAY) or None. state: the forward's (h, z) (chunk_h.states). Split over the sequence as the
    forward's scan is (`plan`): then `_dstates_fix` adds what the later segments carry into each segment, and fp32
    scratch of B x Hkv x segments x F x (D + 1) holds the segments' sums."""
    hkv, hk = state
    B, Hkv, ns, F, D = hkv.shape
    H, T = fq.shape[1], fq.shape[2]
    cfg = case.cfg
    bf, bdv = min(cfg["dstates_block_f"], pow2(F)), min(cfg["dstates_block_dv"], pow2(D))
    blocks = (triton.cdiv(F, bf), triton.cdiv(D, bdv))
    per_sm = resident(cfg["dstates_warps"], cfg.get("dstates_maxnreg"))
    L, P = _segments(ns, plan(blocks[0] * blocks[1] * B * Hkv, ns, _sms(fq), per_sm=per_sm))
    grid = (*blocks, B * Hkv * P)
    f32 = dict(dtype=torch.float32, device=fq.device)
    dhkv, dhk = torch.empty_like(hkv), torch.empty_like(hk)
    dh0, dz0 = (torch.empty(B, Hkv, F, D, **f32), torch.empty(B, Hkv, F, **f32)) if case.has_init else (dhk, dhk)
    rscan = torch.zeros(grid[0] * grid[1] * grid[2], **f32) if case.decay else None
    end = zend = dhk  # (unused without a split)
    if P > 1:
        end, zend = torch.empty(B * Hkv, P, F, D, **f32), torch.empty(B * Hkv, P, F, **f32)
    r = hk if rho is None else rho
    rs = dhk if rscan is None else rscan
    tiles = dict(DECAY=case.decay, CHUNK=CHUNK, BLOCK_F=bf, BLOCK_DV=bdv, HAS_INIT=case.has_init)
    _chunk_dstates[grid](
        fq, dy, zs, dlz, r, hkv, hk, dhkv, dhk, dh0, dz0, rs, end, zend,
        T, H, H // Hkv, D, F, ns, Hkv, case.window, case.nb, L, P, DT=case.dt, PREC=case.prec, **tiles,
        num_warps=cfg["dstates_warps"], **regs(cfg, "dstates"),
    )  # fmt: skip
    if P > 1:
        _dstates_fix[grid](r, end, zend, hkv, hk, dhkv, dhk, dh0, dz0, rs, ns, F, D, Hkv, L, P, **tiles,
                           num_warps=cfg["dstates_warps"])  # fmt: skip
    init = (dh0, dz0) if case.has_init else (None, None)
    return (dhkv, dhk), init, rscan
