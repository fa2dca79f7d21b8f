"""The cache of exact keys in constant-memory decode: one token at a time over a window/recurrent.DecodeState that
keeps, besides the ring, the sinks and the LA state, C cache slots per KV head (keys, values, the LA's keys and
gates, the score each won its place with, its position; C the largest budget over the KV heads), the ring's
`attention` sums (cache_select=attention) or the self_recall state of every candidate that has left the window (the
`shadow`, cache_select=self_recall). Every tensor is allocated once and written in place, and `step` has no branch on
a value, so it compiles to one graph (torch.compile fullgraph, CUDA graphs) and the state's bytes do not grow.

Step n (the row's n-th real token; select.py's module doc is the authority, attend.py the whole-sequence path):
  1. key j = n - w leaves the window (the ring's slot n mod w). If it is a candidate (j >= first) it gets its score,
     fixed now and independent of what the cache holds: recency j; attention the sum of the probabilities it got
     from queries j .. j+w-1 (kept per ring slot, added at each step); self_recall the part's error of the shadow
     state on it (then the shadow takes it, whatever the cache does);
  2. it joins the cache; if the cache then holds more than the head's budget, the lowest (score, position) leaves it
     (the newer wins a tie) and the part folds it into the LA state at this step (nothing is dropped);
  3. key n takes the ring slot (its attention sum starts at 0), and the sink buffer if n < S;
  4. query n attends: one softmax (one max, one normaliser) over the sinks (if the mode keeps them), the window and
     the cache slots, joined to the LA's read-out as the part's cached.py joins them (hybrid), or alone (swa_only,
     swa_sinks, cache_only: no window); with cache_select=attention its probabilities over the sinks and the window
     alone (no cache, no LA, no gamma) are added to the window keys' sums.
A padded step changes nothing and gives 0. `extend` (any number of tokens) runs `step` token by token.

The state follows one mode and one cache_select from its first token; switching either on a live state (or
turning the cache on or off) is not the whole-sequence forward of any one setting: start a new cache.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..window.chunk import gather_time, pack_real
from ..window.naive import EPS, compute_dtype
from ..window.recurrent import DecodeState, scatter_slots
from .attend import CACHED_MODES, candidates, scores
from .select import drop_times, never


def _check(state: DecodeState, o) -> None:
    C = state.cache_k.shape[2]
    if sizes(o.budget, len(state.cache_sizes)) != state.cache_sizes or (C and o.cache_select != state.cache_select):
        raise ValueError(
            f"this decode cache was built for a cache of {C} keys per KV head"
            + (f" chosen by {state.cache_select}" if C else "")
            + f", the layer now has {list(sizes(o.budget, len(state.cache_sizes)))} by {o.cache_select}; a live "
            "cache cannot change them: start a new cache"
        )
    if o.mode not in CACHED_MODES:
        raise ValueError(f"the cache's decode runs modes {', '.join(CACHED_MODES)}, not {o.mode}")


def sizes(budget, heads: int) -> tuple:
    """The cache's budget per KV head as a tuple of ints (an int for every head, or one per head)."""
    if isinstance(budget, int):
        return (budget,) * heads
    return tuple(int(c) for c in budget)


