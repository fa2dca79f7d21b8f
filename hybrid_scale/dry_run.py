"""`hybrid-scale plan --dry-run`: stage 1, stage 2 and evaluation set up and stepped at the model's real size, as
rank 0 of the configured mesh (launch.nodes x launch.procs_per_node ranks, launch.tensor_parallel), on the meta device
under torch's fake process group (torchtitan's dry run): no weights, no data, no GPU, and each collective is counted
but moves nothing.

It goes through what a rank does, with the stages' own code:
  stage 1: one decoder layer built and split as stage 1 streams it, its hybrid layer narrowed to the rank's heads,
  one step of distill_step.gradients (the batch gathered from the data-parallel groups, this rank's query blocks,
  the backward, the summed gradients) and AdamW;
  stage 2: the model built from its architecture, converted as `attention` configures it, finetune.prepare (phi/gamma
  trainable as asked, activation checkpointing, LoRA, the tensor-parallel split and the replicated engine), one
  micro-batch of finetune.micro_batch x seq_len tokens forward and backward through the engine, one optimizer step;
  evaluation: the converted model split as evaluation splits it, one perplexity forward.
It measures what this rank holds (weights, trainable state, gradients, AdamW moments), the collectives of a step, and
the checkpoint bytes (whole trainable tensors, fp32, with the moments). `plan` states the same figures from its
formulas; the dry run prints both and their ratio.

At launch.tensor_parallel = 1 stage 2 (and evaluation with eval.shard_weights) run under DeepSpeed ZeRO-3, whose
engine is not started here: it materialises its partitions (the 70B preset's would be 4.4 GB on this host) and its
collectives need real tensors. The dry run builds the same model with LoRA and runs its forward and backward (every
shape at its real size), and accounts the bytes by ZeRO-3's partitioning rule (each tensor cut into `ranks` equal
parts); those collectives are not counted.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .attention.hf.architectures import BY_MODEL_TYPE
from .attention.layer import HybridAttention
from .config import attention_settings
from .config.schema import Config
from .distill import step as distill_step
from .distributed import tensor_parallel
from .distributed.deepspeed import train_config
from .distributed.parallelize import parallelize
from .distributed.runtime import Runtime
from .errors import ConfigError
from .finetune.stage import prepare
from .models import streaming
from .models.convert import convert_model
from .preflight import plan as plan_module
from .preflight import shape
from .run.settings import Derived, derive

TOLERANCE = 0.10  # the dry run and plan agree within this, or the dry run says which figure does not


def dry_run(cfg: Config) -> dict:
    """Stage 2 of `cfg` as rank 0 of its mesh on the meta device (see the module docstring); collective: it starts
    and ends torch's fake process group, so nothing else may hold one. Returns {"measured", "plan", "rows"}."""
    import transformers.masking_utils as masking
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own (fake) process group; run it in a process without one")
    launch = cfg.launch
    world, tp = launch.nodes * launch.procs_per_node, launch.tensor_parallel
    arch, _ = shape.architecture(cfg)
    if not arch:
        raise ConfigError("config key 'model.path': the dry run needs the model's config.json or model.arch")
    dtype = getattr(torch, cfg.model.dtype)
    config = AutoConfig.for_model(arch["model_type"], **{k: v for k, v in arch.items() if k != "model_type"})
    config.architectures = config.architectures or [BY_MODEL_TYPE[config.model_type].hf_class]
    tensor_parallel.check_divisible(config, tp)
    rt = Runtime(0, world, 0, torch.device("meta"), tp, launch.timeout_min)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    find_packed = masking.find_packed_sequence_indices
    # transformers probes position ids for packed sequences by reading their values; meta tensors have none
    masking.find_packed_sequence_indices = lambda position_ids: None

    def converted():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return convert_model(model, cfg.attention)

    derived = derive(cfg)
    try:
        measured = {
            "stage 1": _stage1(cfg, derived, config, rt, dtype),
            "stage 2": _stage2(cfg, derived, converted(), rt, dtype),
            "evaluate": _evaluate(cfg, converted(), rt),
        }
    finally:
        masking.find_packed_sequence_indices = find_packed
        dist.destroy_process_group()
        tensor_parallel.forget_meshes()
    planned = plan_module.plan(cfg).figures
    return {
        stage: {"measured": m, "plan": planned.get(stage, {}), "rows": compare(m, planned.get(stage, {}))}
        for stage, m in measured.items()
    }


