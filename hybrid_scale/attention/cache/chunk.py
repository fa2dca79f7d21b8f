"""The cache's softmax part a block of queries at a time: O(T (S + 2 L + C)) instead of O(T^2), equal to naive.py in
outputs and gradients.

Block b (queries n = bL .. bL+L-1, L the window by default) can see only
  * the sinks 0..first-1 (if the mode keeps them),
  * the keys bL-w .. bL+L-1: every query's window, and the keys that leave it during the block,
  * the cache at the block's start: the candidates j < bL - w with d_j > bL, at most C of them (select.py: the cache
    after step bL - 1 holds the C best that have left, and those still held at bL are among them).
Those S + w + L + C keys are gathered per block and masked per query exactly as naive.soft_masks says.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .select import budgets


def block_keys(drop: torch.Tensor, budget, *, first: int, keep_sinks: bool, window: int, block: int):
    """The keys each block may see: (index [B,Hkv,nb,N] long, kind [N]: 0 sink, 1 window range, 2 cache, valid
    [B,Hkv,nb,N] bool), N = S + w + L + C."""
    B, K, T = drop.shape
    dev = drop.device
    nb = -(-T // block)
    b0 = torch.arange(nb, device=dev) * block
    sinks = torch.arange(first if keep_sinks else 0, device=dev).expand(nb, -1)
    rng = b0[:, None] - window + torch.arange(window + block, device=dev)[None, :]
    rng_ok = (rng >= max(first, 0)) & (rng < T)
    parts = [sinks.expand(B, K, nb, -1), rng.expand(B, K, nb, -1)]
    valid = [torch.ones(B, K, nb, sinks.shape[-1], dtype=torch.bool, device=dev), rng_ok.expand(B, K, nb, -1)]
    cap = int(budgets(budget, K, dev).max()) if T else 0
    if cap:
        j = torch.arange(T, device=dev)
        held = (j >= first) & (j[None, :] < (b0 - window)[:, None])  # [nb,T]: left the window before the range
        held = held & (drop[:, :, None, :] > b0[:, None])  # [B,K,nb,T]: and still cached at the block's start
        cap = min(cap, T)
        score, idx = held.to(torch.int8).topk(cap, dim=-1)
        parts.append(idx)
        valid.append(score.bool())
    kinds = torch.cat([torch.full((p.shape[-1],), i, device=dev) for i, p in enumerate(parts)])
    return torch.cat(parts, -1), kinds, torch.cat(valid, -1)


def soft_terms(q, k, v, drop, budget, *, first, keep_sinks, window, scale, with_window=True, gamma=None, block=None,
               probabilities=False):  # fmt: skip
    """naive.soft_terms_dense a block at a time (module doc): (num [B,H,T,Dv], den [B,H,T], {"sinks", "window",
    "cache"} shares of den). With `probabilities` it returns instead naive.window_probabilities_dense ([B,Hkv,T]),
    computed over the same blocks (drop then has to be the cache-free one, d_j = e_j). q/k/v in the compute dtype."""
    B, H, T, D = q.shape
    K = k.shape[1]
    G = H // K
    L = min(block or window, max(T, 1))
    nb = -(-T // L)
    idx, kinds, valid = block_keys(drop, budget, first=first, keep_sinks=keep_sinks, window=window, block=L)
    N = idx.shape[-1]
    safe = idx.clamp(0, max(T - 1, 0))
    flat = safe.reshape(B, K, nb * N)

    def take(x):
        return x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1])).view(B, K, nb, N, x.shape[-1])

    kb, vb = take(k), take(v)
    db = drop.gather(2, flat).view(B, K, nb, N)
    qb = F.pad(q, (0, 0, 0, nb * L - T)).view(B, K, G, nb, L, D)
    n = torch.arange(nb, device=q.device)[:, None] * L + torch.arange(L, device=q.device)[None, :]  # [nb,L]
    n = n[None, None, :, :, None]  # [1,1,nb,L,1]
    j, dj = idx[:, :, :, None, :], db[:, :, :, None, :]  # [B,K,nb,1,N]
    ok = valid[:, :, :, None, :] & (j <= n) & (n < T)
    is_sink = kinds == 0
    held = ok & (n < dj) & ~is_sink
    in_window = held & (j > n - window)
    masks = (ok & is_sink, in_window if with_window else torch.zeros_like(held), held & (j <= n - window))
    soft = (masks[0] | masks[1] | masks[2])[:, :, None]  # [B,K,1,nb,L,N]
    a = scale * torch.einsum("bkgnld,bkncd->bkgnlc", qb, kb)
    if probabilities:
        window_only = (masks[0] | masks[1])[:, :, None]
        p = torch.where(window_only, a, float("-inf")).softmax(-1).nan_to_num()
        p = torch.where(masks[1][:, :, None], p, 0.0).sum((2, 4))  # [B,K,nb,N]: over the group and the block
        out = p.new_zeros(B, K, T + 1)
        target = torch.where(masks[1].any(3), idx, T).clamp(max=T).reshape(B, K, -1)
        return out.scatter_add_(2, target, p.reshape(B, K, -1))[..., :T]
    c = torch.where(soft, a, float("-inf")).amax(-1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    e = torch.exp(torch.where(soft, a - c, float("-inf")))
    if gamma is not None:
        e = gamma.to(e.dtype).view(1, K, G, 1, 1, 1) * e
    num = torch.einsum("bkgnlc,bkncd->bkgnld", e, vb).reshape(B, H, nb * L, -1)[:, :, :T]
    den = e.sum(-1).reshape(B, H, nb * L)[:, :, :T]
    parts = {
        name: torch.where(m[:, :, None], e, 0.0).sum(-1).reshape(B, H, nb * L)[:, :, :T]
        for name, m in zip(("sinks", "window", "cache"), masks, strict=True)
    }
    return num, den, parts
