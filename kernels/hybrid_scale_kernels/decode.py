"""Fused decode step: one new token per row attends to the ring buffer, the sinks and the LA state, and updates them.

One program per (batch row, KV head) serves the G query heads of that KV head. With p = the row's real tokens seen
so far (the new token's real index) and R ring slots, slot r holds real token p-1 - ((p-1-r) mod R):
  * every ring key in the window (index > p - w) and the new key are softmax terms (online max over ring blocks);
  * a ring key that is no longer in the window (the one in slot p mod R once p >= R = w) and the fp32 state are
    LA terms (hybrid), or every key is (la_only);
  * the sink buffer (the first S keys, values and phi_k) gives swa_sinks / sinks_only their sink terms, and the
    hybrid with its sinks its gamma-weighted sink terms (its LA leaves the sinks out, so a ring key that is a sink is
    no LA term); the state never holds the first S keys, so la_only and the hybrid without sinks take the LA terms of
    those that have left the ring (index <= p-1-R) from the sink buffer (an addition: no cancellation);
then, after a barrier, the key in slot p mod R (if any, and not a sink) is folded into the state, the new
key/value/phi_k take its slot, and a new key with p < S is written to the sinks (key, value and phi_k). Rows whose new
token is padding are left untouched (output 0).
With a decay of the LA (rho per KV head, alpha = exp(-rho)) every L term of key j counts alpha^max(0, p - w - j), and
the state keeps its sums as the last token seen (p - 1) sees them: the new token reads them times alpha, and the
update multiplies them by alpha once (one multiply per KV head) before folding the evicted key in as p sees it.
The state is the same object `hybrid_scale.attention.recurrent.DecodeState` keeps (duck-typed here: this package
does not import the attention package); the result equals `recurrent.extend` on one token.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .jit_helpers import _EPS, MODES, mode_parts


@triton.jit
def _decode(
    Q, K, V, FQ, FK, GAMMA, RHO,
    RING_K, RING_V, RING_FK, SINK_K, SINK_V, SINK_FK, KV, KSUM, COUNT, REAL,  # (the state, updated in place)
    Y,
    H, G, D, F, R, S, window, lin_off, sink_off, n_sinks, scale,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_FS: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr,
    HYBRID: tl.constexpr, LA_ONLY: tl.constexpr, SINKS_ONLY: tl.constexpr, DECAY: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    Hkv = H // G
    b = pid // Hkv
    hk = pid % Hkv
    real = tl.load(REAL + b) != 0
    p = tl.load(COUNT + b).to(tl.int32)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    of = tl.arange(0, BLOCK_F)
    gm = og < G
    dm = od < D
    fm = of < F
    heads = (b * H + hk * G + og).to(tl.int64)
    q = tl.load(Q + heads[:, None] * D + od[None, :], mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    k_new = tl.load(K + pid.to(tl.int64) * D + od, mask=dm, other=0.0).to(tl.float32)
    v_new = tl.load(V + pid.to(tl.int64) * D + od, mask=dm, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    num_e = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    den_e = tl.zeros([BLOCK_G], tl.float32)
    num_l = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    den_l = tl.zeros([BLOCK_G], tl.float32)
    if DECAY:
        rho = tl.load(RHO + hk).to(tl.float32)
    if LIN:
        fq = tl.load(FQ + heads[:, None] * F + of[None, :], mask=gm[:, None] & fm[None, :], other=0.0)
        fq = fq.to(tl.float32)
        fk_new = tl.load(FK + pid.to(tl.int64) * F + of, mask=fm, other=0.0).to(tl.float32)
    if SOFT:  # the new key: always in its own window
        m_i = tl.sum(q * k_new[None, :], 1) * scale
        den_e = tl.full([BLOCK_G], 1.0, tl.float32)
        num_e = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new[None, :]
    if LA_ONLY:  #: the new key is an LA term
        s_new = tl.sum(fq * fk_new[None, :], 1)
        num_l += s_new[:, None] * v_new[None, :]
        den_l += s_new
    ring = pid.to(tl.int64) * R
    if SOFT or LIN:
        for r0 in range(0, R, BLOCK_N):
            slot = r0 + tl.arange(0, BLOCK_N)
            pos = p - 1 - (((p - 1 - slot) % R + R) % R)  # % truncates in Triton: made non-negative
            ok = (slot < R) & (pos >= 0)
            kr = tl.load(RING_K + (ring + slot)[:, None] * D + od[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
            vr = tl.load(RING_V + (ring + slot)[:, None] * D + od[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
            vr = vr.to(tl.float32)
            if SOFT:
                a = tl.sum(q[:, None, :] * kr.to(tl.float32)[None, :, :], 2) * scale
                a = tl.where((ok & (pos > p - window))[None, :], a, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(a, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                e = tl.exp(a - m_safe[:, None])
                num_e = num_e * alpha[:, None] + tl.sum(e[:, :, None] * vr[None, :, :], 1)
                den_e = den_e * alpha + tl.sum(e, 1)
                m_i = m_new
            if LIN:
                fr = tl.load(
                    RING_FK + (ring + slot)[:, None] * F + of[None, :], mask=ok[:, None] & fm[None, :], other=0.0
                )
                s = tl.sum(fq[:, None, :] * fr.to(tl.float32)[None, :, :], 2)
                s = tl.where((ok & (pos <= p - lin_off) & (pos >= n_sinks))[None, :], s, 0.0)
                if DECAY:
                    s = s * tl.exp(-rho * tl.maximum(p - window - pos, 0).to(tl.float32))[None, :]
                num_l += tl.sum(s[:, :, None] * vr[None, :, :], 1)
                den_l += tl.sum(s, 1)
    if SINKS:
        sj = tl.arange(0, BLOCK_S)
        ok = (sj < n_sinks) & (sj < p) & (sj <= p - sink_off)
        sptr = (pid.to(tl.int64) * S + sj)[:, None] * D + od[None, :]
        sk = tl.load(SINK_K + sptr, mask=ok[:, None] & dm[None, :], other=0.0)
        sv = tl.load(SINK_V + sptr, mask=ok[:, None] & dm[None, :], other=0.0)
        a = tl.sum(q[:, None, :] * sk.to(tl.float32)[None, :, :], 2) * scale
        a = tl.where(ok[None, :], a, float("-inf"))
        if SINKS_ONLY:  #: the new token is a sink while p < S
            a_new = tl.sum(q * k_new[None, :], 1) * scale
            a_new = tl.where(p < n_sinks, a_new, float("-inf"))
            m_new = tl.maximum(tl.max(a, 1), a_new)
        else:
            m_new = tl.maximum(m_i, tl.max(a, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(a - m_safe[:, None])
        if SINKS_ONLY:
            e_new = tl.exp(a_new - m_safe)
            num_e = tl.sum(e[:, :, None] * sv.to(tl.float32)[None, :, :], 1) + e_new[:, None] * v_new[None, :]
            den_e = tl.sum(e, 1) + e_new
        else:
            alpha = tl.exp(m_i - m_safe)
            num_e = num_e * alpha[:, None] + tl.sum(e[:, :, None] * sv.to(tl.float32)[None, :, :], 1)
            den_e = den_e * alpha + tl.sum(e, 1)
    if LIN and not SINKS:  # (la_only, the hybrid without sinks) the first S keys that have left the ring are LA terms
        sj = tl.arange(0, BLOCK_S)
        folded = (sj < S) & (sj <= p - 1 - R)  # (kept in the sink buffer, never folded into the state)
        ofs = tl.arange(0, BLOCK_FS)
        s_l = tl.zeros([BLOCK_G, BLOCK_S], tl.float32)
        for f0 in range(0, F, BLOCK_FS):
            ff = f0 + ofs
            fqb = tl.load(FQ + heads[:, None] * F + ff[None, :], mask=gm[:, None] & (ff < F)[None, :], other=0.0)
            fptr = (pid.to(tl.int64) * S + sj)[:, None] * F + ff[None, :]
            fks = tl.load(SINK_FK + fptr, mask=folded[:, None] & (ff < F)[None, :], other=0.0)
            s_l += tl.sum(fqb.to(tl.float32)[:, None, :] * fks.to(tl.float32)[None, :, :], 2)
        sptr = (pid.to(tl.int64) * S + sj)[:, None] * D + od[None, :]
        sv = tl.load(SINK_V + sptr, mask=folded[:, None] & dm[None, :], other=0.0).to(tl.float32)
        if DECAY:
            s_l = s_l * tl.exp(-rho * tl.maximum(p - window - sj, 0).to(tl.float32))[None, :]
        num_l += tl.sum(s_l[:, :, None] * sv[None, :, :], 1)
        den_l += tl.sum(s_l, 1)
    evict = (p >= R) & (p - R >= S)  # a key leaving the ring is folded into the state unless it is a sink
    e_slot = p % R
    if LIN:  # the state (before this step's fold: the evicted key was counted from the ring above)
        ofs = tl.arange(0, BLOCK_FS)
        for f0 in range(0, F, BLOCK_FS):
            ff = f0 + ofs
            fok = ff < F
            fqb = tl.load(FQ + heads[:, None] * F + ff[None, :], mask=gm[:, None] & fok[None, :], other=0.0)
            fqb = fqb.to(tl.float32)
            if DECAY:  # (the state as token p - 1 sees it)
                fqb = fqb * tl.exp(-rho)
            st = pid.to(tl.int64) * F + ff
            kv = tl.load(KV + st[:, None] * D + od[None, :], mask=fok[:, None] & dm[None, :], other=0.0)
            ks = tl.load(KSUM + st, mask=fok, other=0.0)
            num_l += tl.sum(fqb[:, :, None] * kv[None, :, :], 1)
            den_l += tl.sum(fqb * ks[None, :], 1)
    if HYBRID:
        g = tl.load(GAMMA + hk * G + og, mask=gm, other=1.0).to(tl.float32)
    else:
        g = tl.full([BLOCK_G], 1.0, tl.float32)
    y = (g[:, None] * num_e + num_l) / (g * den_e + den_l + _EPS)[:, None]
    y = tl.where(real, y, 0.0)
    tl.store(Y + heads[:, None] * D + od[None, :], y.to(Y.dtype.element_ty), mask=gm[:, None] & dm[None, :])

    tl.debug_barrier()  # every read of the old ring and state is done
    if real:
        e_ptr = ring + e_slot
        if DECAY:  # the state moves on to token p (alpha once), and the key leaving the ring joins it as p sees it
            ve = tl.load(RING_V + e_ptr * D + od, mask=dm, other=0.0).to(tl.float32)
            ofs = tl.arange(0, BLOCK_FS)
            carry = tl.exp(-rho)
            fold = tl.exp(-rho * tl.maximum(R - window, 0).to(tl.float32))
            for f0 in range(0, F, BLOCK_FS):
                ff = f0 + ofs
                fok = ff < F
                fe = tl.load(RING_FK + e_ptr * F + ff, mask=fok, other=0.0).to(tl.float32)
                fe = tl.where(evict, fe * fold, 0.0)  # (nothing leaves the ring yet: the state only moves on)
                st = pid.to(tl.int64) * F + ff
                kv = tl.load(KV + st[:, None] * D + od[None, :], mask=fok[:, None] & dm[None, :], other=0.0)
                both = fok[:, None] & dm[None, :]
                tl.store(KV + st[:, None] * D + od[None, :], kv * carry + fe[:, None] * ve[None, :], mask=both)
                ks = tl.load(KSUM + st, mask=fok, other=0.0)
                tl.store(KSUM + st, ks * carry + fe, mask=fok)
        elif evict:  # fold the key leaving the ring into the LA state (every mode keeps the state; sinks stay out)
            ve = tl.load(RING_V + e_ptr * D + od, mask=dm, other=0.0).to(tl.float32)
            ofs = tl.arange(0, BLOCK_FS)
            for f0 in range(0, F, BLOCK_FS):
                ff = f0 + ofs
                fok = ff < F
                fe = tl.load(RING_FK + e_ptr * F + ff, mask=fok, other=0.0).to(tl.float32)
                st = pid.to(tl.int64) * F + ff
                kv = tl.load(KV + st[:, None] * D + od[None, :], mask=fok[:, None] & dm[None, :], other=0.0)
                both = fok[:, None] & dm[None, :]
                tl.store(KV + st[:, None] * D + od[None, :], kv + fe[:, None] * ve[None, :], mask=both)
                ks = tl.load(KSUM + st, mask=fok, other=0.0)
                tl.store(KSUM + st, ks + fe, mask=fok)
        tl.debug_barrier()
        tl.store(RING_K + e_ptr * D + od, k_new.to(RING_K.dtype.element_ty), mask=dm)
        tl.store(RING_V + e_ptr * D + od, v_new.to(RING_V.dtype.element_ty), mask=dm)
        fnew = tl.load(FK + pid.to(tl.int64) * F + of, mask=fm, other=0.0)
        tl.store(RING_FK + e_ptr * F + of, fnew.to(RING_FK.dtype.element_ty), mask=fm)
        if p < S:
            s_ptr = pid.to(tl.int64) * S + p
            tl.store(SINK_K + s_ptr * D + od, k_new.to(SINK_K.dtype.element_ty), mask=dm)
            tl.store(SINK_V + s_ptr * D + od, v_new.to(SINK_V.dtype.element_ty), mask=dm)
            tl.store(SINK_FK + s_ptr * F + of, fnew.to(SINK_FK.dtype.element_ty), mask=fm)


PRODUCT = 4096  # elements of the [G, slots, D or F] products one loop step holds in registers (4 warps: 32 each)


def _slots(width: int) -> int:
    """Ring slots (or state features) per loop step: the most, up to 16, whose products with `width` = G x D (or
    G x F) elements per slot stay within PRODUCT (checked without spills by benchmarks/kernel_compile.py)."""
    return max(1, min(16, PRODUCT // width))


def triton_decode_step(
    state, q, k, v, fq, fk, gamma, *, window, mode="hybrid", sinks=8, hybrid_sinks=False, attention_mask=None,
    scale=None, block=None, la_decay=None,
):  # fmt: skip
    """One token per row (q [B,H,1,D], k/v [B,Hkv,1,D], fq, fk), the contract of recurrent.extend for T = 1: returns
    y [B,H,1,D] and advances `state` (a recurrent.DecodeState) in place. la_decay: rho [Hkv], the LA's decay (None =
    off). Returns None when the step is not one the kernel takes (then the caller runs recurrent.extend)."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode '{mode}'; available: {', '.join(MODES)}")
    B, H, T, D = q.shape
    if T != 1 or mode == "none" or v.shape[-1] != D or window != state.window or sinks != state.sink_k.shape[2]:
        return None
    real = torch.ones(B, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask[:, 0].bool()
    # no host sync (CUDA graphs can capture the step): the ring size comes from the positions seen, a host count that
    # bounds every row's real tokens (count <= seen), not from the count itself
    needed = state.seen + 1
    if needed > state.capacity and state.capacity < window:
        return None  # past the cache's max_length: the caller's extend raises its error
    if needed > state.ring and state.ring < state.capacity:
        state.grow(min(state.capacity, max(needed, 2 * state.ring)))
    soft, lin, sink, hybrid = mode_parts(mode, hybrid_sinks)
    Hkv = k.shape[1]
    F = fk.shape[-1]
    y = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    # the state keeps its sums as its last token sees them in every mode (the mode can change between calls), so a
    # decayed state moves on with every token, whatever the mode (recurrent.extend does the same)
    decay = la_decay is not None
    rho = la_decay.detach().float().contiguous() if decay else gamma.detach().float()
    bg, bd, bf = max(1, triton.next_power_of_2(H // Hkv)), triton.next_power_of_2(D), triton.next_power_of_2(F)
    for name in ("k", "v", "fk", "sink_k", "sink_v", "sink_fk", "kv", "ksum"):
        setattr(state, name, getattr(state, name).contiguous())
    _decode[(B * Hkv,)](
        q.contiguous(), k.contiguous(), v.contiguous(), fq.contiguous(), fk.contiguous(),
        gamma.detach().float().contiguous(), rho, state.k, state.v, state.fk, state.sink_k, state.sink_v, state.sink_fk,
        state.kv, state.ksum, state.count, real.to(torch.int8), y,
        H, H // Hkv, D, F, state.ring, state.sink_k.shape[2], int(window), int(window) if mode == "hybrid" else 0,
        int(window) if soft and sink else 0, int(sinks) if sink else 0,
        1.0 / math.sqrt(D) if scale is None else float(scale),
        BLOCK_G=bg, BLOCK_N=_slots(bg * max(bd, bf)), BLOCK_D=bd, BLOCK_F=bf, BLOCK_FS=_slots(bg * bd),
        BLOCK_S=max(2, triton.next_power_of_2(max(1, state.sink_k.shape[2]))),
        SOFT=soft, LIN=lin, SINKS=sink, HYBRID=hybrid, LA_ONLY=mode == "la_only", SINKS_ONLY=mode == "sinks_only",
        DECAY=decay,
        num_warps=4, maxnreg=255,  # ptxas otherwise caps some modes at 80-96 registers and spills
    )  # fmt: skip
    state.count = state.count + real.long()
    state.seen += 1
    return y
