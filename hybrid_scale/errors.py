"""Every error a user can cause, in one place. Each is raised with one line that names the thing and the fix; the
CLI prints it as `hybrid-scale COMMAND: error: ...` and exits 2 (USER_ERRORS). Nothing here imports the rest of the
package, so every module can raise them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config key has a wrong name, type or value."""


class InputError(ValueError):
    """A user-supplied file or directory a stage needs is missing, unreadable or of the wrong kind."""


class DestinationError(ValueError):
    """A stage was asked to write where something it did not create already is."""


class CorpusError(ValueError):
    """Training or held-out text that cannot give what a stage asks of it."""


class TaskError(ValueError):
    """An evaluation task or its data set is unknown or missing."""


class AssetError(RuntimeError):
    """The embedded default (model, data sets, text) is not installed or not prepared."""


class UnsupportedArchitectureError(ValueError):
    """A model the conversion does not know."""


class ConvertedModelError(ValueError):
    """A converted model on disk that does not match its own description."""


class DistillError(RuntimeError):
    """Stage 1 cannot go on (its inputs, its run directory, a non-finite loss)."""


class FinetuneError(RuntimeError):
    """Stage 2 cannot go on (its inputs, its run directory, a non-finite loss)."""


class ExportError(RuntimeError):
    """The export cannot be written from its inputs."""


class PipelineError(RuntimeError):
    """What the other ranks of a pipeline say when rank 0's own work (the config record, the export) failed."""


class RunDirBusyError(RuntimeError):
    """Another live run holds the run directory's lock (run/lock.py)."""


USER_ERRORS = (
    RunDirBusyError,
    PipelineError,
    ConfigError,
    InputError,
    DestinationError,
    CorpusError,
    TaskError,
    AssetError,
    UnsupportedArchitectureError,
    ConvertedModelError,
    DistillError,
    FinetuneError,
    ExportError,
)
