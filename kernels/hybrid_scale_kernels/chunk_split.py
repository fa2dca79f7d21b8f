"""The chunked prefill's state scan split over the sequence, for when (feature blocks) x (value blocks) x B x Hkv
programs are fewer than the GPU's SMs (a small model, few KV heads, batch 1) or the scan is long: chunk_prefill.py's
`_chunk_states` walks all T / 64 chunks one after another in each program, so at 16k tokens it is 256 dependent
steps however many SMs are idle.

The scan's state before chunk c is h_c = sum over the LA keys j < 64 c of alpha^(64 c - 1 - j) phi_k(k_j) v_j^T (and
z_c the same sum of phi_k(k_j)); it is linear in the keys, so the chunks are cut into P segments of L chunks and, for
chunk c of segment p (which starts at chunk c0),

    h_c = alpha^(64 (c - c0)) h_{c0} + l_c,    l_c = the same sum over the keys 64 c0 <= j < 64 c only.

Three launches:
  * `_segment_states`, one program per (feature block, value block, batch x KV head x segment): the scan of its own
    segment from zero, storing l_c for each of its chunks and its segment's whole sum (l at its end) in fp32;
  * `_segment_starts`, one program per (feature block, value block, batch x KV head): walks the P segments only,
    h_{c0(p+1)} = alpha^(64 L_p) h_{c0(p)} + l_end(p), storing each segment's start state (fp32);
  * `_segment_fix`, the grid of the first: adds alpha^(64 (c - c0)) h_{c0} to every l_c of its segment (segment 0
    starts at zero: nothing to add).
The result is what `_chunk_states` stores (h in its dtype, z in fp32), to rounding (the sums are taken in another
order); tests/unit/test_chunk_split.py checks it against `_chunk_states` and `plan` picks P.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # the chunked prefill's chunk (chunk_prefill.CHUNK)


@triton.jit
def _segment_states(
    FK, V, RHO, HKV, HK, END, ZEND,  # phi_k [B,Hkv,T,F], v [B,Hkv,T,D], rho [Hkv]; h, z out; segment sums (fp32)
    T, F, D, NS, Hkv, n_excl, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """l_c for the chunks of one segment (keys n_excl <= j, from the segment's first key), and the segment's sum."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    pid = tl.program_id(2)
    bh = pid // P
    seg = pid % P
    base = bh.to(tl.int64)
    of = f0 + tl.arange(0, BLOCK_F)
    od = d0 + tl.arange(0, BLOCK_DV)
    both = (of < F)[:, None] & (od < D)[None, :]
    z_lim = tl.where(tl.program_id(1) == 0, F, 0)  # (z: by the first value block's programs only)
    h = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_F], tl.float32)
    if DECAY:
        rho = tl.load(RHO + bh % Hkv).to(tl.float32)
        carry = tl.exp(-rho * CHUNK)
    c0 = seg * L
    c1 = tl.minimum(c0 + L, NS)
    for c in range(c0, c1):
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
    sp = base * P + seg
    tl.store(END + (sp * F + of)[:, None] * D + od[None, :], h, mask=both)
    tl.store(ZEND + sp * F + of, z, mask=of < z_lim)


@triton.jit
def _segment_starts(
    RHO, END, ZEND, START, ZSTART, NS, F, D, Hkv, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The state at each segment's first chunk: h_{c0(p+1)} = alpha^(CHUNK L_p) h_{c0(p)} + l_end(p)."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    bh = tl.program_id(2)
    base = bh.to(tl.int64)
    of = f0 + tl.arange(0, BLOCK_F)
    od = d0 + tl.arange(0, BLOCK_DV)
    both = (of < F)[:, None] & (od < D)[None, :]
    z_lim = tl.where(tl.program_id(1) == 0, F, 0)
    h = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_F], tl.float32)
    if DECAY:
        rho = tl.load(RHO + bh % Hkv).to(tl.float32)
    for seg in range(0, P):
        sp = base * P + seg
        tl.store(START + (sp * F + of)[:, None] * D + od[None, :], h, mask=both)
        tl.store(ZSTART + sp * F + of, z, mask=of < z_lim)
        if DECAY:
            n = tl.minimum(L, NS - seg * L)  # chunks in this segment
            carry = tl.exp(-rho * (CHUNK * n).to(tl.float32))
            h = h * carry
            z = z * carry
        h += tl.load(END + (sp * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)
        z += tl.load(ZEND + sp * F + of, mask=of < z_lim, other=0.0)


@triton.jit
def _segment_fix(
    RHO, START, ZSTART, HKV, HK, NS, F, D, Hkv, L, P,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """h_c = alpha^(CHUNK (c - c0)) h_{c0} + l_c for the chunks of one segment (segment 0: nothing to add)."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    pid = tl.program_id(2)
    bh = pid // P
    seg = pid % P
    if seg > 0:
        base = bh.to(tl.int64)
        of = f0 + tl.arange(0, BLOCK_F)
        od = d0 + tl.arange(0, BLOCK_DV)
        both = (of < F)[:, None] & (od < D)[None, :]
        z_lim = tl.where(tl.program_id(1) == 0, F, 0)
        sp = base * P + seg
        h0 = tl.load(START + (sp * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)
        z0 = tl.load(ZSTART + sp * F + of, mask=of < z_lim, other=0.0)
        if DECAY:
            rho = tl.load(RHO + bh % Hkv).to(tl.float32)
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


def plan(programs: int, chunks: int, sms: int, least: int = 8) -> int:
    """Segments to cut a scan of `chunks` chunks into, given `programs` programs without a split and `sms` SMs:
    enough that programs x segments fills the SMs twice, none shorter than `least` chunks; 1 = no split."""
    if programs >= sms or chunks < 2 * least:
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, chunks // least))


def split_states(fk, v, rho, n_excl, ns, hkv, hk, *, segments, block_f, block_dv, warps, dt, prec):
    """Fill hkv [B, Hkv, ns, F, D] and hk [B, Hkv, ns, F] as chunk_prefill's `_chunk_states` does, with the scan cut
    into `segments` segments (three launches; fp32 scratch of 2 x B x Hkv x segments x F x (D + 1))."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    P = max(1, min(int(segments), ns))
    L = -(-ns // P)
    P = -(-ns // L)  # (no empty segment)
    scratch = dict(dtype=torch.float32, device=fk.device)
    end, zend = torch.empty(B * Hkv, P, F, D, **scratch), torch.empty(B * Hkv, P, F, **scratch)
    start, zstart = torch.empty_like(end), torch.empty_like(zend)
    r = hk if rho is None else rho
    grid = (triton.cdiv(F, block_f), triton.cdiv(D, block_dv))
    tiles = dict(DECAY=rho is not None, CHUNK=CHUNK, BLOCK_F=block_f, BLOCK_DV=block_dv)
    _segment_states[(*grid, B * Hkv * P)](
        fk, v, r, hkv, hk, end, zend, T, F, D, ns, Hkv, n_excl, L, P, **tiles, DT=dt, PREC=prec, num_warps=warps
    )
    _segment_starts[(*grid, B * Hkv)](r, end, zend, start, zstart, ns, F, D, Hkv, L, P, **tiles, num_warps=warps)
    _segment_fix[(*grid, B * Hkv * P)](r, start, zstart, hkv, hk, ns, F, D, Hkv, L, P, **tiles, num_warps=warps)
    return hkv, hk
