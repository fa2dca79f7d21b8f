"""What every stage, and the pipeline around them, does on entry, once:

  1. resolve: the run's paths (RunLayout), the derived settings (run/settings.derive) and the model the stage reads
     (run/sources.stage_model: the one disk probe, which reads that model's hybrid_config.json once);
  2. preflight: its inputs (the checks every stage shares, then the stage's own declaration: its inputs.py) and its
     plan checked, before any byte is written (preflight/plan.py);
  3. the runtime: the process group and the device (distributed/runtime.init), unless the stage runs on rank 0 alone;
  4. the run dir's lock (run/lock.py), the signal flag (SIGUSR1/SIGTERM only set it) and the requeue marker of a
     previous stop cleared;
  5. the rank-0 log (run/log.py: `logging`, a file handler on the stage's log file).

`stage_entry` yields an Entry that holds all of it; the stage's body reads everything from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .config.schema import Config
from .distributed import requeue, runtime
from .distributed.requeue import SignalFlag
from .preflight.inputs import StageInputs
from .preflight.plan import Plan, preflight, preflight_ahead
from .run import lock
from .run.layout import RunLayout
from .run.log import StageLog
from .run.resolved import Resolved
from .run.settings import Derived
from .run.sources import ModelSource


@dataclass
class Entry:
    stage: str
    cfg: Config  # the run's config (a structured DictConfig of config/schema.py's Config)
    resolved: Resolved
    plan: Plan
    rt: runtime.Runtime | None  # None: the stage runs on rank 0 alone (the export)
    signal: SignalFlag
    log: StageLog

    @property
    def layout(self) -> RunLayout:
        return self.resolved.layout

    @property
    def derived(self) -> Derived:
        return self.resolved.derived

    @property
    def model(self) -> ModelSource | None:
        return self.resolved.model

    @property
    def main(self) -> bool:
        return self.rt is None or self.rt.main


LOG_ECHO = {"evaluate": "evaluate"}  # the stages whose log lines also go to stderr


@contextmanager
def stage_entry(
    cfg: Config,
    stage: str,
    inputs: StageInputs | None = None,
    ranks: bool = True,
    ahead: dict[str, StageInputs] | None = None,
) -> Iterator[Entry]:
    """Enter `stage` (distill, finetune, evaluate, export, whose `inputs` declare what each reads: its inputs.py), or
    pipeline with the declarations of the stages still to run in `ahead`. `ranks` False: the stage runs in this
    process alone (the export, on rank 0), without the process group."""
    if (inputs is None) == (ahead is None):
        raise ValueError("stage_entry takes exactly one of a stage's inputs and the pipeline's stages ahead")
    resolved = Resolved.of(cfg, None if ahead is not None else stage)
    if ahead is not None:
        checked = preflight_ahead(cfg, ahead, resolved) if ahead else Plan()
    else:
        checked = preflight(cfg, stage, inputs, resolved)
    rt = None
    if ranks:
        rt = runtime.init(cfg.model.device, cfg.launch.tensor_parallel, cfg.launch.timeout_min)
    layout = resolved.layout
    with lock.for_stage(cfg, stage, rt, layout), SignalFlag() as signal:
        main = rt is None or rt.main
        if main:
            requeue.clear_request(layout.run_dir)
        log = StageLog(layout.log(stage), main, LOG_ECHO.get(stage), name=stage)
        try:
            yield Entry(stage, cfg, resolved, checked, rt, signal, log)
        finally:
            log.close()
