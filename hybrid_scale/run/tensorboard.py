"""TensorBoard for a stage's metrics (run/metrics.py): torch's SummaryWriter, made to fail in one line.

The writer flushes from a thread of its own; when that write fails (a full disk, a lost mount), the thread's error
would print with its whole traceback and come back on the stage's next scalar or at close, in front of or in place
of the stage's own error. Here such an OSError, from the thread or from a call, prints one line on stderr and turns
TensorBoard off for the rest of the stage; the stage goes on as it would without it and its own errors stay its own.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


class TensorBoard:
    def __init__(self, directory: Path, purge_step: int | None = None):
        self.dir, self.writer, self.failed = Path(directory), None, False
        self._hook = threading.excepthook
        threading.excepthook = self._thread_failed
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir), purge_step=purge_step)
        except OSError as e:
            self._stop(e)

    def _thread_failed(self, args) -> None:
        """threading.excepthook while the writer lives: the writer thread's OSError in one line, the rest as before."""
        if self._is_writer(args.thread) and isinstance(args.exc_value, OSError):
            self._stop(args.exc_value)
        else:
            self._hook(args)

    @staticmethod
    def _is_writer(thread) -> bool:
        return thread is not None and type(thread).__module__.startswith("tensorboard.")

    def _stop(self, error: OSError) -> None:
        if not self.failed:
            self.failed = True
            reason = f"{error.strerror} ({error.filename})" if error.strerror and error.filename else str(error)
            print(
                f"hybrid-scale: TensorBoard stopped: writing under {self.dir} failed: {reason}; the stage goes on "
                "without it",
                file=sys.stderr,
                flush=True,
            )

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.failed or self.writer is None:
            return
        try:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
        except OSError as e:
            self._stop(e)

    def close(self) -> None:
        """Flush and end the writer (its last error in one line, never raised: the stage may be ending on its own)."""
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            self._stop(e)
        finally:
            self.writer = None
            if threading.excepthook == self._thread_failed:
                threading.excepthook = self._hook