def _stage1(cfg: Config, derived: Derived, config, rt: Runtime, dtype: torch.dtype) -> dict:
    """One decoder layer as stage 1 builds it (split over the tensor-parallel ranks), its hybrid layer narrowed to
    this rank's heads with what stage 1 trains, and one step of distill_step.gradients (the batch gathered from the
    data-parallel groups, this rank's query blocks, the backward, the summed gradients) and AdamW."""
    distill, T = cfg.distill, cfg.data.seq_len
    with torch.device("meta"):
        layer = streaming.model_class(config, "DecoderLayer")(config, 0).to(dtype)
    tensor_parallel.split_layer(layer, rt)
    for p in layer.parameters():
        p.requires_grad_(False)
    m = HybridAttention.from_softmax(layer.self_attn, config, 0, attention_settings(cfg.attention), torch.float32)
    tensor_parallel.narrow(m, rt)
    params = distill_step.trainable(m, cfg, derived)
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=distill.lr)
    buf_dtype = getattr(torch, distill.buffer_dtype)
    stage = SimpleNamespace(cfg=cfg, rt=rt, config=config, dtype=dtype, buf_dtype=buf_dtype, weights=derived.objectives)
    stage.rope = streaming.rotary(config, T, dtype, rt.device)
    batch = list(range(min(distill.batch_size, cfg.data.num_sequences)))
    rows = [g for g in batch if rt.dp == 1 or g % rt.dp == rt.dp_rank]  # the sequences this rank's group holds
    staged = torch.zeros(len(rows), T, config.hidden_size, dtype=buf_dtype, device=rt.device)
    calls = {}
    with recorded() as calls["step"]:
        distill_step.gradients(stage, distill_step.Trained(0, m, layer, params), staged, batch, rows, False)
        opt.step()
    trainable = sum(p.numel() for p in params)
    return {
        "layer_weights_bytes": tensor_parallel.parameter_bytes(layer),
        "trainable_params": trainable,
        "optimizer_bytes": sum(_local_bytes(v) for st in opt.state.values() for k, v in st.items() if k != "step"),
        "collectives_per_step": sum(calls["step"].values()),
        "calls": calls,
        "where": f"one layer split over {rt.tp} tensor-parallel ranks" if rt.tp > 1 else "one whole layer",
        "note": f"a step of {len(batch)} x {T} tokens over {rt.dp} data-parallel group(s)",
    }


def _stage2(cfg: Config, derived: Derived, model, rt: Runtime, dtype: torch.dtype) -> dict:
    """finetune.prepare on the meta model, one micro-batch through the engine, one optimizer step."""
    finetune = cfg.finetune
    ds_config = train_config(finetune, dtype, rt.dp)
    engine, peft_model, _ = prepare(model, cfg, rt, ds_config if rt.tp > 1 else None)
    named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    ids = torch.zeros(finetune.micro_batch, derived.stage2_seq_len, dtype=torch.long, device="meta")
    calls = {}
    with recorded() as calls["forward"]:
        loss = (engine or peft_model)(input_ids=ids, labels=ids).loss
    with recorded() as calls["backward"]:
        (engine.backward if engine else torch.Tensor.backward)(loss)
    accumulation = ds_config["gradient_accumulation_steps"]
    if engine is not None:
        engine.micro_steps = accumulation - 1  # this micro-batch ends the optimizer step
        with recorded() as calls["step"]:
            engine.step()
        measured = _replicated_state(peft_model, engine, named, rt)
        per_micro = sum(calls["forward"].values()) + sum(calls["backward"].values())
        measured["collectives_per_step"] = accumulation * per_micro + sum(calls["step"].values())
    else:
        measured = _zero3_state(peft_model, named, rt.world, dtype)
    heads = tensor_parallel.head_sharded(peft_model)
    measured["checkpoint_bytes"] = sum(_whole_numel(p, rt, heads) for _, p in named) * (4 + 8)
    measured["calls"] = calls
    measured["note"] = f"{accumulation} micro-batch(es) of {finetune.micro_batch} x {ids.shape[1]} tokens per step"
    return measured


