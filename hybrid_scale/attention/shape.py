"""The shape of an attention call as the model fixes it (heads, KV heads, head, value and feature dims, window, sinks,
dtype, the hybrid's own sinks, the LA decay): what a backend's self-check runs at (backends.py) and what a decode
state is allocated for (recurrent.DecodeState.empty).

This file imports only torch and options.py (the export copies it next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kinds import DEFAULT
from .options import AttentionOptions


@dataclass(frozen=True)
class Shape:
    """What a self-check runs at: one attention call's shape (the model's, not the batch's or the length's)."""

    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    value_dim: int = 16
    features: int = 32
    window: int = 16
    sinks: int = 4
    dtype: torch.dtype = torch.bfloat16
    hybrid_sinks: bool = False  # the hybrid keeps its sinks (then the self-check runs it with them)
    la_decay: bool = False  # the LA decays (the self-check runs it with a decay)
    la_kind: str = DEFAULT.name  # the LA's kind (kinds.py): what the decode state keeps per ring slot
    conv: int = 0  # gated_delta's short convolution on q and k (taps; 0 = none): the decode state keeps its last inputs

    @classmethod
    def of(cls, q, k, v, fq, opts: AttentionOptions, la_decay: bool = False) -> Shape:
        """The shape of a call on q [B,H,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv], fq [B,H,T,F] with these options."""
        dims = (q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], fq.shape[-1])
        return cls(*dims, int(opts.window), int(opts.sinks), q.dtype, bool(opts.hybrid_sinks), bool(la_decay))

    def __str__(self) -> str:
        own = " (the hybrid's own)" if self.hybrid_sinks else ""
        own += ", LA decay" if self.la_decay else ""
        if self.la_kind != DEFAULT.name:
            own += f", {self.la_kind} LA" + (f" (conv {self.conv})" if self.conv else "")
        return (
            f"{self.heads} heads / {self.kv_heads} KV heads, head dim {self.head_dim}, feature dim {self.features}, "
            f"window {self.window}, {self.sinks} sinks{own}, {str(self.dtype).removeprefix('torch.')}"
        )
