"""What a converted causal LM needs around its HybridAttention layers (`attach`): `prepare_inputs`, a forward
pre-hook on the decoder, creates a `HybridCache` (cache.py) when `use_cache` is on and none was given (also replacing
the empty `DynamicCache` that `generate()` makes), derives `position_ids` from a 2D `attention_mask` and hands the
layers that mask; `generation_inputs`, the model's prepare_inputs_for_generation, keeps the compiled decode step's
shapes fixed; `prepare_cache`, the model's _prepare_cache_for_generation, gives `generate` a HybridCache from the
start when every layer is hybrid, so that on a GPU it compiles and graph-captures the decode step with no argument.

This file imports only torch, transformers and its siblings (remote code: see ../layer.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .cache import HybridCache


def attach(model: nn.Module) -> None:
    """What a converted causal LM needs besides its HybridAttention layers: `prepare_inputs` as a forward pre-hook on
    its decoder, and `generation_inputs` as its prepare_inputs_for_generation (bound to this model, so a deep copy
    binds its own)."""
    model.get_decoder().register_forward_pre_hook(prepare_inputs, with_kwargs=True)
    model.prepare_inputs_for_generation = generation_inputs.__get__(model)  # (a method of this model)
    model._prepare_cache_for_generation = prepare_cache.__get__(model)


def prepare_cache(model: nn.Module, generation_config, model_kwargs: dict, *args, **kwargs):
    """The model class's own _prepare_cache_for_generation; then, where it made a DynamicCache (no cache given, no
    other cache asked for) and every layer is hybrid, a HybridCache in its place, its rings no longer than the
    generate's max_length. That cache is compileable, so transformers' `generate` compiles and graph-captures the
    decode step on a GPU with no extra argument, as it does for a static cache (generation_config.disable_compile
    turns that off). A model with softmax layers left keeps the DynamicCache (prepare_inputs replaces it at the first
    forward, and decodes eagerly)."""
    out = type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)
    if type(model_kwargs.get("cache")) is DynamicCache and generation_config.cache_implementation in (None, "dynamic"):
        # rings of at most the longest context this generate makes (generate stops at max_length: one fixed size,
        # still compileable), not the whole window
        cache = HybridCache(model, max_length=getattr(generation_config, "max_length", None), bounded=True)
        if all(cache.is_linear):
            model_kwargs["cache"] = cache
    return out


def generation_inputs(model: nn.Module, *args, **kwargs) -> dict:
    """The model class's own prepare_inputs_for_generation, then, when every layer is hybrid (nothing reads a mask
    of the keys), the 2D attention mask cut to the new tokens with the position ids taken from the whole of it: the
    compiled decode step sees tensors of one shape at every step (a mask that grows by one column per token would
    recompile it, and make a CUDA graph per length)."""
    inputs = type(model).prepare_inputs_for_generation(model, *args, **kwargs)
    cache = inputs.get("cache", inputs.get("past_key_values"))
    mask = inputs.get("attention_mask")
    if isinstance(cache, HybridCache) and all(cache.is_linear) and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        tokens = inputs.get("input_ids")
        T = (tokens if tokens is not None else inputs["inputs_embeds"]).shape[1]
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = mask_positions(mask)[:, -T:].contiguous()
        inputs["attention_mask"] = mask[:, -T:].contiguous()
    return inputs


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a 2D attention mask: each token's index among its row's real tokens (0 for padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def prepare_inputs(decoder: nn.Module, args, kwargs):
    """Forward pre-hook (with_kwargs) on the decoder (e.g. LlamaModel) of a converted model."""
    if "past_key_values" in kwargs:
        kwargs["cache"] = kwargs.pop("past_key_values")
    cache = kwargs.get("cache")
    use_cache = kwargs.get("use_cache")
    training = decoder.training and torch.is_grad_enabled()
    if use_cache is None:  # as transformers would default it, but no decode state is built while training
        use_cache = getattr(decoder.config, "use_cache", False) and not training
    if use_cache and training and getattr(decoder, "gradient_checkpointing", False):
        use_cache = False  # a recomputed layer would extend the state twice
    kwargs["use_cache"] = bool(use_cache)
    if use_cache and (cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0)):
        kwargs["cache"] = cache = HybridCache(decoder)
    if cache is not None and not isinstance(cache, HybridCache):
        raise TypeError(
            f"a converted model needs a hybrid_scale HybridCache, got {type(cache).__name__} holding "
            f"{cache.get_seq_length()} tokens; pass no cache (one is created) or HybridCache(model)"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"a converted model takes a 2D attention_mask [batch, length] (1 = token, 0 = padding); got shape "
                f"{tuple(mask.shape)}"
            )
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs["inputs_embeds"]
        T = inputs.shape[1]
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = mask_positions(mask)[:, -T:]
        new = mask[:, -T:]
        # (compiled: always the mask, whose values a traced graph cannot branch on; a step with a mask of ones equals
        # one without)
        kwargs["hybrid_mask"] = new if torch.compiler.is_compiling() or not bool(new.all()) else None
    return args, kwargs
