"""hybrid_scale_kernels: fused Triton kernels for hybrid_scale's hybrid attention (see kernels/README.md).

`register(register_backend)` is this package's entry point in the group "hybrid_scale.attention_backends": the
attention package finds it through the installed metadata, calls it with its own `register_backend`, and never
imports this package by name, so an exported model (which carries a copy of the attention files) picks the kernels up
when they are installed and runs on torch when they are not.
"""

from __future__ import annotations

import os

import torch

from .decode import triton_decode_step
from .hybrid_attention import EPS, MODES, chunk_states, triton_hybrid_attention

__all__ = ["EPS", "MODES", "chunk_states", "register", "triton_decode_step", "triton_hybrid_attention"]


def interpreting() -> bool:
    """True when Triton runs its interpreter (TRITON_INTERPRET=1, set before triton is imported): CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention backend 'triton' runs on CUDA tensors, got {q.device.type}; use attention.backend=auto "
            "(triton on CUDA, torch elsewhere) or torch (TRITON_INTERPRET=1 runs the kernels on CPU, for tests)"
        )


def forward(q, k, v, fq, fk, gamma, **options):
    """The backend function registered as "triton" (the contract of hybrid_scale/attention/backends.py)."""
    _check_device(q)
    return triton_hybrid_attention(q, k, v, fq, fk, gamma, **options)


def decode(state, q, k, v, fq, fk, gamma, **options):
    """The fused decode step registered with it (None = not a step it takes: the caller extends in torch)."""
    _check_device(q)
    return triton_decode_step(state, q, k, v, fq, fk, gamma, **options)


def register(register_backend) -> None:
    register_backend("triton", forward, decode=decode)
