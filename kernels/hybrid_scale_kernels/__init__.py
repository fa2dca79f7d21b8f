"""hybrid_scale_kernels: Triton kernels for hybrid_scale's hybrid attention (see kernels/README.md): the chunked
forward and backward (chunk.py, the entry; chunk_o.py, chunk_h.py, chunk_bwd.py the kernels), the fused decode step
(decode.py), and fla-core's gated delta rule (gated_delta.py).

`register(register_backend)` is this package's entry point in the group "hybrid_scale.attention_backends": the
attention package finds it through the installed metadata, calls it with its own `register_backend`, and never
imports this package by name, so an exported model (which carries a copy of the attention files) picks the kernels up
when they are installed and runs on torch when they are not.
"""

from __future__ import annotations

import os

import torch

from .chunk import triton_hybrid_attention
from .decode import triton_decode_step
from .gated_delta import fla_gated_delta
from .settings import GPU_SETTINGS
from .utils import EPS, MODES

__all__ = ["EPS", "GPU_SETTINGS", "MODES", "register", "supports", "triton_decode_step", "triton_hybrid_attention"]


def interpreting() -> bool:
    """True when Triton runs its interpreter (TRITON_INTERPRET=1, set before triton is imported): CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention backend 'triton' runs on CUDA tensors, got {q.device.type}; use attention.backend=auto "
            "(triton on CUDA, torch elsewhere) or torch (TRITON_INTERPRET=1 runs the kernels on CPU, for tests)"
        )


def forward(q, k, v, fq, fk, gamma, opts=None, **tensors):
    """The backend function registered as "triton" (the contract of hybrid_scale/attention/backends.py)."""
    _check_device(q)
    return triton_hybrid_attention(q, k, v, fq, fk, gamma, opts, **tensors)


def decode(state, q, k, v, fq, fk, gamma, opts=None, **tensors):
    """The fused decode step registered with it (None = not a step it takes: the caller extends in torch)."""
    _check_device(q)
    return triton_decode_step(state, q, k, v, fq, fk, gamma, opts, **tensors)


def supports(head_dim: int, value_dim: int, features: int, sinks: int, dtype: torch.dtype) -> str | None:
    """None when the kernels take this attention shape, else why not (the self-check refuses it by name): the
    shapes tools/kernel_compile.py compiles without spills for sm_80 and sm_90 are the presets' (head dim 64
    and 128, feature dim up to 256)."""
    if value_dim != head_dim:
        return f"value dim {value_dim} differs from head dim {head_dim}"
    if head_dim > 128:
        return f"head dim {head_dim} is over 128, the largest the kernels are compile-checked at"
    if features > 256:
        return f"feature dim {features} is over 256, the largest the kernels are compile-checked at"
    if sinks > 64:
        return f"{sinks} sinks are over 64, the most one tile holds"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype} is not one of bfloat16, float16, float32"
    return None


def register(register_backend) -> None:
    try:
        register_backend("triton", forward, decode=decode, supports=supports)
    except TypeError:  # the attention files of an older export: no shape declaration
        register_backend("triton", forward, decode=decode)
    try:  # fla-core's gated delta rule (attention.la_kind gated_delta), checked on its device before it is used
        register_backend("fla", fla_gated_delta, kind="gated_delta")
    except TypeError:  # the attention files of an export made before the gated delta rule
        pass
