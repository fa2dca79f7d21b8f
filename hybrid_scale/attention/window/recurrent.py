"""The decode state every hybrid layer keeps, whatever its linear part: a ring of the window's last R real keys and
values, the sink buffer of the first S, the real-token counts, and the linear part's state tensors (`kv`, `ksum`,
`gates`, the convolution tails: what each kind keeps is its part's, hedgehog/ and gated_delta/).

The ring is allocated once at its capacity R = min(window, max_length) and then only written in place (what
torch.compile and CUDA graphs need: the same tensors, the same shapes, at every step); it grows toward that capacity
only when a caller gives a shorter ring. The linear part's `extend`/`step` (hedgehog/recurrent.py,
gated_delta/recurrent.py) read and fold it.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..kinds import KINDS
from ..shape import Shape


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
    # the cache of exact keys (../cache/recurrent.py), C = its largest budget over the KV heads (0 wide without one)
    cache_k: torch.Tensor | None = None  # [B, Hkv, C, D]
    cache_v: torch.Tensor | None = None  # [B, Hkv, C, Dv]
    cache_fk: torch.Tensor | None = None  # [B, Hkv, C, F] (as fk)
    cache_gates: torch.Tensor | None = None  # [B, Hkv, C, 2] fp32 (as gates)
    cache_score: torch.Tensor | None = None  # [B, Hkv, C] fp32: the score each cached key won its place with
    cache_pos: torch.Tensor | None = None  # [B, Hkv, C] long: its real index, -1 where the slot is empty
    cache_budget: torch.Tensor | None = None  # [Hkv] long: the keys each KV head may cache (<= C; empty if C = 0)
    ring_score: torch.Tensor | None = None  # [B, Hkv, R] (fp32 or fp64): cache_select=attention's sums so far
    shadow_kv: torch.Tensor | None = None  # self_recall's state of every candidate that has left the window:
    shadow_ksum: torch.Tensor | None = None  # Hedgehog's sums [B,Hkv,F,Dv], [B,Hkv,F]; the delta rule's S (kv only)
    la_has: torch.Tensor | None = None  # [B, Hkv] bool: the LA holds a key (the gated delta rule's has_n; 0 wide
    # without a cache, where cache_only, the one mode that then takes this path, reads no LA)
    window: int = 0  # the window this state was built for
    capacity: int = 0  # the most the ring may hold: min(window, max_length)
    cache_select: str = ""  # the score its cache was built for ("" without a cache)
    cache_sizes: tuple = ()  # cache_budget on the host (what a layer's settings are checked against)

    @classmethod
    def empty(cls, shape: Shape, batch: int, capacity: int, device, ring: int | None = None, *,
              cache: tuple = (0, "")) -> DecodeState:  # fmt: skip
        """A state with nothing seen for `batch` sequences of calls of `shape` (its KV heads, head, value and feature
        dims, window, sinks and dtype); it keeps at most `capacity` window keys (min(capacity, window)), and its ring
        has `ring` slots (default: that capacity, so it is never re-allocated). `cache`: (keys, select), the cache of
        exact keys per KV head (an int, or one per KV head; 0: none) and the score they compete on
        (attention.cache_select: what else the state keeps follows from it, the ring's attention sums or the
        self_recall state)."""
        window, sinks, dtype = shape.window, shape.sinks, shape.dtype
        kv_heads, head_dim, value_dim, feature_dim = shape.kv_heads, shape.head_dim, shape.value_dim, shape.features
        acc = torch.promote_types(dtype, torch.float32)
        # phi_k is kept as it came (every value the rings hold is an input's phi_k, unchanged: bf16 rings lose
        # nothing and halve the bytes a decode step reads); gated_delta's keys are kept in fp32
        ring_f = acc if KINDS[shape.la_kind].ring_fp32 else dtype
        capacity = min(capacity, window)
        ring = capacity if ring is None else ring

        def z(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        budget = torch.as_tensor(cache[0], dtype=torch.long, device=device).expand(kv_heads).clone()
        C = int(budget.max()) if kv_heads else 0
        select = cache[1] if C else ""
        delta = KINDS[shape.la_kind].ring_gates > 0
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
            gates=z(batch, kv_heads, ring, KINDS[shape.la_kind].ring_gates, dt=acc),
            conv_q=z(batch, shape.heads, max(shape.conv - 1, 0), head_dim),
            conv_k=z(batch, kv_heads, max(shape.conv - 1, 0), head_dim),
            cache_k=z(batch, kv_heads, C, head_dim),
            cache_v=z(batch, kv_heads, C, value_dim),
            cache_fk=z(batch, kv_heads, C, feature_dim, dt=ring_f),
            cache_gates=z(batch, kv_heads, C, KINDS[shape.la_kind].ring_gates, dt=acc),
            cache_score=z(batch, kv_heads, C, dt=torch.float32),
            cache_pos=torch.full((batch, kv_heads, C), -1, dtype=torch.long, device=device),
            cache_budget=budget if C else budget[:0],  # (without a cache: no byte more than before it)
            ring_score=z(batch, kv_heads, ring if select == "attention" else 0, dt=acc),
            shadow_kv=z(batch, kv_heads, *((feature_dim, value_dim) if select == "self_recall" else (0, 0)), dt=acc),
            shadow_ksum=z(batch, kv_heads, feature_dim if select == "self_recall" and not delta else 0, dt=acc),
            la_has=torch.zeros(batch, kv_heads if C else 0, dtype=torch.bool, device=device),
            window=window,
            capacity=capacity,
            cache_select=select,
            cache_sizes=tuple(int(c) for c in budget.tolist()),
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
            if isinstance(value, torch.Tensor) and f.name not in ("seen", "lock", "cache_budget"):
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
        for name in ("k", "v", "fk", "gates", "ring_score"):
            old = getattr(self, name)
            if old.dim() == 3:  # (per slot: the ring's attention sums, if kept)
                if old.shape[2]:
                    new = old.new_zeros(*old.shape[:2], size, 1)
                    setattr(self, name, scatter_slots(new, slot, old[..., None])[..., 0].contiguous())
                continue
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
