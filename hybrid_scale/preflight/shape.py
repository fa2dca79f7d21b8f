"""The model's shape as the preflight reads it, without weights: the architecture's config dict (from the stage's
input, model.path or the preset's model.arch), its parameter counts, bytes on disk, free disk, and the assumed rates
that turn counts into rough times."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..attention.hf.architectures import BY_MODEL_TYPE, base_model_type
from ..attention.kinds import kind_of
from ..config.schema import Config
from ..data import assets
from ..models import streaming

SUPPORTED_TYPES = tuple(BY_MODEL_TYPE)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9
MFU = 0.35  # assumed model-flops utilisation for the rough times
SAVE_BYTES_PER_S = 0.5e9  # assumed write speed of a checkpoint (gather + shared file system)
READ_BYTES_PER_S = 2e9  # assumed checkpoint read rate per node at start-up (shared file system)
CPU_FLOPS = 1e11  # assumed forward rate on CPU (SmolLM2-135M's passkey probe: ~3.3 min per mode on 2 cores)


def la_params(cfg: Config, c: dict) -> int:
    """One layer's LA parameters that train as its feature maps, as its kind counts them (attention/kinds.py):
    Hedgehog's phi_q and phi_k (the other maps' too), or gated_delta's gates, short convolutions and q/k maps."""
    return kind_of(cfg.attention).params(c, cfg.attention)


def decay_params(cfg: Config, c: dict) -> int:
    """One layer's LA decay parameters: rho per KV head (attention.la_decay)."""
    return c["K"] if cfg.attention.la_decay else 0


def architecture(cfg: Config, base: Path | None = None) -> tuple[dict, str]:
    """The model's HF config dict: from the stage's input (`base`; an export's hybrid_scale_* type counts as its base
    architecture), else model.path when it is on disk, else the preset's model.arch."""
    if base is not None and (base / "config.json").is_file():
        a = json.loads((base / "config.json").read_text())
        a["model_type"] = base_model_type(a.get("model_type"))
        return a, str(base / "config.json")
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        return json.loads((Path(cfg.model.path) / "config.json").read_text()), str(Path(cfg.model.path) / "config.json")
    if cfg.model.arch:
        return OmegaConf.to_container(cfg.model.arch), "model.arch"
    if not cfg.model.path:
        path = assets.require().model
        return json.loads((path / "config.json").read_text()), str(path / "config.json")
    return {}, ""


def counts(a: dict) -> dict:
    D, L, V, inter = a["hidden_size"], a["num_hidden_layers"], a["vocab_size"], a["intermediate_size"]
    H, K = a["num_attention_heads"], a.get("num_key_value_heads", a["num_attention_heads"])
    hd = a.get("head_dim") or D // H
    attn = D * H * hd * 2 + D * K * hd * 2
    layer = attn + 3 * D * inter + 2 * D
    embed = V * D * (1 if a.get("tie_word_embeddings") else 2)
    return {
        "D": D,
        "L": L,
        "V": V,
        "H": H,
        "K": K,
        "hd": hd,
        "layer": layer,
        "embed": embed,
        "total": embed + L * layer,
    }


def gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def free_at(path: Path) -> tuple[Path, int]:
    probe = next((q for q in (path, *path.parents) if q.exists()), Path("."))
    return probe, shutil.disk_usage(probe).free


def stored_bytes(base: Path) -> tuple[int, int]:
    """(bytes on disk, bytes per element) of a safetensors checkpoint, from file sizes and one header."""
    from safetensors import safe_open

    files = sorted(base.glob("*.safetensors"))
    if not files:
        return 0, 0
    with safe_open(files[0], "pt") as f:
        names = list(f.keys())
        dtype = f.get_slice(names[0]).get_dtype() if names else "F32"
    return sum(x.stat().st_size for x in files), streaming.SAFETENSORS_BYTES.get(dtype, 4)


@dataclass
class Shape:
    """What every estimate reads: the architecture's config dict, its counts, the ranks, bytes per weight."""

    a: dict
    c: dict
    ranks: int
    wbytes: int
    fdim: int  # the feature map's output size per head
    tp: int = 1  # launch.tensor_parallel
