"""Fused decode step: one new token per row attends to the ring buffer, the sinks and the LA state, and updates them,
in one launch with no torch op around it (so a CUDA graph of a model's decode step holds one node per layer).

One program per (batch row, KV head, block of the value dim) serves the G query heads of that KV head: the state
split over its value dim gives B x Hkv x NSPLIT programs (64 at Llama-3-8B's B = 1, 8 KV heads, head dim 128: the
state read, the step's main traffic, is spread over that many SMs). Each program computes the scores over the whole
head dim and the feature dim (recomputed per block: a few kFLOP) and the output, numerators and LA state of its own
value block. With p = the row's real tokens seen so far (the new token's real index) and R ring slots, slot r holds
real token p-1 - ((p-1-r) mod R):
  * every ring key in the window (index > p - w) and the new key are softmax terms (online max over ring blocks);
  * a ring key that is no longer in the window (the one in slot p mod R once p >= R = w) and the fp32 state are
    LA terms (hybrid), or every key is (la_only);
  * the sink buffer (the first S keys, values and phi_k) gives swa_sinks / sinks_only their sink terms, and the
    hybrid with its sinks its gamma-weighted sink terms (its LA leaves the sinks out, so a ring key that is a sink is
    no LA term); the state never holds the first S keys, so la_only and the hybrid without sinks take the LA terms of
    those that have left the ring (index <= p-1-R) from the sink buffer (an addition: no cancellation);
then the state moves on, in place: each program folds the key leaving the ring (slot p mod R, if any, and not a sink)
into its value block of the state and writes its value block of the new value (ring and sinks); what every program
of a (row, KV head) reads -- the ring's keys and phi_k, the sinks' keys and phi_k, the key sum of the state -- is
written by the last of them to finish reading (an atomic count per (row, KV head), acquire-release), and the row's
real-token count and the position count by the last program of the row (a count per row). The counts are back at 0
after every step. Rows whose new token is padding are left untouched (output 0).
With a decay of the LA (rho per KV head, alpha = exp(-rho)) every L term of key j counts alpha^max(0, p - w - j), and
the state keeps its sums as the last token seen (p - 1) sees them: the new token reads them times alpha, and the
update multiplies them by alpha once (one multiply per KV head) before folding the evicted key in as p sees it.
The state is the same object `hybrid_scale.attention.window.recurrent.DecodeState` keeps (duck-typed here: this package
does not import the attention package); the result equals `recurrent.extend` on one token.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .utils import MODES, TL_EPS, mode_parts, options


@triton.jit
def _decode(
    Q, K, V, FQ, FK, GAMMA, RHO, MASK,
    RING_K, RING_V, RING_FK, SINK_K, SINK_V, SINK_FK, KV, KSUM, COUNT, SEEN, LOCK,  # (the state, updated in place)
    Y,
    B, H, G, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr, S, window, lin_off, sink_off, n_sinks, scale,
    NSPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_FS: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, LA_ONLY: tl.constexpr,
    SINKS_ONLY: tl.constexpr, DECAY: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    Hkv = H // G
    bh = pid // NSPLIT  # (row, KV head)
    part = pid % NSPLIT  # the block of the value dim
    b = bh // Hkv
    hk = bh % Hkv
    if HAS_MASK:
        real = tl.load(MASK + b) != 0
    else:
        real = b >= 0
    p = tl.load(COUNT + b).to(tl.int32)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    ov = part * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's value columns
    of = tl.arange(0, BLOCK_F)
    gm = og < G
    dm = od < D
    vm = ov < D
    fm = of < F
    heads = (b * H + hk * G + og).to(tl.int64)
    row = bh.to(tl.int64)
    q = tl.load(Q + heads[:, None] * D + od[None, :], mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    k_new = tl.load(K + row * D + od, mask=dm, other=0.0).to(tl.float32)
    v_new = tl.load(V + row * D + ov, mask=vm, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    num_e = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    den_e = tl.zeros([BLOCK_G], tl.float32)
    num_l = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    den_l = tl.zeros([BLOCK_G], tl.float32)
    if DECAY:
        rho = tl.load(RHO + hk).to(tl.float32)
    if LIN:
        fq = tl.load(FQ + heads[:, None] * F + of[None, :], mask=gm[:, None] & fm[None, :], other=0.0)
        fq = fq.to(tl.float32)
        fk_new = tl.load(FK + row * F + of, mask=fm, other=0.0).to(tl.float32)
    if SOFT:  # the new key: always in its own window
        m_i = tl.sum(q * k_new[None, :], 1) * scale
        den_e = tl.full([BLOCK_G], 1.0, tl.float32)
        num_e = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32) + v_new[None, :]
    if LA_ONLY:  #: the new key is an LA term
        s_new = tl.sum(fq * fk_new[None, :], 1)
        num_l += s_new[:, None] * v_new[None, :]
        den_l += s_new
    ring = row * R
    if SOFT or LIN:
        for r0 in range(0, R, BLOCK_N):
            slot = r0 + tl.arange(0, BLOCK_N)
            pos = p - 1 - (((p - 1 - slot) % R + R) % R)  # % truncates in Triton: made non-negative
            ok = (slot < R) & (pos >= 0)
            vr = tl.load(RING_V + (ring + slot)[:, None] * D + ov[None, :], mask=ok[:, None] & vm[None, :], other=0.0)
            vr = vr.to(tl.float32)
            if SOFT:
                kr = tl.load(
                    RING_K + (ring + slot)[:, None] * D + od[None, :], mask=ok[:, None] & dm[None, :], other=0.0
                )
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
        sk = tl.load(SINK_K + (row * S + sj)[:, None] * D + od[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        sv = tl.load(SINK_V + (row * S + sj)[:, None] * D + ov[None, :], mask=ok[:, None] & vm[None, :], other=0.0)
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
            fptr = (row * S + sj)[:, None] * F + ff[None, :]
            fks = tl.load(SINK_FK + fptr, mask=folded[:, None] & (ff < F)[None, :], other=0.0)
            s_l += tl.sum(fqb.to(tl.float32)[:, None, :] * fks.to(tl.float32)[None, :, :], 2)
        sptr = (row * S + sj)[:, None] * D + ov[None, :]
        sv = tl.load(SINK_V + sptr, mask=folded[:, None] & vm[None, :], other=0.0).to(tl.float32)
        if DECAY:
            s_l = s_l * tl.exp(-rho * tl.maximum(p - window - sj, 0).to(tl.float32))[None, :]
        num_l += tl.sum(s_l[:, :, None] * sv[None, :, :], 1)
        den_l += tl.sum(s_l, 1)
    if LIN:  # the state (before this step's fold: the evicted key was counted from the ring above)
        ofs = tl.arange(0, BLOCK_FS)
        for f0 in range(0, F, BLOCK_FS):
            ff = f0 + ofs
            fok = ff < F
            fqb = tl.load(FQ + heads[:, None] * F + ff[None, :], mask=gm[:, None] & fok[None, :], other=0.0)
            fqb = fqb.to(tl.float32)
            if DECAY:  # (the state as token p - 1 sees it)
                fqb = fqb * tl.exp(-rho)
            st = row * F + ff
            kv = tl.load(KV + st[:, None] * D + ov[None, :], mask=fok[:, None] & vm[None, :], other=0.0)
            ks = tl.load(KSUM + st, mask=fok, other=0.0)
            num_l += tl.sum(fqb[:, :, None] * kv[None, :, :], 1)
            den_l += tl.sum(fqb * ks[None, :], 1)
    if HYBRID:
        g = tl.load(GAMMA + hk * G + og, mask=gm, other=1.0).to(tl.float32)
    else:
        g = tl.full([BLOCK_G], 1.0, tl.float32)
    y = (g[:, None] * num_e + num_l) / (g * den_e + den_l + TL_EPS)[:, None]
    y = tl.where(real, y, 0.0)
    tl.store(Y + heads[:, None] * D + ov[None, :], y.to(Y.dtype.element_ty), mask=gm[:, None] & vm[None, :])

    # the state moves on: first this program's own value block (no other program reads it)
    tl.debug_barrier()  # every read of this block's old state and ring values is done
    evict = (p >= R) & (p - R >= S)  # a key leaving the ring is folded into the state unless it is a sink
    e_ptr = ring + p % R
    ofs = tl.arange(0, BLOCK_FS)
    if DECAY:  # the state moves on to token p (alpha once), and the key leaving the ring joins it as p sees it
        carry = tl.exp(-rho)
        fold = tl.exp(-rho * tl.maximum(R - window, 0).to(tl.float32))
    else:
        carry = 1.0
        fold = 1.0
    if real:
        ve = tl.load(RING_V + e_ptr * D + ov, mask=vm, other=0.0).to(tl.float32)
        for f0 in range(0, F, BLOCK_FS):
            ff = f0 + ofs
            fok = ff < F
            fe = tl.load(RING_FK + e_ptr * F + ff, mask=fok, other=0.0).to(tl.float32)
            fe = tl.where(evict, fe * fold, 0.0)  # (nothing leaves the ring yet: a decayed state only moves on)
            st = row * F + ff
            both = fok[:, None] & vm[None, :]
            kv = tl.load(KV + st[:, None] * D + ov[None, :], mask=both, other=0.0)
            tl.store(KV + st[:, None] * D + ov[None, :], kv * carry + fe[:, None] * ve[None, :], mask=both)
        tl.debug_barrier()
        tl.store(RING_V + e_ptr * D + ov, v_new.to(RING_V.dtype.element_ty), mask=vm)
        if p < S:
            tl.store(SINK_V + (row * S + p) * D + ov, v_new.to(SINK_V.dtype.element_ty), mask=vm)
    # then what every program of this (row, KV head) reads, by the last of them to finish reading
    tl.debug_barrier()
    if tl.atomic_add(LOCK + bh, 1) == NSPLIT - 1:
        if real:
            for f0 in range(0, F, BLOCK_FS):
                ff = f0 + ofs
                fok = ff < F
                fe = tl.load(RING_FK + e_ptr * F + ff, mask=fok, other=0.0).to(tl.float32)
                fe = tl.where(evict, fe * fold, 0.0)
                ks = tl.load(KSUM + row * F + ff, mask=fok, other=0.0)
                tl.store(KSUM + row * F + ff, ks * carry + fe, mask=fok)
            tl.debug_barrier()
            tl.store(RING_K + e_ptr * D + od, k_new.to(RING_K.dtype.element_ty), mask=dm)
            fnew = tl.load(FK + row * F + of, mask=fm, other=0.0)
            tl.store(RING_FK + e_ptr * F + of, fnew.to(RING_FK.dtype.element_ty), mask=fm)
            if p < S:
                s_ptr = row * S + p
                tl.store(SINK_K + s_ptr * D + od, k_new.to(SINK_K.dtype.element_ty), mask=dm)
                tl.store(SINK_FK + s_ptr * F + of, fnew.to(SINK_FK.dtype.element_ty), mask=fm)
        tl.atomic_xchg(LOCK + bh, 0)
        # and the row's counts, by the last (row, KV head) of the row
        if tl.atomic_add(LOCK + B * Hkv + b, 1) == Hkv - 1:
            tl.store(COUNT + b, (p + real.to(tl.int32)).to(COUNT.dtype.element_ty))
            if b == 0:
                tl.store(SEEN, tl.load(SEEN) + 1)
            tl.atomic_xchg(LOCK + B * Hkv + b, 0)


PRODUCT = 4096  # elements of the [G, slots, D or F] products one loop step holds in registers (4 warps: 32 each)
CTAS = 64  # programs a step aims at: the value dim is split until B x Hkv x NSPLIT reaches it (blocks of >= 16)


def _slots(width: int) -> int:
    """Ring slots (or state features) per loop step: the most, up to 16, whose products with `width` = G x D (or
    G x F) elements per slot stay within PRODUCT (checked without spills by tools/kernel_compile.py)."""
    return max(1, min(16, PRODUCT // width))


def nsplit(rows: int, head_dim: int) -> int:
    """Blocks of the value dim per (row, KV head): the fewest, a power of two, that give `rows` (= B x Hkv) x blocks
    >= CTAS programs, with blocks of at least 16 columns."""
    most = max(1, triton.next_power_of_2(head_dim) // 16)
    return min(most, triton.next_power_of_2(max(1, -(-CTAS // rows))))


def _lock(state, rows: int, batch: int) -> torch.Tensor:
    """The step's counts (one per (row, KV head), one per row; 0 between steps): the state's own (made with it, so
    that a compiled step finds them), or new ones for a state made before it had them."""
    lock = getattr(state, "lock", None)
    if lock is None or lock.numel() != rows + batch or lock.dtype != torch.int32:
        lock = state.lock = torch.zeros(rows + batch, dtype=torch.int32, device=state.count.device)
    return lock


def triton_decode_step(state, q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, la_decay=None, **given):
    """One token per row (q [B,H,1,D], k/v [B,Hkv,1,D], fq, fk), the contract of recurrent.extend for T = 1: returns
    y [B,H,1,D] and advances `state` (a recurrent.DecodeState) in place, in one launch (no other op: CUDA graphs
    capture it as one node). opts: the call's AttentionOptions (chunk.options); la_decay: rho [Hkv], the LA's decay
    (None = off). Returns None when the step is not one the kernel takes (then the caller runs recurrent.step or
    extend): not one token, mode none, a value dim other than the head dim, a state for another window or number of
    sinks, or a ring not yet at its capacity (a ring shorter than the window, a cache's max_length, serves only that
    many tokens: generate stops there)."""
    o = options(opts, given)
    mode, window, sinks, scale = o.mode, o.window, o.sinks, o.scale
    if mode not in MODES:
        raise ValueError(f"unknown attention mode '{mode}'; available: {', '.join(MODES)}")
    B, H, T, D = q.shape
    S = state.sink_k.shape[2]
    if (
        T != 1
        or mode == "none"
        or v.shape[-1] != D
        or window != state.window
        or sinks != S
        or state.ring != state.capacity
    ):
        return None
    state_tensors = (state.k, state.v, state.fk, state.sink_k, state.sink_v, state.sink_fk, state.kv, state.ksum,
                     state.count)  # fmt: skip
    if not all(t.is_contiguous() for t in state_tensors):
        return None  # (written in place: a copy would not be the state)
    # (no-ops for a model's own one-token q, k, v, phi and mask, which are contiguous: no launch but the kernel's)
    q, k, v, fq, fk, gamma = (t.contiguous() for t in (q, k, v, fq, fk, gamma))
    la_decay = None if la_decay is None else la_decay.contiguous()
    attention_mask = None if attention_mask is None else attention_mask.contiguous()
    lock = _lock(state, B * k.shape[1], B)
    return torch.ops.hybrid_scale_kernels.decode_step(
        q, k, v, fq, fk, gamma.detach(), None if la_decay is None else la_decay.detach(), attention_mask,
        state.k, state.v, state.fk, state.sink_k, state.sink_v, state.sink_fk, state.kv, state.ksum, state.count,
        state.seen, lock, int(window), mode, int(sinks), bool(o.hybrid_sinks), 1.0 / math.sqrt(D) if scale is None else
        float(scale),
    )  # fmt: skip


# The launch as a torch operator that says what it writes: torch.compile keeps it as one opaque node (it neither
# traces the kernel nor reorders the state's writes) and CUDA graphs capture it as one kernel.
_STATE = (
    "Tensor(a!) ring_k, Tensor(b!) ring_v, Tensor(c!) ring_fk, Tensor(d!) sink_k, Tensor(e!) sink_v, "
    "Tensor(f!) sink_fk, Tensor(g!) kv, Tensor(h!) ksum, Tensor(i!) count, Tensor(j!) seen, Tensor(k!) lock"
)
_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor fq, Tensor fk, Tensor gamma, Tensor? rho, Tensor? mask, " + _STATE \
    + ", int window, str attention_mode, int sinks, bool hybrid_sinks, float scale) -> Tensor"  # fmt: skip
_OUT = ("ring_k", "ring_v", "ring_fk", "sink_k", "sink_v", "sink_fk", "kv", "ksum", "count", "seen", "lock")


@torch.library.custom_op("hybrid_scale_kernels::decode_step", mutates_args=_OUT, schema=_SCHEMA)
def _decode_step(
    q, k, v, fq, fk, gamma, rho, mask, ring_k, ring_v, ring_fk, sink_k, sink_v, sink_fk, kv, ksum, count, seen, lock,
    window, attention_mode, sinks, hybrid_sinks, scale,
):  # fmt: skip
    mode = attention_mode  # ("mode" is a keyword of torch's own dispatch)
    soft, lin, sink, hybrid = mode_parts(mode, hybrid_sinks)
    B, H, _, D = q.shape
    Hkv, F, R, S = k.shape[1], fk.shape[-1], ring_k.shape[2], sink_k.shape[2]
    split = nsplit(B * Hkv, D)
    y = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    # the state keeps its sums as its last token sees them in every mode (the mode can change between calls), so a
    # decayed state moves on with every token, whatever the mode (recurrent.extend does the same)
    bg, bd, bf = max(1, triton.next_power_of_2(H // Hkv)), triton.next_power_of_2(D), triton.next_power_of_2(F)
    bdv = bd // split
    _decode[(B * Hkv * split,)](
        q, k, v, fq, fk, gamma, gamma if rho is None else rho, count if mask is None else mask,
        ring_k, ring_v, ring_fk, sink_k, sink_v, sink_fk, kv, ksum, count, seen, lock, y,
        B, H, H // Hkv, D, F, R, S, window, window if mode == "hybrid" else 0, window if soft and sink else 0,
        sinks if sink else 0, scale,
        NSPLIT=split, BLOCK_G=bg, BLOCK_N=_slots(bg * max(bd, bf)), BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_F=bf,
        BLOCK_FS=_slots(bg * bdv), BLOCK_S=max(2, triton.next_power_of_2(max(1, S))),
        SOFT=soft, LIN=lin, SINKS=sink, HYBRID=hybrid, LA_ONLY=mode == "la_only", SINKS_ONLY=mode == "sinks_only",
        DECAY=rho is not None, HAS_MASK=mask is not None,
        num_warps=4, maxnreg=255,  # ptxas otherwise caps some modes at 80-96 registers and spills
    )  # fmt: skip
    return y


@_decode_step.register_fake
def _(q, *args, **kwargs):
    return torch.empty_like(q)
