"""The cache's spec: the selection token by token, and the softmax over the window, the sinks and the cache written out
densely.

On real tokens 0..T-1 (the caller moves padding out), window w, scale s, `first` the first candidate (select.py):
    soft(n) = {j < first : j <= n} if the mode keeps its sinks   (the sinks)
            + {j >= first : j <= n < d_j}                          (the window n - w < j <= n, and the cache)
    E_nj = exp(s q_n.k_j - c_n) on soft(n), c_n = max over soft(n) (one normaliser for all three)
`with_window=False` (cache_only) leaves the window out: {j >= first : j + w <= n < d_j}. What the LA takes (from step
d_j) is the part's (hedgehog/cached.py, gated_delta/cached.py).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from .select import budgets, never


def select_loop(prio: torch.Tensor, budget, *, window: int, first: int) -> torch.Tensor:
    """select.drop_times token by token (the spec): at each step n the key n - w (if a candidate) joins the cache, and
    while it holds more than C keys the lowest (score, position) leaves it at n. Same arguments and result."""
    B, K, T = prio.shape
    out = torch.full((B, K, T), never(T, window), dtype=torch.long)
    c = budgets(budget, K, "cpu").tolist()
    p = prio.detach().float().cpu().tolist()
    for b in range(B):
        for h in range(K):
            held: list[int] = []
            for n in range(T):
                j = n - window
                if j < first:
                    continue
                held.append(j)
                if len(held) > c[h]:
                    loser = min(held, key=lambda i: (p[b][h][i], i))
                    held.remove(loser)
                    out[b, h, loser] = n
    return out.to(prio.device)


def soft_masks(drop: torch.Tensor, group: int, *, first: int, keep_sinks: bool, window: int, with_window: bool = True):
    """The visible softmax keys of every query, [B,H,T,T] bool (query, key), split into (sinks, window, cache)."""
    B, K, T = drop.shape
    n = torch.arange(T, device=drop.device)[:, None]
    j = torch.arange(T, device=drop.device)[None, :]
    d = drop.repeat_interleave(group, dim=1)[:, :, None, :]  # [B,H,1,T]
    sinks = (j < first) & (j <= n) & keep_sinks
    held = (j >= first) & (j <= n) & (n < d)
    in_window = held & (j > n - window)
    cached = held & (j <= n - window)
    return sinks.expand_as(held), in_window if with_window else torch.zeros_like(held), cached


def soft_terms_dense(q, k, v, drop, *, first, keep_sinks, window, scale, with_window=True, gamma=None):
    """The softmax part over the sinks, the window and the cache (module doc), densely: (num [B,H,T,Dv], den [B,H,T],
    {"sinks", "window", "cache"}: each one's share of den [B,H,T]), E times gamma [H] if given, in fp32 (fp64 in)."""
    B, H, T, _ = q.shape
    group = H // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    masks = soft_masks(drop, group, first=first, keep_sinks=keep_sinks, window=window, with_window=with_window)
    soft = masks[0] | masks[1] | masks[2]
    a = scale * q @ k.transpose(-1, -2)
    c = torch.where(soft, a, float("-inf")).amax(-1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    e = torch.exp(torch.where(soft, a - c, float("-inf")))
    if gamma is not None:
        e = gamma.to(e.dtype).view(1, H, 1, 1) * e
    parts = {name: torch.where(m, e, 0.0).sum(-1) for name, m in zip(("sinks", "window", "cache"), masks, strict=True)}
    return e @ v, e.sum(-1), parts


def window_probabilities_dense(q, k, *, first, keep_sinks, window, scale):
    """The `attention` score (attend.py) densely: the probability each key gets in the softmax over the window and
    the sinks of each query, summed over the queries and the query heads of its KV head. [B,Hkv,T]."""
    B, H, T, _ = q.shape
    K = k.shape[1]
    no_cache = torch.arange(T, device=q.device).expand(B, K, T) + window  # C = 0: d_j = e_j
    group = H // K
    kk = k.repeat_interleave(group, dim=1)
    masks = soft_masks(no_cache, group, first=first, keep_sinks=keep_sinks, window=window)
    soft = masks[0] | masks[1]
    a = scale * q @ kk.transpose(-1, -2)
    p = torch.where(soft, a, float("-inf")).softmax(-1).nan_to_num()
    p = torch.where(masks[1], p, 0.0)  # the window's keys (the sinks are no candidates)
    return p.sum(2).view(B, K, group, T).sum(2)
