"""fla-core's Triton kernel for the gated delta rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`), wrapped to
the contract of hybrid_scale's chunk_gated_delta (attention/gated_delta/chunk.py) and registered as the gated delta
rule's implementation "fla": attention.backend=auto uses it on CUDA only where it passes a forward-and-backward check
against the torch form there (the registry's self-check, attention/gated_delta/part.py). This package imports fla
only when the kernel is called, so the attention never depends on it."""

from __future__ import annotations

import torch


def fla_gated_delta(q, k, v, beta, g, *, initial_state=None, chunk_size=64):
    """The same recurrence by fla-core's Triton kernel `chunk_gated_delta_rule` (CUDA; scale 1, q and k normalised by
    the caller), each KV head's keys, values and gates repeated over its query group (fla has a state per head; the
    group's states stay equal). Same result as recurrent_gated_delta, in fp32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, Hkv, T, _ = k.shape
    G = q.shape[1] // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    heads = lambda t: t.to(acc).repeat_interleave(G, 1).transpose(1, 2).contiguous()  # noqa: E731
    S0 = None if initial_state is None else initial_state.to(acc).repeat_interleave(G, 1)
    o, S = chunk_gated_delta_rule(
        q.to(acc).transpose(1, 2).contiguous(), heads(k), heads(v), heads(g), heads(beta), scale=1.0,
        initial_state=S0, output_final_state=True,
    )  # fmt: skip
    return o.transpose(1, 2), S.view(B, Hkv, G, *S.shape[-2:])[:, :, 0]
