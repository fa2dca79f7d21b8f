"""Convert a Hugging Face Llama-family causal LM into a hybrid model, in place; switch component modes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from ..attention.hf.architectures import ARCHITECTURES
from ..attention.hf.generation import attach
from ..attention.layer import HybridAttention, hybrid_layers, set_layers_cache
from ..attention.settings import by_name
from ..attention.window.naive import check_mode
from ..config import attention_settings
from ..errors import UnsupportedArchitectureError


def check_architecture(model: nn.Module) -> str:
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"hybrid_scale cannot convert {name}: supported architectures are {', '.join(ARCHITECTURES)}"
        )
    return name


def convert_model(model: nn.Module, attention: Mapping[str, Any] | Any = None) -> nn.Module:
    """Swap the attention of the selected layers (all by default) for HybridAttention, in place.

    `attention` is a dict or the config's `attention` section (window, feature_map, feature_dim, gamma_init, sinks,
    mode, layers, chunk_size). Returns the model, which records the resolved settings in `model.hybrid_settings`.
    """
    check_architecture(model)
    if hybrid_layers(model):
        raise ValueError("this model is already converted; load the base model again to convert it differently")
    settings = attention_settings(attention)
    cfg = model.config
    decoder = model.get_decoder()
    n_layers = len(decoder.layers)
    layers = list(range(n_layers)) if settings.layers is None else sorted(set(settings.layers))
    if layers and layers[-1] >= n_layers:
        raise ValueError(f"attention.layers names layer {layers[-1]} but the model has {n_layers} (0..{n_layers - 1})")
    for i in layers:
        decoder.layers[i].self_attn = HybridAttention.from_softmax(decoder.layers[i].self_attn, cfg, i, settings)
    attach(model)
    resolved = dict(settings)
    resolved["layers"] = layers
    resolved["feature_dim"] = decoder.layers[layers[0]].self_attn.feature_dim if layers else None
    model.hybrid_settings = resolved
    return model


Modes = str | Mapping[int, str] | Sequence[str]


def get_modes(model: nn.Module) -> dict[int, str]:
    return {i: m.mode for i, m in sorted(hybrid_layers(model).items())}


def set_modes(model: nn.Module, modes: Modes) -> None:
    """One mode for every hybrid layer, or {layer: mode}, or a list with one mode per hybrid layer (in order)."""
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("set_modes needs a converted model (no hybrid layer found)")
    if isinstance(modes, str):
        modes = dict.fromkeys(layers, modes)
    elif not isinstance(modes, Mapping):
        modes = list(modes)
        if len(modes) != len(layers):
            raise ValueError(f"got {len(modes)} modes for {len(layers)} hybrid layers")
        modes = dict(zip(sorted(layers), modes, strict=True))
    unknown = sorted(set(modes) - set(layers))
    if unknown:
        raise ValueError(f"layers {unknown} are not hybrid layers; hybrid layers: {sorted(layers)}")
    for mode in modes.values():
        check_mode(mode)
    for i, mode in modes.items():
        layers[i].mode = mode


def set_window(model: nn.Module, window: int) -> None:
    """The sliding window (in real tokens) of every hybrid layer: the one place it changes after conversion
    (eval.window, SSD's window schedule). Between forwards only: a live decode cache refuses another window
    (recurrent.extend raises), so start a new cache after a change."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"the window must be an integer >= 1, got {window!r}")
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("set_window needs a converted model (no hybrid layer found)")
    for m in layers.values():
        m.window = window


def set_cache(model: nn.Module, keys: int, select: str | None = None, budgets: Mapping[int, Any] | None = None) -> None:
    """The cache of exact keys (attention.cache, attention/cache/) of every hybrid layer: `keys` per KV head (0 = off)
    and, if given, the score they compete on (attention.cache_select). `budgets`: {layer: [Hkv] ints}, each layer's
    keys * Hkv slots shared out over its KV heads (attention.cache_heads=retrieval: models/cache_heads.py), summing to
    keys * Hkv; a layer it does not name (and every layer without it) keeps `keys` for every head. Settable on any
    converted model at any time between forwards (eval's `+cache` modes, a loaded export); a live decode cache refuses
    another size, so start a new one after a change."""
    record = by_name()
    for name, value in (("cache", keys), ("cache_select", select)):
        if value is None:
            continue
        if name == "cache" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"the cache must be an integer >= 0 (keys per KV head), got {value!r}")
        why = record[name].check(value, {})
        if why is not None:
            raise ValueError(f"attention.{name}: {why}")
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("set_cache needs a converted model (no hybrid layer found)")
    set_layers_cache(layers, keys, select, budgets)


@contextlib.contextmanager
def components(model: nn.Module, mode: Modes) -> Iterator[nn.Module]:
    """Run every hybrid layer in `mode` (or per-layer modes) inside the block; restore the previous modes after."""
    before = get_modes(model)
    set_modes(model, mode)
    try:
        yield model
    finally:
        set_modes(model, before)
