"""The Run every part of either harness writes into, and how the harness runs its parts: the settings, the figures
(Run.data, written as NAME.json and NAME.md after every part by report.py), the deadline (DEADLINE, time.monotonic(),
set by the harness from DEVICE_STARTED, device.sh's start) and the budgets; `run_part` runs one part guarded (a
part failing must not lose the others), records its status and writes the report before the next part starts (and
a part's start, so a run killed inside a part names it); the child processes (`run_child`, cut at the deadline;
`child_part`, a part in its own process) and the log of everything they print. `ratio` records a figure beside its
target (settings.TARGETS: at most, FLOORS: at least) and prints it at once, so a run cut short still has what it
measured."""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.device.report import save_report
from benchmarks.device.settings import COLLECTIVES, FLOORS, ROOT, TARGETS
from benchmarks.report_table import fmt

DEADLINE = [math.inf]  # time.monotonic() by which every part and subprocess must have ended


def start_deadline(seconds: float) -> None:
    """DEADLINE `seconds` after device.sh's start (DEVICE_STARTED, epoch s: its wheel installation counts), else now."""
    started = float(os.environ.get("DEVICE_STARTED") or time.time())
    DEADLINE[0] = time.monotonic() + seconds - max(0.0, time.time() - started)


class Log:
    """Everything the subprocesses print, in one file beside the report."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        path.write_text("")

    def add(self, title: str, text: str) -> None:
        with self.lock, self.path.open("a") as f:
            f.write(f"\n===== {title} =====\n{text}\n")


class Run:
    """One harness's run: `harness` (speed / check: what `python -m benchmarks.device` is given), `name` (its files:
    NAME.md, NAME.json, NAME_children.log in `out`), the settings, the figures, the deadline; `markdown(data)` its
    report."""

    def __init__(self, harness: str, name: str, cfg: dict, out: Path, command: str, markdown: Callable[[dict], str]):
        self.harness, self.name, self.cfg, self.out, self.command = harness, name, cfg, out, command
        self.dry, self.markdown = cfg["dry"], markdown
        self.device, self.dtype = cfg["device"], getattr(torch, cfg["dtype"])
        self.cuda = torch.device(self.device).type == "cuda"
        self.data: dict = {"harness": harness, "parts": {}, "settings": cfg, "dry_run": self.dry, "command": command}
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.data["date"] = self.started.strftime("%Y-%m-%d %H:%M UTC")
        self.log = Log(out / f"{name}_children.log")
        self.lock = threading.Lock()
        self.kept: dict = {}  # what one part leaves to a later one (decode's step for profile), never written

    def left(self) -> float:
        return DEADLINE[0] - time.monotonic()

    def part_deadline(self, name: str) -> float:
        """time.monotonic() after which part `name` starts nothing: its budget from now, or the run's deadline."""
        return min(DEADLINE[0], time.monotonic() + self.cfg["budgets"][name])

    def ratio(self, key: str, value: float | None, note: str = "") -> None:
        """A figure with its target (TARGETS: at most; FLOORS: at least), printed at once."""
        target, floor = TARGETS.get(key), FLOORS.get(key)
        bound, sign = (target, "<=") if floor is None else (floor, ">=")
        met = None if value is None or bound is None else bool(value <= bound if floor is None else value >= bound)
        self.data.setdefault("ratios", {})[key] = dict(value=value, target=bound, at=sign, met=met, note=note)
        goal = "" if bound is None else f" (target {sign} {bound:.3g}: {'met' if met else 'MISSED'})"
        print(f"{self.name}: RATIO {key}: {fmt(value)}{goal}{' ' + note if note else ''}", flush=True)

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def save(self) -> None:
        with self.lock:
            save_report(self.out, self.name, self.data, self.markdown)

    def seconds(self) -> float:
        return (datetime.datetime.now(datetime.timezone.utc) - self.started).total_seconds()


def status_of(result: dict | None) -> tuple[str, str]:
    """(ok / FAILED / skipped, the note) of a part's result (None: the part kept its figures itself)."""
    result = result or {}
    if result.get("skipped_part"):
        return "skipped", result["skipped_part"]
    if result.get("failed"):
        return "FAILED", result["failed"] if isinstance(result["failed"], str) else "checks failed (see its section)"
    skipped = [r for r in result.get("rows", []) if "skipped" in r]
    if skipped:
        return "ok", f"{len(skipped)} rows not measured: " + "; ".join(sorted({r["skipped"] for r in skipped}))[:300]
    return "ok", ""


