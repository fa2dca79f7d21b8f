"""A Hugging Face safetensors checkpoint, one decoder layer at a time: the shard index (every shard's header read and
checked), tensors read by name (or only a rank's part of each: `get_slice`), a decoder layer built on the meta device
and given only its own weights, the model's rotary embeddings, and the teacher loop over the layers. Stage 1
(attention transfer) and the export's gamma calibration are its users; the export's LoRA merge reads its shard index.

At launch.tensor_parallel > 1 a layer (stage 1) or the whole model (stage 2, evaluation: `split_model`) is built on
the meta device, split there by tensor_parallel's plan, and each rank reads only its own rows or columns of each
weight from the shards, straight into its device tensors: no rank holds a whole model or a whole split weight, and
no rank waits for another's read."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..attention.hf.architectures import ARCHITECTURES
from ..distributed import tensor_parallel
from ..distributed.runtime import Runtime
from ..errors import InputError, UnsupportedArchitectureError

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_json(path: Path, fix: str) -> dict:
    """A JSON object from a file the user supplied; anything else is one InputError ending with `fix`."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object; {fix}")
    return data


def shard_map(path: Path, key: str = "model.path") -> dict[str, str]:
    """tensor name -> shard file of a safetensors checkpoint directory, after reading every shard's header (a missing,
    truncated or corrupt shard is named here, before any work)."""
    fix = f"restore the checkpoint's files or set {key} to a complete checkpoint"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        where = read_json(index, fix).get("weight_map")
        if not isinstance(where, dict) or not where:
            raise InputError(f"{index} has no weight_map; {fix}")
        files = sorted(set(where.values()))
    elif (path / "model.safetensors").is_file():
        where, files = None, ["model.safetensors"]
    else:
        raise InputError(
            f"config key '{key}': {path} has no model.safetensors(.index.json) (the stages stream safetensors "
            "checkpoints); convert .bin weights with save_pretrained(safe_serialization=True)"
        )
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise InputError(f"{path}: shard(s) named in its index are missing: {', '.join(missing[:3])}; {fix}")
    out: dict[str, str] = {}
    for file in files:
        shard = path / file
        try:
            with safe_open(shard, "pt") as f:  # refuses a truncated file too ("file not fully covered")
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{shard} is not a readable safetensors file ({e}); {fix}") from None
        out.update(dict.fromkeys(names, file) if where is None else {n: file for n in names if where.get(n) == file})
    if where is not None:
        absent = sorted(set(where) - set(out))
        if absent:
            raise InputError(f"{path}: tensors listed in its index are not in their shards: {absent[:3]}; {fix}")
    return out


