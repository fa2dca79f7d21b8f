"""The hybrid layer: `HybridAttention`, which composes the window (and its sinks) with one kind of linear part, and
`attend`, the one entry point to the attention math over whole sequences.

`attend` computes a call by the part of its LA kind (parts.py; kinds.py) with the implementation the backend registry
resolves for the device (backends.py: "auto" by default: the kind's accelerated implementation for CUDA tensors when
installed and self-checked, the chunked torch path elsewhere; "torch", or a name the kind has such as "naive" = the
spec). Decode with a cache goes through the part's decode step (hf/cache.py). `HybridAttention.attend` is the same
with the layer's own settings (its `backend` included) as defaults; its forward, stage 1, gamma calibration and the
LA-share diagnostic call it.

`HybridAttention` takes the place of the attention module of an architecture in hf/architectures.py (Llama, Mistral,
Qwen2, Granite) and adopts its q/k/v/o projections (same names, so PEFT targets them as before), its scaling and the
model's rotary embeddings; its part adds the LA's parameters (Hedgehog: phi_q per query head, phi_k per KV head, the
optional decay) and the layer gamma per query head from a learnable theta: sigmoid(theta) in (0, 1) as LoLCATs, or
exp(theta) in (0, inf), which can weight the window above a weak LA (`gamma_param`). Its keywords are settings.py's
record; its `mode` is one of settings.MODES and can be switched at any time; with a cache its forward hands the decode
to the cache's layer (hf/cache.py), whose state is kept in every mode. What a converted model needs around its layers
(the decoder's pre-hook, generation's inputs) is hf/generation.py.

This file imports only torch, transformers and its siblings (the export copies the package flattened next to a
modeling file, its relative imports rewritten to flat siblings: export/remote_code.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.cache_utils import Cache

from .kinds import DEFAULT, for_inputs, kind_of
from .options import AttentionOptions
from .part import Projections
from .parts import part_of
from .settings import SETTINGS, layer_settings, problems

# gamma_param -> (theta -> gamma, gamma -> theta): LoLCATs' sigmoid caps the window's weight at 1, exp does not
GAMMA_PARAMS = {
    "sigmoid": (torch.sigmoid, lambda g: math.log(g / (1.0 - g))),
    "exp": (torch.exp, math.log),
}
__all__ = [
    "GAMMA_PARAMS",
    "HybridAttention",
    "Projections",
    "apply_rope",
    "attend",
    "hybrid_layers",
    "set_layers_cache",
]


def _at_least(theta: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """theta clamped at `floor` in the forward, with the identity's gradient (straight through): a decay at its bound
    (rho = 0, the formula without decay, or the floor of la_decay_max_horizon) still learns in both directions."""
    return theta + (theta.clamp(min=floor) - theta).detach()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def attend(q, k, v, fq, fk, gamma, opts=None, *, gates=None, attention_mask=None, initial_state=None, la_decay=None,
           backend="auto", la_kind=None, **settings):  # fmt: skip
    """Hybrid attention (docs/design.md §2) computed by the implementation `backend` resolves to for q's device and
    the LA kind (backends.py: auto, torch, or a name the kind has).

    q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F], fk [B,Hkv,T,F] the LA's queries and keys (phi_q(q),
    phi_k(k) for the Hedgehog LA), gamma [H] > 0; opts the call's AttentionOptions (options.py; or its fields as
    keywords), taken as the layer computes it (`own()`: with hybrid_sinks, swa_only is swa_sinks); attention_mask
    [B,T] (1 = token, 0 = padding) or None; initial_state None or the LA sums (kv [B,Hkv,F,D], k [B,Hkv,F]) of keys
    before the sequence (see backends.py); la_decay rho [Hkv]: the Hedgehog LA's decay per KV head (None = off);
    gates: the gated delta rule's per-token gates (gated_delta/naive.DeltaGates). la_kind: the LA's kind (kinds.py;
    None: the gated delta rule when gates are given, else Hedgehog).
    Returns y [B,H,T,D] in q's dtype; with opts.return_denominators (y, sum of E [B,H,T], sum of L [B,H,T]), the two
    parts of the shared normaliser (unpadded input; the LA-share diagnostic; with gates the soft and the LA weight)."""
    part = part_of(la_kind or for_inputs(gates).name)
    o = AttentionOptions.of(opts, **settings)
    x = Projections(q, k, v, fq, fk, gates)
    return part.attend(x, gamma, o, attention_mask=attention_mask, initial_state=initial_state, la_decay=la_decay,
                       backend=backend)  # fmt: skip


class HybridAttention(nn.Module):
    """A model's attention module replaced by the hybrid (module doc): its projections adopted, phi (or the kind's
    own part, kinds.py / parts.py) and gamma added. Its keywords are the layer settings of settings.py's record (a
    keyword not given takes the record's default); `part` is its LA kind's part, which holds what differs."""

    def __init__(self, base: nn.Module, *, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, param_dtype: torch.dtype | None = None, **settings):  # fmt: skip
        super().__init__()
        unknown = sorted(set(settings) - {s.name for s in SETTINGS if s.layer})
        if unknown:
            raise TypeError(f"HybridAttention got unknown settings {unknown}; its settings are attention/settings.py's")
        settings = layer_settings(settings)
        for name, why in problems(settings):
            raise ValueError(f"attention.{name}: {why}")
        if (problem := kind_of(settings).problem(settings)) is not None:
            raise ValueError(f"attention.{problem[0]}: {problem[1]}")
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
        self.settings = settings  # as converted (the record's names); the live ones are attributes (`setting`)
        for s in SETTINGS:  # window, sinks, mode, backend, ...: what set_window, set_modes and the parts change
            if s.layer and s.live and not isinstance(getattr(type(self), s.live, None), property):
                value = settings[s.name]
                setattr(self, s.live, s.type(value) if isinstance(s.type, type) and value is not None else value)
        self.part = part_of(self.la_kind)
        ref = self.q_proj.weight
        dtype = param_dtype or ref.dtype  # fp32 masters for training in half precision; else the projections'
        self.part.build(self, settings, dtype)
        logit = GAMMA_PARAMS[self.gamma_param][1](settings["gamma_init"])
        self.gamma_logit = nn.Parameter(torch.full((num_heads,), logit, device=ref.device, dtype=dtype))
        horizon = settings["la_decay_max_horizon"]  # the decay's floor: rho >= 1/horizon in the forward (0: rho >= 0)
        self.la_decay_floor = 1.0 / horizon if horizon else 0.0

    @classmethod
    def from_softmax(cls, base: nn.Module, config, layer_idx: int, settings, param_dtype=None) -> HybridAttention:
        """Take the place of an attention module of an ARCHITECTURES model (hf/architectures.py); settings maps the
        record's names (a hybrid_config.json's: a name it lacks means what the record says an older file means).
        param_dtype: of phi/gamma (default: the projections' dtype)."""
        return cls(
            base,
            layer_idx=layer_idx,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=base.head_dim,
            scaling=base.scaling,
            param_dtype=param_dtype,
            **layer_settings(settings, older=True),
        )

    head_range: tuple[int, int] | None = None  # the query heads kept by narrow_heads (None: all of them)
    _cache_budget: tuple | None = None  # cache_budget on the host (what options() hands each call)

    @property
    def cache_budget(self) -> torch.Tensor | None:
        """The cache of exact keys' size per KV head of this layer ([Hkv] long, on the host; attention.cache_heads=
        retrieval: models/cache_heads.py), or None: cache_keys for every head. Its mean is the layer's cache_keys
        (set_cache checks it); narrow_heads keeps its heads' slice."""
        return None if self._cache_budget is None else torch.tensor(self._cache_budget, dtype=torch.long, device="cpu")

    @cache_budget.setter
    def cache_budget(self, budget) -> None:
        b = _ints(budget)
        if b is not None and (len(b) != self.num_key_value_heads or min(b, default=0) < 0):
            raise ValueError(
                f"layer {self.layer_idx}: a cache budget is {self.num_key_value_heads} integers >= 0 (one per KV "
                f"head), got {budget!r}"
            )
        self._cache_budget = b

    def setting(self, name: str):
        """The current value of the record's setting `name` (its live attribute, else as converted)."""
        live = next((s.live for s in SETTINGS if s.name == name), None)
        return getattr(self, live) if live else self.settings[name]

    @property
    def has_la_decay(self) -> bool:
        return hasattr(self, "la_decay_rho")

    def narrow_heads(self, start: int, stop: int) -> None:
        """Keep only query heads start..stop-1 and their KV heads: the part's parameters (phi_q, phi_k, the LA's
        decay; the gated delta rule's gates) and gamma are sliced to them, so that a rank computing only those heads
        (tensor parallelism) holds and trains only theirs; the LA state and the decode cache follow from the local
        k/v. The projections are split by the caller (their own plan)."""
        g = self.num_key_value_groups
        if not (0 <= start < stop <= self.num_heads and start % g == 0 and stop % g == 0):
            raise ValueError(
                f"layer {self.layer_idx}: cannot keep query heads {start}..{stop - 1} of {self.num_heads} in whole "
                f"groups of {g} per KV head"
            )
        self.part.narrow(self, start, stop, g)
        theta = self.gamma_logit
        self.gamma_logit = nn.Parameter(theta.detach()[start:stop].clone(), requires_grad=theta.requires_grad)
        if self._cache_budget is not None:  # the cache's budget per KV head: the kept heads' slice
            self._cache_budget = self._cache_budget[start // g : stop // g]
        self.num_heads, self.num_key_value_heads = stop - start, (stop - start) // g
        offset = self.head_range[0] if self.head_range else 0
        self.head_range = (offset + start, offset + stop)

    def hybrid_parameters(self):
        """(name, parameter) of what conversion added: the part's (phi_q, phi_k, the LA decay; gated_delta: its gates
        and convolutions) and gamma (not the adopted projections)."""
        return [(n, p) for n, p in self.named_parameters() if not n.split(".")[0].endswith("_proj")]

    def la_parameters(self) -> list[nn.Parameter]:
        """The LA's own learnable parameters (what distill.train_feature_maps and finetune.train_feature_maps train):
        phi_q and phi_k, or gated_delta's gates and convolutions."""
        return self.part.la_parameters(self)

    @property
    def gamma(self) -> torch.Tensor:
        return GAMMA_PARAMS[self.gamma_param][0](self.gamma_logit)

    @property
    def la_decay(self) -> torch.Tensor | None:
        """rho >= its floor (0, or 1/la_decay_max_horizon) per KV head (alpha = exp(-rho)), or None without a decay."""
        rho = getattr(self, "la_decay_rho", None)
        return None if rho is None else _at_least(rho, self.la_decay_floor)

    def extra_repr(self) -> str:
        heads = f", heads={self.head_range[0]}..{self.head_range[1] - 1}" if self.head_range else ""
        own = ", hybrid_sinks=True" if self.hybrid_sinks else ""
        own += ", la_decay=True" if self.has_la_decay else ""
        own += f", la_decay_floor={self.la_decay_floor:.4g}" if self.la_decay_floor else ""
        if self.part.kind is not DEFAULT:
            own += f", la_kind={self.la_kind}, la_combine={self.la_combine}" + (
                f", la_conv={self.la_conv}" * bool(self.la_conv)
            )
        return f"layer={self.layer_idx}, window={self.window}, sinks={self.sinks}{own}, mode={self.mode}{heads}"

    def options(self, **settings) -> AttentionOptions:
        """This layer's AttentionOptions (the record's call settings: window, mode, sinks and its hybrid's own,
        chunk_size, la_combine; and its scaling); a keyword given (not None) replaces the layer's own for this call."""
        own = {s.name: getattr(self, s.live) for s in SETTINGS if s.call} | {"scale": self.scaling}
        own["cache_budget"] = self._cache_budget
        return AttentionOptions(**own | {name: value for name, value in settings.items() if value is not None})

    def attend(self, q, k, v, fq, fk, *, gates=None, gamma=None, attention_mask=None, backend=None,
               initial_state=None, la_decay=None, **settings):  # fmt: skip
        """`attend` with this layer's part, gamma, LA decay, backend and `options(**settings)`; a keyword given (not
        None) replaces the layer's own for this call only. q, k, v, fq, fk (and gates) as `project` returns them."""
        return self.part.attend(
            Projections(q, k, v, fq, fk, gates), self.gamma if gamma is None else gamma, self.options(**settings),
            attention_mask=attention_mask, initial_state=initial_state,
            la_decay=self.la_decay if la_decay is None else la_decay,
            backend=self.backend if backend is None else backend,
        )  # fmt: skip

    def project(self, hidden_states, position_embeddings, attention_mask=None, conv_tails=None) -> Projections:
        """q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, and the LA's queries and keys (the part's: phi_q(q), phi_k(k);
        gated_delta: its own q and k and gates). attention_mask [B,T] and conv_tails (the decode state's last
        convolution inputs, updated in place) matter only to a part with a convolution."""
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        rotated = apply_rope(q, k, *position_embeddings)
        return self.part.project(self, (q, k, v), rotated, hidden_states, attention_mask, conv_tails)

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
        layer = cache.layers[self.layer_idx] if cache is not None and self.layer_idx < len(cache.layers) else None
        tails = layer.conv_tails(self, hidden_states) if hasattr(layer, "conv_tails") else None
        x = self.project(hidden_states, position_embeddings, hybrid_mask, tails)
        if hasattr(layer, "hybrid_attend"):  # a HybridCacheLayer (hf/cache.py): the decode state of this layer
            y = layer.hybrid_attend(self, x, hybrid_mask)
        elif cache is not None:
            raise TypeError(
                f"a converted model needs a hybrid_scale HybridCache, got {type(cache).__name__}; "
                "pass no cache (one is created) or HybridCache(model)"
            )
        else:
            y = self.attend(*x[:5], gates=x.gates, attention_mask=hybrid_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), None


def hybrid_layers(model: nn.Module) -> dict[int, HybridAttention]:
    return {m.layer_idx: m for m in model.modules() if isinstance(m, HybridAttention)}


def set_layers_cache(layers: dict[int, HybridAttention], keys: int, select: str | None = None, budgets=None) -> None:
    """The cache of exact keys of `layers` ({index: layer}): `keys` per KV head, the score `select` if given, and
    `budgets` {layer: [Hkv] ints} (attention.cache_heads=retrieval), each the layer's keys x Hkv slots shared out over
    its KV heads (checked: Hkv integers >= 0 summing to keys x Hkv); a layer it does not name keeps `keys` for every
    head. A layer narrowed to some heads (tensor parallelism) takes the whole layer's budget and keeps its slice.
    models.convert.set_cache and an export's set_hybrid_cache (hf/modeling_hybrid_scale.py) call it."""
    given = {int(i): b for i, b in (budgets or {}).items()}
    unknown = sorted(set(given) - set(layers))
    if unknown:
        raise ValueError(
            f"cache budgets name layers {unknown} that are not hybrid layers; hybrid layers: {sorted(layers)}"
        )
    sliced = {}
    for i, budget in given.items():
        m, b = layers[i], _ints(budget)
        g = m.num_key_value_groups
        heads = m.all_heads // g
        if b is None or len(b) != heads or min(b, default=0) < 0 or sum(b) != keys * heads:
            raise ValueError(
                f"layer {i}: a cache budget shares out keys x KV heads = {keys} x {heads} slots over the layer's "
                f"KV heads (integers >= 0), got {budget!r}"
            )
        h0, h1 = m.head_range or (0, m.all_heads)
        sliced[i] = b[h0 // g : h1 // g]
    for i, m in layers.items():
        m.cache_keys = keys
        m.cache_budget = sliced.get(i)
        if select is not None:
            m.cache_select = select


def _ints(budget) -> tuple | None:
    """A budget per KV head (a tensor, list or tuple of integers) as a tuple of ints on the host, or None. (No tensor
    is made: a model built on the meta device, as transformers builds one, sets its budgets too.)"""
    if budget is None:
        return None
    values = budget.tolist() if isinstance(budget, torch.Tensor) else list(budget)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in values):
        raise ValueError(f"a cache budget is integers (keys per KV head), got {budget!r}")
    return tuple(values)
