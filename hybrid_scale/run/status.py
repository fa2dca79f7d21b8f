"""`hybrid-scale status RUN_DIR`: what a user on a cluster checks before resubmitting. Which stages are done, what
is committed (stage 1's layers, stage 2's steps, the evaluation's cells), who holds the run dir's lock (and whether
it still runs), and the last lines of the newest log. Reads only, imports no torch, and hashes nothing: a layer or
step counts as committed when its marker and the files it names are there (the stages verify the hashes when they
resume). The layout comes from the run's recorded config when there is one, so eval.out_dir and export.out_dir
overrides are followed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from ..config import load_config
from ..distributed.requeue import REQUEUE_MARKER
from ..storage.commits import MARKER, PARTIAL_TAG, is_export
from . import lock, metrics
from .layout import CONFIG_NAME, RUN_CONFIG, RunLayout


class NotARunDir(ValueError):
    """The path given to `status` is not a directory."""


def _layout(run_dir: Path) -> RunLayout:
    """The run's layout from its recorded config (the pipeline writes it), else the defaults under run_dir."""
    recorded = run_dir / RUN_CONFIG
    overrides = [f"run_dir={run_dir}"]
    if recorded.is_file():
        try:
            cfg = OmegaConf.load(recorded)
            overrides += [f"eval.out_dir={cfg.eval.out_dir}"] if cfg.eval.get("out_dir") else []
            overrides += [f"export.out_dir={cfg.export.out_dir}"] if cfg.export.get("out_dir") else []
            overrides += [f"distill.buffer_dir={cfg.distill.buffer_dir}"] if cfg.distill.get("buffer_dir") else []
        except Exception:  # noqa: BLE001  (a damaged record: the defaults, as before the pipeline wrote one)
            pass
    return RunLayout.of(load_config(overrides=overrides))


def _marked(directory: Path) -> bool:
    """A step directory whose marker is there and names files that are all there (hashes: checked on resume)."""
    try:
        files = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all((directory / name).is_file() for name in files)


def _stage1(layout: RunLayout) -> str:
    stage1 = layout.stage1
    if not stage1.is_dir():
        return "stage 1: not started"
    layers = sorted(int(p.stem[6:]) for p in stage1.glob("layer_*.done") if p.stem[6:].isdigit())
    committed = [i for i in layers if (stage1 / f"layer_{i:03d}.safetensors").is_file()]
    if (layout.stage1_output / CONFIG_NAME).is_file():
        return f"stage 1: done ({len(committed)} layers committed, converted model in stage1/converted)"
    last = ", ".join(map(str, committed[-3:])) or "none"
    return f"stage 1: {len(committed)} layer(s) committed (the last: {last})" + _metrics(stage1)


def _stage2(layout: RunLayout) -> str:
    stage2 = layout.stage2
    if not stage2.is_dir():
        return "stage 2: not started"
    steps = sorted(p for p in stage2.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and _marked(p))
    saved = ", ".join(p.name for p in steps) or "no committed step"
    output = layout.stage2_output
    if output.is_symlink() and (output / CONFIG_NAME).is_file():
        return f"stage 2: done, output -> {output.resolve().name} (checkpoints: {saved})"
    return f"stage 2: running or stopped (checkpoints: {saved})" + _metrics(stage2)


def _evaluate(layout: RunLayout) -> str:
    out = layout.eval
    if (out / "results.json").is_file():
        verdict = json.loads((out / "results.json").read_text()).get("verdict", "n/a")
        return f"evaluate: done, verdict: {verdict} ({out})"
    if not out.is_dir():
        return "evaluate: not started"
    return f"evaluate: {len(list((out / 'cells').glob('*.json')))} cell(s) committed ({out})" + _metrics(out, "cell")


def _metrics(directory: Path, kind: str = "step") -> str:
    """A running stage's last metrics (run/metrics.py): step of total, loss, tokens/s, ETA, and when it was logged."""
    r = metrics.last(directory / metrics.FILE, kind)
    if r is None:
        return ""
    if kind == "cell":
        what = f"cell {r['cells_done']}/{r['cells_total']} ({r['cell']})"
    else:
        what = f"step {r['step']}/{r.get('steps_total', '?')}, loss {r['loss']:.4f}, {r['tokens_per_s']:.0f} tokens/s"
    when = time.strftime("%H:%M:%S", time.localtime(r["time"]))
    return f"\n  last metrics ({when}): {what}, ETA {metrics.duration(r.get('eta_s'))}"


def _export(layout: RunLayout) -> str:
    out = layout.export
    if not is_export(out):
        return "export: not done"
    return f"export: being written ({out})" if (out / PARTIAL_TAG).is_file() else f"export: done ({out})"


def _lock(run_dir: Path) -> str:
    holder = lock.read(run_dir)
    if holder is None:
        return "lock: free"
    if holder == {}:
        return "lock: being taken"
    state = {True: "running", False: "gone (the next run breaks this lock)", None: "cannot be checked from here"}
    return f"lock: held by {lock.describe(holder)}: {state[lock.alive(holder)]}"


def status(run_dir) -> str:
    """The report; NotARunDir when run_dir is missing or a file."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise NotARunDir(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise NotARunDir(f"{run_dir}: a file, not a run directory")
    layout = _layout(run_dir)
    lines = [f"run directory {run_dir.resolve()}", _lock(run_dir), _stage1(layout), _stage2(layout), _evaluate(layout)]
    lines.append(_export(layout))
    if (run_dir / REQUEUE_MARKER).is_file():
        lines.append(f"requeue requested: {(run_dir / REQUEUE_MARKER).read_text().strip()}")
    logs = [p for p in layout.logs if p.is_file()]
    if logs:
        newest = max(logs, key=lambda p: p.stat().st_mtime)
        tail = newest.read_text().splitlines()[-5:]
        name = newest.relative_to(run_dir) if newest.is_relative_to(run_dir) else newest
        lines += [f"last lines of {name}:", *(f"  {line}" for line in tail)]
    return "\n".join(lines)
