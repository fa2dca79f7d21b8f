"""Constant-memory decoding state for one hybrid layer, and extension by any number of new tokens.

Per layer and KV head the state holds
  * a ring buffer of the last R real keys/values (and their phi_k), real token r in slot r mod R, allocated once at
    its capacity R = min(window, max_length) and then only written in place (what torch.compile and CUDA graphs need:
    the same tensors, the same shapes, at every step);
  * the linear-attention state sum phi_k(k) v^T and sum phi_k(k) of every key that has left the ring but the first S
    (fp32), kept in every mode so the mode can change between calls;
  * the first S real keys, values and phi_k (sinks_only, swa_sinks and the hybrid with its sinks take them as softmax
    terms; la_only and the hybrid without sinks add the LA terms of those that have left the ring to the state's);
  * per row, the number of real tokens seen (padding is not counted) and, for transformers, the positions seen (a
    device tensor, like the counts: a step reads no host value and leaves no host value changed).
With a decay of the LA (la_decay, rho per KV head) the sums are kept as the last token seen (real index count - 1) sees
them, each key j weighted alpha^(count - 1 - w - j): every call multiplies them by alpha^(tokens it adds) (one multiply
per KV head) before folding its own keys in.
When a key leaves the window it is folded into the state. Extending by k tokens gives exactly the full forward over
the whole sequence: short extensions attend densely over ring + new keys, long ones run the chunked path over the
ring (in order) followed by the new tokens, starting from the state. `step` is the one-token case written for
compiled decoding: fixed shapes, no host synchronisation, every tensor of the state updated in place.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from ..options import AttentionOptions
from ..window.chunk import gather_time
from ..window.naive import compute_dtype
from ..window.recurrent import DecodeState, scatter_slots
from .chunk import chunk_hybrid_attention
from .naive import decay_weight, masked_attention


def extend(
    state: DecodeState,
    q,
    k,
    v,
    fq,
    fk,
    gamma,
    opts=None,
    *,
    attention_mask=None,
    la_decay=None,
    prefill=None,
    **settings,
) -> torch.Tensor:
    """Attend k new tokens (q [B,H,k,D], k/v [B,Hkv,k,D], fq, fk) to everything the state has seen, then fold
    them into the state. attention_mask [B,k] marks the new tokens' real ones. Returns [B,H,k,D].
    prefill: optional backend function (backends.py contract) that computes the first call's attention when the
    state is still empty and the call is long (a prompt), e.g. the Triton kernels; the state is built the same way.
    la_decay rho [Hkv]: the LA's decay (naive.py), None = off.

    Longer than the rest on purpose: the ring buffer's bookkeeping (positions, real-token counts, what leaves the
    window and is folded into the LA state, the sink buffer) is one sequence of steps that reads top to bottom
    against the spec in naive.py; split up, each piece would need the whole state passed around.
    opts: the call's AttentionOptions (options.py; or its fields as keywords), as a layer computes it (`own()`)."""
    o = AttentionOptions.of(opts, **settings).own()
    mode, window, sinks, hybrid_sinks, chunk_size = o.mode, o.window, o.sinks, o.hybrid_sinks, o.chunk_size
    if window != state.window:
        raise ValueError(
            f"this cache was built for window {state.window}, the layer now has window {window}; "
            "a live cache cannot change window: start a new cache"
        )
    if sinks != state.sink_k.shape[2]:
        raise ValueError(
            f"this cache keeps {state.sink_k.shape[2]} sinks, the layer now has {sinks}; start a new cache"
        )
    B, _, T, _ = q.shape
    real, new_count, pos_new = state.make_room(attention_mask, B, T, q.device)
    R, S = state.ring, state.sink_k.shape[2]
    pos_ring = state.ring_positions()
    acc = compute_dtype(q)
    sink_slots = torch.arange(S, device=q.device)
    folded_sinks = sink_slots[None] < (state.count - R)[:, None]  # sinks that have left the ring (not in the state)
    lin_state = (state.kv, state.ksum)
    last = (state.count - 1)[:, None]  # the query the state's sums are kept for
    rho = None if la_decay is None else la_decay.to(acc).view(1, -1, 1)  # [1, Hkv, 1] against [B, Hkv, keys]
    if not hybrid_sinks:  # an LA that covers the sinks: those that have left the ring join the state's sums
        fold = state.sink_fk.to(acc) * folded_sinks[:, None, :, None].to(acc)
        if rho is not None:  # as the last token sees sink j: alpha^(count - 1 - w - j)
            fold = fold * decay_weight(rho, (last - window - sink_slots[None])[:, None])[..., None]
        lin_state = (state.kv + fold.transpose(-1, -2) @ state.sink_v.to(acc), state.ksum + fold.sum(2))
    own_sinks = o.keeps_sinks  # the modes whose softmax keeps the sinks besides the window

    if mode == "sinks_only":
        n = min(S, T)
        pos_sink = torch.where(sink_slots[None] < state.count[:, None], sink_slots[None], -1)
        # the new tokens that are sinks (real index < S), moved to the front; at most S of them
        pick = torch.argsort((~(real & (pos_new < S))).to(torch.int8), dim=-1, stable=True)[:, :n]
        keys = torch.cat([state.sink_k, gather_time(k, pick).to(state.sink_k.dtype)], 2)
        vals = torch.cat([state.sink_v, gather_time(v, pick).to(state.sink_v.dtype)], 2)
        dummy = fk.new_zeros(*keys.shape[:3], fk.shape[-1])
        pos_keys = torch.cat([pos_sink, pos_new.gather(1, pick)], 1)
        y = masked_attention(q, keys, vals, fq, dummy, gamma, pos_new, pos_keys, o)
    elif prefill is not None and T > chunk_size and not bool(state.count.any()):  # a prompt: nothing seen yet
        y = prefill(q, k, v, fq, fk, gamma, o, attention_mask=attention_mask, la_decay=la_decay)
    elif T <= chunk_size or mode == "none" or (own_sinks and bool(state.count.any())):
        keys = torch.cat([state.k, k.to(state.k.dtype)], 2)
        vals = torch.cat([state.v, v.to(state.v.dtype)], 2)
        fks = torch.cat([state.fk.to(acc), fk.to(acc)], 2)
        pos_keys = torch.cat([pos_ring, pos_new], 1)
        if own_sinks:  # the sinks that have left the ring (the ring holds real tokens count-R .. count-1)
            pos_sink = torch.where(folded_sinks, sink_slots[None], -1)
            keys, vals = torch.cat([state.sink_k, keys], 2), torch.cat([state.sink_v, vals], 2)
            fks = torch.cat([state.sink_fk.to(acc), fks], 2)  # (never L terms: the hybrid's LA leaves its sinks out)
            pos_keys = torch.cat([pos_sink, pos_keys], 1)
        y = masked_attention(
            q, keys, vals, fq, fks, gamma, pos_new, pos_keys, o, state=lin_state, state_ref=state.count - 1,
            la_decay=la_decay,
        )  # fmt: skip
    else:
        order = torch.argsort(pos_ring, dim=-1)  # empty slots (-1) first, then oldest to newest

        ring_real = pos_ring.gather(1, order) >= 0
        q_all = torch.cat([q.new_zeros(*q.shape[:2], R, q.shape[-1]), q], 2)
        fq_all = torch.cat([fq.new_zeros(*fq.shape[:2], R, fq.shape[-1]), fq], 2)
        y = chunk_hybrid_attention(
            q_all,
            torch.cat([gather_time(state.k, order).to(k.dtype), k], 2),
            torch.cat([gather_time(state.v, order).to(v.dtype), v], 2),
            fq_all,
            torch.cat([gather_time(state.fk, order).to(fk.dtype), fk], 2),
            gamma,
            o,  # (with own sinks nothing has been seen yet here: the rows start at token 0)
            attention_mask=torch.cat([ring_real, real], 1),
            initial_state=lin_state,  # (as query count - 1 = the row's first + w - 1 sees it: the ring is full)
            la_decay=la_decay,
        )[:, :, R:]

    # sinks: new real tokens with index < S
    sink_slot = torch.where(real & (pos_new < S), pos_new, S)
    for name, x in (("sink_k", k), ("sink_v", v), ("sink_fk", fk)):
        state.assign(name, scatter_slots(getattr(state, name), sink_slot, x))
    # fold every key that leaves the ring into the linear state, but the sinks (the sink buffer keeps them)
    limit = (new_count - 1 - R)[:, None]
    fold_ring = ((pos_ring >= S) & (pos_ring <= limit)).to(acc)[:, None, :, None]
    fold_new = (real & (pos_new >= S) & (pos_new <= limit)).to(acc)[:, None, :, None]
    fk_new, v_new = fk.to(acc), v.to(acc)
    kv, ksum = state.kv, state.ksum
    if rho is not None:  # the sums move on to the new last token; each key folded now counts as that token sees it
        now = (new_count - 1)[:, None]
        carry = decay_weight(rho, (now - last)[:, None])  # [B, Hkv, 1]
        kv, ksum = kv * carry[..., None], ksum * carry
        fold_ring = fold_ring * decay_weight(rho, (now - window - pos_ring)[:, None])[..., None]
        fold_new = fold_new * decay_weight(rho, (now - window - pos_new)[:, None])[..., None]
    fk_ring = state.fk.to(acc) * fold_ring
    kv = kv + fk_ring.transpose(-1, -2) @ state.v.to(acc)
    kv = kv + (fk_new * fold_new).transpose(-1, -2) @ v_new
    ksum = ksum + fk_ring.sum(2) + (fk_new * fold_new).sum(2)
    state.assign("kv", kv)
    state.assign("ksum", ksum)
    # write the new keys that stay into the ring
    slot = torch.where(real & (pos_new > limit), torch.remainder(pos_new, R), R)
    for name, x in (("k", k), ("v", v), ("fk", fk)):
        state.assign(name, scatter_slots(getattr(state, name), slot, x))
    state.count.copy_(new_count)
    state.seen.add_(T)
    return y


