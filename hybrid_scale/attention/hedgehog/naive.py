"""The O(T^2) reference: the hybrid attention formula of docs/design.md §2 with the Hedgehog LA, written out densely.
This is the spec.

For query n and key j (positions counted in real tokens only), window w, scale s:
    W(n) = {j : n - w < j <= n},  P(n) = {j : j <= n - w}
    E_nj = gamma_h * exp(s q_n.k_j - c_n) on W(n), c_n = max over W(n) of s q_n.k_j (not detached)
    L_nj = phi_q(q_n) . phi_k(k_j) on P(n)
    hybrid: y_n = (sum E v + sum L v) / (sum E + sum L + EPS)
Hybrid with sinks (hybrid_sinks=True, S = sinks): E also covers S(n) = {j <= n : j < S}, the first S real tokens, and
L covers P(n) minus S(n): one shared normaliser, gamma on every E term, c_n the max over W(n) and S(n). With
hybrid_sinks=False (S = 0 for the hybrid) it is LoLCATs' hybrid above, exactly.
The LA's decay (la_decay = rho [Hkv], rho >= 0, alpha = exp(-rho) per KV head; None = off): every L term counts
alpha^(n - w - j) for a key that has left the window (j in P(n)), and 1 for a key still inside it (la_only), so the
LA's mass stays below 2 / (1 - alpha) whatever the length. Sinks are softmax terms: never decayed. rho = 0 gives the
formula above bit for bit.
Other modes: swa_only (E on W only), swa_sinks (softmax over W(n) and the first S real tokens, no L: the
sliding-window + attention-sinks baseline), la_only (L on all j <= n), sinks_only (causal softmax over the first S
real tokens), none (zeros). Padded query rows give exactly 0. All arithmetic is fp32; the output has q's dtype.
The window's own pieces (positions in real tokens, EPS, the compute dtype) are ../window/naive.py's.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch

from ..options import AttentionOptions
from ..window.naive import EPS, compute_dtype, real_positions


def decay_weight(rho: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """alpha^steps = exp(-rho * steps), steps clamped at 0 (a key inside the window counts 1). rho broadcast by the
    caller against steps; differentiable in rho."""
    return torch.exp(-rho * steps.clamp(min=0).to(rho.dtype))


def masked_attention(q, k, v, fq, fk, gamma, pos_q, pos_k, opts=None, *, state=None, state_ref=None, la_decay=None,
                     **settings):  # fmt: skip
    """Dense hybrid attention between queries and keys that carry explicit real-token positions.

    q [B,H,Tq,D], k/v [B,Hkv,Tk,D], fq [B,H,Tq,F], fk [B,Hkv,Tk,F], gamma [H];
    pos_q [B,Tq], pos_k [B,Tk]: real-token index of each query / key, -1 where there is none;
    state: optional (kv [B,Hkv,F,D], k [B,Hkv,F]) = sums of phi_k(k) v^T and phi_k(k) over keys already folded away
    (every one of them lies in P(n) of every query, and with hybrid_sinks none is a sink), with la_decay as seen by
    query state_ref ([B] or int: each key j in it weighted alpha^(state_ref - w - j)); query n takes it times
    alpha^(n - state_ref) (exponent clamped at 0). la_decay [Hkv]: the LA's decay above.
    Returns [B,H,Tq,D] in q's dtype; with return_denominators (y, sum of E [B,H,Tq], sum of L [B,H,Tq]), the two
    parts of the shared normaliser (fp32 or fp64). opts: the call's AttentionOptions (options.py; chunk_size unused).
    """
    o = AttentionOptions.of(opts, **settings)
    mode, window, sinks, return_denominators = o.mode, o.window, o.sinks, o.return_denominators
    B, H, Tq, D = q.shape
    out_dtype = q.dtype
    if mode == "none":
        y = q.new_zeros(B, H, Tq, v.shape[-1])
        if return_denominators:
            zero = q.new_zeros(B, H, Tq, dtype=compute_dtype(q))
            return y, zero, zero.clone()
        return y
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if o.scale is None else o.scale
    acc = compute_dtype(q)
    q, k, v, fq, fk = (t.to(acc) for t in (q, k, v, fq, fk))
    k, v, fk = (t.repeat_interleave(group, dim=1) for t in (k, v, fk))
    gamma = gamma.to(acc).view(1, H, 1, 1)

    pq, pk = pos_q[:, None, :, None], pos_k[:, None, None, :]
    causal = (pq >= 0) & (pk >= 0) & (pk <= pq)
    in_window = causal & (pk > pq - window)
    in_past = causal & (pk <= pq - window)
    sink = causal & (pk < sinks)
    if mode == "hybrid" and o.hybrid_sinks:
        soft, in_past = in_window | sink, in_past & ~sink
    elif mode == "swa_only" or mode == "hybrid":
        soft = in_window
    elif mode == "sinks_only":
        soft = sink
    elif mode == "swa_sinks":
        soft = in_window | sink
    else:
        soft = None
    linear = {"hybrid": in_past, "la_only": causal}.get(mode)
    if la_decay is not None:
        rho = la_decay.to(acc).repeat_interleave(group).view(1, H, 1, 1)

    num = q.new_zeros(B, H, Tq, v.shape[-1])
    den = q.new_zeros(B, H, Tq, 1)
    if soft is not None:
        a = scale * q @ k.transpose(-1, -2)
        c = torch.where(soft, a, float("-inf")).amax(-1, keepdim=True)
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
        e = torch.exp(torch.where(soft, a - c, float("-inf")))
        if mode in ("hybrid", "swa_only"):  # gamma cancels without L; the sink modes are plain softmax
            e = gamma * e
        num = num + e @ v
        den = den + e.sum(-1, keepdim=True)
    den_soft = den
    if linear is not None:
        lin = torch.where(linear, fq @ fk.transpose(-1, -2), 0.0)
        if la_decay is not None:
            lin = lin * decay_weight(rho, pq - window - pk)
        num = num + lin @ v
        den = den + lin.sum(-1, keepdim=True)
        if state is not None:
            kv, ksum = (s.to(acc).repeat_interleave(group, dim=1) for s in state)
            s_num, s_den = fq @ kv, fq @ ksum.unsqueeze(-1)
            if la_decay is not None:
                ref = torch.as_tensor(state_ref, device=pos_q.device).reshape(-1, 1, 1, 1)
                lag = decay_weight(rho, pos_q[:, None, :, None] - ref)
                s_num, s_den = s_num * lag, s_den * lag
            num, den = num + s_num, den + s_den
    y = num / (den + EPS)
    y = torch.where(pos_q[:, None, :, None] >= 0, y, 0.0).to(out_dtype)
    if return_denominators:
        return y, den_soft[..., 0], (den - den_soft)[..., 0]
    return y


def naive_hybrid_attention(q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, la_decay=None, **settings):
    """The spec. q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq/fk feature-mapped, gamma [H] > 0, opts the call's
    AttentionOptions (options.py; or its fields as keywords), attention_mask [B,T] (1 = token, 0 = padding),
    la_decay rho [Hkv] the LA's decay (None = off). Returns [B,H,T,D]; with opts.return_denominators (y, sum of E
    [B,H,T], sum of L [B,H,T]), the two parts of the shared normaliser."""
    B, _, T, _ = q.shape
    pos = real_positions(attention_mask, B, T, q.device)
    return masked_attention(q, k, v, fq, fk, gamma, pos, pos, AttentionOptions.of(opts, **settings), la_decay=la_decay)
