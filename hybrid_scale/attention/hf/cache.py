"""The decode cache of a converted model: `HybridCache`, a transformers `Cache` whose converted layers hold a
`window/recurrent.DecodeState` (memory independent of the generated length: a ring of the window's keys, the sinks,
the LA state and, with attention.cache, the cache of exact keys: cache/recurrent.py) and whose other layers keep the
usual `DynamicLayer`. `HybridAttention.forward` (layer.py) hands its decode to its layer's `hybrid_attend`, which
asks the layer's part (its decode step over this state).

This file imports only torch, transformers and its siblings (remote code: see ../layer.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..cache.recurrent import sizes
from ..layer import HybridAttention, Projections, hybrid_layers
from ..window.recurrent import DecodeState


def static(state: DecodeState) -> DecodeState:
    """Marks the state's tensors as static inputs of a compiled step (as transformers' StaticCache marks its keys and
    values): they are updated in place, so a CUDA graph of the step can read them where they are instead of copying
    them in at every replay, or skipping the graph."""
    if not torch.compiler.is_compiling():
        for t in state.tensors():
            torch._dynamo.mark_static_address(t)
    return state


class HybridCacheLayer(CacheLayerMixin):
    """Decode state of one hybrid layer (see window/recurrent.DecodeState): a ring of min(window, max_length) keys, the
    sink buffer and the LA state, allocated at the first call and then updated in place; the step counters live on the
    device. With a ring of the whole window, or one bounded by its caller (generate's max_length), a one-token step
    is compileable: it runs the backend's fused decode step, or the part's torch step (fixed shapes, no host sync),
    chosen at the first call; so transformers' `generate` compiles and graph-captures the decode steps of a model whose
    layers are all hybrid."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, window: int, sinks: int, max_length: int | None = None, bounded: bool = False):
        super().__init__()
        self.window, self.sinks = window, sinks
        self.capacity = window if max_length is None else min(window, max_length)
        # a shorter ring checks its bound on the host (extend), unless the caller bounds the tokens itself
        self.is_compileable = self.capacity == window or bounded
        self.state: DecodeState | None = None
        self.step = None  # the one-token step: the backend's fused decode step or the part's torch step

    def hybrid_attend(self, module: HybridAttention, x: Projections, mask):
        """`module`'s attention of the new tokens' projections `x` (mask [B, T] or None) over this layer's state: its
        part's decode step (hedgehog/part.py, gated_delta/part.py)."""
        return module.part.decode(self, module, x, mask)

    def conv_tails(self, module: HybridAttention, hidden: torch.Tensor):
        """The decode state's last inputs of the part's short convolution, if it has one (else None)."""
        tails = getattr(module.part, "conv_tails", None)
        return None if tails is None else tails(self, module, hidden)

    def allocate(self, module: HybridAttention, shape, batch: int, device) -> None:
        """The state for `batch` rows of `module` at `shape` (window/recurrent.DecodeState), allocated once."""
        self.check(module)
        cache = (module.options().budget, module.cache_select)  # (cache_keys per KV head, or the layer's budget)
        self.state = static(DecodeState.empty(shape, batch, self.capacity, device, cache=cache))
        self.is_initialized = True

    def check(self, module: HybridAttention) -> None:
        if module.window != self.window or module.sinks != self.sinks:
            raise ValueError(
                f"cache was made for window={self.window}, sinks={self.sinks} but layer {module.layer_idx} has "
                f"window={module.window}, sinks={module.sinks}; make a new HybridCache after changing them"
            )
        state = self.state
        if state is not None and (
            sizes(module.options().budget, len(state.cache_sizes)) != state.cache_sizes
            or (state.cache_k.shape[2] and module.cache_select != state.cache_select)
        ):
            raise ValueError(
                f"cache was made for a cache of {list(state.cache_sizes)} keys per KV head"
                + (f" by {state.cache_select}" if state.cache_select else "")
                + f" but layer {module.layer_idx} has {list(sizes(module.options().budget, len(state.cache_sizes)))}"
                + f" by {module.cache_select}; make a new "
                "HybridCache after changing them (set_cache)"
            )

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("hybrid layers keep a ring buffer and a linear-attention state; they do not use update()")

    def get_seq_length(self) -> int:
        if self.state is None:
            return 0
        return self.state.seen if torch.compiler.is_compiling() else int(self.state.seen)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if torch.compiler.is_compiling():  # (transformers asks a hybrid layer only when every layer is one: then no
            return query_length, 0  # layer reads the mask it sizes, and a traced graph cannot size it by the count)
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    def reset(self) -> None:
        self.state = None
        self.is_initialized = False

    def offload(self):
        if self.state is not None:
            self.state.map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                "a hybrid cache cannot be cropped: keys that left the window are folded into the linear state; "
                "copy the cache (cache.copy()) before the tokens you may want to drop"
            )


class HybridCache(Cache):
    """Cache of a converted model: HybridCacheLayer for converted layers, DynamicLayer for softmax ones.
    Each ring holds min(window, max_length) keys (max_length optional), allocated at the first call. Hybrid layers
    count as linear-attention layers for transformers (`is_linear`): masks are sized by the softmax layers, and
    `generate` with this cache on a model whose layers are all hybrid passes its 2D mask through and compiles the
    decode step (`is_compileable`, torch.compile and CUDA graphs). `bounded`: the caller never brings a row past
    max_length (generate stops there), so a ring shorter than the window is compileable too."""

    def __init__(self, model: nn.Module, max_length: int | None = None, *, bounded: bool = False):
        hybrid = hybrid_layers(model)
        if not hybrid:
            raise ValueError("HybridCache needs a converted model (no HybridAttention layer found)")
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        layers = [
            HybridCacheLayer(hybrid[i].window, hybrid[i].sinks, max_length, bounded) if i in hybrid else DynamicLayer()
            for i in range(n_layers)
        ]
        super().__init__(layers=layers)

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, HybridCacheLayer) for layer in self.layers]

    def copy(self) -> HybridCache:
        """An independent copy (e.g. to score several continuations of one context)."""
        return copy.deepcopy(self)

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, HybridCacheLayer):
                total += layer.nbytes
            elif layer.is_initialized and layer.keys is not None:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total
