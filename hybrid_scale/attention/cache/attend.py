"""The one entry of a layer with a cache (attention.cache > 0, the cache_only mode, or a call that asks each memory's
weight): the keys' scores, their drop times (select.py), the softmax over the sinks, the window and the cache, and
the part's LA over the keys in the order they reach it (the part's `cached_join`).

The scores (attention.cache_select), fixed when a key leaves the window and computed from the sequence alone:
  * attention: the probability the key got in the softmax over the window and the sinks of each query whose window
    held it (n = j .. j+w-1), summed over those queries and the query heads of its KV head (heavy hitters);
  * self_recall: how badly the LA state of the candidates before it predicts its value (the part's recall_scores:
    Hedgehog's normalised read-out at phi_k(k_j), the gated delta rule's residual v_j - alpha_j S^T k_j);
  * recency: its position (the newest stay: the cache is then a longer window).
Modes: hybrid (sinks as the model keeps them, window, cache, LA), swa_only / swa_sinks (no LA: a key that leaves the
cache is gone), cache_only (the cache's keys alone, with the hybrid's candidates), and the others as without a cache.
A padded batch is computed with each row's real tokens first (padded query rows give 0).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch

from ..window.chunk import pack_real
from ..window.naive import EPS, compute_dtype, real_positions
from .chunk import soft_terms
from .naive import select_loop, soft_terms_dense, window_probabilities_dense
from .select import drop_times

CACHED_MODES = ("hybrid", "swa_only", "swa_sinks", "cache_only")  # the modes a cache changes
MEMORIES = ("window", "sinks", "cache", "la")  # the keys of return_parts' weights


def uses_cache(opts) -> bool:
    """This call goes through the cache's path (exact also with a cache of 0, the path every memory's weight takes)."""
    keys = opts.cache > 0 or bool(opts.cache_budget and max(opts.cache_budget) > 0)
    return opts.mode == "cache_only" or (opts.mode in CACHED_MODES and (keys or opts.return_parts))


def candidates(opts) -> int:
    """`first`: the keys before it are the mode's own sinks (softmax keys for good), the others compete (select.py).
    cache_only holds what the hybrid's cache would."""
    own = opts.own()
    hybrid_keeps = opts.hybrid_sinks and opts.mode in ("hybrid", "cache_only")
    return opts.sinks if (hybrid_keeps or own.keeps_sinks) else 0


def _time(x, order):
    """x [B, heads, T(, d)] gathered along T by order [B,T]."""
    if x is None:
        return None
    index = order[:, None, :].expand(-1, x.shape[1], -1)
    if x.dim() == 4:
        index = index[..., None].expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, index)


def scores(part, x, opts, first: int, *, impl, dense: bool) -> torch.Tensor:
    """Each key's score [B,Hkv,T] for the cache (module doc), without gradient."""
    q, k = x[:2]
    B, K, T = k.shape[0], k.shape[1], k.shape[2]
    with torch.no_grad():
        if opts.cache_select == "recency":
            return torch.arange(T, device=k.device, dtype=torch.float32).expand(B, K, T)
        if opts.cache_select == "self_recall":
            return part.recall_scores(x, opts, first, impl=impl, dense=dense).float()
        acc = compute_dtype(q)
        scale = 1.0 / math.sqrt(q.shape[-1]) if opts.scale is None else opts.scale
        qa, ka = q.detach().to(acc), k.detach().to(acc)
        if dense:
            return window_probabilities_dense(qa, ka, first=first, keep_sinks=first > 0, window=opts.window,
                                              scale=scale).float()  # fmt: skip
        no_cache = torch.arange(T, device=k.device).expand(B, K, T) + opts.window
        return soft_terms(qa, ka, ka[..., :1], no_cache, 0, first=first, keep_sinks=first > 0, window=opts.window,
                          scale=scale, probabilities=True).float()  # fmt: skip


def cached_attend(part, x, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None, impl=None,
                  dense=False):  # fmt: skip
    """The layer's output with its cache (module doc). x: the part's Projections; impl: the part's implementation
    (its LA's), dense: the spec (selection token by token, dense masks). Returns y [B,H,T,Dv] in q's dtype; with
    opts.return_denominators (y, soft weight, LA weight) [B,H,T]; with opts.return_parts (y, {memory: weight}) [B,H,T]
    per MEMORIES (their sum: the output's normaliser)."""
    if initial_state is not None:
        raise ValueError("a layer with a cache continues a sequence through its decode cache (HybridCache), not an "
                         "initial_state")  # fmt: skip
    first = candidates(opts)
    o = opts.own()
    q = x[0]
    B, H, T, _ = q.shape
    out_dtype, acc = q.dtype, compute_dtype(q)
    pos = real_positions(attention_mask, B, T, q.device)
    real = pos >= 0
    packed = attention_mask is not None and not bool(real.all())
    if packed:
        order, inverse = pack_real(real)
        gates = x.gates
        if gates is not None:
            gates = type(gates)(*(_time(t, order) for t in gates))
        x = type(x)(*(_time(t, order) for t in x[:5]), gates)
        real = real.gather(1, order)
    prio = scores(part, x, o, first, impl=impl, dense=dense)
    drop = (select_loop if dense else drop_times)(prio, o.budget, window=o.window, first=first)
    q, k, v = (t.to(acc) for t in x[:3])
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else o.scale
    keep = first > 0 and o.mode != "cache_only"
    common = dict(first=first, keep_sinks=keep, window=o.window, scale=scale, with_window=o.mode != "cache_only")
    if dense:
        num, den, parts = soft_terms_dense(q, k, v, drop, **common)
    else:
        num, den, parts = soft_terms(q, k, v, drop, o.budget, **common)
    if o.mode == "hybrid":
        y, weights = part.cached_join(x, gamma, o, (num, den, parts), drop, first, la_decay=la_decay, impl=impl,
                                      dense=dense)  # fmt: skip
    else:
        y = num / (den[..., None] + EPS)
        weights = dict(parts, la=torch.zeros_like(den))
    if packed:
        y = _time(y, inverse)
        weights = {name: _time(w, inverse) for name, w in weights.items()}
        real = real.gather(1, inverse)
    keep_rows = real[:, None, :]
    y = torch.where(keep_rows[..., None], y, 0.0).to(out_dtype)
    weights = {name: torch.where(keep_rows, weights[name], 0.0) for name in MEMORIES}
    if o.return_parts:
        return y, weights
    if o.return_denominators:
        return y, weights["window"] + weights["sinks"] + weights["cache"], weights["la"]
    return y