class ShardedCheckpoint:
    """The tensors of a safetensors checkpoint, read by name without loading the rest."""

    def __init__(self, path: Path, key: str = "model.path"):
        self.path = Path(path)
        self.where = shard_map(self.path, key)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.where]
        if missing:
            raise InputError(f"{self.path} lacks {missing[:3]}: restore the checkpoint's files")
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(self.path / file, "pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out

    def load_into(self, targets: dict[str, tuple[torch.Tensor, int | None]], rank: int = 0, world: int = 1) -> None:
        """Copy into each target tensor its named tensor's part: along `dim`, part `rank` of `world` equal parts (all
        of it when dim is None). Only those bytes are read (get_slice), one tensor at a time, its shard mapped only
        while it is read (a mapped page a read touched counts in the process's resident memory until the unmap)."""
        missing = [n for n in targets if n not in self.where]
        if missing:
            raise InputError(f"{self.path} lacks {missing[:3]}: restore the checkpoint's files")
        for name, (target, dim) in targets.items():
            file = self.path / self.where[name]
            with safe_open(file, "pt") as f:
                part = read_part(f, name, dim, rank, world)
                if part.shape != target.shape:
                    raise InputError(
                        f"{file}: {name} has shape {list(f.get_slice(name).get_shape())}, which does not give this "
                        f"model's {list(target.shape)} (part {rank} of {world} along dim {dim}): the checkpoint does "
                        "not match its config.json"
                    )
            with torch.no_grad():
                target.copy_(part)
            del part


def read_part(f, name: str, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """Part `rank` of `world` equal parts of tensor `name` along `dim` of an open safetensors file (all of it when dim
    is None): only its bytes are read."""
    s = f.get_slice(name)
    if dim is None or world == 1:
        return s[:]
    shape = s.get_shape()
    if shape[dim] % world:
        raise InputError(f"{name}: dimension {dim} of {list(shape)} does not split into {world} equal parts")
    n = shape[dim] // world
    return s[tuple(slice(rank * n, (rank + 1) * n) if d == dim else slice(None) for d in range(len(shape)))]


def model_class(config, suffix: str):
    """transformers' class of the architecture with `suffix` in place of ForCausalLM, e.g. LlamaDecoderLayer."""
    arch = config.architectures[0] if config.architectures else None
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"hybrid_scale supports {', '.join(ARCHITECTURES)}; {arch} is not one of them"
        )
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return getattr(module, arch.replace("ForCausalLM", suffix))


def build_layer(config, ckpt: ShardedCheckpoint, i: int, dtype: torch.dtype, device="cpu", rt: Runtime | None = None):
    """Decoder layer i with its weights on `device` in `dtype` (frozen, eval mode), and nothing else of the model; at
    rt.tp > 1 split over the tensor-parallel group, each rank reading only its part of each weight."""
    cls = model_class(config, "DecoderLayer")
    with torch.device("meta"):
        layer = cls(config, i)
    prefix = f"model.layers.{i}."
    if rt is not None and rt.tp > 1:
        tensor_parallel.split_layer(layer.to(dtype), rt)  # (a decoder layer has no buffers for the cast to touch)
        _fill(layer, ckpt, prefix, device, rt)
    else:
        tensors = ckpt.read([prefix + k for k in layer.state_dict()])  # only the decoder layer's own tensors
        state = {k[len(prefix) :]: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        layer.load_state_dict(state, assign=True)
    for p in layer.parameters():
        p.requires_grad_(False)
    return layer.eval()


def split_model(config, ckpt: ShardedCheckpoint, dtype: torch.dtype, rt: Runtime):
    """The causal LM of a checkpoint split over rt's tensor-parallel group (rt.tp > 1) on rt.device: built on the
    meta device, split there (tensor_parallel.split), then each rank's part of each weight read from the shards."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensor_parallel.split(model, rt)
    _fill(model, ckpt, "", rt.device, rt)
    for m in model.modules():  # non-persistent buffers (the rotary frequencies) are computed, not read
        if any(name in m._non_persistent_buffers_set for name, _ in m.named_buffers(recurse=False)):
            model._init_weights(m)
    return model.eval()


def _fill(module, ckpt: ShardedCheckpoint, prefix: str, device, rt: Runtime) -> None:
    """A module split on the meta device given real storage on `device`, then this rank's part of each parameter
    read from the checkpoint (a tied weight once)."""
    module.to_empty(device=device)
    tensor_parallel.tie(module)
    heads = tensor_parallel.head_sharded(module)
    targets = {
        prefix + name: (tensor_parallel.local(p), tensor_parallel.placement(p, heads))
        for name, p in module.named_parameters()
    }
    ckpt.load_into(targets, rt.tp_rank, rt.tp)


def rotary(config, seq_len: int, dtype: torch.dtype, device="cpu"):
    """(cos, sin) of the model's own rotary embedding for positions 0..seq_len-1, on `device`."""
    emb = model_class(config, "RotaryEmbedding")(config=config).to(device)
    x = torch.zeros(1, seq_len, 1, dtype=dtype, device=device)
    return emb(x, torch.arange(seq_len, device=device)[None])


def embedding(ckpt: ShardedCheckpoint, dtype: torch.dtype) -> torch.Tensor:
    """The input embedding matrix [V, D]: index it with token ids for the teacher's layer-0 inputs (read once)."""
    return ckpt.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"].to(dtype)


def layers(
    config, ckpt: ShardedCheckpoint, dtype: torch.dtype, first: int = 0, device="cpu", rt: Runtime | None = None
) -> Iterator[tuple[int, object]]:
    """The teacher/student loop's spine: (i, decoder layer i) for i = first ... L-1, one layer in memory at a time
    (split over rt's tensor-parallel group when rt.tp > 1). The caller trains or fits the student parts of layer i
    on its inputs, then runs `teacher` to make layer i+1's."""
    for i in range(first, config.num_hidden_layers):
        yield i, build_layer(config, ckpt, i, dtype, device, rt)


@torch.no_grad()
def teacher(layer, hidden: torch.Tensor, rope) -> torch.Tensor:
    """The unconverted decoder layer (exact softmax attention, SDPA) on a batch of its inputs."""
    out = layer(hidden, position_embeddings=rope, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def teacher_output(q, k, v, scale):
    """The teacher's attention output: exact causal softmax over q, k, v [B, H(kv), T, d] (KV heads repeated for
    grouped-query attention), before o_proj -- the target of the output objectives and of gamma calibration."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
