"""Constant-memory decoding of the gated delta-rule hybrid (hybrid.py) on a window/recurrent.DecodeState.

The state keeps, per KV head, the ring of the window's last R real keys/values (the softmax part's), with each ring
key's delta-rule key (unnormalised; `fk`) and gates (beta, log alpha; `gates`), the sink buffer, and in `kv` the
delta-rule state S of every key that has left the ring (the recurrence's keys: real tokens, minus the first S when
the hybrid keeps its sinks), fp32 [B, Hkv, Dk, Dv]. The recurrence is ordered, so unlike the Hedgehog kind's sums the
state is of the keys before the ring, and the LA of a query is read after running the ring's keys (and the new ones)
through it: the hybrid reads S_(n-w), la_only S_n.

`extend` takes any number of new tokens (padding anywhere in them); `step` is the one-token case written for compiled
decoding (fixed shapes, no host sync, the state updated in place). Both equal the full forward over the whole sequence.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..hedgehog.naive import masked_attention
from ..options import AttentionOptions
from ..window.chunk import gather_time
from ..window.naive import compute_dtype
from ..window.recurrent import DecodeState, scatter_slots
from .chunk import chunk_gated_delta, lagged_delta
from .hybrid import combine, delta_hybrid_attention, has_past
from .naive import DeltaGates, l2norm


def _check(state: DecodeState, *, window: int, sinks: int) -> None:
    if window != state.window or sinks != state.sink_k.shape[2]:
        raise ValueError(
            f"this cache was built for window {state.window} and {state.sink_k.shape[2]} sinks, the layer now has "
            f"window {window} and {sinks} sinks; a live cache cannot change them: start a new cache"
        )
    if state.gates.shape[-1] != 2:
        raise ValueError("this cache was built for a Hedgehog LA; a gated_delta layer needs a cache of its own")


def _soft(q, keys, vals, pos_q, pos_k, o: AttentionOptions, gamma):
    """The softmax part over explicit keys: (y, sum of E) for the hybrid (gamma 1, zero features: no L term), the
    Hedgehog kind's own output for a mode without LA (sum of E unused)."""
    B, H, Tq, _ = q.shape
    zq, zk = q.new_zeros(B, H, Tq, 1), keys.new_zeros(*keys.shape[:3], 1)
    if o.mode == "hybrid":
        ones = torch.ones(H, dtype=compute_dtype(q), device=q.device)
        y, den, _ = masked_attention(q, keys, vals, zq, zk, ones, pos_q, pos_k, replace(o, return_denominators=True))
        return y, den
    return masked_attention(q, keys, vals, zq, zk, gamma, pos_q, pos_k, o.own()), None


def _sink_positions(state: DecodeState, count: torch.Tensor, mode: str) -> torch.Tensor:
    """Real index of each sink-buffer slot as a key of its own (-1: none): a sink that has left the ring; in
    sinks_only every sink seen (the ring then takes no part)."""
    slots = torch.arange(state.sink_k.shape[2], device=count.device)[None]
    limit = count[:, None] if mode == "sinks_only" else (count - state.ring)[:, None]
    return torch.where(slots < limit, slots, -1)


def _ordered(state: DecodeState, pos_ring, k, v, fk, gates: DeltaGates, pos_new, fq):
    """The ring's keys then the new ones, each row's real keys in position order at the front (the rest trails with
    position -1): (q, k, v, beta, g, pos, order), q zero for the ring's keys. The positions of a row's real keys are
    consecutive (the ring holds the last R real tokens), so index i - w is position n - w."""
    acc = state.kv.dtype
    pos = torch.cat([pos_ring, pos_new], 1)
    big = torch.iinfo(pos.dtype).max
    order = torch.argsort(torch.where(pos >= 0, pos, big), dim=-1, stable=True)
    keys = gather_time(torch.cat([state.fk.to(acc), fk.to(acc)], 2), order)
    vals = gather_time(torch.cat([state.v.to(acc), v.to(acc)], 2), order)
    g2 = torch.cat([state.gates, torch.stack([gates.beta, gates.g], -1).to(acc)], 2)
    g2 = gather_time(g2, order)
    qs = torch.cat([fq.new_zeros(*fq.shape[:2], state.ring, fq.shape[-1]), fq], 2)
    qs = gather_time(qs.to(acc), order)
    return qs, keys, vals, g2[..., 0], g2[..., 1], pos.gather(1, order), order


