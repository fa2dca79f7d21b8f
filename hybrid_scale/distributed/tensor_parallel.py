"""Tensor parallelism with torch DTensor: every attention layer's heads, the MLP's inner columns and the vocabulary
split over the `launch.tensor_parallel` consecutive ranks of a group (inside a node); the model code never learns of
it (gpt-fast's tp.py beside model.py, torchtitan's plain-dict plans).

The plan is one dict per architecture, module-name pattern -> style, laid out as Megatron's: per decoder block one
all-reduce in the forward and one in the backward for the attention and again for the MLP.
  self_attn, mlp: the block's input becomes one replicated DTensor that q/k/v (gate/up) all read, so that their
  input gradients add up as partial sums and are all-reduced once, where the block's input is made; the output
  (partial sums of o_proj, down_proj) is all-reduced once, where the block ends;
  q/k/v, gate/up: column-wise (a rank computes its own heads / inner columns);
  o, down: row-wise, their partial sums left to the block's end;
  embed_tokens: row-wise over the vocabulary (each rank looks up its rows, all-reduced); lm_head: column-wise over
  the vocabulary, the logits gathered, except in training (`vocab_parallel_loss`): there each rank keeps its own
  columns of the logits and the cross-entropy is computed on them (torch's loss_parallel), so no rank holds them all.
A linear that PEFT wrapped with LoRA is split with its factors and adds no collective of its own: column-wise ->
base and lora_B column-wise, lora_A a replicated DTensor (it reads the block's replicated input; the input gradient
it gives is a partial sum added to the base's); row-wise -> base and lora_A row-wise, lora_B a replicated DTensor
applied to lora_A's partial sums (linear), all reduced together at the block's end. The replicated factors'
gradients are partial sums: the engine adds them up once per optimizer step (replicated.ReplicatedEngine). PEFT makes
whole factors (`whole_shapes` when the model was read split), which `apply` then splits.
Stage 1 splits one decoder layer at a time (LAYER_PLAN: o and down all-reduce their own outputs; nothing flows back
through the projections there).
Each hybrid layer is narrowed to its rank's heads (HybridAttention.narrow_heads: phi_q, phi_k and gamma as plain
tensors of the local heads); the LA state and the decode cache follow from the local k/v.

Models are read split (models/streaming.split_model: built on the meta device, split there by `split`, each rank's
part of each weight read from the shards). Checkpoints hold whole tensors (a run resumes at another tensor-parallel
size): `whole` gathers a rank's part, `local_part` cuts a whole tensor to it.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from ..attention.hf.architectures import ARCHITECTURES
from ..attention.layer import HybridAttention
from ..errors import ConfigError
from . import runtime
from .runtime import Runtime

LAYER_PLAN = {  # a decoder layer of every supported architecture (stage 1 splits one layer at a time)
    r"self_attn\.[qkv]_proj": "colwise",
    r"self_attn\.o_proj": "rowwise",
    r"mlp\.(gate|up)_proj": "colwise",
    r"mlp\.down_proj": "rowwise",
}
BLOCK_PLAN = {  # a decoder layer inside the whole model: Megatron's one reduction per attention and per MLP, each way
    r"self_attn": "attention",
    r"self_attn\.[qkv]_proj": "colwise",
    r"self_attn\.o_proj": "rowwise_partial",
    r"mlp": "mlp",
    r"mlp\.(gate|up)_proj": "colwise",
    r"mlp\.down_proj": "rowwise_partial",
}
_LLAMA_LIKE = {
    r"model\.embed_tokens": "vocab_rows",
    **{rf"model\.layers\.\d+\.{pattern}": kind for pattern, kind in BLOCK_PLAN.items()},
    r"lm_head": "vocab_columns",
}
TP_PLANS: dict[str, dict[str, str]] = {"llama_like": _LLAMA_LIKE}  # by name: an architecture record's tp_plan
PLANS: dict[str, dict[str, str]] = {name: TP_PLANS[a.tp_plan] for name, a in ARCHITECTURES.items()}
_PEFT_PREFIX = "base_model.model."  # where PEFT puts the wrapped model in parameter and module names


class _Replicated(ParallelStyle):
    """Every parameter of the module a replicated DTensor of the rank's own values (no broadcast: every rank holds the
    same ones); inputs and outputs pass as they are (LoRA's factors that read a DTensor)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name, m, mesh):
            for key, p in list(m.named_parameters(recurse=False)):
                local_p = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
                m.register_parameter(key, nn.Parameter(local_p, requires_grad=p.requires_grad))

        return distribute_module(module, device_mesh, replicate)


class _VocabColumns(ColwiseParallel):
    """The LM head column-wise over the vocabulary. Its logits are gathered, unless the module's `keep_vocab_shards`
    is set (`vocab_parallel_loss`): then each rank's columns stay a DTensor for loss_parallel's cross-entropy."""

    def __init__(self):
        super().__init__(output_layouts=Shard(-1), use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.keep_vocab_shards = False
        module.register_forward_hook(lambda m, _, out: out if m.keep_vocab_shards else out.full_tensor())
        return module


def _style(kind: str):
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "rowwise_partial": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "replicated": _Replicated(),
        "attention": PrepareModuleInputOutput(  # called as self_attn(hidden_states=..., ...); returns (out, weights)
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            output_layouts=(Partial(), None),
            desired_output_layouts=(Replicate(), None),
        ),
        "mlp": PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            output_layouts=(Partial(),),
            desired_output_layouts=(Replicate(),),
        ),
        "vocab_rows": RowwiseParallel(input_layouts=Replicate()),
        "vocab_columns": _VocabColumns(),
    }[kind]


