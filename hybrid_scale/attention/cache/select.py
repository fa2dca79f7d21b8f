"""Which keys the cache keeps, for a whole sequence at once: when each key leaves it (its drop time) and the order in
which the LA state receives the keys.

The candidates are the real keys j >= `first` (every key but the mode's own sinks, which are softmax keys for good).
Key j leaves the window of query j + w (its eviction step e_j = j + w) and competes then on its score p_j, which is
fixed when it leaves and does not depend on what the cache holds (attend.py: attention, self_recall, recency). At
each step n the key leaving the window joins the cache; if the cache then holds more than C keys, the one with the
lowest (score, position) leaves it for the LA state. With fixed scores the cache after step n is the C best of the
keys that have left the window by n, so key j leaves it at

    d_j = max(e_j, e_i of the C-th key i (in position order) that beats it),  i beats j: p_i > p_j, or p_i = p_j and
                                                                                  i > j (the newer key wins a tie)

and never (NEVER) if fewer than C keys beat it. C = 0 gives d_j = e_j: the hybrid without a cache. Query n holds key
j >= first as an exact softmax key iff j <= n < d_j (its window n - w < j <= n lies inside that) and the LA holds it
from step d_j on. At most one key leaves the cache at a step, so the LA's keys form a sequence in that order: slot s
holds the key with d_j = s (fold_order). naive.select_loop is the same selection token by token (the spec).

This file imports only torch (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

RANKS = 64  # keys of the rank order taken at once by drop_times: its loop has T / RANKS steps


def never(length: int, window: int) -> int:
    """The drop time of a key that never leaves the cache (or the window) within a sequence of `length`."""
    return length + window


def budgets(budget, heads: int, device) -> torch.Tensor:
    """The cache's size per KV head [heads] (long): an int for every head, or one per head."""
    c = torch.as_tensor(budget, device=device, dtype=torch.long)
    return c.expand(heads).clone() if c.dim() == 0 else c


def drop_times(prio: torch.Tensor, budget, *, window: int, first: int) -> torch.Tensor:
    """d_j (module doc) of every key. prio [B,Hkv,T] the keys' scores (finite; only j >= first matter), budget C (an
    int, or [Hkv] per KV head). Returns [B,Hkv,T] long: d_j for the candidates that leave the window within the
    sequence, NEVER (never()) for the others (the sinks and the last w keys).

    The keys that beat j are those before it in the order of (score, position), best first; so walking that order
    with the C smallest positions seen so far gives each key the C-th smallest position among its beaters, i, and
    d_j = max(e_j, i + w). The walk takes RANKS keys at a time: O(T (C + RANKS)) work, T / RANKS steps."""
    B, K, T = prio.shape
    dev = prio.device
    out = torch.full((B, K, T), never(T, window), dtype=torch.long, device=dev)
    n = T - window - first  # candidates that leave the window within the sequence: first .. T - w - 1
    if n <= 0:
        return out
    c = budgets(budget, K, dev).view(1, K, 1)
    cap = int(c.max())
    p = prio[..., first : first + n].float()
    # best first; a tie goes to the newer key: a stable sort of the scores read from the newest key back
    ranked = n - 1 - torch.argsort(p.flip(-1), dim=-1, descending=True, stable=True)  # positions, best first
    big = torch.iinfo(torch.long).max
    seen = torch.full((B, K, cap), big, dtype=torch.long, device=dev)  # the cap smallest positions of the walk so far
    cth = torch.full((B, K, n), big, dtype=torch.long, device=dev)  # per ranked key: the C-th smallest before it
    i = torch.arange(RANKS, device=dev)
    earlier = i[None, :] < i[:, None]  # [key, an earlier key of its block]
    for r0 in range(0, n, RANKS):
        block = ranked[..., r0 : r0 + RANKS]  # [B,K,L]
        L = block.shape[-1]
        before = earlier[:L, :L]
        inside = torch.where(before, block[..., None, :], big)  # [B,K,L,L]
        pool = torch.cat([seen[..., None, :].expand(B, K, L, cap), inside], dim=-1)
        if cap:
            smallest = pool.topk(cap, dim=-1, largest=False).values  # ascending
            cth[..., r0 : r0 + L] = smallest.gather(-1, (c - 1).clamp(min=0)[..., None].expand(B, K, L, 1))[..., 0]
            both = torch.cat([seen, block], dim=-1)
            seen = both.topk(cap, dim=-1, largest=False).values
    j = ranked  # the ranked keys' positions (from first)
    d = torch.where(cth < big, torch.maximum(cth, j) + first + window, never(T, window))
    d = torch.where(c == 0, j + first + window, d)  # no cache: each key reaches the LA when it leaves the window
    out[..., first : first + n] = torch.empty_like(d).scatter_(-1, j, d)
    return out


def fold_order(drop: torch.Tensor) -> torch.Tensor:
    """The LA's keys in the order it receives them: [B,Hkv,T] long, slot s holds the key j with d_j = s, or -1 (no
    key reaches the LA at step s)."""
    B, K, T = drop.shape
    slots = torch.full((B, K, T + 1), -1, dtype=torch.long, device=drop.device)
    keys = torch.arange(T, device=drop.device).expand(B, K, T)
    slots.scatter_(2, drop.clamp(max=T), keys)  # every d_j < T is distinct; the rest land in slot T, dropped
    return slots[..., :T]


def gather_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [B,Hkv,T,...] along T in fold order (slots [B,Hkv,T]), zero where a slot is empty (-1)."""
    shape = slots.shape + x.shape[3:]
    index = slots.clamp(min=0).view(*slots.shape, *([1] * (x.dim() - 3))).expand(shape)
    taken = x.gather(2, index)
    empty = (slots < 0).view(*slots.shape, *([1] * (x.dim() - 3)))
    return torch.where(empty, torch.zeros((), dtype=x.dtype, device=x.device), taken)
