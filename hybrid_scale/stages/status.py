"""`hybrid-scale status RUN_DIR`: what a user on a cluster checks before resubmitting. Which stages are done, what
is committed (stage 1's layers, stage 2's steps, the evaluation's cells), who holds the run dir's lock (and whether
it still runs), and the last lines of the newest log. Reads only."""

from __future__ import annotations

import json
from pathlib import Path

from ..distributed.requeue import REQUEUE_MARKER
from ..models.converted import CONFIG_NAME
from . import lock
from .checkpoints import committed_steps
from .distill_identity import committed
from .rundir import is_export

LOGS = ("stage1/log.txt", "stage2/log.txt", "eval/log.txt")


def _stage1(run: Path) -> str:
    stage1 = run / "stage1"
    if not stage1.is_dir():
        return "stage 1: not started"
    layers = sorted(int(p.stem[6:]) for p in stage1.glob("layer_*.safetensors") if p.stem[6:].isdigit())
    done = [i for i in layers if committed(stage1, i)]
    if (stage1 / "converted" / CONFIG_NAME).is_file():
        return f"stage 1: done ({len(done)} layers committed, converted model in stage1/converted)"
    last = ", ".join(map(str, done[-3:])) or "none"
    return f"stage 1: {len(done)} layer(s) committed (the last: {last})"


def _stage2(run: Path) -> str:
    stage2 = run / "stage2"
    if not stage2.is_dir():
        return "stage 2: not started"
    steps = committed_steps(stage2)
    saved = ", ".join(p.name for p in steps) or "no committed step"
    output = stage2 / "output"
    if output.is_symlink() and (output / CONFIG_NAME).is_file():
        return f"stage 2: done, output -> {output.resolve().name} (checkpoints: {saved})"
    return f"stage 2: running or stopped (checkpoints: {saved})"


def _evaluate(run: Path) -> str:
    out = run / "eval"
    if (out / "results.json").is_file():
        verdict = json.loads((out / "results.json").read_text()).get("verdict", "n/a")
        return f"evaluate: done, verdict: {verdict}"
    if not out.is_dir():
        return "evaluate: not started"
    return f"evaluate: {len(list((out / 'cells').glob('*.json')))} cell(s) committed"


def _lock(run: Path) -> str:
    holder = lock.read(run)
    if holder is None:
        return "lock: free"
    if holder == {}:
        return "lock: being taken"
    state = {True: "running", False: "gone (the next run breaks this lock)", None: "cannot be checked from here"}
    return f"lock: held by {lock.describe(holder)}: {state[lock.alive(holder)]}"


def status(run_dir) -> str:
    run = Path(run_dir)
    if not run.is_dir():
        return f"{run}: no such run directory"
    lines = [f"run directory {run.resolve()}", _lock(run), _stage1(run), _stage2(run), _evaluate(run)]
    lines.append("export: done (export/)" if is_export(run / "export") else "export: not done")
    if (run / REQUEUE_MARKER).is_file():
        lines.append(f"requeue requested: {(run / REQUEUE_MARKER).read_text().strip()}")
    logs = [run / rel for rel in LOGS if (run / rel).is_file()]
    if logs:
        newest = max(logs, key=lambda p: p.stat().st_mtime)
        tail = newest.read_text().splitlines()[-5:]
        lines += [f"last lines of {newest.relative_to(run)}:", *(f"  {line}" for line in tail)]
    return "\n".join(lines)