def _at(buf: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """buf [B, Hkv, N, d] at slot [B] (one per row): [B, Hkv, d]."""
    B, K, _, d = buf.shape
    return buf.gather(2, slot.view(B, 1, 1, 1).expand(B, K, 1, d))[:, :, 0]


def _pick(buf: torch.Tensor, extra: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Of buf [B, Hkv, C, d] followed by extra [B, Hkv, d], the entry index [B, Hkv] (0..C): [B, Hkv, d]."""
    both = torch.cat([buf, extra[:, :, None].to(buf.dtype)], 2)
    return both.gather(2, index[..., None, None].expand(*index.shape, 1, both.shape[-1]))[:, :, 0]


def step(state: DecodeState, x, gamma, opts, *, side, attention_mask=None, la_decay=None) -> torch.Tensor:
    """One token per row (x: the part's Projections with T = 1; attention_mask [B, 1] or None) with the cache (module
    doc), in place. `side`: the part's cached.py (decode_recall, decode_fold, decode_join). opts: the layer's
    options (as attend.cached_attend takes them). Returns y [B, H, 1, Dv] in q's dtype."""
    o = opts.own()
    _check(state, o)
    q, k, v, fq, fk = x[:5]
    if q.shape[2] != 1 or state.ring != state.capacity:
        raise ValueError(
            f"the cache's decode step takes one token on a ring of its whole capacity; got {q.shape[2]} tokens, a ring "
            f"of {state.ring} of {state.capacity}: use extend"
        )  # fmt: skip
    B, H = q.shape[:2]
    K, R, S, C = state.k.shape[1], state.ring, state.sink_k.shape[2], state.cache_k.shape[2]
    G = H // K
    dev = q.device
    acc = compute_dtype(q)
    first = candidates(opts)
    real = torch.ones(B, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask[:, 0].bool()
    n = state.count
    slot = torch.remainder(n, R)  # [B]: the ring slot of key n - R (the window's: R = w, or never reached)
    gates = x.gates
    two = (k.new_zeros(B, K, 1, 0) if gates is None else torch.stack([gates.beta, gates.g], -1))[:, :, 0]  # [B,K,2|0]

    # 1. the key leaving the window, and its score
    j = n - R
    cand = real & (j >= first) & (j >= 0)  # [B]
    ck, cv, cfk, cg = (_at(getattr(state, name), slot) for name in ("k", "v", "fk", "gates"))
    if C == 0:  # no cache: every candidate goes straight on (its score would not matter)
        score = torch.zeros(B, K, dtype=torch.float32, device=dev)
    elif state.cache_select == "recency":
        score = j.to(torch.float32)[:, None].expand(B, K)
    elif state.cache_select == "attention":
        score = state.ring_score.gather(2, slot.view(B, 1, 1).expand(B, K, 1))[:, :, 0].float()
    else:  # self_recall: the shadow state's error on it, then the shadow takes it
        score = side.decode_recall(state, cv, cfk, cg, cand).float()

    # 2. it joins the cache; the lowest (score, position) leaves it for the LA if the cache is then over budget
    cand_k = cand[:, None].expand(B, K)
    if C == 0:
        fold, loser = cand_k, torch.zeros(B, K, dtype=torch.long, device=dev)
    else:
        held = state.cache_pos >= 0  # [B, K, C]
        full = held.sum(-1) >= state.cache_budget  # [B, K]
        pos_all = torch.cat([state.cache_pos, j.view(B, 1, 1).expand(B, K, 1)], 2)
        score_all = torch.cat([state.cache_score, score[..., None]], 2)
        valid_all = torch.cat([held, cand_k[..., None]], 2)
        low = torch.where(valid_all, score_all, math.inf).amin(-1, keepdim=True)
        tied = valid_all & (score_all == low)
        loser = torch.where(tied, pos_all, torch.iinfo(torch.long).max).argmin(-1)  # [B, K], C: the candidate
        fold = cand_k & full
        free = ~held & (torch.arange(C, device=dev) < state.cache_budget[:, None])
        target = torch.where(full, loser, free.to(torch.int8).argmax(-1))  # C: nowhere (the candidate lost)
        write = (torch.arange(C, device=dev) == target[..., None]) & cand_k[..., None]  # [B, K, C]
    leaving = [_pick(getattr(state, name), c, loser) for name, c in
               (("cache_v", cv), ("cache_fk", cfk), ("cache_gates", cg))] if C else [cv, cfk, cg]  # fmt: skip
    if C:
        for name, c in (("cache_k", ck), ("cache_v", cv), ("cache_fk", cfk), ("cache_gates", cg)):
            buf = getattr(state, name)
            buf.copy_(torch.where(write[..., None], c[:, :, None].to(buf.dtype), buf))
        state.cache_score.copy_(torch.where(write, score[..., None], state.cache_score))
        state.cache_pos.copy_(torch.where(write, j.view(B, 1, 1), state.cache_pos))
    side.decode_fold(state, *leaving, fold, real, la_decay)

    # 3. key n takes the ring slot (and the sink buffer's, if n < S)
    here = (torch.arange(R, device=dev)[None] == slot[:, None]) & real[:, None]  # [B, R]
    for name, new in (("k", k[:, :, 0]), ("v", v[:, :, 0]), ("fk", fk[:, :, 0]), ("gates", two)):
        buf = getattr(state, name)
        buf.copy_(torch.where(here[:, None, :, None], new[:, :, None].to(buf.dtype), buf))
    if state.ring_score.shape[2]:
        state.ring_score.masked_fill_(here[:, None], 0.0)
    sink = ((torch.arange(S, device=dev)[None] == n[:, None]) & real[:, None])[:, None, :, None]  # [B, 1, S, 1]
    for name, new in (("sink_k", k), ("sink_v", v), ("sink_fk", fk)):
        buf = getattr(state, name)
        if buf.shape[-1] == new.shape[-1]:
            buf.copy_(torch.where(sink, new.to(buf.dtype), buf))
    state.count.add_(real.long())

    # 4. query n: one softmax over the sinks, the window and the cache
    last = state.count[:, None] - 1  # [B, 1]: query n on a real row (a padded row's output is 0)
    pos_ring = last - torch.remainder(last - torch.arange(R, device=dev)[None], R)
    pos_ring = torch.where(pos_ring >= 0, pos_ring, -1)  # [B, R]
    s_idx = torch.arange(S, device=dev)[None]
    sink_apart = (s_idx < first) & (s_idx <= last - R)  # [B, S]: a sink that has left the ring
    ring_sink = (pos_ring >= 0) & (pos_ring < first)
    ring_window = (pos_ring >= 0) & (pos_ring >= first)
    keep = first > 0 and o.mode != "cache_only"
    with_window = o.mode != "cache_only"
    soft = torch.cat([(sink_apart & keep)[:, None].expand(B, K, S), ((ring_sink & keep) | (ring_window & with_window))
                      [:, None].expand(B, K, R), state.cache_pos >= 0], 2)  # fmt: skip
    keys = torch.cat([state.sink_k, state.k, state.cache_k], 2).to(acc)
    vals = torch.cat([state.sink_v, state.v, state.cache_v], 2).to(acc)
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else o.scale
    qg = q.to(acc).view(B, K, G, -1)
    a = scale * torch.einsum("bkgd,bknd->bkgn", qg, keys)
    m = soft[:, :, None]
    c = torch.where(m, a, -math.inf).amax(-1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    e = torch.exp(torch.where(m, a - c, -math.inf))
    num, den = e @ vals, e.sum(-1)  # [B, K, G, Dv], [B, K, G]
    if state.ring_score.shape[2]:  # the window keys' probabilities in the softmax over the sinks and the window
        alone = torch.cat([sink_apart & (first > 0), ring_sink | ring_window], 1)[:, None, None]  # [B, 1, 1, S + R]
        p = torch.where(alone, a[..., : S + R], -math.inf).softmax(-1).nan_to_num()
        p = torch.where(ring_window[:, None, None] & real[:, None, None, None], p[..., S:], 0.0).sum(2)  # [B, K, R]
        state.ring_score.add_(p.to(state.ring_score.dtype))
    if o.mode == "hybrid":
        y = side.decode_join(state, x, gamma, o, num, den)  # [B, K, G, Dv]
    else:
        y = num / (den[..., None] + EPS)
    state.seen.add_(1)
    y = torch.where(real[:, None, None, None], y, 0.0)
    return y.reshape(B, H, 1, -1).to(q.dtype)


def extend(state: DecodeState, x, gamma, opts, *, side, attention_mask=None, la_decay=None, forward=None,
           part=None) -> torch.Tensor:  # fmt: skip
    """Any number of new tokens (x: the part's Projections [B, *, T, *]; attention_mask [B, T] or None): the state
    the one-token decode leaves, and its outputs. Returns y [B, H, T, Dv]. A prompt (nothing seen yet, more than one
    token) with `forward` (the whole-sequence path: the part's attend with this cache, cache/attend.py) and `part`
    is computed by it and the state built from the drop times at once (`prefill`); otherwise `step` by `step`."""
    q = x[0]
    B, _, T, _ = q.shape
    state.make_room(attention_mask, B, T, q.device)  # (grows a short ring, or says where a row would pass it)
    if state.ring != state.capacity:
        state.grow(state.capacity)
    if forward is not None and T > 1 and not bool(state.count.any()):
        return prefill(state, x, gamma, opts, side=side, part=part, forward=forward, attention_mask=attention_mask,
                       la_decay=la_decay)  # fmt: skip
    outs = []
    for t in range(T):
        gates = x.gates
        if gates is not None:
            gates = type(gates)(*(None if g is None else g[:, :, t : t + 1] for g in gates))
        token = type(x)(*(u[:, :, t : t + 1] for u in x[:5]), gates)
        mask = None if attention_mask is None else attention_mask[:, t : t + 1]
        outs.append(step(state, token, gamma, opts, side=side, attention_mask=mask, la_decay=la_decay))
    if not outs:
        return q.new_zeros(B, q.shape[1], 0, x[2].shape[-1])
    return torch.cat(outs, 2)


def prefill(state: DecodeState, x, gamma, opts, *, side, part, forward, attention_mask=None, la_decay=None):
    """A prompt on an empty state: its outputs from the whole-sequence path (`forward`: x, attention_mask -> y), and
    the state `step` would leave after it, built at once from the keys' scores and drop times (select.py) on each
    row's real tokens 0 .. T_b - 1 (end = T_b - 1):
      * the cache: the candidates with e_j <= end < d_j (their scores and positions), at most the head's budget;
      * the LA: the keys with d_j <= end, as the part folds them (side.prefill_la);
      * self_recall's shadow: the candidates with e_j <= end (side.prefill_shadow);
      * the ring: the last R real keys, with cache_select=attention the sums of their probabilities over the
        queries j .. end so far; the sink buffer: the first S.
    Returns y [B, H, T, Dv]."""
    o = opts.own()
    _check(state, o)
    y = forward(x, attention_mask)
    q = x[0]
    B, H, T, _ = q.shape
    K, R, S, C = state.k.shape[1], state.ring, state.sink_k.shape[2], state.cache_k.shape[2]
    dev = q.device
    acc = compute_dtype(q)
    first = candidates(opts)
    real = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
    if not bool(real.all()):  # each row's real tokens first, in order
        order, _ = pack_real(real)
        gates = x.gates
        if gates is not None:
            gates = type(gates)(*(None if t is None else t.gather(2, order[:, None].expand(-1, t.shape[1], -1))
                                  for t in gates))  # fmt: skip
        x = type(x)(*(gather_time(t, order) for t in x[:5]), gates)
    count = real.sum(-1)
    end = (count - 1).view(B, 1, 1)  # [B, 1, 1]: each row's last real token
    j = torch.arange(T, device=dev)
    if C or state.shadow_kv.numel():
        prio = scores(part, x, o, first, impl=None, dense=False)
        drop = drop_times(prio, state.cache_budget if C else 0, window=o.window, first=first)
    else:  # no cache: every candidate reaches the LA as it leaves the window
        prio = None
        drop = torch.where(j >= first, j + o.window, never(T, o.window)).expand(B, K, T)
    side.prefill_la(state, x, drop, end, la_decay, chunk_size=o.chunk_size)
    if state.shadow_kv.numel():
        side.prefill_shadow(state, x, (j >= first) & (j + o.window <= end[:, 0]), chunk_size=o.chunk_size)
    if C:  # the cache after step end: the candidates that have left the window and not the cache
        held = (j >= first) & (j + o.window <= end) & (drop > end)  # [B, K, T]
        top, idx = held.to(torch.int8).topk(min(C, T), dim=-1)
        if idx.shape[-1] < C:
            idx, top = F.pad(idx, (0, C - idx.shape[-1])), F.pad(top, (0, C - top.shape[-1]))
        ok = top.bool()
        for name, t in (("cache_k", x.k), ("cache_v", x.v), ("cache_fk", x.fk), ("cache_gates", _two(x))):
            got = t.gather(2, idx[..., None].expand(-1, -1, -1, t.shape[-1]))
            state.assign(name, torch.where(ok[..., None], got, 0).to(getattr(state, name).dtype))
        state.assign("cache_score", torch.where(ok, prio.float().gather(2, idx), 0.0))
        state.assign("cache_pos", torch.where(ok, idx, -1))
    # the ring (the last R real keys, key p in slot p mod R) and the sink buffer (the first S)
    p = j[None].expand(B, T)
    mine = p < count[:, None]  # (the real tokens, now first)
    slot = torch.where(mine & (p > end[:, 0] - R), torch.remainder(p, R), R)
    for name, t in (("k", x.k), ("v", x.v), ("fk", x.fk), ("gates", _two(x))):
        state.assign(name, scatter_slots(getattr(state, name), slot, t))
    sink_slot = torch.where(mine & (p < S), p, S)
    for name, t in (("sink_k", x.k), ("sink_v", x.v), ("sink_fk", x.fk)):
        if getattr(state, name).shape[-1] == t.shape[-1]:
            state.assign(name, scatter_slots(getattr(state, name), sink_slot, t))
    if state.ring_score.shape[2]:
        state.assign("ring_score", _ring_sums(x.q.to(acc), x.k.to(acc), end[:, 0, 0], first, o, R).to(
            state.ring_score.dtype))  # fmt: skip
    state.count.copy_(count)
    state.seen.add_(T)
    return y


def _two(x) -> torch.Tensor:
    """The (beta, g) a ring or cache slot keeps of each key [B, Hkv, T, 2] (0 wide for a kind without gates)."""
    if x.gates is None:
        return x.k.new_zeros(*x.k.shape[:3], 0)
    return torch.stack([x.gates.beta, x.gates.g], -1)


def _ring_sums(q, k, end, first: int, o, R: int) -> torch.Tensor:
    """cache_select=attention's sums of the ring's keys (real tokens end - R + 1 .. end, slot j mod R) so far: the
    probability each got in the softmax over the sinks and the window of the queries j .. end (query heads summed),
    [B, Hkv, R]. q [B,H,T,D], k [B,Hkv,T,D] on each row's real tokens first, in the compute dtype."""
    B, H, T, D = q.shape
    K, w = k.shape[1], o.window
    G = H // K
    dev = q.device
    scale = 1.0 / math.sqrt(D) if o.scale is None else o.scale
    m = end[:, None] - R + 1 + torch.arange(R, device=dev)  # [B, R]: the queries
    kj = end[:, None] - R - w + 2 + torch.arange(R + w - 1, device=dev)  # [B, N]: their windows' keys
    sinks = torch.arange(first, device=dev).expand(B, first)
    keys = torch.cat([sinks, kj], 1)  # [B, S + N]
    qm = gather_time(q, m.clamp(0, max(T - 1, 0))).view(B, K, G, R, D)
    kk = gather_time(k, keys.clamp(0, max(T - 1, 0)))
    a = scale * torch.einsum("bkgrd,bknd->bkgrn", qm, kk)
    mm, jj = m[:, :, None], keys[:, None, :]  # [B, R, 1], [B, 1, S + N]
    is_sink = torch.arange(keys.shape[1], device=dev) < first
    window = ~is_sink & (jj >= first) & (jj > mm - w) & (jj <= mm)
    alone = (mm >= 0) & (jj >= 0) & ((is_sink & (jj <= mm)) | window)
    p = torch.where(alone[:, None, None], a, -math.inf).softmax(-1).nan_to_num()
    p = torch.where(window[:, None, None], p, 0.0).sum((2, 3))  # [B, K, S + N]
    ring = (jj[:, 0] > end[:, None] - R) & (jj[:, 0] >= 0)  # [B, S + N]: a key the ring holds
    target = torch.where(ring & ~is_sink, torch.remainder(jj[:, 0], R), R)
    out = p.new_zeros(B, K, R + 1)
    return out.scatter_add_(2, target[:, None].expand(B, K, -1), p)[..., :R]
