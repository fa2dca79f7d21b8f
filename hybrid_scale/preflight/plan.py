"""Preflight (`hybrid-scale plan`): what a run will need before it is queued, from the config and the model's
architecture alone (no weights are read): per-rank memory of each stage, stage-1 buffer disk, checkpoint sizes,
rough times; and the checks that would doom it (paths, tokenizer, architecture, tensor-parallel divisibility, free
disk). Estimates are deliberately simple formulas, stated in the table; they are for catching impossible shapes,
not for tuning. The per-stage figures (`Plan.figures`) are what `plan --dry-run` (dry_run.py) checks against the real
model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from ..attention.architectures import BY_MODEL_TYPE, base_model_type
from ..config import STAGES
from ..data import assets, passkey
from ..data.batches import units_per_step
from ..distributed import tensor_parallel
from ..distributed.slurm import REQUEUE_MARGIN_S, grace_s
from ..errors import ConfigError
from ..measure import training_flops
from ..models import streaming
from ..run.resolved import Resolved
from . import inputs

SUPPORTED_TYPES = tuple(BY_MODEL_TYPE)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9
MFU = 0.35  # assumed model-flops utilisation for the rough times
SAVE_BYTES_PER_S = 0.5e9  # assumed write speed of a checkpoint (gather + shared file system)
READ_BYTES_PER_S = 2e9  # assumed checkpoint read rate per node at start-up (shared file system)
CPU_FLOPS = 1e11  # assumed forward rate on CPU (SmolLM2-135M's passkey probe: ~3.3 min per mode on 2 cores)


@dataclass
class Plan:
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, quantity, value)
    problems: list[str] = field(default_factory=list)  # blocking
    warnings: list[str] = field(default_factory=list)  # the run works, but wastes something
    scope: dict[str, tuple[str, ...]] = field(default_factory=dict)  # problem -> the stages it blocks
    figures: dict[str, dict] = field(default_factory=dict)  # stage -> {figure: value}, what the dry run checks

    def block(self, message: str, *stages: str) -> None:
        self.problems.append(message)
        self.scope[message] = stages or STAGES

    def blocking(self, stage: str | None = None) -> list[str]:
        return [m for m in self.problems if stage is None or stage in self.scope.get(m, STAGES)]

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        width = max(len(q) for _, q, _ in self.rows) if self.rows else 10
        lines = [f"{'stage':<9} {'quantity':<{width}}  value", "-" * (width + 40)]
        lines += [f"{s:<9} {q:<{width}}  {v}" for s, q, v in self.rows]
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines += [f"BLOCKING ({', '.join(self.scope.get(p, STAGES))}): {p}" for p in self.problems]
        lines.append("plan: OK" if self.ok else f"plan: {len(self.problems)} blocking problem(s)")
        return "\n".join(lines)


def decay_params(cfg, c: dict) -> int:
    """One layer's LA decay parameters: rho per KV head (attention.la_decay)."""
    return c["K"] if cfg.attention.la_decay else 0


def architecture(cfg, base: Path | None = None) -> tuple[dict, str]:
    """The model's HF config dict: from the stage's input (`base`; an export's hybrid_scale_* type counts as its base
    architecture), else model.path when it is on disk, else the preset's model.arch."""
    if base is not None and (base / "config.json").is_file():
        a = json.loads((base / "config.json").read_text())
        a["model_type"] = base_model_type(a.get("model_type"))
        return a, str(base / "config.json")
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        return json.loads((Path(cfg.model.path) / "config.json").read_text()), str(Path(cfg.model.path) / "config.json")
    if cfg.model.arch:
        return OmegaConf.to_container(cfg.model.arch), "model.arch"
    if not cfg.model.path:
        path = assets.require().model
        return json.loads((path / "config.json").read_text()), str(path / "config.json")
    return {}, ""


def counts(a: dict) -> dict:
    D, L, V, inter = a["hidden_size"], a["num_hidden_layers"], a["vocab_size"], a["intermediate_size"]
    H, K = a["num_attention_heads"], a.get("num_key_value_heads", a["num_attention_heads"])
    hd = a.get("head_dim") or D // H
    attn = D * H * hd * 2 + D * K * hd * 2
    layer = attn + 3 * D * inter + 2 * D
    embed = V * D * (1 if a.get("tie_word_embeddings") else 2)
    return {
        "D": D,
        "L": L,
        "V": V,
        "H": H,
        "K": K,
        "hd": hd,
        "layer": layer,
        "embed": embed,
        "total": embed + L * layer,
    }


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def _free_at(path: Path) -> tuple[Path, int]:
    probe = next((q for q in (path, *path.parents) if q.exists()), Path("."))
    return probe, shutil.disk_usage(probe).free


