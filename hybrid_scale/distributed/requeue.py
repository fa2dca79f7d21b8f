"""The save-and-requeue protocol every long stage follows under a batch system: SIGUSR1 / SIGTERM only set a flag;
at the next step boundary the ranks agree on it, save a committed checkpoint, write the requeue marker (torchrun
does not pass exit codes on) and raise Requeue; the CLI exits EXIT_REQUEUE, and the sbatch script requeues the job."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING

from ..storage.commits import atomic_write

if TYPE_CHECKING:  # (torch: the CLI imports this module before it knows whether its command needs torch)
    from .runtime import Runtime

EXIT_REQUEUE = 75  # "saved, please requeue" (EX_TEMPFAIL); the Slurm scripts requeue on it
REQUEUE_MARKER = "requeue_requested"  # in run_dir: a stage saved on a signal and asks to be started again
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Requeue(Exception):  # noqa: N818 -- not an error: the stage saved and asks to be started again
    def __init__(self, step, checkpoint: Path, what: str | None = None):
        what = what or f"stopped by a signal after step {step}; saved {checkpoint}"
        super().__init__(f"{what}; run again to resume")
        self.step, self.checkpoint = step, checkpoint


class SignalFlag:
    """While active, USR1 / TERM set the flag instead of ending the process; the previous handlers return when the
    outermost one exits. The flag is one per process: a stage's flag nested in the pipeline's sees a signal that
    came between stages or while the stage was starting. The loop reads `raised` at a step boundary (all ranks agree
    on it through a collective)."""

    _depth = 0
    _raised = False
    _previous: dict = {}

    @property
    def raised(self) -> bool:
        return SignalFlag._raised

    @staticmethod
    def _on_signal(signum, frame) -> None:
        SignalFlag._raised = True

    def __enter__(self) -> SignalFlag:
        if SignalFlag._depth == 0:
            SignalFlag._raised = False
            SignalFlag._previous = {s: signal.signal(s, SignalFlag._on_signal) for s in SIGNALS}
        SignalFlag._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        SignalFlag._depth -= 1
        if SignalFlag._depth == 0:
            for s, handler in SignalFlag._previous.items():
                signal.signal(s, handler)


def clear_request(run_dir: Path) -> None:
    (Path(run_dir) / REQUEUE_MARKER).unlink(missing_ok=True)


def request(run_dir: Path, step, checkpoint: Path, rt: Runtime, what: str | None = None) -> Requeue:
    """The exception to raise after a signal-triggered save, on every rank: rank 0 marks the run for a requeue (for
    batch scripts under torchrun, which does not pass the exit code on), then the ranks meet, so that the marker is
    on disk before any of them exits (torchrun stops the others when one does). `what` replaces the message's first
    part ("stopped by a signal after step N; saved CHECKPOINT")."""
    if rt.main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(run_dir) / REQUEUE_MARKER, f"{step}\n")
    from .runtime import barrier

    barrier(rt)
    return Requeue(step, checkpoint, what)
