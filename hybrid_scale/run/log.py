"""A stage's log, with `logging`: on rank 0 the logger `hybrid_scale.<stage>` has a file handler on the stage's log
file (a timestamped line per event, the file kept open) and, for a stage that echoes, a stderr handler ("evaluate:
message"); on the other ranks it has no handler and drops every line. It does not propagate to the root logger (a
user's logging config sees `hybrid_scale.<stage>` and can add its own handlers).

A line that cannot be written (a full disk) is said once, in one line on stderr, and the stage goes on: its own
writes then fail with its own one-line error.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")


class _File(logging.FileHandler):
    """The log file, opened at its first line; a failed write in one line (logging's default prints a traceback)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:  # (opening the file at its first line is outside logging's own guard)
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if getattr(self, "failed", False):
            return
        self.failed = True
        error = sys.exc_info()[1]
        print(f"hybrid-scale: the stage log {self.baseFilename} could not be written: {error}", file=sys.stderr)


class StageLog:
    """`log(message)`: one event of a stage (see the module docstring); `close()` ends its handlers."""

    def __init__(self, path: Path | None, main: bool = True, echo: str | None = None, name: str = "stage"):
        self.path, self.main, self.echo = path, main, echo
        self.logger = logging.getLogger(f"hybrid_scale.{name}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self._drop_handlers()  # (a stage entered again in this process: the pipeline, a test)
        if main and path is not None:
            handler = _File(path, mode="a", delay=True)
            handler.setFormatter(FORMAT)
            self.logger.addHandler(handler)
        if main and echo:
            stream = logging.StreamHandler(sys.stderr)
            stream.setFormatter(logging.Formatter(f"{echo}: %(message)s"))
            self.logger.addHandler(stream)

    def __call__(self, message: str) -> None:
        if self.main:
            self.logger.info(message)

    def _drop_handlers(self) -> None:
        for handler in list(self.logger.handlers):
            self.logger.removeHandler(handler)
            handler.close()

    def close(self) -> None:
        self._drop_handlers()