@functools.cache
def _mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def forget_meshes() -> None:
    """Drop the meshes made so far: they belong to a process group that is ending (the dry run's fake one)."""
    _mesh.cache_clear()


def mesh(rt: Runtime) -> DeviceMesh:
    """The 2-D mesh (data x tensor) of this job: ranks r*tp .. r*tp+tp-1 form tensor-parallel group r. (A dry run's
    meta device gets a cpu mesh: its fake process group moves nothing.)"""
    return _mesh("cpu" if rt.device.type == "meta" else rt.device.type, rt.dp, rt.tp)


def dp_group(rt: Runtime):
    """The process group of this rank's data-parallel peers (the ranks holding the same heads), for runtime's
    collectives; None means the whole world (tensor parallelism off)."""
    return mesh(rt).get_group("dp") if rt.tp > 1 else None


def tp_group(rt: Runtime):
    """The process group of this rank's tensor-parallel group (None when tensor parallelism is off)."""
    return mesh(rt).get_group("tp") if rt.tp > 1 else None


def plan_for(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module name: style} of this model instance from a plan of name patterns (names as `model.named_modules`
    gives them, with PEFT's LoRA wrappers expanded into their base layer and factors)."""
    patterns = [(re.compile(rf"(?:{re.escape(_PEFT_PREFIX)})?{p}"), kind) for p, kind in plan.items()]
    plan = {}
    for name, module in model.named_modules():
        kind = next((k for p, k in patterns if p.fullmatch(name)), None)
        if kind is None:
            continue
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a PEFT LoRA layer
            if kind not in ("colwise", "rowwise_partial"):
                raise ConfigError(
                    f"config key 'finetune.lora_targets': LoRA on {name} cannot be split over tensor-parallel ranks; "
                    "leave it out"
                )
            plan[f"{name}.base_layer"] = kind
            split, whole = ("lora_B", "lora_A") if kind == "colwise" else ("lora_A", "lora_B")
            for adapter in getattr(module, split):
                plan[f"{name}.{split}.{adapter}"] = kind
                plan[f"{name}.{whole}.{adapter}"] = "replicated"
        else:
            plan[name] = kind
    return plan


def apply(model: nn.Module, rt: Runtime) -> nn.Module:
    """Split `model` (a transformers causal LM, converted or not, optionally PEFT-wrapped) over this rank's
    tensor-parallel group, in place, and put it on rt.device. What is already split (a model that
    streaming.split_model read in parts) stays as it is: only the rest is split, e.g. the LoRA factors that PEFT
    added since. A whole model on the host moves to the device one split weight at a time (the whole weight, then
    this rank's part of it)."""
    if rt.tp == 1:
        return model
    split(model, rt)
    return model.to(rt.device)  # what stays whole: norms, rotary tables, the narrowed phi/gamma


def split(model: nn.Module, rt: Runtime) -> nn.Module:
    """`apply` without the move to the device (also on the meta device): the hybrid layers not yet narrowed are
    narrowed to the local heads, then the plan splits what is not split yet; tied embeddings share one local part."""
    config = _config(model)
    check_divisible(config, rt.tp)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    architecture = type(inner).__name__
    if architecture not in PLANS:
        raise ConfigError(f"tensor parallelism has no plan for {architecture}; supported: {', '.join(sorted(PLANS))}")
    for m in model.modules():
        if isinstance(m, HybridAttention) and m.head_range is None:
            narrow(m, rt)
    _split(model, plan_for(model, PLANS[architecture]), rt)
    tie(model)
    return model


SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def check_divisible(config, tp: int) -> None:
    """Every size the plan splits must divide by tp (equal parts on every rank); one ConfigError naming it."""
    for name in SPLIT_SIZES:
        if tp > 1 and getattr(config, name) % tp:
            raise ConfigError(
                f"config key 'launch.tensor_parallel': the model's {name} = {getattr(config, name)} is not divisible "
                f"by {tp}; choose a divisor of it"
            )


@contextlib.contextmanager
def whole_shapes(model: nn.Module):
    """Inside the block every split linear shows its whole weight shape (a storage-free stand-in of the whole
    weight's shape, dtype and device). PEFT (0.21) sizes the LoRA factors of a DTensor weight by its local part (its
    own tensor-parallel scheme); this plan instead splits whole factors after PEFT made them (`split`), so that
    their initial values and checkpoints are those of tensor_parallel 1. Wrap with PEFT inside it."""
    saved = [(m, m.weight) for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, DTensor)]
    for m, w in saved:
        stand_in = torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)
        m.weight = nn.Parameter(stand_in, requires_grad=w.requires_grad)
    try:
        yield model
    finally:
        for m, w in saved:
            w.requires_grad_(m.weight.requires_grad)  # what PEFT froze stays frozen
            m.weight = w