def extend(
    state: DecodeState, q, k, v, fq, fk, gates: DeltaGates, gamma, opts=None, *, attention_mask=None, **settings
) -> torch.Tensor:
    """Attend the new tokens (q [B,H,T,D], k/v [B,Hkv,T,D], fq/fk the delta rule's queries and keys, gates) to
    everything the state has seen, then fold them into it; attention_mask [B,T] marks the new real tokens.
    opts: the call's AttentionOptions (options.py; or its fields as keywords); hybrid_sinks is the model's (its
    recurrence skips the sinks in every mode). Returns y [B,H,T,Dv]."""
    o = AttentionOptions.of(opts, **settings)
    mode, window, sinks, hybrid_sinks, chunk_size = o.mode, o.window, o.sinks, o.hybrid_sinks, o.chunk_size
    _check(state, window=window, sinks=sinks)
    B, H, T, _ = q.shape
    real, new_count, pos_new = state.make_room(attention_mask, B, T, q.device)
    R, S = state.ring, state.sink_k.shape[2]
    pos_ring = state.ring_positions()
    qs, keys, vals, beta, g, pos, order = _ordered(state, pos_ring, k, v, fk, gates, pos_new, fq)
    skip = (pos < 0) | ((pos < S) if hybrid_sinks else torch.zeros_like(real[:, :1]))
    beta, g = torch.where(skip[:, None], 0.0, beta), torch.where(skip[:, None], 0.0, g)
    where_new = torch.argsort(order, dim=-1)[:, R:]  # index of each new token in the ordered keys

    if T > chunk_size and not bool(state.count.any()):  # a prompt: the full forward
        y = delta_hybrid_attention(q, k, v, fq, fk, gamma, gates, o, attention_mask=attention_mask)
    else:
        ring_keys = torch.cat([state.sink_k, state.k, k.to(state.k.dtype)], 2)
        ring_vals = torch.cat([state.sink_v, state.v, v.to(state.v.dtype)], 2)
        pos_keys = torch.cat([_sink_positions(state, state.count, mode), pos_ring, pos_new], 1)
        if mode == "sinks_only":
            pos_keys[:, S : S + R] = -1
        y_soft, den = _soft(q, ring_keys, ring_vals, pos_new, pos_keys, o, gamma)
        if mode in ("hybrid", "la_only"):
            lag = window if mode == "hybrid" else 0
            read = lagged_delta(l2norm(qs), l2norm(keys), vals, beta, g, lag=lag, initial_state=state.kv,
                                chunk_size=chunk_size)  # fmt: skip
            read = gather_time(read, where_new)
            if mode == "la_only":
                y = read
            else:
                has = has_past(pos_new, o) & real
                y = combine(y_soft, den, read, gamma, gates.mix, has, how=o.la_combine)[0]
        else:
            y = y_soft
        y = torch.where(real[:, None, :, None], y, 0.0).to(q.dtype)

    # the keys that leave the ring (index <= new count - 1 - R) are run into the state, in order
    leave = (pos >= 0) & (pos <= (new_count - 1 - R)[:, None])
    S_new = chunk_gated_delta(
        keys.new_zeros(B, keys.shape[1], keys.shape[2], keys.shape[3]), l2norm(keys), vals,
        torch.where(leave[:, None], beta, 0.0), torch.where(leave[:, None], g, 0.0), initial_state=state.kv,
        chunk_size=chunk_size,
    )[1]  # fmt: skip
    state.assign("kv", S_new)
    sink_slot = torch.where(real & (pos_new < S), pos_new, S)
    for name, x in (("sink_k", k), ("sink_v", v), ("sink_fk", fk)):
        if getattr(state, name).shape[-1] == x.shape[-1]:
            state.assign(name, scatter_slots(getattr(state, name), sink_slot, x))
    slot = torch.where(real & (pos_new > (new_count - 1 - R)[:, None]), torch.remainder(pos_new, R), R)
    two = torch.stack([gates.beta, gates.g], -1)
    for name, x in (("k", k), ("v", v), ("fk", fk), ("gates", two)):
        state.assign(name, scatter_slots(getattr(state, name), slot, x))
    state.count.copy_(new_count)
    state.seen.add_(T)
    return y