def _evaluate(cfg: Config, model, rt: Runtime) -> dict:
    """The converted model as evaluation splits it (train=False: the logits gathered), one perplexity forward of
    eval.ppl_seq_len tokens without gradients. With eval.shard_weights (ZeRO-3 inference at tensor_parallel 1) the
    weights are accounted by ZeRO-3's rule and the forward runs unsharded."""
    evaluation = cfg.eval
    _, model = parallelize(model, rt=rt)
    ids = torch.zeros(1, evaluation.ppl_seq_len, dtype=torch.long, device="meta")
    calls = {}
    with torch.no_grad(), recorded() as calls["forward"]:
        model.eval()(input_ids=ids)
    measured = {"calls": calls, "note": f"one model, a {evaluation.ppl_seq_len}-token forward"}
    if rt.tp > 1:
        measured["weights_bytes"] = tensor_parallel.parameter_bytes(model)
        measured["collectives_per_forward"] = sum(calls["forward"].values())
        measured["where"] = f"split over {rt.tp} tensor-parallel ranks"
    elif evaluation.shard_weights:
        measured["weights_bytes"] = sum(math.ceil(p.numel() / rt.world) * p.element_size() for p in model.parameters())
        measured["where"] = f"ZeRO-3 partitions over {rt.world} ranks (DeepSpeed's rule; its engine is not started)"
    else:
        measured["weights_bytes"] = tensor_parallel.parameter_bytes(model)
        measured["where"] = "the whole model on every rank"
    return measured


COLLECTIVES = {  # module -> the functions that start a collective (DTensor calls the functional ones by module)
    "torch.distributed": ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                          "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all_single",
                          "all_gather_object", "broadcast_object_list"),
    "torch.distributed._functional_collectives": (
        "all_reduce", "all_reduce_coalesced", "all_gather_single", "all_gather_single_autograd", "all_gather_tensor",
        "all_gather_tensor_autograd", "reduce_scatter_single", "reduce_scatter_single_autograd",
        "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd",
        "broadcast",
    ),
}  # fmt: skip


@contextlib.contextmanager
def recorded():
    """A Counter of the collectives started inside the block, by function ("all_reduce", "funcol.all_reduce"); a
    collective that calls another counts once."""
    import importlib

    counts, depth, saved = Counter(), [0], []

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if not depth[0]:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for module_name, names in COLLECTIVES.items():
        module = importlib.import_module(module_name)
        prefix = "funcol." if "functional" in module_name else ""
        for name in names:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrap(prefix + name, getattr(module, name)))
    try:
        yield counts
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _local_bytes(t: torch.Tensor) -> int:
    t = tensor_parallel.local(t)
    return t.numel() * t.element_size()


def _whole_numel(p: torch.Tensor, rt: Runtime, heads: set[int]) -> int:
    """Elements of the whole tensor of which p is this rank's part (a DTensor's numel is its whole tensor's; phi/gamma
    narrowed to the local heads are one of tp equal parts)."""
    return p.numel() * (rt.tp if id(p) in heads else 1)


