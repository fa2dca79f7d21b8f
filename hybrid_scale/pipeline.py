"""The whole pipeline in one command: stage 1 -> stage 2 -> ablation evaluation -> export, resuming where it stopped.

Each stage is skipped when its output is committed and still describes what it would make now: stage 2 when its
output and curves exist (stage 1 resumes at its first uncommitted layer, stage 2 from its newest committed
checkpoint, by themselves); the evaluation and the export when the identity they recorded (the model's files, their
settings, the text; evaluate/cells.identity, export/stage.export_identity) is the current one, else they run again
(the evaluation reusing its cells whose keys still match). The resolved config is saved as {run_dir}/config.yaml;
rerunning with training settings that would change results is refused, naming the keys. `allow_config_change=true`
lets such a rerun go on for the training stages not started yet; a started or finished stage 1 or 2 whose settings
changed is still refused (remove its directory, or use another run_dir), and config.yaml is not rewritten then.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from .config import STAGES
from .config.schema import Config
from .data import corpus
from .distill import inputs as distill_inputs
from .distill.stage import distill
from .distributed import requeue, runtime
from .entry import Entry, stage_entry
from .errors import ConfigError, PipelineError
from .evaluate import inputs as evaluate_inputs
from .evaluate.cells import identity
from .evaluate.results import EvalResults
from .evaluate.stage import evaluate
from .export import inputs as export_inputs
from .export.identity import IDENTITY_NAME, export_identity
from .export.stage import export
from .finetune import inputs as finetune_inputs
from .finetune.stage import finetune
from .run.identity import differing, is_current
from .run.layout import RunLayout
from .run.resolved import Resolved
from .run.settings import run_settings
from .storage.commits import MARKER, atomic_write

STAGE_INPUTS = {  # what each stage reads from the user (its inputs.py), checked ahead of a pipeline's first stage
    "distill": distill_inputs.INPUTS,
    "finetune": finetune_inputs.INPUTS,
    "evaluate": evaluate_inputs.INPUTS,
    "export": export_inputs.INPUTS,
}


def _started(directory: Path) -> bool:
    return directory.is_dir() and any(directory.iterdir())


def record_config(cfg: Config, layout: RunLayout, allow_change: bool = False) -> Path:
    """Save the resolved config in the run directory; refuse a rerun whose result settings (run/settings.py)
    differ, and with allow_change, one whose changed settings belong to a stage that has started."""
    path = layout.config
    if path.is_file():
        changed = differing(run_settings(OmegaConf.load(path)), run_settings(cfg))
        if changed and not allow_change:
            raise ConfigError(
                f"{layout.run_dir} was run with another config: {', '.join(changed)} changed (see {path}); use another "
                "run_dir, restore them, or pass allow_config_change=true (for the training stages not started yet)"
            )
        for name, directory, keys in (
            ("stage 1", layout.stage1, [k for k in changed if not k.startswith("finetune.")]),
            ("stage 2", layout.stage2, [k for k in changed if k.startswith("finetune.")]),
        ):
            if keys and _started(directory):
                raise ConfigError(
                    f"{layout.run_dir}: {', '.join(keys)} changed, but {name} has started with the recorded values "
                    f"(see {path}); allow_config_change applies to the stages not started yet: remove {directory} to "
                    "run it again with the new settings, or use another run_dir"
                )
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, OmegaConf.to_yaml(cfg))
    return path


def is_done(cfg: Config, layout: RunLayout, stage: str) -> bool:
    """Whether `stage`'s output is committed and describes what it would make now (stage 1 resumes by itself: a
    finished one only rewrites its small output), or is not needed: stage 1 when finetune.model names the converted
    model stage 2 starts from."""
    if stage == "distill":
        return cfg.finetune.model is not None
    if stage == "finetune":
        return (layout.stage2 / "curves.json").is_file() and layout.stage2_output.exists()
    if stage == "evaluate":
        results = layout.eval / "results.json"
        return results.is_file() and _same(lambda: EvalResults.load(results).identity, cfg, stage)
    if stage == "export":
        recorded = layout.export / IDENTITY_NAME
        return (layout.export / MARKER).is_file() and _same(lambda: json.loads(recorded.read_text()), cfg, stage)
    return False


def _same(recorded, cfg: Config, stage: str) -> bool:
    """Whether the identity the stage recorded is the one it would record now (any error: no)."""
    try:
        model = Resolved.of(cfg, stage).model
        if stage == "evaluate":
            now = identity(cfg, model, runtime.resolve_device(cfg.model.device))
        else:
            now = export_identity(cfg, model, RunLayout.of(cfg).eval)
        return is_current(recorded(), now)
    except Exception:  # (no model there, an unreadable record, ...: the stage runs and says what is wrong)
        return False


def pipeline(cfg: Config, stages: tuple[str, ...] = STAGES, log=print) -> dict:
    layout = RunLayout.of(cfg)
    todo = [stage for stage in stages if not is_done(cfg, layout, stage)]
    # the preflight of every stage still to run, then the runtime, the lock (held across the stages: one writer per
    # run dir) and one signal flag for the whole run (entry.py); each stage enters its own preflight again
    with stage_entry(cfg, "pipeline", ahead={stage: STAGE_INPUTS[stage] for stage in todo}) as entry:
        return _run_stages(entry, stages, log)


def on_rank0(rt, what: str, work) -> None:
    """`work` on rank 0 alone, then the ranks agree on its outcome: an error stops every rank at once (rank 0 raises
    it, the others say rank 0 failed) instead of leaving them waiting in a barrier until launch.timeout_min."""
    error = None
    if rt.main:
        try:
            work()
        except Exception as e:  # (raised below, after the others know)
            error = e
    if not runtime.all_ranks(rt, error is None):
        raise error or PipelineError(f"{what} failed on rank 0 (its error is in rank 0's output)")


def export_on_rank0(cfg: Config, rt) -> None:
    """The export, the last stage, runs on rank 0 alone, and the other ranks do not wait for it: no collective
    follows, so an export longer than launch.timeout_min cannot time them out, and a failed export is rank 0's exit
    code (which torchrun and srun report for the job)."""
    if rt.main:
        export(cfg)


def _run_stages(entry: Entry, stages, log) -> dict:
    """pipeline's work, under the run dir's lock: the config recorded, then each stage not done yet."""
    cfg, rt, layout = entry.cfg, entry.rt, entry.layout
    on_rank0(rt, "recording the config", lambda: record_config(cfg, layout, cfg.allow_config_change))
    timings = json.loads(layout.timings.read_text()) if layout.timings.is_file() else {}
    assert "export" not in stages or stages[-1] == "export"  # (nothing after it: the other ranks have left)
    for stage in stages:
        if is_done(cfg, layout, stage):
            why = "finetune.model is given" if stage == "distill" else "done before"
            log(f"[pipeline] {stage}: {why}, skipped")
            continue
        if runtime.any_rank(rt, entry.signal.raised):  # between stages: everything before is committed
            what = f"pipeline stopped by a signal before {stage}"
            raise requeue.request(layout.run_dir, stage, layout.run_dir, rt, what=what)
        log(f"[pipeline] {stage}: running")
        t0 = time.perf_counter()
        if stage == "distill":
            distill(cfg)
        elif stage == "finetune":
            finetune(cfg)
        elif stage == "evaluate":  # eval.model unset: the run's own model (run/sources.stage_model)
            evaluate(cfg)
        elif stage == "export":
            export_on_rank0(cfg, rt)
        timings[stage] = time.perf_counter() - t0
        corpus.forget()  # (a stage's packed text is not held through the next: each re-reads its own once)
        if rt.main:
            atomic_write(layout.timings, json.dumps(timings, indent=1))
    return timings
