"""DeepSpeed helpers: ZeRO-3 partitioned weights (for inference here; stage 2 builds on the same config).

DeepSpeed compiles a small C++ op on first use (a shared-memory collective on CPU); TORCH_EXTENSIONS_DIR defaults
to a folder inside the virtual environment so that the build is paid once, not on every run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch import nn


def _import_deepspeed():
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    try:
        import deepspeed
    except ImportError:
        raise ImportError(
            "sharded weights need DeepSpeed: .venv/bin/pip install 'hybrid_scale[deepspeed]' (deepspeed>=0.16)"
        ) from None
    return deepspeed


def zero3_config(dtype: torch.dtype, offload: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def shard_for_inference(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Partition every parameter over the ranks (ZeRO-3); forwards gather each layer's weights as they run.
    Every rank must then run the same sequence of forwards (see loglik.score(lockstep=True))."""
    deepspeed = _import_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(dtype))
    return engine.module.eval()


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def gathered(module: nn.Module):
    """Context in which the module's own (non-recursive) ZeRO-3 parameters are whole; a no-op otherwise."""
    params = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
    if not params:
        return contextlib.nullcontext()
    return _import_deepspeed().zero.GatheredParameters(params)
