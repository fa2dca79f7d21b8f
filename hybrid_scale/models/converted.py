"""A converted model on disk: the base model (its own directory, or weights written alongside) plus
`hybrid_config.json` (attention settings) and `hybrid_params.safetensors` (phi and gamma of every hybrid layer)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from ..attention.hf.architectures import BY_EXPORT_TYPE
from ..attention.layer import HybridAttention, hybrid_layers
from ..attention.settings import SETTINGS
from ..distributed import tensor_parallel
from ..distributed.deepspeed import import_deepspeed, is_partitioned
from ..distributed.runtime import Runtime
from ..errors import ConvertedModelError
from ..run.layout import CONFIG_NAME
from ..run.sources import FORMAT_VERSION, ModelSource, read_hybrid_config
from ..storage.commits import save_tensors
from . import streaming
from .convert import check_architecture, convert_model, set_modes

PARAMS_NAME = "hybrid_params.safetensors"
ADAPTER_DIR = "adapter"  # stage 2 adds a PEFT LoRA adapter here


def load_base_model(path: str | os.PathLike, dtype: torch.dtype, rt: Runtime | None = None) -> nn.Module:
    """The plain softmax model of a model directory (an HF model, a converted model's base, or an export: its merged
    weights as the base architecture). An export's shards also hold the phi/gamma tensors; they are not the base
    model's, so they are expected extras here rather than reported as unexpected keys. At rt.tp > 1 the model is
    split over rt's tensor-parallel group on rt.device, each rank reading only its part (streaming.split_model)."""
    config = base_config(path)
    if rt is not None and rt.tp > 1:
        return streaming.split_model(config, streaming.ShardedCheckpoint(Path(path)), dtype, rt)
    hybrid_keys = [
        r"\.self_attn\.(feature_map_[qk]|la_gates|la_conv_[qk]|la_map_[qk])\.",
        r"\.self_attn\.(gamma_logit|la_decay_rho)$",
    ]
    with _also_ignored(type(config), hybrid_keys):
        return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)


@contextlib.contextmanager
def _also_ignored(config_class, patterns: list[str]):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    own = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    cls._keys_to_ignore_on_load_unexpected = [*(cls._keys_to_ignore_on_load_unexpected or []), *patterns]
    try:
        yield
    finally:
        if own:
            cls._keys_to_ignore_on_load_unexpected = before
        else:
            del cls._keys_to_ignore_on_load_unexpected


def base_config(path: Path):
    """The config of a model directory; for a hybrid_scale export (model_type hybrid_scale_*), the base
    architecture's config without the hybrid additions (read without remote code)."""
    data = json.loads((Path(path) / "config.json").read_text())
    if not str(data.get("model_type", "")).startswith("hybrid_scale_"):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    from transformers import CONFIG_MAPPING

    base = BY_EXPORT_TYPE[data["model_type"]]
    for key in ("model_type", "auto_map", "hybrid", "architectures", "transformers_version"):
        data.pop(key, None)
    return CONFIG_MAPPING[base.model_type](architectures=[base.hf_class], **data)


def hybrid_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """phi and gamma parameters of every hybrid layer, keyed by their name in the model."""
    return {name: p.detach() for name, p in _hybrid_parameters(model).items()}


def _hybrid_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {
        f"{prefix}.{name}": p
        for prefix, module in model.named_modules()
        if isinstance(module, HybridAttention)
        for name, p in module.hybrid_parameters()
    }


def describe(model: nn.Module) -> dict:
    """The attention settings of a converted model, as written to hybrid_config.json."""
    layers = hybrid_layers(model)
    if not layers:
        raise ConvertedModelError("this model has no hybrid layer: convert it first (hybrid_scale.convert_model)")
    first = layers[min(layers)]
    settings = dict(getattr(model, "hybrid_settings", {}))
    # every setting of the record (attention/settings.py), its live value where the layer holds one
    settings.update({s.name: first.setting(s.name) for s in SETTINGS if s.live})
    settings["layers"] = sorted(layers)
    modes = {i: m.mode for i, m in layers.items()}
    if len(set(modes.values())) > 1:
        settings["layer_modes"] = {str(i): mode for i, mode in sorted(modes.items())}
    for name in ("window", "sinks", "hybrid_sinks"):
        if len({getattr(m, name) for m in layers.values()}) > 1:
            raise ConvertedModelError(f"hybrid layers disagree on {name}; the on-disk format records one value")
    return settings


