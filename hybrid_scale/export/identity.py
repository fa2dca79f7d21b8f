"""What an export was made from (identity.json in it): the pipeline exports again when this changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from ..config.schema import Config
from ..run.settings import data_settings
from ..run.sources import ModelSource

IDENTITY_NAME = "identity.json"  # in an export: what it was made from (export_identity)


def export_identity(cfg: Config, model: ModelSource, eval_dir: Path) -> dict:
    """What an export was made from: the export.* settings, the input model's files (and its base's), whether it runs
    on torch only, the text a calibration or report reads, the seed, and the evaluation its card may carry. The
    pipeline exports again when this changed."""
    export = {
        k: v for k, v in OmegaConf.to_container(cfg.export, resolve=True).items() if k not in ("out_dir", "model")
    }
    results = eval_dir / "results.json"
    identity = {
        "export": export,
        "torch_only": cfg.attention.backend == "torch",
        "model": hashlib.sha256(json.dumps(model.files()).encode()).hexdigest(),
        "evaluation": hashlib.sha256(results.read_bytes()).hexdigest() if results.is_file() else None,
        "seed": cfg.seed,
        **data_settings(cfg),
    }
    return json.loads(json.dumps(identity))
