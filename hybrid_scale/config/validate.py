"""The config's validation: every key's value on its own and the combinations that cannot run, one ConfigError
naming the key and the fix."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig

from ..attention.kinds import kind_of
from ..attention.settings import MODES, problems
from ..errors import ConfigError
from ..recipes import RECIPES
from .schema import (
    DEVICES,
    DTYPES,
    EVAL_MODE_NAMES,
    EVAL_TASKS,
    JOBS,
    LAUNCHERS,
    OBJECTIVES,
    SSD_GRANULARITY,
    eval_cache,
    eval_mode,
)


def _choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}': '{value}' is not allowed; choose one of: {', '.join(allowed)}")


def _positive(key: str, value, minimum=1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"config key '{key}': must be >= {minimum}, got {value}")


def validate(cfg: DictConfig) -> DictConfig:
    """Every key's value on its own and the combinations that cannot run, section by section: one ConfigError
    naming the key and the fix."""
    _validate_attention(cfg.attention)
    _validate_model(cfg.model)
    _validate_eval(cfg.eval)
    _validate_eval_cache(cfg)
    _validate_distill(cfg.distill)
    _validate_data(cfg.data)
    _validate_finetune(cfg.finetune)
    _validate_launch(cfg)
    _validate_slurm(cfg)
    _validate_export(cfg.export)
    _validate_log(cfg.log)
    return cfg


def _validate_attention(a) -> None:
    """Each setting's own check (attention/settings.py), then what its LA kind refuses (attention/kinds.py)."""
    settings = dict(a)
    for name, why in problems(settings):
        raise ConfigError(f"config key 'attention.{name}': {why}")
    problem = kind_of(settings).problem(settings)
    if problem is not None:
        raise ConfigError(f"config key 'attention.{problem[0]}': {problem[1]}")
    if a.layers is not None and any(i < 0 for i in a.layers):
        raise ConfigError(f"config key 'attention.layers': layer indices must be >= 0, got {list(a.layers)}")


def _validate_model(m) -> None:
    _choice("model.dtype", m.dtype, DTYPES)
    _choice("model.device", m.device, DEVICES)


def _validate_eval(e) -> None:
    for mode in e.modes:
        _choice("eval.modes", mode, EVAL_MODE_NAMES)
    for task in e.tasks:
        _choice("eval.tasks", task, EVAL_TASKS)
    _positive("eval.limit", e.limit)
    _positive("eval.batch_size", e.batch_size)
    _positive("eval.window", e.window)
    _positive("eval.bootstrap", e.bootstrap, 0)
    _positive("eval.ppl_seq_len", e.ppl_seq_len, 2)
    _positive("eval.ppl_sequences", e.ppl_sequences, 0)
    _positive("eval.la_share_seq_len", e.la_share_seq_len, 0)
    _positive("eval.passkey_trials", e.passkey_trials, 0)
    _positive("eval.recall_pairs", e.recall_pairs, 0)
    _positive("eval.cache", e.cache, 0)
    for mode in e.passkey_modes or []:
        _choice("eval.passkey_modes", mode, EVAL_MODE_NAMES)
    for d in e.passkey_distances:
        _positive("eval.passkey_distances", d)
    if e.ppl_margin < 0:
        raise ConfigError(f"config key 'eval.ppl_margin': must be >= 0, got {e.ppl_margin}")
    if list(e.buckets) != sorted(set(e.buckets)) or len(e.buckets) < 2 or e.buckets[0] != 0:
        raise ConfigError(f"config key 'eval.buckets': must start at 0 and increase strictly, got {list(e.buckets)}")


def _validate_eval_cache(cfg) -> None:
    """A mode that runs with the cache (`+cache`, cache_only) needs a cache of at least one key per KV head."""
    e = cfg.eval
    for key, modes in (("eval.modes", e.modes), ("eval.passkey_modes", e.passkey_modes or [])):
        cached = [m for m in modes if eval_mode(m)[1]]
        if cached and eval_cache(cfg) == 0:
            where = f"eval.cache = {e.cache}" if e.cache is not None else "eval.cache unset, attention.cache = 0"
            raise ConfigError(
                f"config key '{key}': {cached[0]} runs with the cache of exact keys, whose size is 0 ({where}); set "
                "eval.cache (or attention.cache) to the keys per KV head it keeps, e.g. eval.cache=32, or leave "
                f"{cached[0]} out"
            )


def _validate_distill(d) -> None:
    _choice("distill.recipe", d.recipe, list(RECIPES))
    for name, weight in (d.objectives or {}).items():
        _choice("distill.objectives", name, OBJECTIVES)
        if weight < 0:
            raise ConfigError(f"config key 'distill.objectives.{name}': weight must be >= 0, got {weight}")
    if d.objectives is not None and not any(w > 0 for w in d.objectives.values()):
        raise ConfigError("config key 'distill.objectives': at least one weight must be > 0")
    _choice("distill.buffer_dtype", d.buffer_dtype, DTYPES)
    _positive("distill.epochs", d.epochs)
    _positive("distill.batch_size", d.batch_size)
    _positive("distill.query_block", d.query_block)