def save_converted(model: nn.Module, out_dir: str | os.PathLike, base_path: str | os.PathLike | None = None) -> Path:
    """Write hybrid_config.json + hybrid_params.safetensors into out_dir.

    The base weights are referenced, not copied, when `base_path` (or the model's own name_or_path) is a local
    model directory; otherwise they are saved into out_dir with save_pretrained (without the hybrid parameters).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    architecture = check_architecture(model)
    settings = describe(model)
    base = Path(base_path) if base_path is not None else Path(str(getattr(model, "name_or_path", "") or ""))
    if base_path is not None and not (base / "config.json").is_file():
        raise ConvertedModelError(f"base_path {base} is not a model directory (no config.json)")
    if str(base) and (base / "config.json").is_file() and base.resolve() != out.resolve():
        base_ref = str(base.resolve())
    else:
        hybrid = set(hybrid_state_dict(model))
        state = {k: v for k, v in model.state_dict().items() if k not in hybrid}
        model.save_pretrained(out, state_dict=state)
        base_ref = "."
    return write_converted(out, architecture, base_ref, settings, hybrid_state_dict(model))


def write_converted(
    out: Path, architecture: str, base_ref: str, settings: dict, params: dict, origin: dict | None = None
) -> Path:
    """The two files of the format: the parameters first, the config (which makes it a converted model) last.
    `origin` says which checkpoint it is (e.g. {"stage": "stage2", "checkpoint": "final", "step": 200})."""
    out.mkdir(parents=True, exist_ok=True)
    # "format": "pt" lets transformers read this file as a shard too (an export lists it in its index)
    save_tensors({k: v.contiguous() for k, v in params.items()}, out / PARAMS_NAME, metadata={"format": "pt"})
    meta = {"format_version": FORMAT_VERSION, "architecture": architecture, "base_model": base_ref}
    meta["attention"] = settings
    if origin:
        meta["origin"] = origin
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model directory (an export too: its config is read without remote code)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, config=base_config(path), local_files_only=True)


def base_dir(path: str | os.PathLike, meta: dict | None = None) -> Path:
    """The directory holding a converted model's base weights: itself (an export, a stage-2 copy) or the one named
    in its hybrid_config.json (`meta`, when the caller has read it already)."""
    path = Path(path)
    return ModelSource(path, "", meta or read_hybrid_config(path)).base


def lora_deltas(adapter: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """{base weight name: (A, B)} and the scaling alpha / r (or alpha / sqrt(r) with rsLoRA) of a PEFT adapter."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    unsupported = [k for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)]
    if cfg.get("bias", "none") != "none" or unsupported or cfg.get("peft_type", "LORA") != "LORA":
        raise ConvertedModelError(f"{adapter}: only plain LoRA adapters (bias none, no DoRA) can be merged here")
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (r**0.5 if cfg.get("use_rslora") else r)
    tensors = load_file(adapter / "adapter_model.safetensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, kind = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        pairs.setdefault(f"{module}.weight", {})[kind.split(".")[0]] = t
    return {name: (p["A"], p["B"]) for name, p in pairs.items()}, scaling


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


ADAPTER_README = """# A LoRA adapter of a converted hybrid model

This adapter was trained on the hybrid attention model in the directory above it ({model}), not on the
softmax model it was converted from. Loaded onto that softmax base it would give a different model, so its
`adapter_config.json` names the converted directory as its base, which transformers cannot load by itself:
`AutoPeftModelForCausalLM.from_pretrained` on this directory fails instead of loading the wrong model.

Load the model with the adapter merged:

    import hybrid_scale
    model = hybrid_scale.load_converted("{model}")

or export it as a self-contained Hugging Face directory (`hybrid-scale export export.model={model}`), which loads
with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.
"""


def mark_adapter(adapter: Path, model_dir: Path) -> None:
    """Make a stage-2 adapter say whose it is: its base_model_name_or_path names the converted model directory it
    belongs to (so PEFT's Auto classes fail on it rather than load the LoRA onto the plain softmax base), and its
    README says how to load it. `model_dir` is where the converted model will live."""
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(Path(model_dir).resolve())
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (adapter / "README.md").write_text(ADAPTER_README.format(model=Path(model_dir).resolve()))


def merge_adapter(model: nn.Module, adapter: Path) -> None:
    """Merge a stage-2 LoRA adapter into the model's weights in place, with the export's arithmetic (tested equal to
    PEFT's merge_and_unload). Weights partitioned by ZeRO-3 are gathered one at a time, merged on rank 0 and
    partitioned again; a weight split by tensor parallelism merges its own rows (B's rows) or columns (A's)."""

    deltas, scaling = lora_deltas(adapter)
    named = dict(model.named_parameters())
    missing = sorted(set(deltas) - set(named))
    if missing:
        raise ConvertedModelError(f"{adapter} adapts {missing[:3]}, which the model does not have")
    for name, (a, b) in deltas.items():
        p = named[name]
        shape = list(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the whole shape aside
        if [b.shape[0], a.shape[1]] != shape:
            raise ConvertedModelError(
                f"{adapter} gives {name} a delta of shape {[b.shape[0], a.shape[1]]} but the model's weight is "
                f"{shape}: the adapter was trained on another model"
            )
        if isinstance(p, DTensor):
            dim = tensor_parallel.placement(p, set())
            rank, parts = p.device_mesh.get_local_rank(), p.device_mesh.size()
            a, b = (a.chunk(parts, 1)[rank], b) if dim == 1 else (a, b.chunk(parts, 0)[rank] if dim == 0 else b)
            with torch.no_grad():
                t = p.to_local()
                t.copy_(merge(t, a.to(t.device), b.to(t.device), scaling))
            continue
        sharded = is_partitioned(p)
        whole = (
            import_deepspeed().zero.GatheredParameters([p], modifier_rank=0) if sharded else contextlib.nullcontext()
        )
        with whole, torch.no_grad():
            if not sharded or dist.get_rank() == 0:
                p.copy_(merge(p, a, b, scaling))


def load_converted(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    rt: Runtime | None = None,
    meta: dict | None = None,
):
    """Load base model + hybrid parameters (+ a stage-2 LoRA adapter, merged); `meta` is its hybrid_config.json when
    the caller has read it (a stage's ModelSource), so that it is read once. The dtype is always passed explicitly
    to transformers. backend: the attention backend to run on (auto | torch | triton); None = as recorded.
    At rt.tp > 1 the model is split over rt's tensor-parallel group on rt.device (`device` is then ignored): each
    rank reads only its part of every base weight, phi/gamma of its own heads, and merges the LoRA delta of its part."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    path = Path(path)
    meta = meta or read_hybrid_config(path)
    base = base_dir(path, meta)
    if not (base / "config.json").is_file():
        raise ConvertedModelError(
            f"base model {base} named in {path / CONFIG_NAME} is missing; restore it or edit 'base_model'"
        )
    split = rt is not None and rt.tp > 1
    model = load_base_model(base, dtype, rt)
    # a setting the file lacks (written before the setting existed) means what the record says it means there
    attention = {s.name: s.missing for s in SETTINGS if s.layer} | dict(meta["attention"])
    layer_modes = attention.pop("layer_modes", None)
    if backend is not None:
        attention["backend"] = backend
    convert_model(model, attention)
    if split:  # phi/gamma of the local heads only (the projections were split as they were read)
        tensor_parallel.split(model, rt)
    params_file = path / PARAMS_NAME
    if not params_file.is_file():
        raise ConvertedModelError(f"{params_file} is missing")
    expected = _hybrid_parameters(model)
    with safe_open(params_file, "pt") as f:
        names = set(f.keys())
        if names != set(expected):
            missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
            raise ConvertedModelError(
                f"{params_file} does not match {CONFIG_NAME}: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        heads = tensor_parallel.head_sharded(model)
        with torch.no_grad():
            for name, p in expected.items():
                dim = tensor_parallel.placement(p, heads)
                t = streaming.read_part(f, name, dim, rt.tp_rank, rt.tp) if split else f.get_tensor(name)
                if t.shape != p.shape:
                    part = " (this rank's part)" if split else ""
                    raise ConvertedModelError(
                        f"{params_file}: {name} has shape {list(f.get_slice(name).get_shape())}, not the model's "
                        f"{list(p.shape)}{part}: the file belongs to another model"
                    )
                p.copy_(t)
    adapter = path / ADAPTER_DIR
    if adapter.is_dir():  # a stage-2 output: its LoRA adapter, merged for inference
        merge_adapter(model, adapter)
    if layer_modes:
        set_modes(model, {int(i): m for i, m in layer_modes.items()})
    return model.to(rt.device if split else device).eval()