def tie(model: nn.Module) -> None:
    """A model with tied word embeddings: the LM head shares the input embedding's (local) weight."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    if config is not None and getattr(_config(inner), "tie_word_embeddings", False) and hasattr(inner, "lm_head"):
        inner.lm_head.weight = inner.model.embed_tokens.weight


def split_layer(layer: nn.Module, rt: Runtime) -> nn.Module:
    """One decoder layer (stage 1 streams them) split over the tensor-parallel group, in place."""
    if rt.tp > 1:
        _split(layer, plan_for(layer, LAYER_PLAN), rt)
    return layer


def narrow(m: HybridAttention, rt: Runtime) -> HybridAttention:
    """A hybrid layer narrowed to this rank's heads (its projections are split by the plan)."""
    if rt.tp > 1:
        per = m.num_heads // rt.tp
        m.narrow_heads(rt.tp_rank * per, (rt.tp_rank + 1) * per)
    return m


def _split(module: nn.Module, plan: dict[str, str], rt: Runtime) -> None:
    styles = {name: _style(kind) for name, kind in plan.items() if not _is_split(module.get_submodule(name))}
    # every rank loaded the same weights: each keeps its own part (src_data_rank None: no scatter from rank 0)
    parallelize_module(module, mesh(rt)["tp"], styles, src_data_rank=None)
    for name in styles:
        module.get_submodule(name).tensor_parallel_style = plan[name]


def _is_split(m: nn.Module) -> bool:
    """Split already (its hooks are in place; `_split` marks what it styles): a second style would add its
    collectives twice."""
    return hasattr(m, "tensor_parallel_style")