def _validate_data(data) -> None:
    _positive("data.seq_len", data.seq_len, 2)
    _positive("data.num_sequences", data.num_sequences)
    if not 0 <= data.heldout_fraction < 1:
        raise ConfigError(f"config key 'data.heldout_fraction': must be in [0, 1), got {data.heldout_fraction}")


def _validate_launch(cfg) -> None:
    """launch's values, and what the tensor-parallel split cannot combine with (other sections' keys)."""
    launch = cfg.launch
    _choice("launch.launcher", launch.launcher, LAUNCHERS)
    for key in ("nodes", "procs_per_node", "tensor_parallel"):
        _positive(f"launch.{key}", launch[key])
    if not launch.timeout_min > 0:
        raise ConfigError(f"config key 'launch.timeout_min': must be > 0 minutes, got {launch.timeout_min}")
    if launch.tensor_parallel > 1 and cfg.model.dtype == "float16":
        raise ConfigError(
            "config keys 'model.dtype' and 'launch.tensor_parallel': float16 needs DeepSpeed's loss scaling, which "
            "the tensor-parallel path does not use: set model.dtype=bfloat16 (or float32)"
        )
    if launch.tensor_parallel > 1 and cfg.finetune.offload:
        raise ConfigError(
            "config keys 'finetune.offload' and 'launch.tensor_parallel': CPU offload is ZeRO-3's; with the "
            f"tensor-parallel split ({launch.tensor_parallel}) the weights are divided over the GPUs instead: set "
            "finetune.offload=false (or launch.tensor_parallel=1)"
        )
    if launch.tensor_parallel > 1 and cfg.eval.shard_weights:
        raise ConfigError(
            "config keys 'eval.shard_weights' and 'launch.tensor_parallel': ZeRO-3 partitioning and the "
            f"tensor-parallel split ({launch.tensor_parallel}) do not combine; the split already divides the weights: "
            "set eval.shard_weights=false (or launch.tensor_parallel=1)"
        )
    if launch.procs_per_node % launch.tensor_parallel:
        raise ConfigError(
            f"config key 'launch.tensor_parallel': {launch.tensor_parallel} does not divide launch.procs_per_node = "
            f"{launch.procs_per_node}; a tensor-parallel group stays inside a node: choose a divisor of it"
        )


def _validate_export(x) -> None:
    if x.mode is not None:
        _choice("export.mode", x.mode, MODES)
    if x.dtype is not None:
        _choice("export.dtype", x.dtype, DTYPES)
    _positive("export.window", x.window)
    for key in ("calibration_sequences", "calibration_seq_len", "calibration_steps"):
        _positive(f"export.{key}", x[key])
    _positive("export.report_sequences", x.report_sequences, 0)
    _positive("export.report_seq_len", x.report_seq_len, 2)
    if x.gamma is not None and x.gamma <= 0.0:  # (the upper bound is the model's: export checks it, check_gamma)
        raise ConfigError(f"config key 'export.gamma': must be > 0 (and < 1 with gamma_param sigmoid), got {x.gamma}")
    if x.gamma is not None and x.calibrate_gamma:
        raise ConfigError("config keys 'export.gamma' and 'export.calibrate_gamma': choose one (fixed or calibrated)")
    if x.max_shard_gb <= 0:
        raise ConfigError(f"config key 'export.max_shard_gb': must be > 0, got {x.max_shard_gb}")


def _validate_log(g) -> None:
    if g.wandb is not None and (not g.wandb.strip() or any(c in g.wandb for c in "/\\#?%:\n\r\0")):
        raise ConfigError(
            f"config key 'log.wandb': {g.wandb!r} is not a W&B project name (no / \\ # ? % : or line break); set a "
            "plain name such as hybrid-scale, or leave it unset"
        )
    if g.every_s <= 0:
        raise ConfigError(f"config key 'log.every_s': must be > 0, got {g.every_s}")


def _schedule(key: str, steps, lo, hi) -> None:
    if not steps or any(len(s) != 2 for s in steps):
        raise ConfigError(f"config key '{key}': a non-empty list of [fraction, value] pairs, got {steps}")
    fractions = [s[0] for s in steps]
    if fractions[0] != 0 or fractions != sorted(set(fractions)) or fractions[-1] >= 1:
        raise ConfigError(
            f"config key '{key}': fractions of training must start at 0, increase strictly and stay below 1, "
            f"got {fractions}"
        )
    for _, value in steps:
        if not lo <= value <= hi:
            raise ConfigError(f"config key '{key}': values must be in [{lo}, {hi}], got {value}")


