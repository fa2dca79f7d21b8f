"""The softmax window's own pieces of the spec: positions counted in real tokens (window membership and the sinks
count real tokens only), the compute dtype, the one denominator eps every path shares, the component modes.

This file imports only torch and ../settings.py (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from ..settings import MODES

EPS = 1e-12  # the one denominator eps shared by every path (only guards 0/0: all-zero feature rows)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (used by the tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown attention mode '{mode}'; available: {', '.join(MODES)}")


def real_positions(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Index of each token among its row's real tokens, -1 for padding. Shape [B, T]."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must have shape {(batch, length)}, got {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    return torch.where(real, real.long().cumsum(-1) - 1, -1)