def note_of(e: BaseException) -> str:
    """An exception as a table cell: its type and the last line of its message (where a child's error ends)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1][:300]}".replace("|", "/") if lines else type(e).__name__


def run_part(run: Run, key: str, title: str, fn: Callable[[], dict | None], margin: float = 10, needs: str = ""):
    """Part `key` (guarded: a part failing must not lose the others): not started within `margin` s of the deadline,
    skipped when the part it `needs` is not ok; what fn returns (when not None) kept as run.data[key]; its status
    into run.data["parts"], the files saved."""
    t0, parts = time.perf_counter(), run.data["parts"]
    if run.left() < margin:
        parts[key] = dict(title=title, status="FAILED", seconds=0.0, note="not started: the deadline is reached")
        print(f"\n== part {key}: {title}: not started, the deadline is reached", flush=True)
    elif needs and parts.get(needs, {}).get("status") != "ok":
        parts[key] = dict(title=title, status="skipped", seconds=0.0, note=f"needs part {needs}")
        print(f"\n== part {key}: {title}: skipped (needs part {needs})", flush=True)
    else:
        parts[key] = dict(title=title, status="cut", seconds=0.0, note="started; the run ended inside it")
        run.save()  # (a run killed inside this part still has the parts before it, and says which part it was)
        print(f"\n== part {key}: {title} ({run.left():.0f} s left)", flush=True)
        try:
            result = fn()
            if result is not None:
                run.data[key] = result
            status, note = status_of(result)
        except Exception as e:  # noqa: BLE001  (a part failing must not lose the others)
            traceback.print_exc()
            sys.stdout.flush()
            status, note = "FAILED", note_of(e)
        parts[key] = dict(title=title, status=status, seconds=time.perf_counter() - t0, note=note)
        print(f"== part {key}: {status} ({time.perf_counter() - t0:.1f} s) {note}", flush=True)
    run.save()
    run.free()


def child_env(extra: dict | None = None) -> dict:
    checker = [str(COLLECTIVES)] if (extra or {}).get("HYBRID_SCALE_COLLECTIVES") else []
    path = os.pathsep.join(filter(None, [str(ROOT), *checker, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(extra or {})}


def run_child(cmd: list[str], title: str, log: Log, timeout: float, extra_env: dict | None = None, reserve: int = 0):
    """cmd run to its end, cut at `timeout` s or at `reserve` s before the deadline, whichever comes first."""
    t0 = time.perf_counter()
    timeout = max(1, int(min(timeout, DEADLINE[0] - reserve - time.monotonic())))
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=child_env(extra_env), capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + f"\n[timed out: {timeout} s]"
    seconds = time.perf_counter() - t0
    log.add(f"{title} (rc {rc}, {seconds:.1f} s): {shlex.join(cmd)}", f"--- stdout\n{out}\n--- stderr\n{err}")
    return rc, out, err, seconds


def child_part(run: Run, name: str, timeout: float, work: Path | None = None, reserve: int = 0) -> dict:
    """Part `name` in its own process (`python -m benchmarks.device HARNESS --part NAME`, which __main__.py answers
    from the harness's CHILDREN), its figures back as JSON. Without `work`, in a temporary folder removed after it (the
    shaped models' checkpoints: gigabytes)."""
    own = work is None
    work = Path(tempfile.mkdtemp(prefix=f"{run.name}_{name}_")) if own else work
    json_path = work / f"{name}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.device", run.harness, "--part", name, "--work", str(work)]
    cmd += ["--json", str(json_path), *(["--dry-run"] if run.dry else [])]
    try:
        rc, out, err, seconds = run_child(cmd, f"part {name}", run.log, timeout, reserve=reserve)
        result = json.loads(json_path.read_text()) if rc == 0 else None
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    print(out[-4000:], end="", flush=True)
    if rc != 0:
        print(err.strip()[-3000:], flush=True)
        tail = " / ".join((out + err).strip().splitlines()[-3:])[-600:]
        raise RuntimeError(f"part {name} failed (exit {rc}, {seconds:.0f} s); it ends with: {tail}")
    return result


def until(deadline: float, shares: int) -> float:
    """The time.monotonic() by which the next of `shares` equal slices of what is left before `deadline` ends (a
    length's share of a part's budget, so that one length cannot spend the next one's)."""
    now = time.monotonic()
    return now + max(0.0, deadline - now) / max(1, shares)


def out_of_time(limit: float, what: str, needs: float = 0.0) -> str | None:
    """Why a row is skipped when `limit` (time.monotonic()) has passed, or when less than `needs` seconds (what a
    like row took) are left before it, else None."""
    left = limit - time.monotonic()
    if left <= 0:
        return f"{what} spent ({-left:.0f} s past it)"
    if left < needs:
        return f"{what}: {left:.0f} s left, a like row took {needs:.0f} s"
    return None