def step(
    state: DecodeState, q, k, v, fq, fk, gates: DeltaGates, gamma, opts=None, *, attention_mask=None, **settings
) -> torch.Tensor:
    """`extend` by one token per row, for compiled decoding: the shapes are the state's, no value is read back to the
    host, every tensor of the state is updated in place; needs a ring of its whole capacity (the window, or a
    max_length below it that the caller does not pass: generate stops there). The key leaving the ring
    (index p - R, slot p mod R) is run into S first (unless it is an own sink or there is none), so that token p
    reads S_(p-w); la_only then runs the ring's keys and the new one through a copy of it."""
    o = AttentionOptions.of(opts, **settings)
    mode, window, sinks, hybrid_sinks = o.mode, o.window, o.sinks, o.hybrid_sinks
    _check(state, window=window, sinks=sinks)
    if state.ring != state.capacity or q.shape[2] != 1:
        raise ValueError(
            f"gated_delta.recurrent.step takes one token on a ring of its whole capacity ({state.ring} of "
            f"{state.capacity}, window {window}); use extend"
        )
    B, R, S = q.shape[0], state.ring, state.sink_k.shape[2]
    acc = state.kv.dtype
    real = torch.ones(B, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask[:, 0].bool()
    p = state.count
    pos_new = torch.where(real, p, -1)[:, None]
    pos_ring = state.ring_positions()
    pos_sink = _sink_positions(state, p, mode)
    if mode == "sinks_only":
        pos_ring = torch.full_like(pos_ring, -1)
    keys = torch.cat([state.sink_k, state.k, k.to(state.k.dtype)], 2)
    vals = torch.cat([state.sink_v, state.v, v.to(state.v.dtype)], 2)
    y_soft, den = _soft(q, keys, vals, pos_new, torch.cat([pos_sink, pos_ring, pos_new], 1), o, gamma)
    # the key leaving the ring: index p - R in slot p mod R
    evict = (torch.arange(R, device=q.device)[None] == torch.remainder(p, R)[:, None]) & real[:, None]  # [B, R]
    gone = evict[:, None, :, None].to(acc)
    fold = real & (p - R >= (S if hybrid_sinks else 0))  # [B]
    k_gone = l2norm((state.fk.to(acc) * gone).sum(2))
    v_gone = (state.v.to(acc) * gone).sum(2)
    bg = (state.gates * gone).sum(2) * fold[:, None, None].to(acc)  # [B, Hkv, 2]
    S_state = state.kv * bg[..., 1].exp()[..., None, None]
    u = bg[..., 0, None] * (v_gone - torch.einsum("bhk,bhkv->bhv", k_gone, S_state))
    S_state = S_state + k_gone[..., :, None] * u[..., None, :]
    state.kv.copy_(S_state)
    for name, x in (("k", k), ("v", v), ("fk", fk), ("gates", torch.stack([gates.beta, gates.g], -1))):
        buf = getattr(state, name)
        buf.copy_(torch.where(evict[:, None, :, None], x.to(buf.dtype), buf))
    if mode in ("hybrid", "la_only"):
        qn = l2norm(fq.to(acc))
        if mode == "hybrid":
            read = torch.einsum("bhgk,bhkv->bhgv", qn.view(B, S_state.shape[1], -1, qn.shape[-1]), S_state)
            read = read.reshape(B, -1, 1, read.shape[-1])
            has = has_past(pos_new, o) & real[:, None]
            y = combine(y_soft, den, read, gamma, gates.mix, has, how=o.la_combine)[0]
        else:  # the ring (now ending with the new key) run through a copy of S, oldest first
            pos_after = torch.where(evict, p[:, None], pos_ring.clamp(min=-1))
            order = torch.argsort(torch.where(pos_after >= 0, pos_after, -1), dim=-1)
            ring_pos = pos_after.gather(1, order)
            bg_ring = gather_time(state.gates, order)
            skip = (ring_pos < 0) | ((ring_pos < S) if hybrid_sinks else torch.zeros_like(ring_pos, dtype=torch.bool))
            qs = torch.zeros(B, qn.shape[1], R, qn.shape[-1], dtype=acc, device=q.device)
            qs[:, :, -1:] = qn
            read = chunk_gated_delta(
                qs, l2norm(gather_time(state.fk.to(acc), order)), gather_time(state.v.to(acc), order),
                torch.where(skip[:, None], 0.0, bg_ring[..., 0]), torch.where(skip[:, None], 0.0, bg_ring[..., 1]),
                initial_state=S_state, chunk_size=R,
            )[0]  # fmt: skip
            y = read[:, :, -1:]
        y = torch.where(real[:, None, None, None], y, 0.0).to(q.dtype)
    else:
        y = y_soft
    sink = ((torch.arange(S, device=q.device)[None] == p[:, None]) & real[:, None])[:, None, :, None]
    for name, x in (("sink_k", k), ("sink_v", v)):
        buf = getattr(state, name)
        buf.copy_(torch.where(sink, x.to(buf.dtype), buf))
    state.count.add_(real.long())
    state.seen.add_(1)
    return y
