"""The softmax window's pieces of the chunked forms: each row's real tokens moved to the front (padding anywhere),
gathers along time, and the causal softmax over the first S sinks alone (sinks_only).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from .naive import EPS


def pack_real(attention_mask: torch.Tensor):
    """Permutation that moves each row's real tokens to the front, keeping their order; and its inverse."""
    order = torch.argsort((~attention_mask.bool()).to(torch.int8), dim=-1, stable=True)
    return order, torch.argsort(order, dim=-1)


def gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] gathered along T by index [B, n]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def sinks_attention(q, k, v, sinks, scale):
    """Causal softmax over the first S positions. q [B,Hkv,G,T,D], k/v [B,Hkv,T,D] (real tokens first)."""
    T = q.shape[-2]
    S = min(sinks, T)
    a = scale * torch.einsum("bhgtd,bhsd->bhgts", q, k[:, :, :S])
    ok = torch.arange(S, device=q.device)[None, :] <= torch.arange(T, device=q.device)[:, None]
    c = torch.where(ok, a, float("-inf")).amax(-1, keepdim=True)
    e = torch.exp(torch.where(ok, a - c, float("-inf")))
    return torch.einsum("bhgts,bhsd->bhgtd", e, v[:, :, :S]) / (e.sum(-1, keepdim=True) + EPS)
