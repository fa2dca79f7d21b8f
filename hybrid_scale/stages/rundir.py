"""The run directory's rules that several stages share: which model is "the run's model" (evaluate and export read
the same one), and which directory a stage may replace."""

from __future__ import annotations

import json
from pathlib import Path

from ..distributed.checkpoint import MARKER
from ..models.converted import CONFIG_NAME

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


def is_export(path: Path) -> bool:
    """An export this toolkit wrote (or is writing): its own marker and a hybrid_scale config.json."""
    from ..distributed.checkpoint import PARTIAL_TAG

    if not path.is_dir() or path.is_symlink():
        return False
    if (path / PARTIAL_TAG).is_file():
        return True
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return False
    return (path / MARKER).is_file() and str(model_type).startswith("hybrid_scale_")
