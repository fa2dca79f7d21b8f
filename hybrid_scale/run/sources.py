"""The run directory's rules that need the disk: which model is "the run's model" (evaluate and export read the
same one), the model each stage reads, and how an export is recognised (the only kind of directory at export.out_dir
that may be replaced). The paths themselves are `run/layout.py`'s (RunLayout)."""

from __future__ import annotations

import json
from pathlib import Path

from ..data import assets
from ..errors import ConfigError
from ..models.converted import CONFIG_NAME, base_dir
from .layout import RunLayout

RUN_MODEL_ORDER = ("stage2/output", "stage1/converted")  # stage2/output -> best (early stopping chose it) or final


def run_model(run_dir: str | Path) -> Path | None:
    """The run's model: {run_dir}/stage2/output resolved (best/ when early stopping chose it, else final/), else
    {run_dir}/stage1/converted; None before stage 1 has finished. The one rule for every stage that reads it."""
    run = Path(run_dir)
    for rel in RUN_MODEL_ORDER:
        if (run / rel / CONFIG_NAME).is_file():
            return (run / rel).resolve()
    return None


def describe_origin(path: Path) -> str:
    """Where a converted model came from, for reports and model cards: 'stage2/final (step 200)' or the path."""
    path = Path(path).resolve()
    try:
        origin = json.loads((path / CONFIG_NAME).read_text()).get("origin") or {}
    except (OSError, ValueError):
        origin = {}
    name = f"{path.parent.name}/{path.name}"
    if origin.get("step") is not None:
        return f"{name} (step {origin['step']})"
    return name


def stage1_dir(cfg) -> Path:
    return RunLayout.of(cfg).stage1


def buffer_dir(cfg) -> Path:
    return RunLayout.of(cfg).buffers


def stage1_output(cfg) -> Path:
    return RunLayout.of(cfg).stage1_output


def stage2_dir(cfg) -> Path:
    return RunLayout.of(cfg).stage2


def finetune_source(cfg) -> Path:
    """The converted model stage 2 fine-tunes: finetune.model, else stage 1's output."""
    source = Path(cfg.finetune.model) if cfg.finetune.model else stage1_output(cfg)
    if not (source / CONFIG_NAME).is_file():
        raise ConfigError(
            f"config key 'finetune.model': {source} is not a converted model; run stage 1 first (hybrid-scale "
            "distill) or point finetune.model at a converted model"
        )
    return source


def eval_dir(cfg) -> Path:
    return RunLayout.of(cfg).eval


def export_dir(cfg) -> Path:
    return RunLayout.of(cfg).export


def export_source(cfg) -> Path:
    """export.model, else the run's model (run_model: the same one `evaluate` scores)."""
    if cfg.export.model:
        path = Path(cfg.export.model)
        if not (path / CONFIG_NAME).is_file():
            raise ConfigError(
                f"config key 'export.model': {path} is not a converted model (no {CONFIG_NAME}); point it at a "
                "stage-1/stage-2 output, or leave it unset for the run's own model"
            )
        return path
    path = run_model(cfg.run_dir)
    if path is None:
        raise ConfigError(
            f"config key 'export.model': {cfg.run_dir} has no stage-2 or stage-1 model yet; run the stages or set "
            "export.model"
        )
    return path


def eval_source(cfg) -> tuple[Path, bool]:
    """(path, is_converted) of the model to evaluate: eval.model, else the run's model (run_model, the one export
    reads too), else model.path, else the embedded default."""
    path = cfg.eval.model or run_model(cfg.run_dir) or cfg.model.path
    path = Path(path) if path else assets.require().model
    if not path.exists():
        raise ConfigError(
            f"config key 'eval.model': {path} does not exist; set it to a model directory, or leave it unset for the "
            "run's own model"
        )
    converted = (path / CONFIG_NAME).is_file()
    if not converted and not (path / "config.json").is_file():
        raise ConfigError(
            f"config key 'eval.model': {path} is neither a Hugging Face model nor a converted model (no config.json, "
            f"no {CONFIG_NAME}); point it at one"
        )
    return path, converted


def base_of(path: Path, converted: bool) -> Path:
    """The directory with the weights and tokenizer of a model to evaluate / export (a converted model's base)."""
    return base_dir(path) if converted else path
