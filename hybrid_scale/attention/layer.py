"""The hybrid attention entry point and its nn.Module.

`attend` is the one entry point to the attention math over whole sequences (decode with a cache goes through
recurrent.extend, or a backend's fused decode step: cache.py): tensors, then keyword-only settings, computed by a
backend of backends.py chosen per call from `backend` ("auto" by default: the Triton kernels for CUDA tensors when
installed, the chunked torch path elsewhere; "torch", "triton", or a backend name such as "naive" = the spec).
`HybridAttention.attend` is the same with the layer's own settings (its `backend` included) as defaults; its forward,
stage 1, gamma calibration and the LA-share diagnostic call it.

`HybridAttention` takes the place of the attention module of an architecture in architectures.py (Llama, Mistral,
Qwen2, Granite) and adopts its q/k/v/o projections (same names, so PEFT targets them as before), its scaling and the
model's rotary embeddings; it adds phi_q (per query head), phi_k (per KV head) and gamma per query head from a
learnable theta: sigmoid(theta) in (0, 1) as LoLCATs, or exp(theta) in (0, inf), which can weight the window above a
weak LA (`gamma_param`). Its `mode` is one of naive.MODES
and can be switched at any time; with a cache its forward hands the decode to the cache's layer (cache.py), whose
state is kept in every mode. What a converted model needs around its layers (the decoder's pre-hook, generation's
inputs) is generation.py.

This file imports only torch, transformers and its siblings, in the `from .sibling import name` form that transformers
follows when it loads remote code (the export copies these files next to a modeling file).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache

from .backends import Shape, get_backend, resolve
from .gated_delta.hybrid import delta_hybrid_attention
from .gated_delta.modules import HORIZON_WINDOWS, DeltaGateProjection, HeadLinear, ShortConv
from .gated_delta.naive import DeltaGates, recurrent_gated_delta
from .hedgehog.feature_maps import make_feature_map
from .options import AttentionOptions
from .settings import LA_COMBINES, LA_KINDS
from .window.naive import check_mode

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


class Projections(NamedTuple):
    """A layer's projections of a sequence (HybridAttention.project): q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, and
    their feature maps fq = phi_q(q) [B,H,T,F], fk = phi_k(k) [B,Hkv,T,F]; with la_kind gated_delta, fq/fk are the
    delta rule's queries and keys (q and k before RoPE, through the short convolution when there is one) and `gates`
    its per-token gates (delta.DeltaGates). A tuple: `attend(*x[:5], gates=x.gates, ...)` takes them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fq: torch.Tensor
    fk: torch.Tensor
    gates: DeltaGates | None = None


