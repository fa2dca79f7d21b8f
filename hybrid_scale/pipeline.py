"""The whole pipeline in one command: stage 1 -> stage 2 -> ablation evaluation -> export, resuming where it stopped.

Each stage is skipped when its output is committed (stage 1 resumes at its first uncommitted layer, stage 2 from its
newest committed checkpoint, by themselves). The resolved config is saved as {run_dir}/config.yaml; rerunning with a
config that would change results is refused, naming the keys (`allow_config_change=true` proceeds anyway).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from .config import STAGES
from .distill.stage import distill
from .distributed import requeue, runtime
from .distributed.checkpoint import MARKER, atomic_write
from .distributed.requeue import SignalFlag
from .errors import ConfigError
from .evaluate.stage import evaluate
from .export.stage import export
from .finetune.stage import finetune
from .preflight.plan import preflight_ahead
from .run import lock
from .run import sources as rundir

# what a stage's result depends on; eval/export/launch/slurm settings can change between reruns
RESULT_KEYS = ("model.path", "model.dtype", "attention", "data", "distill", "finetune", "seed")
IGNORED = ("distill.progress", "distill.buffer_dir", "finetune.progress", "attention.backend")  # rounding only


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def result_settings(cfg) -> dict:
    data = OmegaConf.to_container(cfg, resolve=True)
    flat = _flat(data)
    keep = {}
    for key, value in flat.items():
        if any(key == r or key.startswith(r + ".") for r in RESULT_KEYS) and key not in IGNORED:
            keep[key] = value
    return keep


def record_config(cfg, allow_change: bool = False) -> Path:
    """Save the resolved config in the run directory; refuse a rerun whose results-relevant keys differ."""
    run_dir = Path(cfg.run_dir)
    path = run_dir / "config.yaml"
    if path.is_file():
        before = result_settings(OmegaConf.load(path))
        now = result_settings(cfg)
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed and not allow_change:
            raise ConfigError(
                f"{run_dir} was run with another config: {', '.join(changed)} changed (see {path}); use another "
                "run_dir, restore them, or pass allow_config_change=true"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, OmegaConf.to_yaml(cfg))
    return path


def done(cfg, stage: str) -> bool:
    if stage == "finetune":
        stage2 = rundir.stage2_dir(cfg)
        return (stage2 / "curves.json").is_file() and (stage2 / "output").exists()
    if stage == "evaluate":
        return (rundir.eval_dir(cfg) / "results.json").is_file()
    if stage == "export":
        return (rundir.export_dir(cfg) / MARKER).is_file()
    return False  # stage 1 resumes by itself (a finished one only rewrites its small output)


def pipeline(cfg, stages: tuple[str, ...] = STAGES, log=print) -> dict:
    todo = [stage for stage in stages if not done(cfg, stage)]
    if todo:
        preflight_ahead(cfg, todo)  # each stage runs its own preflight again when it starts
    rt = runtime.init(cfg.model.device, cfg.launch.tensor_parallel, cfg.launch.timeout_min)
    with lock.for_stage(cfg, "pipeline", rt):  # held across the stages: one writer per run dir (run/lock.py)
        return _run_stages(cfg, stages, log, rt)


def _run_stages(cfg, stages, log, rt) -> dict:
    """pipeline's work, under the run dir's lock: the config recorded, then each stage not done yet."""
    if rt.main:
        record_config(cfg, cfg.allow_config_change)
    runtime.barrier(rt)
    run = Path(cfg.run_dir)
    timings = json.loads((run / "timings.json").read_text()) if (run / "timings.json").is_file() else {}
    with SignalFlag() as signal:  # one flag for the whole run: the stages' loops see a signal that came before them
        for stage in stages:
            if done(cfg, stage):
                log(f"[pipeline] {stage}: done before, skipped")
                continue
            if runtime.any_rank(rt, signal.raised):  # between stages: everything before is committed
                raise requeue.request(cfg.run_dir, stage, run, rt, what=f"pipeline stopped by a signal before {stage}")
            log(f"[pipeline] {stage}: running")
            t0 = time.perf_counter()
            if stage == "distill":
                distill(cfg)
            elif stage == "finetune":
                finetune(cfg)
            elif stage == "evaluate":  # eval.model unset: the run's own stage2/output (rundir.eval_source)
                evaluate(cfg)
            elif stage == "export":
                if rt.main:
                    export(cfg)
                runtime.barrier(rt)
            timings[stage] = time.perf_counter() - t0
            if rt.main:
                atomic_write(run / "timings.json", json.dumps(timings, indent=1))
    return timings
