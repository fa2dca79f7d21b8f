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


def train_config(f, dtype: torch.dtype, world: int) -> dict:
    """Stage 2's DeepSpeed config, generated from the config's `finetune` section (nothing else is read)."""
    accumulation = f.global_batch // (f.micro_batch * world)
    if accumulation < 1 or accumulation * f.micro_batch * world != f.global_batch:
        raise ValueError(
            f"finetune.global_batch={f.global_batch} cannot be split into micro-batches of {f.micro_batch} over "
            f"{world} ranks: make it a multiple of micro_batch x ranks ({f.micro_batch * world})"
        )
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": False}
    if f.offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": f.global_batch,
        "train_micro_batch_size_per_gpu": f.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": f.clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": f.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": f.weight_decay,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": f.lr,
                "warmup_num_steps": f.warmup_steps,
                "total_num_steps": max(f.max_steps, f.warmup_steps + 1),
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


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
