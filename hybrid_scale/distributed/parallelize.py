"""The one place where parallelism is applied to a model, always in this order (torchtitan's): tensor parallelism,
then activation checkpointing, then data-parallel sharding. The model code never learns about any of them.

- Tensor parallelism: not applied yet (launch.tensor_parallel is checked by `plan` only); it goes first here.
- Activation checkpointing: non-reentrant (works with PEFT), on the transformers model.
- Between them and the sharding, `adapt` (e.g. PEFT's LoRA wrapping), which must see the unsharded model.
- Data parallel: DeepSpeed ZeRO-3 (stage 2's engine with its optimizer, or partitioned weights for inference).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .deepspeed import _import_deepspeed


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing; transformers 5.x renamed the method."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parallelize(
    model: nn.Module,
    *,
    activation_checkpointing: bool = False,
    adapt: Callable[[nn.Module], nn.Module] | None = None,
    zero3: dict | None = None,
    train: bool = False,
):
    """`model` with activation checkpointing, adapted, then sharded with ZeRO-3 (`zero3`: the DeepSpeed config).
    Returns (engine, model): for training the engine's optimizer holds the parameters that require grad and the
    model is the adapted one; for inference the model is the sharded one in eval mode; without `zero3` the engine is
    None."""
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if adapt is not None:
        model = adapt(model)
    if zero3 is None:
        return None, model
    deepspeed = _import_deepspeed()
    if train:
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=zero3)
        return engine, model
    engine, *_ = deepspeed.initialize(model=model, config=zero3)
    return engine, engine.module.eval()
