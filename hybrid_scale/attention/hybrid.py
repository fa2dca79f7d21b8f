"""The hybrid attention entry point and nn.Module, its decode cache, and the input preparation a converted model needs.

`attend` is the one entry point to the attention math over whole sequences (decode with a cache goes through
recurrent.extend, or a backend's fused decode step): tensors, then keyword-only settings, computed by a backend of
backends.py chosen per call from `backend` ("auto" by default: the Triton kernels for CUDA tensors when installed,
the chunked torch path elsewhere; "torch", "triton", or a backend name such as "naive" = the spec).
`HybridAttention.attend` is the same with the layer's own settings (its `backend` included) as defaults; its forward,
stage 1, gamma calibration and the LA-share diagnostic call it.

`HybridAttention` takes the place of a Llama/Mistral/Qwen2 attention module and adopts its q/k/v/o projections (same
names, so PEFT targets them as before), its scaling and the model's rotary embeddings; it adds phi_q (per query head),
phi_k (per KV head) and gamma per query head from a learnable theta: sigmoid(theta) in (0, 1) as LoLCATs, or
exp(theta) in (0, inf), which can weight the window above a weak LA (`gamma_param`). Its `mode` is one of naive.MODES
and can be switched at any time; the decode state is kept in every mode.

`HybridCache` is a transformers `Cache` whose converted layers hold a `recurrent.DecodeState` (memory independent of
the generated length) and whose other layers keep the usual `DynamicLayer`. `prepare_inputs` (a forward pre-hook on
the decoder) creates one when `use_cache` is on and none was given (also replacing the empty `DynamicCache` that
`generate()` makes), derives `position_ids` from a 2D `attention_mask`, and hands the layers that mask.

This file imports only torch, transformers and its siblings, in the `from .sibling import name` form that transformers
follows when it loads remote code (the export copies these files next to a modeling file).

Why one file of over 500 lines for now: the decode cache (HybridCache, its layer) is to move to its own module with
issue 53, which lists this split; until then it sits beside the module whose state it holds.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from .backends import Shape, get_backend, get_decode, resolve
from .feature_maps import make_feature_map
from .naive import check_mode, own_mode
from .recurrent import DecodeState, extend, step

# gamma_param -> (theta -> gamma, gamma -> theta): LoLCATs' sigmoid caps the window's weight at 1, exp does not
GAMMA_PARAMS = {
    "sigmoid": (torch.sigmoid, lambda g: math.log(g / (1.0 - g))),
    "exp": (torch.exp, math.log),
}


def check_gamma(gamma: float, param: str, what: str = "gamma_init") -> None:
    """gamma must be reachable by its parametrisation: (0, 1) for sigmoid, > 0 for exp."""
    if param not in GAMMA_PARAMS:
        raise ValueError(f"unknown gamma_param '{param}'; available: {', '.join(GAMMA_PARAMS)}")
    if not (0.0 < gamma < 1.0 if param == "sigmoid" else gamma > 0.0):
        bound = "in (0, 1) with gamma_param sigmoid" if param == "sigmoid" else "> 0"
        raise ValueError(f"{what} must be {bound}, got {gamma}")


def _nonnegative(theta: torch.Tensor) -> torch.Tensor:
    """theta clamped at 0 in the forward, with the identity's gradient (straight through): a decay at its bound
    (rho = 0, the formula without decay) still learns in both directions."""
    return theta + (theta.clamp(min=0.0) - theta).detach()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def attend(
    q,
    k,
    v,
    fq,
    fk,
    *,
    gamma,
    window,
    mode="hybrid",
    sinks=8,
    hybrid_sinks=False,
    scale=None,
    attention_mask=None,
    chunk_size=64,
    backend="auto",
    initial_state=None,
    la_decay=None,
    return_denominators=False,
):
    """Hybrid attention (docs/design.md §2) computed by the backend `backend` resolves to for q's device (see
    backends.py: auto, torch, triton, or a registered name).

    q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F] = phi_q(q), fk [B,Hkv,T,F] = phi_k(k), gamma [H] > 0;
    mode one of naive.MODES; sinks S; hybrid_sinks: the hybrid's softmax also covers the first S real tokens and its LA
    leaves them out (naive.py; swa_only is then passed as swa_sinks, naive.own_mode); scale None = 1/sqrt(D);
    attention_mask [B,T] (1 = token, 0 = padding) or None;
    initial_state None or the LA sums (kv [B,Hkv,F,D], k [B,Hkv,F]) of keys before the sequence (see backends.py).
    la_decay rho [Hkv]: the LA's decay per KV head (naive.py; None = off).
    Returns y [B,H,T,D] in q's dtype; with return_denominators (y, sum of E [B,H,T], sum of L [B,H,T]), the two parts
    of the shared normaliser (unpadded input; the LA-share diagnostic)."""
    mode, hybrid_sinks = own_mode(mode, hybrid_sinks)
    shape = Shape.of(q, k, v, fq, window, sinks, hybrid_sinks, la_decay is not None)
    return get_backend(resolve(backend, q.device, shape))(
        q,
        k,
        v,
        fq,
        fk,
        gamma,
        window=window,
        mode=mode,
        sinks=sinks,
        scale=scale,
        attention_mask=attention_mask,
        chunk_size=chunk_size,
        initial_state=initial_state,
        return_denominators=return_denominators,
        **({"hybrid_sinks": True} if hybrid_sinks else {}),  # (a backend written before the option still runs)
        **({"la_decay": la_decay} if la_decay is not None else {}),  # (passed only when set, like the sinks)
    )


class HybridAttention(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        *,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        window: int = 64,
        feature_map: str = "hedgehog",
        feature_dim: int | None = None,
        gamma_init: float = 0.1,
        gamma_param: str = "sigmoid",
        sinks: int = 8,
        hybrid_sinks: bool = False,
        la_decay: bool = False,
        la_decay_horizon: int = 0,
        mode: str = "hybrid",
        chunk_size: int = 64,
        backend: str = "auto",
        param_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_mode(mode)
        check_gamma(gamma_init, gamma_param)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = base.q_proj, base.k_proj, base.v_proj, base.o_proj
        self.config = getattr(base, "config", None)
        self.layer_idx = layer_idx
        self.num_heads, self.num_key_value_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.all_heads = num_heads  # the layer's query heads, also after narrow_heads
        self.num_key_value_groups = num_heads // num_kv_heads
        self.scaling = scaling
        self.is_causal = True
        self.window, self.sinks, self.mode, self.chunk_size = int(window), int(sinks), mode, int(chunk_size)
        self.hybrid_sinks = bool(hybrid_sinks)  # the hybrid's softmax keeps the first `sinks` real tokens too
        self.backend = backend  # what `attend` runs on: auto | torch | triton or a backends.py name (per call)
        ref = self.q_proj.weight
        dtype = param_dtype or ref.dtype  # fp32 masters for training in half precision; else the projections'
        self.feature_map_q = make_feature_map(feature_map, num_heads, head_dim, feature_dim)
        self.feature_map_k = make_feature_map(feature_map, num_kv_heads, head_dim, feature_dim)
        self.feature_map_q.to(device=ref.device, dtype=dtype)
        self.feature_map_k.to(device=ref.device, dtype=dtype)
        self.gamma_param = gamma_param  # theta -> gamma: sigmoid (LoLCATs, gamma < 1) or exp (unbounded)
        logit = GAMMA_PARAMS[gamma_param][1](gamma_init)
        self.gamma_logit = nn.Parameter(torch.full((num_heads,), logit, device=ref.device, dtype=dtype))
        if la_decay:  # the LA's decay rho per KV head (naive.py): from 0, exactly the hybrid without it, or from
            rho0 = 1.0 / la_decay_horizon if la_decay_horizon else 0.0  # 1/horizon (alpha^horizon = 1/e)
            self.la_decay_rho = nn.Parameter(torch.full((num_kv_heads,), rho0, device=ref.device, dtype=dtype))

    SETTINGS = (
        "window", "feature_map", "feature_dim", "gamma_init", "gamma_param", "sinks", "hybrid_sinks", "la_decay",
        "la_decay_horizon", "mode", "chunk_size", "backend",
    )  # fmt: skip
    DEFAULTS = {
        "backend": "auto",
        "hybrid_sinks": False,
        "gamma_param": "sigmoid",
        "la_decay": False,
        "la_decay_horizon": 0,
    }  # settings that older hybrid_config.json files do not have

    @classmethod
    def from_softmax(cls, base: nn.Module, config, layer_idx: int, settings, param_dtype=None) -> HybridAttention:
        """Take the place of a Llama/Mistral/Qwen2 attention module; settings maps the names in SETTINGS.
        param_dtype: of phi/gamma (default: the projections' dtype)."""
        return cls(
            base,
            layer_idx=layer_idx,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=base.head_dim,
            scaling=base.scaling,
            **{name: settings[name] if name in settings else cls.DEFAULTS[name] for name in cls.SETTINGS},
            param_dtype=param_dtype,
        )

    head_range: tuple[int, int] | None = None  # the query heads kept by narrow_heads (None: all of them)

    def narrow_heads(self, start: int, stop: int) -> None:
        """Keep only query heads start..stop-1 and their KV heads: phi_q, phi_k and gamma are sliced to them, so that
        a rank computing only those heads (tensor parallelism) holds and trains only theirs; the LA state and the
        decode cache follow from the local k/v. The projections are split by the caller (their own plan)."""
        g = self.num_key_value_groups
        if not (0 <= start < stop <= self.num_heads and start % g == 0 and stop % g == 0):
            raise ValueError(
                f"layer {self.layer_idx}: cannot keep query heads {start}..{stop - 1} of {self.num_heads} in whole "
                f"groups of {g} per KV head"
            )
        self.feature_map_q.narrow(start, stop)
        self.feature_map_k.narrow(start // g, stop // g)
        for name, lo, hi in (("gamma_logit", start, stop), ("la_decay_rho", start // g, stop // g)):
            theta = getattr(self, name, None)
            if theta is not None:
                setattr(self, name, nn.Parameter(theta.detach()[lo:hi].clone(), requires_grad=theta.requires_grad))
        self.num_heads, self.num_key_value_heads = stop - start, (stop - start) // g
        offset = self.head_range[0] if self.head_range else 0
        self.head_range = (offset + start, offset + stop)

    def hybrid_parameters(self):
        """(name, parameter) of what conversion added: phi_q, phi_k, gamma (not the adopted projections)."""
        return [(n, p) for n, p in self.named_parameters() if not n.split(".")[0].endswith("_proj")]

    @property
    def gamma(self) -> torch.Tensor:
        return GAMMA_PARAMS[self.gamma_param][0](self.gamma_logit)

    @property
    def la_decay(self) -> torch.Tensor | None:
        """rho >= 0 per KV head (alpha = exp(-rho)), or None without a decay."""
        rho = getattr(self, "la_decay_rho", None)
        return None if rho is None else _nonnegative(rho)

    def extra_repr(self) -> str:
        heads = f", heads={self.head_range[0]}..{self.head_range[1] - 1}" if self.head_range else ""
        own = ", hybrid_sinks=True" if self.hybrid_sinks else ""
        own += ", la_decay=True" if hasattr(self, "la_decay_rho") else ""
        return f"layer={self.layer_idx}, window={self.window}, sinks={self.sinks}{own}, mode={self.mode}{heads}"

    def attend(
        self,
        q,
        k,
        v,
        fq,
        fk,
        *,
        mode=None,
        gamma=None,
        window=None,
        sinks=None,
        scale=None,
        chunk_size=None,
        attention_mask=None,
        backend=None,
        initial_state=None,
        la_decay=None,
        return_denominators=False,
    ):
        """`attend` with this layer's mode, gamma, window, sinks (and its hybrid's own), LA decay, scaling, chunk_size
        and backend; a keyword given
        (not None) replaces the layer's own for this call only. q, k, v, fq, fk as `project` returns them."""
        return attend(
            q,
            k,
            v,
            fq,
            fk,
            gamma=self.gamma if gamma is None else gamma,
            window=self.window if window is None else window,
            mode=self.mode if mode is None else mode,
            sinks=self.sinks if sinks is None else sinks,
            hybrid_sinks=self.hybrid_sinks,
            scale=self.scaling if scale is None else scale,
            attention_mask=attention_mask,
            chunk_size=self.chunk_size if chunk_size is None else chunk_size,
            backend=self.backend if backend is None else backend,
            initial_state=initial_state,
            return_denominators=return_denominators,
            la_decay=self.la_decay if la_decay is None else la_decay,
        )

    def project(self, hidden_states, position_embeddings):
        """q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, and their feature maps."""
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, *position_embeddings)
        return q, k, v, self.feature_map_q(q), self.feature_map_k(k)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask=None,  # the 4D mask transformers builds; hybrid layers use `hybrid_mask` instead
        cache: Cache | None = None,
        hybrid_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        B, T, _ = hidden_states.shape
        q, k, v, fq, fk = self.project(hidden_states, position_embeddings)
        if cache is not None and isinstance(cache, HybridCache):
            y = cache.layers[self.layer_idx].attend(self, q, k, v, fq, fk, hybrid_mask)
        elif cache is not None:
            raise TypeError(
                f"a converted model needs a hybrid_scale HybridCache, got {type(cache).__name__}; "
                "pass no cache (one is created) or HybridCache(model)"
            )
        else:
            y = self.attend(q, k, v, fq, fk, attention_mask=hybrid_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), None


class HybridCacheLayer(CacheLayerMixin):
    """Decode state of one hybrid layer (see recurrent.DecodeState): a ring of min(window, max_length) keys, the sink
    buffer and the LA state, allocated at the first call and then updated in place; the step counters live on the
    device. With a ring of the whole window (no max_length below it) a one-token step is compileable: it runs the
    backend's fused decode step, or recurrent.step (fixed shapes, no host sync), chosen at the first call; so
    transformers' `generate` compiles and graph-captures the decode steps of a model whose layers are all hybrid."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, window: int, sinks: int, max_length: int | None = None):
        super().__init__()
        self.window, self.sinks = window, sinks
        self.capacity = window if max_length is None else min(window, max_length)
        self.is_compileable = self.capacity == window  # (a shorter ring checks its bound on the host: extend)
        self.state: DecodeState | None = None
        self._step = None  # the one-token step: the backend's fused decode step or recurrent.step

    def attend(self, module: HybridAttention, q, k, v, fq, fk, mask):
        mode, hybrid_sinks = own_mode(module.mode, module.hybrid_sinks)
        rho = module.la_decay
        options = dict(window=module.window, mode=mode, sinks=module.sinks, attention_mask=mask)
        options |= {"hybrid_sinks": True} if hybrid_sinks else {}
        options |= {"la_decay": rho} if rho is not None else {}
        if self.state is not None and q.shape[2] == 1 and self.is_compileable:  # (the compiled decode step)
            self._check(module)
            y = self._step(self.state, q, k, v, fq, fk, module.gamma, scale=module.scaling, **options)
            if y is not None:
                return y
            return step(self.state, q, k, v, fq, fk, module.gamma, scale=module.scaling, **options)
        shape = Shape.of(q, k, v, fq, module.window, module.sinks, hybrid_sinks, rho is not None)
        backend = resolve(module.backend, q.device, shape)
        if self.state is None:
            self._check(module)
            B, Hkv, _, D = k.shape
            self.state = DecodeState.empty(
                B, Hkv, D, v.shape[-1], fk.shape[-1], self.capacity, self.sinks, self.window, k.dtype, k.device
            )
            self._step = get_decode(backend) or step
            self.is_initialized = True
        return extend(
            self.state,
            q,
            k,
            v,
            fq,
            fk,
            module.gamma,
            scale=module.scaling,
            chunk_size=module.chunk_size,
            prefill=get_backend(backend),
            **options,
        )

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


def hybrid_layers(model: nn.Module) -> dict[int, HybridAttention]:
    return {m.layer_idx: m for m in model.modules() if isinstance(m, HybridAttention)}


class HybridCache(Cache):
    """Cache of a converted model: HybridCacheLayer for converted layers, DynamicLayer for softmax ones.
    Each ring holds min(window, max_length) keys (max_length optional), allocated at the first call. Hybrid layers
    count as linear-attention layers for transformers (`is_linear`): masks are sized by the softmax layers, and
    `generate` with this cache on a model whose layers are all hybrid passes its 2D mask through and compiles the
    decode step (`is_compileable`, torch.compile and CUDA graphs)."""

    def __init__(self, model: nn.Module, max_length: int | None = None):
        hybrid = hybrid_layers(model)
        if not hybrid:
            raise ValueError("HybridCache needs a converted model (no HybridAttention layer found)")
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        layers = [
            HybridCacheLayer(hybrid[i].window, hybrid[i].sinks, max_length) if i in hybrid else DynamicLayer()
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


def attach(model: nn.Module) -> None:
    """What a converted causal LM needs besides its HybridAttention layers: `prepare_inputs` as a forward pre-hook on
    its decoder, and `generation_inputs` as its prepare_inputs_for_generation (bound to this model, so a deep copy
    binds its own)."""
    model.get_decoder().register_forward_pre_hook(prepare_inputs, with_kwargs=True)
    model.prepare_inputs_for_generation = generation_inputs.__get__(model)  # (a method of this model)


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