def step(
    state: DecodeState, q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, la_decay=None, **settings
) -> torch.Tensor:
    """`extend` by one token per row (q [B,H,1,D], k/v [B,Hkv,1,D], fq, fk; attention_mask [B,1] or None), written
    for compiled decoding: the shapes are the state's whatever it holds, no value is read back to the host, and
    every tensor of the state is updated in place. Needs a ring of its whole capacity (state.ring == state.capacity:
    the window, the cache's default, or a max_length below it, which the caller must not pass: generate stops
    there); returns y [B,H,1,D].

    The new token p = count attends densely to the sink buffer, the ring and itself, each key carrying its real
    index (-1 where it takes no part): a sink is a key of its own only once it has left the ring (before, the ring
    holds it), or, in sinks_only, from the start (the ring then takes no part); masked_attention's mode rules do the
    rest, as in the spec, with the LA state as the keys folded before the ring. Then the key leaving the ring
    (index p - R, slot p mod R) is folded into the state unless it is a sink, the new key takes its slot, and a new
    key with p < S is written to the sinks."""
    o = AttentionOptions.of(opts, **settings).own()
    mode, window, sinks = o.mode, o.window, o.sinks
    if window != state.window or sinks != state.sink_k.shape[2] or state.ring != state.capacity or q.shape[2] != 1:
        raise ValueError(
            f"hedgehog.recurrent.step takes one token on a state with a ring of its whole capacity; got {q.shape[2]} "
            f"tokens, a ring of {state.ring} of {state.capacity} for window {window} (state: window {state.window}, "
            f"{state.sink_k.shape[2]} sinks, layer: {sinks} sinks): use extend"
        )
    B, R, S = q.shape[0], state.ring, state.sink_k.shape[2]
    acc = compute_dtype(q)
    real = torch.ones(B, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask[:, 0].bool()
    p = state.count
    sink_slots = torch.arange(S, device=q.device)[None]
    pos_new = torch.where(real, p, -1)[:, None]
    pos_ring = state.ring_positions()
    if mode == "sinks_only":  # every sink seen from the buffer, none from the ring
        pos_sink = torch.where(sink_slots < p[:, None], sink_slots, -1)
        pos_ring = torch.full_like(pos_ring, -1)
    else:  # the sinks that have left the ring (an LA term or a softmax sink, as the mode says)
        pos_sink = torch.where(sink_slots < (p - R)[:, None], sink_slots, -1)
    y = masked_attention(
        q,
        torch.cat([state.sink_k, state.k, k.to(state.k.dtype)], 2),
        torch.cat([state.sink_v, state.v, v.to(state.v.dtype)], 2),
        fq,
        torch.cat([state.sink_fk, state.fk, fk.to(state.fk.dtype)], 2),
        gamma,
        pos_new,
        torch.cat([pos_sink, pos_ring, pos_new], 1),
        o,
        state=(state.kv, state.ksum),
        state_ref=p - 1,
        la_decay=la_decay,
    )
    # the key leaving the ring (index p - R in slot p mod R) joins the state unless it is a sink; a padded row moves
    # nothing
    evict = (torch.arange(R, device=q.device)[None] == torch.remainder(p, R)[:, None]) & real[:, None]  # [B, R]
    gone = evict[:, None, :, None].to(acc)
    fold = (real & (p - R >= S)).to(acc)[:, None, None]  # [B, 1, 1]
    fk_gone, v_gone = (state.fk.to(acc) * gone).sum(2), (state.v.to(acc) * gone).sum(2)  # [B, Hkv, F], [B, Hkv, D]
    kv, ksum = state.kv, state.ksum
    if la_decay is not None:  # the sums move on to token p (alpha once); the leaving key, index p - w (R = w), counts
        # alpha^0 as token p sees it
        carry = decay_weight(la_decay.to(acc).view(1, -1, 1), real.long()[:, None, None])  # [B, Hkv, 1]
        kv, ksum = kv * carry[..., None], ksum * carry
    fk_gone = fk_gone * fold
    state.kv.copy_(kv + fk_gone[..., :, None] * v_gone[..., None, :])
    state.ksum.copy_(ksum + fk_gone)
    for name, x in (("k", k), ("v", v), ("fk", fk)):
        buf = getattr(state, name)
        buf.copy_(torch.where(evict[:, None, :, None], x.to(buf.dtype), buf))
    sink = ((sink_slots == p[:, None]) & real[:, None])[:, None, :, None]  # [B, 1, S, 1]
    for name, x in (("sink_k", k), ("sink_v", v), ("sink_fk", fk)):
        buf = getattr(state, name)
        buf.copy_(torch.where(sink, x.to(buf.dtype), buf))
    state.count.add_(real.long())
    state.seen.add_(1)
    return y
