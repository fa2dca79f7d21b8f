"""The save-and-requeue protocol every long stage follows under a batch system: SIGUSR1 / SIGTERM only set a flag;
at the next step boundary the ranks agree on it, save a committed checkpoint, write the requeue marker (torchrun
does not pass exit codes on) and raise Requeue; the CLI exits EXIT_REQUEUE, and the sbatch script requeues the job."""

from __future__ import annotations

import signal
from pathlib import Path

from .checkpoint import atomic_write

EXIT_REQUEUE = 75  # "saved, please requeue" (EX_TEMPFAIL); the Slurm scripts requeue on it
REQUEUE_MARKER = "requeue_requested"  # in run_dir: a stage saved on a signal and asks to be started again
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Requeue(Exception):  # noqa: N818 -- not an error: the stage saved and asks to be started again
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped by a signal after step {step}; saved {checkpoint}; run again to resume")
        self.step, self.checkpoint = step, checkpoint


class SignalFlag:
    """While active, USR1 / TERM set `self.raised` instead of ending the process; the previous handlers return on
    exit. The loop reads the flag at a step boundary (all ranks agree on it through a collective)."""

    def __init__(self):
        self.raised = False
        self._previous: dict = {}

    def _on_signal(self, signum, frame) -> None:
        self.raised = True

    def __enter__(self) -> SignalFlag:
        self.raised = False
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def clear_request(run_dir: Path) -> None:
    (Path(run_dir) / REQUEUE_MARKER).unlink(missing_ok=True)


def request(run_dir: Path, step: int, checkpoint: Path, write_marker: bool = True) -> Requeue:
    """The exception to raise after a signal-triggered save; `write_marker` (rank 0) also marks the run for a requeue,
    for batch scripts under torchrun, which does not pass the exit code on."""
    if write_marker:
        atomic_write(Path(run_dir) / REQUEUE_MARKER, f"{step}\n")
    return Requeue(step, checkpoint)