@contextlib.contextmanager
def vocab_parallel_loss(model: nn.Module):
    """Inside the block (forward and backward) the LM head keeps each rank's vocabulary columns of the logits and the
    cross-entropy that transformers computes from them runs on those columns (torch's loss_parallel: two small
    all-reduces of [tokens] instead of gathering [tokens, vocab]). The loss is a replicated DTensor: `.to_local()`.
    A model without tensor parallelism is left as it is."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(inner, "lm_head", None)
    if getattr(head, "tensor_parallel_style", None) != "vocab_columns":
        yield model
        return
    head.keep_vocab_shards = True
    try:
        with loss_parallel():
            yield model
    finally:
        head.keep_vocab_shards = False


def _config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def head_sharded(model: nn.Module) -> set[int]:
    """ids of the plain tensors that hold only this rank's heads (phi/gamma of narrowed hybrid layers)."""
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, HybridAttention) and m.head_range is not None
        for _, p in m.hybrid_parameters()
    }


def placement(p: torch.Tensor, heads: set[int]) -> int | None:
    """The dimension along which this rank holds a part of parameter `p` (None: it holds all of it)."""
    if isinstance(p, DTensor):
        shard = [pl for pl in p.placements if isinstance(pl, Shard)]
        return shard[0].dim if shard else None
    return 0 if id(p) in heads else None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` as a plain tensor (a DTensor's local shard; a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor, dim: int | None, rt: Runtime) -> torch.Tensor:
    """The whole tensor of which `t` is this rank's part along `dim` (collective over the tensor-parallel group when
    dim is not None), detached. A DTensor says itself what it is: its shards gathered, its partial sums (the gradient
    of a replicated LoRA factor) added up, a replicated one as it is."""
    if isinstance(t, DTensor):
        return t.detach().full_tensor()
    t = t.detach()
    if dim is None or rt.tp == 1:
        return t
    return DTensor.from_local(t.contiguous(), mesh(rt)["tp"], [Shard(dim)], run_check=False).full_tensor()


def local_part(full: torch.Tensor, dim: int | None, rt: Runtime) -> torch.Tensor:
    """This rank's part of a whole tensor along `dim` (all of it when dim is None)."""
    if dim is None or rt.tp == 1:
        return full
    return full.chunk(rt.tp, dim)[rt.tp_rank]


def split_report(model: nn.Module, rt: Runtime) -> str:
    """One line on what this split left each rank: its parameter bytes against the whole model's, and the local
    shape of one split weight of each kind (from every rank; collective). Logged by the stages at tp > 1."""
    whole, shapes = 0, {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        whole += p.numel() * p.element_size()  # (a DTensor's numel is its whole tensor's)
        parts = [x for x in name.split(".") if x not in ("weight", "base_layer", "default") and not x.isdigit()]
        kind = ".".join(parts[-2:]) if parts[-1].startswith("lora_") else parts[-1]
        if isinstance(p, DTensor) and kind not in shapes:
            shapes[kind] = f"{kind} {list(local(p).shape)} of {list(p.shape)}"
    heads = head_sharded(model)
    narrowed = next((list(p.shape) for p in model.parameters() if id(p) in heads), None)
    held = parameter_bytes(model)
    ranks = runtime.gather_objects(rt, (rt.rank, held, f"{held:,} of {whole:,} parameter bytes"))
    fraction = max(r[1] for r in ranks) / whole
    parts = "; ".join(shapes.values()) + (f"; phi/gamma of the local heads {narrowed}" if narrowed else "")
    return (
        f"tensor parallel {rt.tp}: each rank holds at most {fraction:.3f} of the parameter bytes "
        f"({', '.join(f'rank {r}: {m}' for r, _, m in ranks)}); local parts: {parts}"
    )


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard; a tied weight once)."""
    seen, total = set(), 0
    for p in model.parameters():
        t = local(p)
        key = id(p) if t.is_meta else t.data_ptr()  # (meta tensors have no storage: a dry run counts each once)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
