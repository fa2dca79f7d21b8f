"""Preflight (`hybrid-scale plan`): what a run will need before it is queued, from the config and the model's
architecture alone (no weights are read): per-rank memory of each stage, stage-1 buffer disk, checkpoint sizes,
rough times; and the checks that would doom it (paths, tokenizer, architecture, tensor-parallel divisibility, free
disk). Estimates are deliberately simple formulas (costs.py, over shape.py), stated in the table; they are for
catching impossible shapes, not for tuning. The per-stage figures (`Plan.figures`) are what `plan --dry-run`
(dry_run.py) checks against the real model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..attention.kinds import kind_of
from ..config import on_gpus
from ..config.schema import Config
from ..distributed import tensor_parallel
from ..errors import ConfigError
from ..launch.slurm import REQUEUE_MARGIN_S, grace_s
from ..run.resolved import Resolved
from . import costs, inputs
from .inputs import StageInputs
from .report import Plan
from .shape import DTYPE_BYTES, GB, MFU, SAVE_BYTES_PER_S, SUPPORTED_TYPES, Shape, architecture, counts, free_at, gb


def plan(cfg: Config, stage: str | None = None, resolved: Resolved | None = None) -> Plan:
    """The table and the blocking problems, planned from the base of the model the stage reads (resolved.model,
    checked by then), else (`plan` itself, and stage 1: StageInputs.plans_from_model) from model.path / model.arch."""
    p = Plan()
    r = resolved or Resolved.of(cfg, stage)
    base = r.model.base if r.model is not None else None
    a, source = architecture(cfg, base)
    launch = cfg.launch
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
    a_cfg = cfg.attention
    fdim = kind_of(a_cfg).features(c["hd"], a_cfg)  # the LA's query and key width
    sh = Shape(a, c, launch.nodes * launch.procs_per_node, DTYPE_BYTES[cfg.model.dtype], fdim, launch.tensor_parallel)
    _check_shape_and_path(p, cfg, sh)
    p.rows += [
        ("model", "architecture", f"{model_type} ({source})"),
        ("model", "parameters", f"{c['total'] / 1e9:.2f} B ({gb(c['total'] * sh.wbytes)} in {cfg.model.dtype})"),
        ("model", "layers x heads / KV heads", f"{c['L']} x {c['H']} / {c['K']} (head_dim {c['hd']})"),
        (
            "launch",
            "ranks",
            f"{launch.nodes} node(s) x {launch.procs_per_node} = {sh.ranks} (tensor parallel {launch.tensor_parallel})",
        ),
    ]
    s1_mem, s1_disk, flops1, tokens1 = costs.stage1(p, cfg, sh, r)
    s2_mem, ckpt, flops2, tokens2 = costs.stage2(p, cfg, sh, r)
    if launch.gpu_tflops:
        rate = sh.ranks * launch.gpu_tflops * 1e12 * MFU
        p.rows += [
            (
                "time",
                "stage 1 (rough)",
                f"~{flops1 / rate / 3600:.2f} h ({tokens1 / 1e6:.1f} M tokens x {c['L']} layers)",
            ),
            ("time", "stage 2 (rough)", f"~{flops2 / rate / 3600:.2f} h ({tokens2 / 1e6:.1f} M tokens)"),
        ]
        step1 = flops1 / rate / (c["L"] * costs.d_steps(cfg))
        step2 = flops2 / rate / max(1, cfg.finetune.max_steps)
        _requeue(p, cfg, {"distill": (step1, 0.0), "finetune": (step2, ckpt / SAVE_BYTES_PER_S)})
    costs.start_up_read(p, cfg, sh, base)
    eval_mem = costs.evaluation(p, cfg, sh)
    _device_fit(p, cfg, s1_mem, s2_mem, eval_mem)
    _disk(p, cfg, sh, s1_disk, ckpt, r)
    costs.export(p, cfg, sh, base, r)
    return p


def _check_shape_and_path(p: Plan, cfg: Config, sh: Shape) -> None:
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


def _requeue(p: Plan, cfg: Config, per_stage: dict[str, tuple[float, float]]) -> None:
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
        if need > grace and on_gpus(cfg.model.device):  # the Slurm presets; a laptop run has no limit
            p.warnings.append(
                f"{stage} needs ~{need:.0f} s to finish its step and save after a signal but torchrun's grace is "
                f"{grace} s (a job at its time limit would be killed mid-save and lose the step's work): raise "
                f"slurm.signal_lead_s to at least {int(need) + REQUEUE_MARGIN_S + 30}"
            )


def _device_fit(p: Plan, cfg: Config, s1_mem: float, s2_mem: float, eval_mem: float) -> None:
    launch = cfg.launch
    device_gb = launch.gpu_memory_gb * GB if launch.gpu_memory_gb else None
    if not (on_gpus(cfg.model.device) and device_gb):
        return
    for stage_name, mem, fix in (
        ("stage 1", s1_mem, "lower distill.batch_size or data.seq_len"),
        (
            "stage 2",
            s2_mem,
            "enable finetune.offload, lower finetune.micro_batch or finetune.seq_len, or add ranks"
            if launch.tensor_parallel == 1
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
                f"{stage_name} needs ~{gb(mem)} per rank but launch.gpu_memory_gb is {launch.gpu_memory_gb}: {fix}",
                {"stage 1": "distill", "stage 2": "finetune"}.get(stage_name, stage_name),
            )


def _disk(p: Plan, cfg: Config, sh: Shape, s1_disk: float, ckpt: float, r: Resolved) -> None:
    """Stage 1's buffers where distill.buffer_dir is (by default under run_dir, which on a cluster is one disk every
    node writes to: the buffers of all ranks; set to a node's own disk: that node's), and stage 2's checkpoints
    where run_dir is, after the buffers (which stay) when both are on one file system."""
    launch = cfg.launch
    buffer_dir, stage2 = r.layout.buffers, r.layout.stage2
    shared = cfg.distill.buffer_dir is None or launch.nodes == 1
    groups = (sh.ranks if shared else launch.procs_per_node) // sh.tp  # a tensor-parallel group shares one copy
    have = sum(x.stat().st_size for x in buffer_dir.glob("*.bin")) if buffer_dir.is_dir() else 0  # reused in place
    buffers = max(0, s1_disk * groups - have)
    checkpoints = (cfg.finetune.keep + 1) * ckpt
    b_probe, b_free = free_at(buffer_dir)
    c_probe, c_free = free_at(stage2)
    one_disk = b_probe.stat().st_dev == c_probe.stat().st_dev
    whose = "every node's ranks" if shared and launch.nodes > 1 else "this node"
    p.rows.append(("disk", f"free at {b_probe}", f"{gb(b_free)} (stage-1 buffers of {whose}: ~{gb(buffers)} more)"))
    after = " after the buffers, on the same file system" if one_disk else ""
    p.rows.append(("disk", f"free at {c_probe}", f"{gb(c_free)} (stage-2 checkpoints: ~{gb(checkpoints)}{after})"))
    if buffers > b_free:
        p.block(
            f"{b_probe} has {gb(b_free)} free but the stage-1 buffers of {whose} need ~{gb(buffers)}: set "
            "distill.buffer_dir to a larger disk (or a node's own disk) or lower data.num_sequences",
            "distill",
        )
    need = checkpoints + (buffers if one_disk else 0)
    if need > c_free:
        p.block(
            f"{c_probe} has {gb(c_free)} free but the stage-2 checkpoints need ~{gb(need)}"
            + (" with the stage-1 buffers beside them" if one_disk and buffers else "")
            + ": set run_dir (or distill.buffer_dir) to a larger disk, or lower finetune.keep",
            "finetune",
        )


def _refuse(label: str, problems: list[str]) -> None:
    if problems:
        raise ConfigError(
            f"preflight ({label}): " + "; ".join(problems) + " (run `hybrid-scale plan` with the same config for "
            "the table)"
        )


def stage_plan(cfg: Config, stage: str, stage_inputs: StageInputs, r: Resolved) -> Plan:
    """The plan a stage's preflight makes: from its model's base, or as `plan` does (stage_inputs.plans_from_model)."""
    return plan(cfg, stage, r if stage_inputs.plans_from_model else replace(r, model=None))


def preflight(cfg: Config, stage: str, stage_inputs: StageInputs, resolved: Resolved | None = None) -> Plan:
    """What every stage runs first (entry.py), before it writes anything: its inputs checked (the checks every stage
    shares, then the stage's own declaration, `stage_inputs.now`), then the plan's problems that block `stage` become
    one clear error."""
    r = resolved or Resolved.of(cfg, stage)
    inputs.check(cfg, r, stage_inputs.now)
    result = stage_plan(cfg, stage, stage_inputs, r)
    _refuse(stage, result.blocking(stage))
    return result


def preflight_ahead(cfg: Config, stages: dict[str, StageInputs], resolved: Resolved | None = None) -> Plan:
    """Before a pipeline: the inputs of every stage still to run (`stages`: name -> its declaration; each one's
    `ahead`: the later stages' models do not exist yet), and the problems of every one of them, planned from
    model.path / model.arch, so that a doomed evaluation or export stops the run before stage 1."""
    r = resolved or Resolved.of(cfg)
    inputs.check(cfg, r, *(declared.ahead for declared in stages.values()))
    result = plan(cfg, None, r)
    _refuse(", ".join(stages), [m for m in result.problems if set(stages) & set(result.scope[m])])
    return result
