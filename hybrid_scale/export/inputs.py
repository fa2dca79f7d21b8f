"""What the export reads from the user, checked where it lives: its model (export.model, else the run's: a converted
model, readable, its base present and its adapter fitting it, not an export already) and export.out_dir (refused
where writing could lose data). entry.stage_entry has preflight run `INPUTS.now` before the export writes its first
byte, and a pipeline runs `INPUTS.ahead` (only the output: the model does not exist yet)."""

from __future__ import annotations

import json
from pathlib import Path

from ..config.schema import Config
from ..errors import ConfigError
from ..preflight.inputs import StageInputs, check_converted
from ..run.resolved import Resolved
from ..run.sources import check_stage_model
from ..storage.commits import check_destination, is_export


def check_export_output(cfg: Config, out: Path, *protected: Path) -> Path:
    """export.out_dir (`out`), refused before any work when writing there could lose data: the input model, its base,
    the run directory or a directory holding one of them, a file, or an existing directory that is not an export of
    ours (a previous export is replaced)."""
    key = "export.out_dir"
    resolved = out.resolve()
    for path in (Path(cfg.run_dir), *protected):
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise ConfigError(
                f"config key '{key}': {out} is or holds {path}, which the export reads or the run keeps; nothing was "
                f"touched: choose a new directory, e.g. export.out_dir={Path(cfg.run_dir) / 'export'}"
            )
    check_destination(out, key, owned=is_export, what="an export written by hybrid_scale")
    return out


def check_not_an_export(path: Path) -> None:
    """The export merges a model's adapter into its base's shards; an export's shards are merged already and carry its
    own architecture: refused in one line (it used to fail on the architecture, naming the wrong fix)."""
    config = path / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or [""])[0] if config.is_file() else ""
    if arch.startswith("HybridScale"):
        raise ConfigError(
            f"config key 'export.model': {path} is an export already ({arch}); export from the stage-2 or stage-1 "
            "model it was made from (its model card names it), with the new export.* settings"
        )


def now(cfg: Config, r: Resolved) -> None:
    model = r.model
    check_stage_model(cfg, "export", model)  # first: nothing else can be checked without it
    check_converted(model)
    check_not_an_export(model.path)
    check_export_output(cfg, r.layout.export, model.path, model.base)


def ahead(cfg: Config, r: Resolved) -> None:
    check_export_output(cfg, r.layout.export, *([Path(cfg.export.model)] if cfg.export.model else []))


INPUTS = StageInputs(now, ahead)