def _at_least(theta: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """theta clamped at `floor` in the forward, with the identity's gradient (straight through): a decay at its bound
    (rho = 0, the formula without decay, or the floor of la_decay_max_horizon) still learns in both directions."""
    return theta + (theta.clamp(min=floor) - theta).detach()


def _local(x):
    """x itself, or under tensor parallelism (a replicated DTensor) this rank's copy, whose gradient is a partial sum
    over the ranks (each rank computes its own heads from it, as the column-split projections do)."""
    if not hasattr(x, "to_local"):
        return x
    from torch.distributed.tensor import Partial

    return x.to_local(grad_placements=[Partial()] * len(x.placements))


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
    gamma,
    opts=None,
    *,
    gates=None,
    attention_mask=None,
    initial_state=None,
    la_decay=None,
    backend="auto",
    **settings,
):
    """Hybrid attention (docs/design.md §2) computed by the backend `backend` resolves to for q's device (see
    backends.py: auto, torch, triton, or a registered name).

    q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F] = phi_q(q), fk [B,Hkv,T,F] = phi_k(k), gamma [H] > 0;
    opts the call's AttentionOptions (options.py; or its fields as keywords), taken as the layer computes it
    (`own()`: with hybrid_sinks, swa_only is swa_sinks); attention_mask [B,T] (1 = token, 0 = padding) or None;
    initial_state None or the LA sums (kv [B,Hkv,F,D], k [B,Hkv,F]) of keys before the sequence (see backends.py).
    la_decay rho [Hkv]: the LA's decay per KV head (naive.py; None = off).
    gates (delta.DeltaGates): the LA is the gated delta rule (la_kind gated_delta) on fq/fk, joined to the window as
    opts.la_combine says (delta.py); it runs the spec with backend "naive", else the chunked torch form (no initial
    state, no la_decay: its gates decay it).
    Returns y [B,H,T,D] in q's dtype; with opts.return_denominators (y, sum of E [B,H,T], sum of L [B,H,T]), the two
    parts of the shared normaliser (unpadded input; the LA-share diagnostic; with gates the soft and the LA weight)."""
    o = AttentionOptions.of(opts, **settings)
    if gates is not None:
        if initial_state is not None or la_decay is not None:
            raise ValueError("the gated delta-rule LA takes no initial_state and no la_decay (its gates decay it)")
        impl = recurrent_gated_delta if backend == "naive" else None
        return delta_hybrid_attention(q, k, v, fq, fk, gamma, gates, o, attention_mask=attention_mask, impl=impl)
    o = o.own()
    shape = Shape.of(q, k, v, fq, o, la_decay=la_decay is not None)
    fn = get_backend(resolve(backend, q.device, shape))
    return fn(q, k, v, fq, fk, gamma, o, attention_mask=attention_mask, initial_state=initial_state, la_decay=la_decay)


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
        la_decay_max_horizon: int = 0,
        la_kind: str = "hedgehog",
        la_combine: str = "normaliser",
        la_conv: int = 0,
        la_delta_horizon: int = 0,
        la_qk_map: bool = False,
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
        if la_kind not in LA_KINDS or la_combine not in LA_COMBINES:
            raise ValueError(
                f"la_kind must be one of {', '.join(LA_KINDS)} and la_combine one of {', '.join(LA_COMBINES)}; "
                f"got {la_kind!r}, {la_combine!r}"
            )
        self.la_kind, self.la_combine, self.la_conv, self.la_qk_map = la_kind, la_combine, int(la_conv), bool(la_qk_map)
        self.feature_map_name = feature_map  # (recorded as configured; gated_delta has no feature map)
        if la_kind == "gated_delta":  # its queries and keys are q and k themselves (through the conv); gates (delta.py)
            if la_decay or la_decay_max_horizon:
                raise ValueError("la_decay and la_decay_max_horizon are the Hedgehog LA's; gated_delta has its gates")
            horizon = la_delta_horizon or HORIZON_WINDOWS * int(window)
            hidden = self.q_proj.in_features if hasattr(self.q_proj, "in_features") else ref.shape[1]
            self.la_gates = DeltaGateProjection(
                hidden, num_heads, num_kv_heads, horizon=horizon, mix=la_combine == "mix"
            ).to(device=ref.device, dtype=dtype)
            if self.la_conv:
                self.la_conv_q = ShortConv(num_heads, head_dim, self.la_conv).to(device=ref.device, dtype=dtype)
                self.la_conv_k = ShortConv(num_kv_heads, head_dim, self.la_conv).to(device=ref.device, dtype=dtype)
            if la_qk_map:
                self.la_map_q = HeadLinear(num_heads, head_dim).to(device=ref.device, dtype=dtype)
                self.la_map_k = HeadLinear(num_kv_heads, head_dim).to(device=ref.device, dtype=dtype)
            self.feature_dim = head_dim
        else:
            self.feature_map_q = make_feature_map(feature_map, num_heads, head_dim, feature_dim)
            self.feature_map_k = make_feature_map(feature_map, num_kv_heads, head_dim, feature_dim)
            self.feature_map_q.to(device=ref.device, dtype=dtype)
            self.feature_map_k.to(device=ref.device, dtype=dtype)
            self.feature_dim = self.feature_map_q.feature_dim
        self.gamma_param = gamma_param  # theta -> gamma: sigmoid (LoLCATs, gamma < 1) or exp (unbounded)
        logit = GAMMA_PARAMS[gamma_param][1](gamma_init)
        self.gamma_logit = nn.Parameter(torch.full((num_heads,), logit, device=ref.device, dtype=dtype))
        if la_decay:  # the LA's decay rho per KV head (naive.py): from 0, exactly the hybrid without it, or from
            rho0 = 1.0 / la_decay_horizon if la_decay_horizon else 0.0  # 1/horizon (alpha^horizon = 1/e)
            self.la_decay_rho = nn.Parameter(torch.full((num_kv_heads,), rho0, device=ref.device, dtype=dtype))
        # the decay's floor: rho >= 1/la_decay_max_horizon in the forward (0: rho >= 0)
        self.la_decay_floor = 1.0 / la_decay_max_horizon if la_decay_max_horizon else 0.0

    SETTINGS = (
        "window", "feature_map", "feature_dim", "gamma_init", "gamma_param", "sinks", "hybrid_sinks", "la_decay",
        "la_decay_horizon", "la_decay_max_horizon", "la_kind", "la_combine", "la_conv",
        "la_delta_horizon", "la_qk_map", "mode", "chunk_size", "backend",
    )  # fmt: skip
    DEFAULTS = {
        "backend": "auto",
        "hybrid_sinks": False,
        "gamma_param": "sigmoid",
        "la_decay": False,
        "la_decay_horizon": 0,
        "la_decay_max_horizon": 0,
        "la_kind": "hedgehog",
        "la_combine": "normaliser",
        "la_conv": 0,
        "la_delta_horizon": 0,
        "la_qk_map": False,
    }  # settings that older hybrid_config.json files do not have

    @classmethod
    def from_softmax(cls, base: nn.Module, config, layer_idx: int, settings, param_dtype=None) -> HybridAttention:
        """Take the place of an attention module of an ARCHITECTURES model; settings maps the names in SETTINGS.
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
        if self.la_kind == "gated_delta":
            self.la_gates.narrow(start, stop, g)
            if self.la_conv:
                self.la_conv_q.narrow(start, stop)
                self.la_conv_k.narrow(start // g, stop // g)
            if self.la_qk_map:
                self.la_map_q.narrow(start, stop)
                self.la_map_k.narrow(start // g, stop // g)
        else:
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
        """(name, parameter) of what conversion added: phi_q, phi_k (gated_delta: its gates and convolutions), gamma,
        the LA decay (not the adopted projections)."""
        return [(n, p) for n, p in self.named_parameters() if not n.split(".")[0].endswith("_proj")]

    def la_parameters(self) -> list[nn.Parameter]:
        """The LA's own learnable parameters (what distill.train_feature_maps and finetune.train_feature_maps train):
        phi_q and phi_k, or gated_delta's gates and convolutions."""
        names = ("feature_map_q", "feature_map_k", "la_gates", "la_conv_q", "la_conv_k", "la_map_q", "la_map_k")
        return [p for name in names if hasattr(self, name) for p in getattr(self, name).parameters()]

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
        own += ", la_decay=True" if hasattr(self, "la_decay_rho") else ""
        own += f", la_decay_floor={self.la_decay_floor:.4g}" if self.la_decay_floor else ""
        if self.la_kind != "hedgehog":
            own += f", la_kind={self.la_kind}, la_combine={self.la_combine}" + (
                f", la_conv={self.la_conv}" * bool(self.la_conv)
            )
        return f"layer={self.layer_idx}, window={self.window}, sinks={self.sinks}{own}, mode={self.mode}{heads}"

    def options(self, **settings) -> AttentionOptions:
        """This layer's AttentionOptions (its window, mode, sinks and its hybrid's own, scaling, chunk_size and
        la_combine); a keyword given (not None) replaces the layer's own for this call only."""
        own = dict(window=self.window, mode=self.mode, sinks=self.sinks, hybrid_sinks=self.hybrid_sinks,
                   scale=self.scaling, chunk_size=self.chunk_size, la_combine=self.la_combine)  # fmt: skip
        return AttentionOptions(**own | {name: value for name, value in settings.items() if value is not None})

    def attend(self, q, k, v, fq, fk, *, gates=None, gamma=None, attention_mask=None, backend=None,
               initial_state=None, la_decay=None, **settings):  # fmt: skip
        """`attend` with this layer's gamma, LA decay, backend and `options(**settings)`; a keyword given (not None)
        replaces the layer's own for this call only. q, k, v, fq, fk as `project` returns them."""
        return attend(
            q, k, v, fq, fk, self.gamma if gamma is None else gamma, self.options(**settings), gates=gates,
            attention_mask=attention_mask, initial_state=initial_state,
            la_decay=None if gates is not None else self.la_decay if la_decay is None else la_decay,
            backend=self.backend if backend is None else backend,
        )  # fmt: skip

    def project(self, hidden_states, position_embeddings, attention_mask=None, conv_tails=None) -> Projections:
        """q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, and their feature maps (gated_delta: the delta rule's q and k,
        before RoPE, through the short convolution if any, and the gates). attention_mask [B,T] (padding enters the
        convolution as zeros) and conv_tails (the decode state's last convolution inputs, updated in place) matter
        only to gated_delta's convolution."""
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        q_rot, k_rot = apply_rope(q, k, *position_embeddings)
        if self.la_kind == "gated_delta":
            fq, fk = q, k
            if self.la_conv:
                tq, tk = conv_tails if conv_tails is not None else (None, None)
                fq, fk = self.la_conv_q(q, attention_mask, tq), self.la_conv_k(k, attention_mask, tk)
            if self.la_qk_map:
                fq, fk = self.la_map_q(fq), self.la_map_k(fk)
            return Projections(q_rot, k_rot, v, fq, fk, self.la_gates(_local(hidden_states)))
        return Projections(q_rot, k_rot, v, self.feature_map_q(q_rot), self.feature_map_k(k_rot))

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
        tails = layer.conv_tails(self, hidden_states) if self.la_conv and hasattr(layer, "conv_tails") else None
        x = self.project(hidden_states, position_embeddings, hybrid_mask, tails)
        if hasattr(layer, "hybrid_attend"):  # a HybridCacheLayer (cache.py): the decode state of this layer
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
