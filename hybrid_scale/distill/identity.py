"""Stage 1's resume rules: the refusal's list of what a rerun changed (identity_changes, over the settings
run/settings.py says change stage 1's result, recorded in the manifest; identities written by older versions are
read through LEGACY_KEYS), and the marker that says a layer is committed (committed: it holds the sha256 of the
layer's parameter file). The step checkpoint a signal leaves mid-layer is the training step's (step.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..run.identity import changes
from ..storage.commits import sha256

# identities written before the keys were dotted config keys; their "world" is dropped (a resume may change it)
LEGACY_KEYS = {
    "model": "model.path",
    "seq_len": "data.seq_len",
    "num_sequences": "data.num_sequences",
    "seed": "seed",
    "data": "data.source",
    "buffer_dtype": "distill.buffer_dtype",
    "weights": "distill.objectives",
    "epochs": "distill.epochs",
    "batch_size": "distill.batch_size",
    "lr": "distill.lr",
}


def identity_changes(recorded: dict, identity: dict) -> list[str]:
    """'key old -> new' for each key whose recorded value differs (run/identity.changes). A key the recorded
    identity lacks (written by an older version) counts as changed: nothing says it was the same."""
    if "seq_len" in recorded:  # the older, undotted form
        old = {new: recorded[k] for k, new in LEGACY_KEYS.items() if k in recorded}
        old.update({f"attention.{k}": v for k, v in (recorded.get("attention") or {}).items()})
        recorded = old

    return changes(recorded, identity)


def committed(stage1: Path, i: int) -> bool:
    marker, params = stage1 / f"layer_{i:03d}.done", stage1 / f"layer_{i:03d}.safetensors"
    if not (marker.is_file() and params.is_file()):
        return False
    try:
        return json.loads(marker.read_text())["sha256"] == sha256(params)
    except (ValueError, KeyError):
        return False