def _stored_bytes(base: Path) -> tuple[int, int]:
    """(bytes on disk, bytes per element) of a safetensors checkpoint, from file sizes and one header."""
    from safetensors import safe_open

    files = sorted(base.glob("*.safetensors"))
    if not files:
        return 0, 0
    with safe_open(files[0], "pt") as f:
        names = list(f.keys())
        dtype = f.get_slice(names[0]).get_dtype() if names else "F32"
    return sum(x.stat().st_size for x in files), streaming.SAFETENSORS_BYTES.get(dtype, 4)


@dataclass
class Shape:
    """What every estimate reads: the architecture's config dict, its counts, the ranks, bytes per weight."""

    a: dict
    c: dict
    ranks: int
    wbytes: int
    fdim: int  # the feature map's output size per head
    tp: int = 1  # launch.tensor_parallel


def plan(cfg, stage: str | None = None, resolved: Resolved | None = None) -> Plan:
    """The table and the blocking problems; `stage` (finetune / evaluate / export) plans from the base of the model
    that stage reads (resolved.model, checked by then); stage 1 and `plan` itself plan from model.path / model.arch."""
    p = Plan()
    r = resolved or Resolved.of(cfg, stage)
    base = r.model.base if stage in ("finetune", "evaluate", "export") else None
    a, source = architecture(cfg, base)
    lc = cfg.launch
    if not a:
        p.block(
            f"model.path {cfg.model.path} has no config.json and no model.arch is given: point model.path at a local "
            "Hugging Face directory (or use a preset that carries model.arch)"
        )
        return p
    model_type = a.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        p.block(f"architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
        return p
    c = counts(a)
    fdim = 2 * (cfg.attention.feature_dim or c["hd"]) if cfg.attention.feature_map == "hedgehog" else c["hd"]
    sh = Shape(a, c, lc.nodes * lc.procs_per_node, DTYPE_BYTES[cfg.model.dtype], fdim, lc.tensor_parallel)
    _check_shape_and_path(p, cfg, sh)
    p.rows += [
        ("model", "architecture", f"{model_type} ({source})"),
        ("model", "parameters", f"{c['total'] / 1e9:.2f} B ({_gb(c['total'] * sh.wbytes)} in {cfg.model.dtype})"),
        ("model", "layers x heads / KV heads", f"{c['L']} x {c['H']} / {c['K']} (head_dim {c['hd']})"),
        (
            "launch",
            "ranks",
            f"{lc.nodes} node(s) x {lc.procs_per_node} = {sh.ranks} (tensor parallel {lc.tensor_parallel})",
        ),
    ]
    s1_mem, s1_disk, flops1, tokens1 = _stage1(p, cfg, sh, r)
    s2_mem, ckpt, flops2, tokens2 = _stage2(p, cfg, sh, r)
    if lc.gpu_tflops:
        rate = sh.ranks * lc.gpu_tflops * 1e12 * MFU
        p.rows += [
            (
                "time",
                "stage 1 (rough)",
                f"~{flops1 / rate / 3600:.2f} h ({tokens1 / 1e6:.1f} M tokens x {c['L']} layers)",
            ),
            ("time", "stage 2 (rough)", f"~{flops2 / rate / 3600:.2f} h ({tokens2 / 1e6:.1f} M tokens)"),
        ]
        step1 = flops1 / rate / (c["L"] * d_steps(cfg))
        step2 = flops2 / rate / max(1, cfg.finetune.max_steps)
        _requeue(p, cfg, {"distill": (step1, 0.0), "finetune": (step2, ckpt / SAVE_BYTES_PER_S)})
    _load(p, cfg, sh, base)
    eval_mem = _evaluation(p, cfg, sh)
    _device_fit(p, cfg, s1_mem, s2_mem, eval_mem)
    _disk(p, cfg, sh, s1_disk, ckpt, r)
    _export(p, cfg, sh, base, r)
    return p


def _check_shape_and_path(p: Plan, cfg, sh: Shape) -> None:
    tp = cfg.launch.tensor_parallel
    for name in tensor_parallel.SPLIT_SIZES:  # what the plan splits: heads, MLP columns, the vocabulary
        n = sh.a.get(name, sh.c["H"] if name == "num_key_value_heads" else None)
        if n is not None and n % tp:
            p.block(
                f"{name} = {n} is not divisible by launch.tensor_parallel = {tp}: it is split into equal parts over "
                f"the tensor-parallel ranks; choose a divisor of {n}",
                "distill",
                "finetune",
                "evaluate",
            )
    path = Path(cfg.model.path) if cfg.model.path else None  # stage 1 reads it; later stages read their inputs
    if path is not None and not (path / "config.json").is_file():
        p.block(f"model.path {path} is not a Hugging Face model directory (no config.json); set model.path", "distill")
    elif path is not None:
        if not any((path / t).is_file() for t in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            p.block(f"model.path {path} has no tokenizer files; copy the tokenizer next to the weights", "distill")
        if not any(path.glob("*.safetensors")):
            p.block(f"model.path {path} has no safetensors weights (stage 1 streams safetensors shards)", "distill")


def _stage1(p: Plan, cfg, sh: Shape, r: Resolved) -> tuple[float, float, float, float]:
    """Stage 1: one layer (its heads and MLP columns split over tensor_parallel ranks) + a batch; the embedding only
    while building layer 0's inputs. The query blocks of a step are split over the data-parallel groups, and the
    ranks of a group hold the same sequences. (memory, buffer disk, flops, tokens)"""
    a, c, d, ranks, tp = sh.a, sh.c, cfg.distill, sh.ranks, sh.tp
    dp = ranks // tp
    N, T = cfg.data.num_sequences, cfg.data.seq_len
    n_local = -(-N // dp)
    B = d.batch_size
    blocks = -(-T // d.query_block)
    units = units_per_step(B, T, d.query_block)
    per_rank = -(-units // dp)
    touched = min(B, -(-per_rank // blocks) + 1)  # sequences a rank projects (its units are contiguous)
    batch = B * T * c["D"] * DTYPE_BYTES[d.buffer_dtype]  # the step's whole batch, on every rank
    # hidden states, then this rank's q/k/v/features and teacher MLP columns
    acts = touched * T * (c["D"] * 2 + (c["D"] * 6 + a["intermediate_size"] * 3) / tp) * 4
    block = per_rank * c["H"] / tp * min(d.query_block, T) * T * 4 * 6  # score blocks kept for the backward, fp32
    s1_mem = c["layer"] * sh.wbytes / tp + c["V"] * c["D"] * sh.wbytes + batch + acts + block
    s1_disk = 2 * n_local * T * c["D"] * DTYPE_BYTES[d.buffer_dtype]
    weights = r.derived.objectives
    maps = (c["H"] + c["K"]) * c["hd"] * (sh.fdim // 2) if cfg.attention.feature_map == "hedgehog" else 0
    trained = (maps if d.train_feature_maps else 0) + (c["H"] if r.derived.train_gamma else 0)
    if weights.get("hybrid_output_mse") or weights.get("output_mse"):  # the LA's decay (distill.step.trainable)
        trained += decay_params(cfg, c)
    p.figures["stage 1"] = {  # per rank, one layer
        "layer_weights_bytes": c["layer"] * sh.wbytes / tp,
        "trainable_params": trained / tp,
        "optimizer_bytes": trained / tp * 8,
        "collectives_per_step": (B if dp > 1 else 0) + 1,  # the batch's broadcasts between groups, the gradients'
    }
    tokens1 = N * T * d.epochs
    # per layer: feature maps, the T^2 score rows of the objective (forward + backward), the teacher layer's forward
    scores = 3 * 2 * N * T * T * c["H"] * (c["hd"] + sh.fdim) * d.epochs
    flops1 = c["L"] * (6 * tokens1 * c["H"] * c["hd"] * sh.fdim + scores + 2 * N * T * c["layer"])
    p.rows += [
        (
            "stage 1",
            "per-rank memory",
            f"~{_gb(s1_mem)} (one layer{f' / {tp}' if tp > 1 else ''} + embedding + batch of {B} x {T})",
        ),
        (
            "stage 1",
            "work per step",
            f"{units} query blocks ({B} seq x {blocks} of {min(d.query_block, T)} rows) over {dp} "
            f"{'data-parallel groups' if tp > 1 else 'ranks'}: {per_rank} per {'group' if tp > 1 else 'rank'}"
            + (f", {c['H'] // tp} of {c['H']} heads per rank" if tp > 1 else ""),
        ),
        (
            "stage 1",
            f"hidden-state buffers per {'tensor-parallel group' if tp > 1 else 'rank'}",
            f"{_gb(s1_disk)} (2 x {n_local} seq x {T} x {c['D']})",
        ),
    ]
    if units < dp:
        p.warnings.append(
            f"stage 1 leaves {(dp - units) * tp} of {ranks} ranks idle every step: a step has {units} query blocks "
            f"(distill.batch_size {B} x {blocks}); raise distill.batch_size or lower distill.query_block to at most "
            f"{max(1, T * B // dp)}"
        )
    return s1_mem, s1_disk, flops1, tokens1


def d_steps(cfg) -> int:
    """Stage 1's optimizer steps per layer."""
    return cfg.distill.epochs * -(-cfg.data.num_sequences // cfg.distill.batch_size)


def _requeue(p: Plan, cfg, per_stage: dict[str, tuple[float, float]]) -> None:
    """After USR1 (slurm.signal_lead_s before the time limit) a stage finishes its step and saves; torchrun waits
    grace_s for that before SIGKILL. Each stage's (step seconds, save seconds) should fit in it (a warning: the
    estimates are rough, and a stage that misses it only loses the work since its last checkpoint)."""
    lead, grace = cfg.slurm.signal_lead_s, grace_s(cfg)
    p.rows += [
        ("requeue", "signal lead", f"{lead} s before the time limit (slurm.signal_lead_s)"),
        (
            "requeue",
            "torchrun grace",
            f"{grace} s from TERM to SIGKILL (--shutdown-timeout: lead - {REQUEUE_MARGIN_S})",
        ),
    ]
    for stage, (step, save) in per_stage.items():
        need = step + save
        p.rows.append(("requeue", f"{stage}: step + save", f"~{need:.2f} s (step ~{step:.2f} s, save ~{save:.2f} s)"))
        if need > grace and cfg.model.device.startswith("cuda"):  # the Slurm presets; a laptop run has no limit
            p.warnings.append(
                f"{stage} needs ~{need:.0f} s to finish its step and save after a signal but torchrun's grace is "
                f"{grace} s (a job at its time limit would be killed mid-save and lose the step's work): raise "
                f"slurm.signal_lead_s to at least {int(need) + REQUEUE_MARGIN_S + 30}"
            )


def _stage2(p: Plan, cfg, sh: Shape, r: Resolved) -> tuple[float, float, float, float]:
    """Stage 2: ZeRO-3 partitions weights, gradients and optimizer state of the trainable part over the ranks; at
    tensor_parallel > 1 the weights are split over the tensor-parallel ranks and the trainable state (fp32 weights,
    gradients, AdamW moments) is replicated. (memory, checkpoint size, flops, tokens)"""
    a, c, f, ranks, wbytes, tp = sh.a, sh.c, cfg.finetune, sh.ranks, sh.wbytes, sh.tp
    T2 = r.derived.stage2_seq_len
    D, qo, kv, inter = c["D"], c["H"] * c["hd"], c["K"] * c["hd"], a["intermediate_size"]
    shapes = {  # (in, out, split): a column-wise linear splits its out (LoRA's B), a row-wise one its in (LoRA's A)
        "q_proj": (D, qo, "out"),
        "k_proj": (D, kv, "out"),
        "v_proj": (D, kv, "out"),
        "o_proj": (qo, D, "in"),
        "gate_proj": (D, inter, "out"),
        "up_proj": (D, inter, "out"),
        "down_proj": (inter, D, "in"),
    }
    lora = lora_rank = 0
    for t in f.lora_targets:
        n_in, n_out, split = shapes.get(t, (D, D, "out"))
        lora += c["L"] * f.lora_r * (n_in + n_out)
        lora_rank += c["L"] * f.lora_r * ((n_in + n_out // tp) if split == "out" else (n_in // tp + n_out))
    phi = c["L"] * (c["H"] + c["K"]) * c["hd"] * (sh.fdim // 2 if cfg.attention.feature_map == "hedgehog" else 0)
    hybrid = (phi if f.train_feature_maps else 0) + (c["L"] * c["H"] if f.train_gamma else 0)
    hybrid += c["L"] * decay_params(cfg, c) if f.train_decay else 0
    trainable = lora + hybrid
    if tp > 1:  # (finetune.offload is refused with tensor parallelism)
        per_rank = lora_rank + hybrid // tp  # LoRA's whole factors replicated, the split ones and phi/gamma in parts
        weights, states = c["total"] * wbytes / tp, per_rank * (4 + 4 + 8)
        figures = {"weights_bytes": weights, "trainable_params": per_rank, "trainable_bytes": per_rank * 4}
        figures |= {"gradient_bytes": per_rank * 4, "optimizer_bytes": per_rank * 8}
        accumulation = f.global_batch // (f.micro_batch * sh.ranks // tp)
        # per micro-batch: forward 2 all-reduces per block, the embedding's, the loss-parallel cross-entropy's 3;
        # backward 2 per block, and with activation checkpointing the recomputed attention output's (the recompute
        # stops before the MLP's) and one more (as the dry run counts them); per optimizer step: the data-parallel
        # gradients' (dp > 1), LoRA's replicated factors', the clipping norm's
        backward = 3 * c["L"] + 1 if f.gradient_checkpointing else 2 * c["L"]
        per_micro = 2 * c["L"] + 1 + 3 + backward
        figures["collectives_per_step"] = accumulation * per_micro + (sh.ranks > tp) + (lora > 0) + 1
    else:
        weights = 0 if f.offload else c["total"] * wbytes / ranks
        states = 0 if f.offload else trainable * (4 + 8 + wbytes) / ranks
        part = trainable / ranks
        figures = {"weights_bytes": c["total"] * wbytes / ranks, "trainable_params": part}
        figures |= {"trainable_bytes": part * (4 + wbytes), "gradient_bytes": part * wbytes}
        figures["optimizer_bytes"] = part * 8
    act_layers = c["L"] if f.gradient_checkpointing else c["L"] * 12
    s2_acts = (
        f.micro_batch * T2 * c["D"] * wbytes * act_layers
        + f.micro_batch * T2 * (c["D"] * 10 + (a["intermediate_size"] * 4 + c["V"]) / tp) * 4  # (MLP, logits split)
    )
    gathered = 2 * c["layer"] * wbytes if tp == 1 else 0  # ZeRO-3 gathers a layer (and prefetches the next)
    s2_mem = weights + states + s2_acts + gathered
    ckpt = trainable * (4 + 8)
    p.figures["stage 2"] = figures | {"checkpoint_bytes": ckpt}
    tokens2 = f.max_steps * f.global_batch * T2
    p.rows += [
        (
            "stage 2",
            "trainable parameters",
            f"{trainable / 1e6:.1f} M (LoRA r={f.lora_r} on {', '.join(f.lora_targets)})",
        ),
        (
            "stage 2",
            "per-rank memory",
            f"~{_gb(s2_mem)} (weights/{ranks}, states, activations, 2 gathered layers)"
            if tp == 1
            else f"~{_gb(s2_mem)} (weights/{tp} split by tensor parallelism, fp32 trainable state, activations)",
        ),
        ("stage 2", "checkpoint size", f"{_gb(ckpt)} per step dir (fp32 weights + AdamW moments; no base)"),
        ("stage 2", "CPU offload", "on (weights and optimizer state in host memory)" if f.offload else "off"),
    ]
    return s2_mem, ckpt, training_flops(c["total"], tokens2), tokens2


def _load(p: Plan, cfg, sh: Shape, base: Path | None) -> None:
    """What stage 2 and evaluation read at start-up, per rank and per node, and how long that takes at
    READ_BYTES_PER_S per node (an assumed shared-filesystem rate): at tensor_parallel > 1 each rank reads only its
    part (all ranks at once); at 1 every rank reads the whole checkpoint (transformers' from_pretrained, then ZeRO-3
    keeps its partition)."""
    lc = cfg.launch
    stored = _stored_bytes(base)[0] if base is not None else 0
    if not stored and cfg.model.path:
        stored = _stored_bytes(Path(cfg.model.path))[0]
    whole = stored or sh.c["total"] * sh.wbytes
    rank = whole / sh.tp
    node = rank * lc.procs_per_node
    seconds = node / READ_BYTES_PER_S
    how = f"its 1/{sh.tp} of each weight" if sh.tp > 1 else "the whole checkpoint"
    p.rows.append(
        (
            "load",
            "read per rank (stage 2, evaluate)",
            f"{_gb(rank)}: {how}; {_gb(node)} per node, ~{seconds:,.0f} s at an assumed {READ_BYTES_PER_S / GB:g} GB/s "
            f"(launch.timeout_min = {lc.timeout_min:g} min)",
        )
    )
    if seconds > lc.timeout_min * 60 / 2:
        p.warnings.append(
            f"the start-up read (~{seconds / 60:,.0f} min per node at {READ_BYTES_PER_S / GB:g} GB/s) is over half of "
            f"launch.timeout_min = {lc.timeout_min:g}; raise launch.timeout_min"
        )


def passkey_estimate(cfg, params: int, lead: int = passkey.LEAD) -> str:
    """The passkey probe's modes, prompts, tokens and rough time (a forward of 2 x params FLOPs per token, at
    launch.gpu_tflops x MFU per rank on a GPU, else an assumed CPU_FLOPS); "" when it does not run."""
    e = cfg.eval
    modes = passkey.probe_modes(e)
    if not modes:
        return ""
    tokens = passkey.probe_tokens(list(e.passkey_distances), e.passkey_trials, lead) * len(modes)
    gpu = cfg.model.device != "cpu" and cfg.launch.gpu_tflops
    rate = cfg.launch.gpu_tflops * 1e12 * MFU if gpu else CPU_FLOPS
    minutes = 2 * params * tokens / rate / 60
    why = " (eval.passkey_modes unset: the evaluated modes)" if e.passkey_modes is None else ""
    prompts = len(e.passkey_distances) * e.passkey_trials
    return (
        f"{prompts} prompts x {len(modes)} mode(s){why}: {', '.join(modes)}; {tokens / 1e3:,.0f} k tokens, "
        f"~{minutes:.1f} min at {'launch.gpu_tflops x ' + str(MFU) if gpu else f'an assumed {CPU_FLOPS:.0e} FLOP/s'}"
    )


def _evaluation(p: Plan, cfg, sh: Shape) -> float:
    """The whole model on every rank (or partitioned with eval.shard_weights; loaded partitioned too), the base and
    the converted model both (when `base` is among the modes), one perplexity forward."""
    a, c, e, ranks = sh.a, sh.c, cfg.eval, sh.ranks
    copies = 2 if "base" in e.modes and len(set(e.modes)) > 1 else 1
    parts = ranks if e.shard_weights else sh.tp
    eval_weights = copies * c["total"] * sh.wbytes / parts
    eval_acts = e.ppl_seq_len * (c["D"] * 12 + a["intermediate_size"] * 3 + c["V"] * 2) * 4
    eval_mem = eval_weights + eval_acts + (2 * c["layer"] * sh.wbytes if e.shard_weights else 0)
    p.figures["evaluate"] = {"weights_bytes": c["total"] * sh.wbytes / parts}  # one model
    if sh.tp > 1:  # 2 all-reduces per block, the embedding's, the logits' gather
        p.figures["evaluate"]["collectives_per_forward"] = 2 * c["L"] + 2
    how = f"{copies} model(s)" + (f" / {ranks} ranks" if e.shard_weights else "")
    how += f" / {sh.tp} (tensor parallel)" if sh.tp > 1 else ""
    p.rows.append(("evaluate", "per-rank memory", f"~{_gb(eval_mem)} ({how}, a {e.ppl_seq_len}-token forward)"))
    if probe := passkey_estimate(cfg, c["total"], max(passkey.LEAD, cfg.attention.sinks)):
        p.rows.append(("evaluate", "passkey probe", probe))
    return eval_mem


def _device_fit(p: Plan, cfg, s1_mem: float, s2_mem: float, eval_mem: float) -> None:
    lc = cfg.launch
    device_gb = lc.gpu_memory_gb * GB if lc.gpu_memory_gb else None
    if not (cfg.model.device.startswith("cuda") and device_gb):
        return
    for stage_name, mem, fix in (
        ("stage 1", s1_mem, "lower distill.batch_size or data.seq_len"),
        (
            "stage 2",
            s2_mem,
            "enable finetune.offload, lower finetune.micro_batch or finetune.seq_len, or add ranks"
            if lc.tensor_parallel == 1
            else "raise launch.tensor_parallel, lower finetune.micro_batch or finetune.seq_len",
        ),
        (
            "evaluate",
            eval_mem,
            "add ranks (launch.nodes), lower eval.ppl_seq_len or leave 'base' out of eval.modes"
            if cfg.eval.shard_weights
            else "set eval.shard_weights=true (ZeRO-3 inference) or raise launch.tensor_parallel",
        ),
    ):
        if mem > device_gb:
            p.block(
                f"{stage_name} needs ~{_gb(mem)} per rank but launch.gpu_memory_gb is {lc.gpu_memory_gb}: {fix}",
                {"stage 1": "distill", "stage 2": "finetune"}.get(stage_name, stage_name),
            )


def _disk(p: Plan, cfg, sh: Shape, s1_disk: float, ckpt: float, r: Resolved) -> None:
    lc = cfg.launch
    buffer_dir = r.layout.buffers
    probe, free = _free_at(buffer_dir)
    have = sum(x.stat().st_size for x in buffer_dir.glob("*.bin")) if buffer_dir.is_dir() else 0  # reused in place
    groups = (sh.ranks if lc.nodes == 1 else lc.procs_per_node) // sh.tp  # a tensor-parallel group shares one copy
    buffers = max(0, s1_disk * groups - have)
    checkpoints = (cfg.finetune.keep + 1) * ckpt
    p.rows.append(
        (
            "disk",
            f"free at {probe}",
            f"{_gb(free)} (this node: buffers ~{_gb(buffers)} more, checkpoints ~{_gb(checkpoints)})",
        )
    )
    for stage_name, need, what in (("distill", buffers, "stage-1 buffers"), ("finetune", checkpoints, "checkpoints")):
        if need > free:
            p.block(
                f"{probe} has {_gb(free)} free but this node needs ~{_gb(need)} for {what}: set distill.buffer_dir "
                "/ run_dir to a larger disk or lower data.num_sequences",
                stage_name,
            )


def _export(p: Plan, cfg, sh: Shape, base: Path | None, r: Resolved) -> None:
    """The merged model, shard by shard, in export.dtype (else the input checkpoint's dtype)."""
    c, x = sh.c, cfg.export
    out = r.layout.export
    stored, per = _stored_bytes(base) if base is not None else (0, 0)
    if stored:
        size = stored * DTYPE_BYTES[x.dtype] / per if x.dtype else stored
    else:
        size = c["total"] * DTYPE_BYTES[x.dtype or cfg.model.dtype]
    probe, free = _free_at(out.parent)
    p.rows.append(("export", "merged model", f"{_gb(size)} at {out} ({_gb(free)} free at {probe})"))
    if size > free:
        smaller = " or export.dtype=bfloat16" if size / c["total"] > 2 else ""
        p.block(
            f"{probe} has {_gb(free)} free but the export needs ~{_gb(size)}: set export.out_dir to a larger disk"
            + smaller,
            "export",
        )
    if (x.gamma is not None or x.calibrate_gamma) and x.report_sequences:
        p.rows.append(
            (
                "export",
                "gamma report memory",
                f"~{_gb(c['total'] * 4)} host RAM (the whole model in fp32 on CPU for the before/after perplexity; "
                "export.report_sequences=0 skips it)",
            )
        )


def _refuse(label: str, problems: list[str]) -> None:
    if problems:
        raise ConfigError(
            f"preflight ({label}): " + "; ".join(problems) + " (run `hybrid-scale plan` with the same config for "
            "the table)"
        )


def preflight(cfg, stage: str, resolved: Resolved | None = None) -> Plan:
    """What every stage runs first (run/entry.py), before it writes anything: its inputs checked (inputs.check), then
    the plan's problems that block `stage` become one clear error."""
    r = resolved or Resolved.of(cfg, stage)
    inputs.check(cfg, stage, r)
    result = plan(cfg, stage, r)
    _refuse(stage, result.blocking(stage))
    return result


def preflight_ahead(cfg, stages: list[str], resolved: Resolved | None = None) -> Plan:
    """Before a pipeline: the problems of every stage still to run, planned from model.path / model.arch (the later
    stages' inputs do not exist yet), so that a doomed evaluation or export stops the run before stage 1."""
    r = resolved or Resolved.of(cfg)
    inputs.check_ahead(cfg, stages, r)
    result = plan(cfg, None, r)
    _refuse(", ".join(stages), [m for m in result.problems if set(stages) & set(result.scope[m])])
    return result