def _replicated_state(model, engine, named, rt) -> dict:
    trainable = sum(_local_bytes(p) for _, p in named)
    moments = sum(_local_bytes(v) for st in engine.optimizer.state.values() for k, v in st.items() if k != "step")
    return {
        "weights_bytes": tensor_parallel.parameter_bytes(model) - trainable,
        "trainable_params": sum(tensor_parallel.local(p).numel() for _, p in named),
        "trainable_bytes": trainable,
        "gradient_bytes": trainable,  # fp32, as the parameters (each rank's part of each)
        "optimizer_bytes": moments,
        "where": f"split over {rt.tp} tensor-parallel ranks; trainable state fp32, replicated over {rt.dp}",
    }


def _zero3_state(model, named, world: int, dtype: torch.dtype) -> dict:
    """ZeRO-3's partitioning rule, applied to the real model's tensors: each cut into `world` equal parts."""
    per_rank = lambda p: math.ceil(p.numel() / world)  # noqa: E731
    trained = {id(p) for _, p in named}
    width = torch.finfo(dtype).bits // 8
    frozen = [p for p in model.parameters() if id(p) not in trained]
    params = sum(per_rank(p) for _, p in named)
    return {
        "weights_bytes": sum(per_rank(p) for p in frozen) * width,
        "trainable_params": params,
        "trainable_bytes": params * (4 + width),  # fp32 masters and the model's own copy
        "gradient_bytes": params * width,
        "optimizer_bytes": params * 8,
        "where": f"ZeRO-3 partitions over {world} ranks (DeepSpeed's rule; its engine is not started)",
    }


FIGURES = (  # (key, label, unit)
    ("layer_weights_bytes", "layer weights per rank", "GB"),
    ("weights_bytes", "weights per rank", "GB"),
    ("trainable_params", "trainable parameters per rank", "M"),
    ("trainable_bytes", "trainable weights per rank", "GB"),
    ("gradient_bytes", "gradients per rank", "GB"),
    ("optimizer_bytes", "AdamW moments per rank", "GB"),
    ("checkpoint_bytes", "checkpoint per step dir", "GB"),
    ("collectives_per_step", "collectives per optimizer step", ""),
    ("collectives_per_forward", "collectives per forward", ""),
)


def compare(measured: dict, planned: dict) -> list[dict]:
    """One row per figure: the dry run's, plan's, their ratio, and whether they agree within TOLERANCE."""
    rows = []
    for key, label, unit in FIGURES:
        if key not in measured:
            continue
        m, p = measured[key], planned.get(key)
        ratio = (p / m if m else (1.0 if not p else math.inf)) if p is not None else None
        ok = ratio is not None and abs(ratio - 1) <= TOLERANCE
        rows.append({"figure": label, "key": key, "unit": unit, "dry_run": m, "plan": p, "ratio": ratio, "ok": ok})
    return rows


def table(result: dict) -> str:
    def show(x, unit):
        if x is None:
            return "-"
        return f"{x / 1e9:.3f}" if unit == "GB" else f"{x / 1e6:.2f}" if unit == "M" else f"{x:,}"

    lines, bad = [], []
    for stage, r in result.items():
        m = r["measured"]
        lines += [
            f"dry run of {stage} (rank 0; {m['where']}; {m['note']})",
            f"{'figure':<32} {'unit':<4} {'dry run':>12} {'plan':>12} {'plan/dry':>9}",
        ]
        for row in r["rows"]:
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
            lines.append(
                f"{row['figure']:<32} {row['unit']:<4} {show(row['dry_run'], row['unit']):>12} "
                f"{show(row['plan'], row['unit']):>12} {ratio:>9}{'' if row['ok'] else '  DIFFERS'}"
            )
            if not row["ok"]:
                bad.append(f"{stage}: {row['figure']}")
        for phase, calls in m["calls"].items():
            counted = ", ".join(f"{op} x{n}" for op, n in sorted(calls.items())) or "none recorded"
            lines.append(f"collectives in the {phase}: {counted}")
        lines.append("")
    agree = f"dry run: plan agrees within {TOLERANCE:.0%}"
    lines.append(agree if not bad else f"dry run: plan differs in {'; '.join(bad)}")
    return "\n".join(lines)
