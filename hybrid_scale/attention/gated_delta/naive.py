"""The gated delta rule's spec (Gated DeltaNet, arXiv 2412.06464): the recurrence one token at a time, per KV head,
on L2-normalised keys (module doc of hybrid.py for how it joins the window).

    S_t = alpha_t (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T        (S [Dk, Dv], fp32)
    o_t = S_t^T q_t                                                         (no 1/sqrt(d): a matching key returns v)

This file imports only torch and ../window (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..window.naive import compute_dtype


class DeltaGates(NamedTuple):
    """The gated delta rule's per-token gates: beta [B,Hkv,T] in (0, 1) (write strength), g [B,Hkv,T] <= 0 (log of
    the forget gate alpha), mix [B,H,T] in (0, 1) or None (la_combine=mix: the LA's weight per query head)."""

    beta: torch.Tensor
    g: torch.Tensor
    mix: torch.Tensor | None = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim (fla's l2norm: x * rsqrt(sum x^2 + eps))."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B,H,T,D] -> [B,Hkv,G,T,D]."""
    B, H, T, D = q.shape
    return q.reshape(B, kv_heads, H // kv_heads, T, D)


def recurrent_gated_delta(q, k, v, beta, g, *, initial_state=None, chunk_size=None):
    """The spec: the recurrence above, one token at a time. q [B,H,T,Dk] (already normalised), k [B,Hkv,T,Dk],
    v [B,Hkv,T,Dv], beta/g [B,Hkv,T], initial_state [B,Hkv,Dk,Dv] or None. Returns (o [B,H,T,Dv], S_T) in fp32
    (fp64 for fp64 inputs). chunk_size: unused (the implementations of this part share one contract)."""
    acc = compute_dtype(q)
    B, Hkv, T, Dk = k.shape
    qg = grouped(q.to(acc), Hkv)
    k, v, beta, g = (t.to(acc) for t in (k, v, beta, g))
    S = k.new_zeros(B, Hkv, Dk, v.shape[-1]) if initial_state is None else initial_state.to(acc)
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., :, None] * u[..., None, :]
        out.append(torch.einsum("bhgk,bhkv->bhgv", qg[:, :, :, t], S))
    o = torch.stack(out, dim=3) if out else qg.new_zeros(*qg.shape[:3], 0, v.shape[-1])
    return o.reshape(B, -1, T, v.shape[-1]), S