def _validate_finetune(f) -> None:
    if f.recipe is not None:
        _choice("finetune.recipe", f.recipe, list(RECIPES))
    for key in ("lora_r", "max_steps", "global_batch", "micro_batch", "heldout_sequences", "save_every"):
        _positive(f"finetune.{key}", getattr(f, key))
    _positive("finetune.seq_len", f.seq_len, 2)
    _positive("finetune.keep", f.keep, 2)
    _positive("finetune.warmup_steps", f.warmup_steps, 0)
    _positive("finetune.eval_every", f.eval_every, 0)
    _positive("finetune.patience", f.patience)
    if f.global_batch % f.micro_batch:
        raise ConfigError(
            f"config key 'finetune.global_batch': {f.global_batch} is not a multiple of finetune.micro_batch "
            f"({f.micro_batch})"
        )
    if not 0 <= f.lora_dropout < 1:
        raise ConfigError(f"config key 'finetune.lora_dropout': must be in [0, 1), got {f.lora_dropout}")
    if not f.lora_targets:
        raise ConfigError("config key 'finetune.lora_targets': name at least one module (e.g. [q_proj, v_proj])")
    _schedule("finetune.ssd_schedule", f.ssd_schedule, 0.0, 1.0)
    if f.ssd_windows is not None:
        _schedule("finetune.ssd_windows", f.ssd_windows, 1, float("inf"))
    _choice("finetune.ssd_granularity", f.ssd_granularity, SSD_GRANULARITY)


# Slurm's --time formats (sbatch(1); src/common/parse_time.c time_str2secs): minutes, minutes:seconds,
# hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds; UNLIMITED or INFINITE
SLURM_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|(?i:unlimited|infinite)")
SLURM_MEM = re.compile(r"[0-9]+[KMGTkmgt]?")  # --mem: mebibytes, or a K/M/G/T suffix; 0 = all of a node's memory
SLURM_NAME_BAD = re.compile(r"[\s'\"#$`;&|<>\\]")  # what sbatch or the shell would split, quote or run


def _one_line(key: str, value, fix: str = "remove it") -> None:
    """A value written onto one line of the sbatch script: a line break would start a new shell command."""
    if value is not None and any(c in str(value) for c in "\n\r\0"):
        raise ConfigError(
            f"config key '{key}': {value!r} contains a line break or NUL, which would end its line of the sbatch "
            f"script and run the rest as a command; {fix}"
        )


def _slurm_time(key: str, value) -> None:
    _one_line(key, value)
    if not SLURM_TIME.fullmatch(str(value)):
        raise ConfigError(
            f"config key '{key}': {value!r} is not a Slurm time limit; use minutes, minutes:seconds, "
            "hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds (e.g. 90, "
            "24:00:00, 2-00:00:00), or UNLIMITED"
        )


def _validate_slurm(cfg) -> None:
    """The values written into the sbatch scripts' #SBATCH lines and shell body (dist/slurm.py render)."""
    slurm = cfg.slurm
    _positive("slurm.signal_lead_s", slurm.signal_lead_s, 0)
    _positive("slurm.max_restarts", slurm.max_restarts, 0)
    _positive("slurm.cpus_per_task", slurm.cpus_per_task)
    if not slurm.job_name:
        raise ConfigError("config key 'slurm.job_name': must not be empty (the jobs are named <job_name>-<stage>)")
    _one_line("run_dir", cfg.run_dir)
    _one_line("slurm.template_dir", slurm.template_dir)
    for key in ("job_name", "partition", "account"):
        value = slurm[key]
        _one_line(f"slurm.{key}", value)
        bad = SLURM_NAME_BAD.search(str(value or ""))
        if bad:
            lists = " (a comma-separated list for several, e.g. gpu,gpu-long)" if key != "job_name" else ""
            raise ConfigError(
                f"config key 'slurm.{key}': {value!r} contains {bad.group()!r}; use a plain name{lists} without "
                "whitespace, quotes or any of # $ ` ; & | < > \\"
            )
    _slurm_time("slurm.time", slurm.time)
    unknown = sorted(set(slurm.times) - set(JOBS))
    if unknown:
        raise ConfigError(f"config key 'slurm.times': unknown stage(s) {', '.join(unknown)}; use {', '.join(JOBS)}")
    for stage, value in slurm.times.items():
        _slurm_time(f"slurm.times.{stage}", value)
    if slurm.mem not in (None, ""):
        _one_line("slurm.mem", slurm.mem)
        if not SLURM_MEM.fullmatch(str(slurm.mem)):
            raise ConfigError(
                f"config key 'slurm.mem': {slurm.mem!r} is not a Slurm memory size; use an integer with an optional "
                "unit K, M, G or T (e.g. 200G; mebibytes without a unit; 0 = all of a node's memory)"
            )
    for i, item in enumerate(slurm.extra):
        _one_line(f"slurm.extra[{i}]", item, "give each sbatch option as its own item")
        if not str(item).startswith("-"):
            raise ConfigError(
                f"config key 'slurm.extra[{i}]': {item!r} is not an sbatch option; give one option per item, "
                "starting with - (e.g. --qos=high)"
            )
    for i, line in enumerate(slurm.setup):
        _one_line(f"slurm.setup[{i}]", line, "give each shell line as its own item")
