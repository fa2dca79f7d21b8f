"""DeepSpeed helpers: ZeRO-3 configs (stage 2's engine, partitioned weights for inference), the ZeRO-3 state gathered
whole and restored (world-size-free checkpoints), and the log noise it makes.

On CPU, DeepSpeed's communication backend compiles a C++ op when it starts (a shared-memory all-reduce, ~70 s on 2
cores). That op serves only `inference_all_reduce` (DeepSpeed's own inference engine), which nothing here calls --
ZeRO-3 gathers and reduces through torch.distributed -- so it is marked unavailable and never built.
TORCH_EXTENSIONS_DIR still defaults to a folder inside the virtual environment, for any op DeepSpeed does build.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SHM_OP = "deepspeed_shm_comm"  # the name of DeepSpeed's shared-memory all-reduce op (ShareMemCommBuilder.NAME)


def import_deepspeed():
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    # the accelerator DeepSpeed would detect, named: on a CPU-only machine its detection logs a WARNING to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError:
        raise ImportError(
            "sharded weights need DeepSpeed: .venv/bin/pip install 'hybrid_scale[deepspeed]' (deepspeed>=0.16)"
        ) from None
    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # unused (module docstring): no compile at start
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
    """Stage 2's DeepSpeed config, generated from the config's `finetune` section (nothing else is read). It has no
    scheduler: the engines take finetune.schedule's (parallelize's `schedule`)."""
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
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def clear_gradients(engine) -> None:
    """Zero ZeRO-3's gradient partitions before an optimizer step's first backward. ZeRO-3 keeps them in one flat
    buffer and overwrites only the partitions of parameters that receive a gradient: a parameter that gets none in a
    step (gamma of a layer SSD runs in la_only) would otherwise be stepped with its previous step's gradient."""
    buffer = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None:
        buffer.zero_()


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def gathered(module: nn.Module):
    """Context in which the module's own (non-recursive) ZeRO-3 parameters are whole; a no-op otherwise."""
    params = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
    if not params:
        return contextlib.nullcontext()
    return import_deepspeed().zero.GatheredParameters(params)


def init_comm(backend: str) -> None:
    """DeepSpeed's communication over the process group already joined, with the collectives that torch 2.13 does
    not deprecate: DeepSpeed 0.19 picks torch.distributed.all_gather_into_tensor and reduce_scatter_tensor for every
    ZeRO-3 gather and gradient reduction, which warn (FutureWarning) on the first call of a run; their successors
    all_gather_single and reduce_scatter_single take the same arguments and do the same collective."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend=backend)
    backend_of = deepspeed.comm.comm.cdb  # DeepSpeed's TorchBackend: it calls these two for every gather/reduce
    if hasattr(torch.distributed, "all_gather_single") and getattr(backend_of, "all_gather_function", None):
        backend_of.all_gather_function = torch.distributed.all_gather_single
    if hasattr(torch.distributed, "reduce_scatter_single") and getattr(backend_of, "reduce_scatter_function", None):
        backend_of.reduce_scatter_function = torch.distributed.reduce_scatter_single


# --- whole tensors out of ZeRO-3 partitions (collective: every rank calls in the same order) ----------------------


def gather_full(params: list[tuple[str, nn.Parameter]], group: int = 64) -> dict[str, torch.Tensor]:
    """{name: the whole tensor on CPU} of partitioned parameters, gathered `group` at a time."""
    deepspeed = import_deepspeed()
    out = {}
    for a in range(0, len(params), group):
        chunk = params[a : a + group]
        with deepspeed.zero.GatheredParameters([p for _, p in chunk]):
            for name, p in chunk:
                out[name] = p.detach().to("cpu", copy=True).contiguous()
    return out


def trainable_state(named: list[tuple[str, nn.Parameter]]) -> tuple[dict, dict]:
    """(fp32 master weights, AdamW moments) of the trainable parameters, each whole: a world-size-free form."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, moments = {}, {}
    for name, p in named:
        weights[name] = safe_get_full_fp32_param(p).detach().cpu().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            moments[f"{name}::{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().contiguous()
    return weights, moments


def restore_trainable(engine, named, weights: dict, moments: dict, step: int) -> None:
    """Put whole saved weights and moments back into the partitions of this world size (any number of ranks)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    deepspeed = import_deepspeed()
    opt = engine.optimizer
    for flat in opt.fp32_partitioned_groups_flat:  # AdamW state is created lazily by its first step
        opt.optimizer.state[flat] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    for name, p in named:
        value = weights[name]
        safe_set_full_fp32_param(p, value.float())
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(value.view(p.shape).to(p.dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(p, moments[f"{name}::{key}"], key)
