"""Commit helpers shared by the stages: atomic small files, content hashes, commit markers written last, rotation,
and the fault injection the resume tests use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

MARKER = "COMMITTED"
REQUEUE_MARKER = "requeue_requested"  # in run_dir: a stage saved on a signal and asks to be started again


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def throttle() -> None:
    """Test hook: HYBRID_SCALE_STEP_SLEEP=<seconds> slows every training step (to signal a run mid-way)."""
    seconds = float(os.environ.get("HYBRID_SCALE_STEP_SLEEP", "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def fault(point: str, rank: int = 0) -> None:
    """Fault injection for the resume tests: HYBRID_SCALE_FAULT=<point> sends this process SIGKILL there;
    <point>@USR1 (or another signal name) sends that signal instead, on rank 0 only."""
    spec = os.environ.get("HYBRID_SCALE_FAULT", "")
    where, _, name = spec.partition("@")
    if where != point or (name and rank != 0):
        return
    os.kill(os.getpid(), getattr(signal, f"SIG{name}") if name else signal.SIGKILL)


def commit(directory: Path) -> None:
    """Write the marker of a finished directory: the sha256 of every file in it, written last."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER)
    atomic_write(directory / MARKER, json.dumps({str(p.relative_to(directory)): sha256(p) for p in files}, indent=1))


def is_committed(directory: Path) -> bool:
    """A marker whose hashes match every file it names (a partial or corrupt directory is never trusted)."""
    marker = directory / MARKER
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text())
    except ValueError:
        return False
    return all((directory / name).is_file() and sha256(directory / name) == h for name, h in files.items())


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move a committed tmp directory into place, dropping what was there."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
