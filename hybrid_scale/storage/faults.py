"""Test hooks the resume and full-disk tests set through the environment: HYBRID_SCALE_FAULT (a kill, a signal or
a full disk at a named point) and HYBRID_SCALE_STEP_SLEEP (slower training steps). Unset, each is a no-op."""

from __future__ import annotations

import errno
import os
import signal
import time


def fault_enospc(point: str) -> None:
    """Fault injection: HYBRID_SCALE_FAULT=enospc:<point> raises the OSError of a full disk there (a save that runs
    out of space), as the OS would."""
    if os.environ.get("HYBRID_SCALE_FAULT", "") == f"enospc:{point}":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), point)


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
