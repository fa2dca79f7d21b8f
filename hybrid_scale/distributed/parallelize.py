"""The one place where parallelism is applied to a model. The model code never learns about any of it.

- Activation checkpointing: non-reentrant (works with PEFT), on the transformers model (it only wraps each layer's
  call, so its place in the order changes nothing).
- `adapt` (PEFT's LoRA wrapping), which must see whole linears (tensor_parallel.whole_shapes, for a model that was
  read split): the tensor-parallel plan then splits each wrapped linear's LoRA factors as it split the linear.
- Tensor parallelism (launch.tensor_parallel > 1, torch DTensor, tensor_parallel.py): heads, MLP columns and the
  vocabulary split over the ranks of a node.
- Data parallel: DeepSpeed ZeRO-3 at tensor_parallel = 1 (stage 2's engine with its optimizer, or partitioned
  weights for inference); at tensor_parallel > 1 the trainable state is replicated over the data-parallel ranks
  (replicated.ReplicatedEngine: ZeRO-3 does not compose with DTensor-split weights) and inference needs no more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from . import tensor_parallel
from .deepspeed import import_deepspeed
from .replicated import ReplicatedEngine
from .runtime import Runtime


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing; transformers 5.x renamed the method."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass(frozen=True)
class Zero3:
    """The data-parallel engine: `config` is DeepSpeed's (ZeRO-3) config, which at tensor_parallel > 1 configures the
    replicated engine instead; `train` makes a training engine with its optimizer over the parameters that require
    grad, and `schedule` builds its learning-rate scheduler over that optimizer (both engines take the same one)."""

    config: dict | None  # None: no engine (the dry run's stage 2 builds the model alone)
    train: bool = False
    schedule: Callable | None = None


def parallelize(
    model: nn.Module,
    *,
    activation_checkpointing: bool = False,
    adapt: Callable[[nn.Module], nn.Module] | None = None,
    zero3: Zero3 | None = None,
    rt: Runtime | None = None,
):
    """`model` with activation checkpointing, adapted, split over `rt`'s tensor-parallel group (rt.tp > 1), then
    sharded with ZeRO-3 (`zero3`). Returns (engine, model): for training the engine's optimizer holds the parameters
    that require grad and the model is the adapted one; for inference the model is the sharded one in eval mode;
    without `zero3` the engine is None."""
    train = zero3 is not None and zero3.train
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if adapt is not None:  # (a model read split: PEFT makes whole LoRA factors, which the plan then splits)
        with tensor_parallel.whole_shapes(model):
            model = adapt(model)
    if rt is not None and rt.tp > 1:
        tensor_parallel.apply(model, rt)
        if train and zero3.config is not None:
            return ReplicatedEngine(model, zero3.config, rt, zero3.schedule), model
        return None, model if train else model.eval()
    if zero3 is None or zero3.config is None:
        return None, model
    deepspeed = import_deepspeed()
    if train:
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=params, config=zero3.config, lr_scheduler=zero3.schedule
        )
        return engine, model
    engine, *_ = deepspeed.initialize(model=model, config=zero3.config)
    return engine, engine.module.eval()
