"""The run's one disk probe: which model a stage reads. `stage_model` is called once when a stage starts (by its
entry, entry.py) and reads that model's hybrid_config.json once; the checks, `plan` and the stage body all take
the ModelSource it returns. The paths themselves are run/layout.py's (RunLayout)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import Config
from ..data import assets
from ..errors import ConfigError, InputError
from .layout import CONFIG_NAME, RunLayout

FORMAT_VERSION = 1  # of hybrid_config.json


@dataclass(frozen=True)
class ModelSource:
    """A model a stage reads: its directory, the config key that names it (for errors), and its hybrid_config.json
    as read once (None: a plain Hugging Face model, or no model there yet)."""

    path: Path
    key: str
    hybrid_config: dict | None = None

    @property
    def converted(self) -> bool:
        return self.hybrid_config is not None

    @property
    def base(self) -> Path:
        """The directory with its weights and tokenizer: itself (a plain model, an export, a stage-2 copy) or the
        base named in its hybrid_config.json."""
        if self.hybrid_config is None:
            return self.path
        ref = self.hybrid_config["base_model"]
        return self.path if ref == "." else Path(ref)

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def files(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime) of every file of the model and of its base (stage 2 rewrites its output in place): what
        says, without reading a weight, that a result made from it still describes it."""
        dirs = sorted({self.path.resolve(), self.base.resolve()})
        return [
            (str(f), f.stat().st_size, f.stat().st_mtime_ns) for d in dirs for f in sorted(d.rglob("*")) if f.is_file()
        ]

    def describe(self) -> str:
        """Where it came from, for reports and model cards: 'stage2/final (step 200)' or its last two names."""
        path = self.path.resolve()
        origin = (self.hybrid_config or {}).get("origin") or {}
        name = f"{path.parent.name}/{path.name}"
        return f"{name} (step {origin['step']})" if origin.get("step") is not None else name


def read_hybrid_config(path: str | Path) -> dict:
    """A converted model's hybrid_config.json (its format version checked); one InputError names a missing or
    damaged file."""
    file = Path(path) / CONFIG_NAME
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise InputError(f"{path} is not a converted model: {CONFIG_NAME} is missing") from None
    except ValueError as e:
        raise InputError(f"{file} is not valid JSON ({e}); restore {file}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise InputError(f"{file} has format_version {version}; this hybrid_scale reads {FORMAT_VERSION}")
    return meta


def probe(path: Path, key: str) -> ModelSource:
    """The model at `path`, its hybrid_config.json read when it has one."""
    converted = (path / CONFIG_NAME).is_file()
    return ModelSource(path, key, read_hybrid_config(path) if converted else None)


def run_model(layout: RunLayout) -> Path | None:
    """The run's model: stage2/output resolved (best/ when early stopping chose it, else final/), else
    stage1/converted; None before stage 1 has finished. The one rule for the evaluation and the export."""
    for path in (layout.stage2_output, layout.stage1_output):
        if (path / CONFIG_NAME).is_file():
            return path.resolve()
    return None


def stage_model(cfg: Config, stage: str, layout: RunLayout) -> ModelSource | None:
    """The model `stage` reads (None for the pipeline, which reads none itself):
    - distill: model.path, else the embedded default (the teacher, a plain model);
    - finetune: finetune.model, else stage 1's output;
    - evaluate: eval.model, else the run's model (run_model), else model.path, else the embedded default;
    - export: export.model, else the run's model.
    The path may not hold a model yet; `check_stage_model` refuses that, in the preflight."""
    if stage == "distill":
        return ModelSource(Path(cfg.model.path) if cfg.model.path else assets.require().model, "model.path")
    if stage == "finetune":
        return probe(Path(cfg.finetune.model) if cfg.finetune.model else layout.stage1_output, "finetune.model")
    if stage == "evaluate":
        path = cfg.eval.model or run_model(layout) or cfg.model.path
        return probe(Path(path) if path else assets.require().model, "eval.model")
    if stage == "export":
        path = Path(cfg.export.model) if cfg.export.model else run_model(layout)
        return probe(path, "export.model") if path is not None else ModelSource(layout.stage1_output, "export.model")
    return None


def check_stage_model(cfg: Config, stage: str, source: ModelSource) -> None:
    """A stage's model is there and of the kind it reads; one clear error otherwise."""
    if stage == "finetune" and not source.converted:
        raise ConfigError(
            f"config key 'finetune.model': {source.path} is not a converted model; run stage 1 first (hybrid-scale "
            "distill) or point finetune.model at a converted model"
        )
    if stage == "export" and not source.converted:
        if cfg.export.model:
            raise ConfigError(
                f"config key 'export.model': {source.path} is not a converted model (no {CONFIG_NAME}); point it at "
                "a stage-1/stage-2 output, or leave it unset for the run's own model"
            )
        raise ConfigError(
            f"config key 'export.model': {cfg.run_dir} has no stage-2 or stage-1 model yet; run the stages or set "
            "export.model"
        )
    if stage == "evaluate":
        if not source.exists:
            raise ConfigError(
                f"config key 'eval.model': {source.path} does not exist; set it to a model directory, or leave it "
                "unset for the run's own model"
            )
        if not source.converted and not (source.path / "config.json").is_file():
            raise ConfigError(
                f"config key 'eval.model': {source.path} is neither a Hugging Face model nor a converted model (no "
                f"config.json, no {CONFIG_NAME}); point it at one"
            )
