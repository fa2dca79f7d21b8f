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

This file imports only torch and its siblings (the export copies it next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .chunked import chunk_hybrid_attention, gather_time
from .naive import compute_dtype, decay_weight, masked_attention
from .options import AttentionOptions
from .shape import Shape


@dataclass
class DecodeState:
    k: torch.Tensor  # [B, Hkv, R, D] ring keys
    v: torch.Tensor  # [B, Hkv, R, Dv]
    fk: torch.Tensor  # [B, Hkv, R, F] phi_k of the ring keys (the inputs' dtype; gated_delta: fp32)
    sink_k: torch.Tensor  # [B, Hkv, S, D]
    sink_v: torch.Tensor  # [B, Hkv, S, Dv]
    sink_fk: torch.Tensor  # [B, Hkv, S, F] (as fk)
    kv: torch.Tensor  # [B, Hkv, F, Dv] fp32
    ksum: torch.Tensor  # [B, Hkv, F] fp32
    count: torch.Tensor  # [B] real tokens seen
    seen: torch.Tensor  # [] positions seen, padding included (on the state's device)
    lock: torch.Tensor  # [B * (Hkv + 1)] int32 zeros: the counts a one-launch fused step syncs its programs with
    gates: torch.Tensor  # [B, Hkv, R, 2] fp32 (beta, log alpha) of the ring's keys (la_kind gated_delta; else 0 wide)
    conv_q: torch.Tensor  # [B, H, conv - 1, D]: the last inputs of gated_delta's short convolution on q (else empty)
    conv_k: torch.Tensor  # [B, Hkv, conv - 1, D]: the same for k
    window: int = 0  # the window this state was built for
    capacity: int = 0  # the most the ring may hold: min(window, max_length)

    @classmethod
    def empty(cls, shape: Shape, batch: int, capacity: int, device, ring: int | None = None) -> DecodeState:
        """A state with nothing seen for `batch` sequences of calls of `shape` (its KV heads, head, value and feature
        dims, window, sinks and dtype); it keeps at most `capacity` window keys (min(capacity, window)), and its ring
        has `ring` slots (default: that capacity, so it is never re-allocated)."""
        window, sinks, dtype = shape.window, shape.sinks, shape.dtype
        kv_heads, head_dim, value_dim, feature_dim = shape.kv_heads, shape.head_dim, shape.value_dim, shape.features
        acc = torch.promote_types(dtype, torch.float32)
        # phi_k is kept as it came (every value the rings hold is an input's phi_k, unchanged: bf16 rings lose
        # nothing and halve the bytes a decode step reads); gated_delta's keys are kept in fp32
        ring_f = acc if shape.la_kind == "gated_delta" else dtype
        capacity = min(capacity, window)
        ring = capacity if ring is None else ring

        def z(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(
            k=z(batch, kv_heads, ring, head_dim),
            v=z(batch, kv_heads, ring, value_dim),
            fk=z(batch, kv_heads, ring, feature_dim, dt=ring_f),
            sink_k=z(batch, kv_heads, sinks, head_dim),
            sink_v=z(batch, kv_heads, sinks, value_dim),
            sink_fk=z(batch, kv_heads, sinks, feature_dim, dt=ring_f),
            kv=z(batch, kv_heads, feature_dim, value_dim, dt=acc),
            ksum=z(batch, kv_heads, feature_dim, dt=acc),
            count=torch.zeros(batch, dtype=torch.long, device=device),
            seen=torch.zeros((), dtype=torch.long, device=device),
            lock=torch.zeros(batch * (kv_heads + 1), dtype=torch.int32, device=device),
            gates=z(batch, kv_heads, ring, 2 if shape.la_kind == "gated_delta" else 0, dt=acc),
            conv_q=z(batch, shape.heads, max(shape.conv - 1, 0), head_dim),
            conv_k=z(batch, kv_heads, max(shape.conv - 1, 0), head_dim),
            window=window,
            capacity=capacity,
        )

    @property
    def ring(self) -> int:
        return self.k.shape[2]

    def tensors(self):
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_batch(self, fn) -> None:
        """Apply fn to every tensor along the batch dim (beam reordering, repeat, select)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name not in ("seen", "lock"):
                setattr(self, f.name, fn(value))
        self.lock = self.lock.new_zeros(self.kv.shape[0] * (self.kv.shape[1] + 1))

    def assign(self, name: str, value: torch.Tensor) -> None:
        """Give field `name` the values of `value`: written into the tensor it holds when the shape and dtype agree
        (its storage stays where a compiled or captured step expects it), replaced otherwise (a grown ring)."""
        old = getattr(self, name)
        if old.shape == value.shape and old.dtype == value.dtype and not (value.requires_grad or old.requires_grad):
            old.copy_(value)  # (a value in an autograd graph replaces it: the graph may have saved the old one)
        else:
            setattr(self, name, value)

    def grow(self, size: int) -> None:
        """Re-lay the ring out for `size` slots (larger than now); every held key keeps its place r mod size."""
        pos = self.ring_positions()
        slot = torch.where(pos >= 0, torch.remainder(pos, size), size)
        for name in ("k", "v", "fk", "gates"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], size, old.shape[-1])
            setattr(self, name, scatter_slots(new, slot, old).contiguous())

    def make_room(self, attention_mask, batch: int, length: int, device) -> tuple[torch.Tensor, ...]:
        """Before an extension by `length` tokens (attention_mask [B,T] marks the real ones, None: all): grow the ring
        toward its capacity if the new real tokens need it. Returns (real [B,T] bool, the new count [B], each new
        token's real index [B,T], -1 for padding); raises where a row would pass a max_length below the window."""
        if attention_mask is None:
            real = torch.ones(batch, length, dtype=torch.bool, device=device)
        else:
            real = attention_mask.bool()
        new_count = self.count + real.sum(-1)
        needed = int(new_count.max())
        if needed > self.ring and self.ring < self.capacity:
            self.grow(min(self.capacity, max(needed, 2 * self.ring)))
        if needed > self.capacity and self.capacity < self.window:
            raise ValueError(
                f"the cache holds at most {self.capacity} tokens (max_length) but this call brings a row to {needed}; "
                "create the cache with a larger max_length"
            )
        return real, new_count, torch.where(real, self.count[:, None] + real.long().cumsum(-1) - 1, -1)

    def ring_positions(self) -> torch.Tensor:
        """Real-token index held by each ring slot, -1 where empty. [B, R]."""
        R = self.ring
        if R == 0:
            return self.count.new_zeros(self.count.shape[0], 0)
        last = self.count[:, None] - 1
        pos = last - torch.remainder(last - torch.arange(R, device=self.count.device), R)
        return torch.where(pos >= 0, pos, -1)


def scatter_slots(buf: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write src[:, :, t] into buf slot index[:, t]; index == slots means 'do not write'."""
    slots = buf.shape[2]
    padded = torch.cat([buf, buf.new_zeros(*buf.shape[:2], 1, buf.shape[-1])], dim=2)
    idx = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
    return padded.scatter(2, idx, src.to(buf.dtype))[:, :, :slots]


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
            f"recurrent.step takes one token on a state with a ring of its whole capacity; got {q.shape[2]} tokens, a "
            f"ring of {state.ring} of {state.capacity} for window {window} (state: window {state.window}, "
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
