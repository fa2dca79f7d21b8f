"""Stage 1's identity and resume rules: every setting that changes its result (run_identity, recorded in the
manifest), the refusal's list of what a rerun changed (identity_changes; identities written by older versions are
read through _LEGACY_KEYS), and the marker that says a layer is committed (committed: it holds the sha256 of the
layer's parameter file). The step checkpoint a signal leaves mid-layer is the training step's (step.py)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from ..distributed.checkpoint import sha256
from ..recipes import train_gamma

# identities written before the keys were dotted config keys; their "world" is dropped (a resume may change it)
_LEGACY_KEYS = {
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


def run_identity(cfg, model_path: Path, attention, weights: dict[str, float]) -> dict:
    """Every setting that changes stage 1's result, under the dotted key a user writes, as it takes effect (JSON
    values). Left out, as they do not change what is computed: the number of ranks (the buffers are per sequence; a
    resume on another world rebuilds them), model.device and model.arch (the device moves only rounding; arch is for
    `plan`), distill.progress, distill.buffer_dir (where the buffers live, not what they hold), distill.recipe
    (only through distill.objectives, recorded as resolved), distill.query_block (the same loss summed in other
    row blocks: memory only, like the number of ranks it moves only floating-point rounding) and attention.backend
    (the same attention computed by another implementation: rounding only)."""
    d, data = cfg.distill, cfg.data
    user_source = data.source is not None  # the embedded default ignores text_field and heldout_fraction
    identity = {
        "model.path": str(Path(model_path).resolve()),
        "model.dtype": cfg.model.dtype,
        "seed": cfg.seed,
        "data.source": str(Path(data.source).resolve()) if user_source else None,
        "data.text_field": data.text_field if user_source else None,
        "data.heldout_fraction": data.heldout_fraction if user_source else 0.0,
        "data.seq_len": data.seq_len,
        "data.num_sequences": data.num_sequences,
        "distill.objectives": weights,  # resolved: distill.objectives, else distill.recipe's objective
        "distill.train_feature_maps": d.train_feature_maps,
        "distill.train_gamma": train_gamma(cfg, weights),  # resolved
        "distill.lr": d.lr,
        "distill.weight_decay": d.weight_decay,
        "distill.epochs": d.epochs,
        "distill.batch_size": d.batch_size,
        "distill.buffer_dtype": d.buffer_dtype,
    }
    container = OmegaConf.to_container(attention, resolve=True) if OmegaConf.is_config(attention) else dict(attention)
    identity.update({f"attention.{k}": v for k, v in container.items() if k != "backend"})  # window, layers, ...
    return json.loads(json.dumps(identity))


def identity_changes(recorded: dict, identity: dict) -> list[str]:
    """'key old -> new' for each key of `identity` whose recorded value differs (sorted by key). A key the
    recorded identity lacks (written by an older version) counts as changed: nothing says it was the same."""
    if "seq_len" in recorded:  # the older, undotted form
        old = {new: recorded[k] for k, new in _LEGACY_KEYS.items() if k in recorded}
        old.update({f"attention.{k}": v for k, v in (recorded.get("attention") or {}).items()})
        recorded = old

    def show(d: dict, key: str) -> str:
        if key not in d:
            return "(not recorded)"
        return d[key] if isinstance(d[key], str) else json.dumps(d[key])

    missing = object()
    return [
        f"{k} {show(recorded, k)} -> {show(identity, k)}"
        for k in sorted(identity)
        if recorded.get(k, missing) != identity[k]
    ]


def committed(stage1: Path, i: int) -> bool:
    marker, params = stage1 / f"layer_{i:03d}.done", stage1 / f"layer_{i:03d}.safetensors"
    if not (marker.is_file() and params.is_file()):
        return False
    try:
        return json.loads(marker.read_text())["sha256"] == sha256(params)
    except (ValueError, KeyError):
        return False
