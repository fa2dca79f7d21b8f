"""The decode cache of a converted model: `HybridCache`, a transformers `Cache` whose converted layers hold a
`recurrent.DecodeState` (memory independent of the generated length: a ring of the window's keys, the sinks and the
LA state) and whose other layers keep the usual `DynamicLayer`. `HybridAttention.forward` (hybrid.py) hands its
decode to its layer's `hybrid_attend`.

This file imports only torch, transformers and its siblings (remote code: see hybrid.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..backends import Shape, get_backend, get_decode, resolve
from ..gated_delta.recurrent import extend as delta_extend
from ..gated_delta.recurrent import step as delta_step
from ..hedgehog.recurrent import extend, step
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
    """Decode state of one hybrid layer (see recurrent.DecodeState): a ring of min(window, max_length) keys, the sink
    buffer and the LA state, allocated at the first call and then updated in place; the step counters live on the
    device. With a ring of the whole window, or one bounded by its caller (generate's max_length), a one-token step
    is compileable: it runs the backend's fused decode step, or recurrent.step (fixed shapes, no host sync), chosen
    at the first call; so transformers' `generate` compiles and graph-captures the decode steps of a model whose
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
        self._step = None  # the one-token step: the backend's fused decode step or recurrent.step

    def hybrid_attend(self, module: HybridAttention, x: Projections, mask):
        """`module`'s attention of the new tokens' projections `x` (mask [B, T] or None) over this layer's state."""
        if module.la_kind == "gated_delta":
            return self._delta_attend(module, x, mask)
        q, k, v, fq, fk = x[:5]
        o, rho = module.options().own(), module.la_decay
        if self.state is not None and q.shape[2] == 1 and self.is_compileable:  # (the compiled decode step)
            self._check(module)
            y = self._step(self.state, q, k, v, fq, fk, module.gamma, o, attention_mask=mask, la_decay=rho)
            if y is not None:
                return y
            return step(self.state, q, k, v, fq, fk, module.gamma, o, attention_mask=mask, la_decay=rho)
        shape = Shape.of(q, k, v, fq, o, la_decay=rho is not None)
        backend = resolve(module.backend, q.device, shape)
        if self.state is None:
            self._check(module)
            self.state = static(DecodeState.empty(shape, k.shape[0], self.capacity, k.device))
            self._step = get_decode(backend) or step
            self.is_initialized = True
        return extend(self.state, q, k, v, fq, fk, module.gamma, o, attention_mask=mask, la_decay=rho,
                      prefill=get_backend(backend))  # fmt: skip

    def _delta_shape(self, module: HybridAttention, dtype: torch.dtype) -> Shape:
        d = module.head_dim
        return Shape(
            module.num_heads, module.num_key_value_heads, d, d, d, module.window, module.sinks, dtype,
            module.hybrid_sinks, False, "gated_delta", module.la_conv,
        )  # fmt: skip

    def conv_tails(self, module: HybridAttention, hidden: torch.Tensor):
        """The decode state's last inputs of gated_delta's short convolution (q's, k's), allocated at the first call;
        the layer's `project` continues from them and updates them in place."""
        if self.state is None:
            self._check(module)
            shape = self._delta_shape(module, hidden.dtype)
            self.state = static(DecodeState.empty(shape, hidden.shape[0], self.capacity, hidden.device))
            self.is_initialized = True
        return self.state.conv_q, self.state.conv_k

    def _delta_attend(self, module: HybridAttention, x: Projections, mask):
        """The gated delta-rule hybrid over this layer's state (delta_decode.py): its compileable one-token step, or
        extend."""
        q, k, v, fq, fk, gates = x
        o = module.options()
        if self.state is None:
            self._check(module)
            shape = self._delta_shape(module, q.dtype)
            self.state = static(DecodeState.empty(shape, q.shape[0], self.capacity, q.device))
            self.is_initialized = True
        self._check(module)
        if q.shape[2] == 1 and self.is_compileable:
            return delta_step(self.state, q, k, v, fq, fk, gates, module.gamma, o, attention_mask=mask)
        return delta_extend(self.state, q, k, v, fq, fk, gates, module.gamma, o, attention_mask=mask)

    def _check(self, module: HybridAttention) -> None:
        if module.window != self.window or module.sinks != self.sinks:
            raise ValueError(
                f"cache was made for window={self.window}, sinks={self.sinks} but layer {module.layer_idx} has "
                f"window={module.window}, sinks={module.sinks}; make a new HybridCache after changing them"
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
