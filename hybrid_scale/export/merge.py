"""The merged Hugging Face directory of an export: LoRA merged into the base weights while the shards are streamed
(tensors read one by one, the adapter's delta B @ A * alpha / r added where it applies, output shards of at most
`export.max_shard_gb`, peak memory about one shard, with model.safetensors.index.json); phi and gamma in their own
shard (hybrid_params.safetensors) in the same index; config.json with its own model_type and an auto_map to
configuration_/modeling_hybrid_scale.py, copied with the package's attention files (the code that trained it; torch +
transformers only), so that without trust_remote_code=True transformers refuses it instead of loading a softmax
model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..attention.hf.architectures import ARCHITECTURES
from ..errors import ExportError
from ..models import streaming
from ..models.converted import (
    PARAMS_NAME,
    merge,
    write_converted,
)
from ..storage.commits import save_tensors
from ..storage.faults import fault_enospc
from .remote_code import write_remote_code

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


# --- writing -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    """The output shards of a merge: `shards` (tensor names, in order) over the input checkpoint `base`, whose file
    `where` names per tensor; floating tensors are written in `dtype` (None: as read)."""

    base: Path
    where: dict[str, str]
    shards: list[list[str]]
    dtype: torch.dtype | None


def plan_shards(base: Path, where: dict[str, str], max_bytes: int, dtype: torch.dtype | None) -> ShardPlan:
    """Tensor names grouped into output shards: one per input shard, split where it exceeds max_bytes (a larger
    single tensor gets its own), so that writing never holds more than about one input shard."""
    shards = []
    for file in sorted(set(where.values())):
        current, size = [], 0
        with safe_open(base / file, "pt") as f:
            for name in [n for n in f.keys() if where.get(n) == file]:
                s = f.get_slice(name)
                numel = 1
                for d in s.get_shape():
                    numel *= d
                nbytes = numel * (
                    torch.empty((), dtype=dtype).element_size() if dtype else streaming.SAFETENSORS_BYTES[s.get_dtype()]
                )
                if current and size + nbytes > max_bytes:
                    shards.append(current)
                    current, size = [], 0
                current.append(name)
                size += nbytes
        if current:
            shards.append(current)
    return ShardPlan(base, where, shards, dtype)


def write_shards(plan: ShardPlan, deltas: dict, scaling: float, out: Path, log) -> dict[str, str]:
    """The planned shards written to `out`, each LoRA delta of `deltas` ({weight: (A, B)}, times `scaling`) merged
    into its weight as it is read; returns the weight map (tensor -> file)."""
    base, where, shards, dtype = plan.base, plan.where, plan.shards, plan.dtype
    weight_map = {}
    merged = 0
    for n, names in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            try:
                with safe_open(base / where[name], "pt") as f:
                    t = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ExportError(
                    f"input shard {base / where[name]} is corrupt ({e}); restore it and export again"
                ) from None
            if name in deltas:
                t = merge(t, *deltas[name], scaling)
                merged += 1
            tensors[name] = (t.to(dtype) if dtype and t.is_floating_point() else t).contiguous()
        fault_enospc("export")
        save_tensors(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        log(f"wrote {file} ({len(names)} tensors)")
        del tensors
    if merged != len(deltas):
        missing = sorted(set(deltas) - set(weight_map))[:3]
        raise ExportError(f"the adapter names weights the base checkpoint lacks: {missing}")
    return weight_map


def export_config(base: Path, settings: dict, dtype_name: str | None) -> dict:
    config = json.loads((base / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ExportError(f"export supports {', '.join(ARCHITECTURES)}; {base} is {arch}")
    prefix = ARCHITECTURES[arch].prefix
    config.pop("quantization_config", None)
    config.update(
        model_type=ARCHITECTURES[arch].export_type,
        architectures=[f"HybridScale{prefix}ForCausalLM"],
        auto_map={
            "AutoConfig": f"configuration_hybrid_scale.HybridScale{prefix}Config",
            "AutoModelForCausalLM": f"modeling_hybrid_scale.HybridScale{prefix}ForCausalLM",
        },
        hybrid=settings,
    )
    if dtype_name:
        config["dtype"] = dtype_name
    return config


def write_code_and_tokenizer(tmp: Path, base: Path, config: dict) -> None:
    """config.json, the attention package's modules (the remote code), the base model's tokenizer files."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_remote_code(tmp)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, tmp / name)


@dataclass
class Draft:
    """An export being written in its {out}.partial directory `dir`: its config.json, the attention settings, the
    merged shards' weight map and the export's log."""

    dir: Path
    config: dict
    settings: dict
    weight_map: dict[str, str]
    log: Callable[[str], None]

    def write_hybrid(self, params: dict) -> None:
        """The phi/gamma shard + hybrid_config.json, then the index that lists every shard."""
        tmp = self.dir
        write_converted(tmp, self.config["architectures"][0].replace("HybridScale", ""), ".", self.settings, params)
        index = {**self.weight_map, **dict.fromkeys(params, PARAMS_NAME)}
        total = sum((tmp / f).stat().st_size for f in set(index.values()))
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1) + "\n"
        )
