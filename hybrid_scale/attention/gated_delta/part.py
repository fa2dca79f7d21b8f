"""The gated delta rule as a part of the hybrid layer (../part.py's interface): its gates from the hidden state, an
optional short convolution and q/k maps (modules.py), the recurrence (naive.py, the spec; chunk.py, the WY form),
its read-out joined to the window (hybrid.py) and its decode (recurrent.py). Registers its built-in recurrences
("naive", "chunk") and its self-check with the backend registry; the kernels package registers fla-core's kernel as
"fla" (attention never imports fla).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from ..backends import get_backend, register_backend, register_check, resolve
from ..cache.attend import cached_attend, uses_cache
from ..cache.recurrent import extend as cache_extend
from ..cache.recurrent import step as cache_step
from ..kinds import GATED_DELTA
from ..part import Part, Projections
from ..shape import Shape
from .cached import SIDE, cached_join, recall_scores
from .chunk import chunk_gated_delta
from .hybrid import delta_hybrid_attention
from .modules import HORIZON_WINDOWS, DeltaGateProjection, HeadLinear, ShortConv
from .naive import l2norm, recurrent_gated_delta
from .recurrent import extend, step


def _local(x):
    """x itself, or under tensor parallelism (a replicated DTensor) this rank's copy, whose gradient is a partial sum
    over the ranks (each rank computes its own heads from it, as the column-split projections do)."""
    if not hasattr(x, "to_local"):
        return x
    from torch.distributed.tensor import Partial

    return x.to_local(grad_placements=[Partial()] * len(x.placements))


class GatedDeltaPart(Part):
    kind = GATED_DELTA
    modules = ("la_gates", "la_conv_q", "la_conv_k", "la_map_q", "la_map_k")

    def build(self, layer, settings: dict, dtype: torch.dtype) -> None:
        """Its queries and keys are q and k themselves (through the convolution and the maps, if any)."""
        ref = layer.q_proj.weight
        horizon = settings["la_delta_horizon"] or HORIZON_WINDOWS * int(settings["window"])
        hidden = layer.q_proj.in_features if hasattr(layer.q_proj, "in_features") else ref.shape[1]
        H, K, d = layer.num_heads, layer.num_key_value_heads, layer.head_dim
        mix = settings["la_combine"] == "mix"
        layer.la_gates = DeltaGateProjection(hidden, H, K, horizon=horizon, mix=mix).to(device=ref.device, dtype=dtype)
        if layer.la_conv:
            layer.la_conv_q = ShortConv(H, d, layer.la_conv).to(device=ref.device, dtype=dtype)
            layer.la_conv_k = ShortConv(K, d, layer.la_conv).to(device=ref.device, dtype=dtype)
        if layer.la_qk_map:
            layer.la_map_q = HeadLinear(H, d).to(device=ref.device, dtype=dtype)
            layer.la_map_k = HeadLinear(K, d).to(device=ref.device, dtype=dtype)
        layer.feature_dim = d

    def project(self, layer, raw, rotated, hidden, mask=None, tails=None) -> Projections:
        """The delta rule's q and k are the layer's before RoPE, through the short convolution (padding enters it as
        zeros; `tails` continues a decode) and the q/k maps, if any; its gates come from the hidden state."""
        fq, fk = raw[:2]
        if layer.la_conv:
            tq, tk = tails if tails is not None else (None, None)
            fq, fk = layer.la_conv_q(fq, mask, tq), layer.la_conv_k(fk, mask, tk)
        if layer.la_qk_map:
            fq, fk = layer.la_map_q(fq), layer.la_map_k(fk)
        return Projections(*rotated, raw[2], fq, fk, layer.la_gates(_local(hidden)))

    def attend(self, x, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None, backend="auto"):
        if initial_state is not None or la_decay is not None:
            raise ValueError("the gated delta-rule LA takes no initial_state and no la_decay (its gates decay it)")
        q, k, v, fq, fk = x[:5]
        shape = self.shape_of(x, opts, conv=0)
        impl = get_backend(resolve(backend, q.device, shape), self.kind.name)
        if uses_cache(opts):
            return cached_attend(self, x, gamma, opts, attention_mask=attention_mask, impl=impl,
                                 dense=impl is recurrent_gated_delta)  # fmt: skip
        return delta_hybrid_attention(q, k, v, fq, fk, gamma, x.gates, opts, attention_mask=attention_mask, impl=impl)

    def recall_scores(self, x, opts, first, *, impl=None, dense=False):
        return recall_scores(x, first, opts, impl=impl)

    def cached_join(self, x, gamma, opts, soft, drop, first, *, la_decay=None, impl=None, dense=False):
        return cached_join(x, gamma, opts, soft, drop, first, impl=impl, dense=dense)

    def shape_of(self, x, opts, conv: int) -> Shape:
        q, k, v = x[:3]
        d = q.shape[-1]
        return Shape(q.shape[1], k.shape[1], d, v.shape[-1], d, int(opts.window), int(opts.sinks), q.dtype,
                     bool(opts.hybrid_sinks), False, self.kind.name, conv)  # fmt: skip

    def decode_shape(self, layer, x, opts) -> Shape:
        return self._state_shape(layer, x.q.dtype)

    def _state_shape(self, layer, dtype: torch.dtype) -> Shape:
        d = layer.head_dim
        return Shape(layer.num_heads, layer.num_key_value_heads, d, d, d, layer.window, layer.sinks, dtype,
                     layer.hybrid_sinks, False, self.kind.name, layer.la_conv)  # fmt: skip

    def conv_tails(self, cache_layer, layer, hidden):
        """The decode state's last inputs of the short convolution (q's, k's), allocated at the first call; the
        layer's `project` continues from them and updates them in place."""
        if not layer.la_conv:
            return None
        if cache_layer.state is None:
            cache_layer.allocate(layer, self._state_shape(layer, hidden.dtype), hidden.shape[0], hidden.device)
        return cache_layer.state.conv_q, cache_layer.state.conv_k

    def decode(self, cache_layer, layer, x, mask):
        """Its compileable one-token step, or extend (gated_delta/recurrent.py)."""
        q, k, v, fq, fk, gates = x
        o = layer.options()
        if cache_layer.state is None:
            cache_layer.allocate(layer, self.decode_shape(layer, x, o), q.shape[0], q.device)
        cache_layer.check(layer)
        if uses_cache(o):  # the cache of exact keys: its torch step (cache/recurrent.py), token by token
            if q.shape[2] == 1 and cache_layer.is_compileable:
                return cache_step(cache_layer.state, x, layer.gamma, o, side=SIDE, attention_mask=mask)
            whole = lambda x, m: self.attend(x, layer.gamma, o, attention_mask=m, backend=layer.backend)  # noqa: E731
            return cache_extend(cache_layer.state, x, layer.gamma, o, side=SIDE, attention_mask=mask, forward=whole,
                                part=self)  # fmt: skip
        if q.shape[2] == 1 and cache_layer.is_compileable:
            return step(cache_layer.state, q, k, v, fq, fk, gates, layer.gamma, o, attention_mask=mask)
        return extend(cache_layer.state, q, k, v, fq, fk, gates, layer.gamma, o, attention_mask=mask)

    def narrow(self, layer, start, stop, group) -> None:
        layer.la_gates.narrow(start, stop, group)
        if layer.la_conv:
            layer.la_conv_q.narrow(start, stop)
            layer.la_conv_k.narrow(start // group, stop // group)
        if layer.la_qk_map:
            layer.la_map_q.narrow(start, stop)
            layer.la_map_k.narrow(start // group, stop // group)

    def gamma_fit_problem(self, layer) -> str | None:
        if layer.la_combine != "normaliser":
            return (
                "export.gamma=calibrated fits gamma, which attention.la_combine=mix does not use (its mix gate weighs "
                "the LA); export with export.gamma=trained"
            )
        return None

    def check(self, fn, decode, device, shape) -> str | None:
        """`fn` (a recurrence with chunk_gated_delta's contract) against chunk_gated_delta on `device`: the output,
        the final state and every gradient, on a small input at the shape's head dim."""
        gen = torch.Generator().manual_seed(0)
        B, H, Hkv, T, D = 1, 4, 2, 150, shape.head_dim
        x = [l2norm(torch.randn(B, H, T, D, generator=gen)), l2norm(torch.randn(B, Hkv, T, D, generator=gen)),
             torch.randn(B, Hkv, T, D, generator=gen), torch.rand(B, Hkv, T, generator=gen),
             -0.1 * torch.rand(B, Hkv, T, generator=gen)]  # fmt: skip
        results = []
        for f in (fn, chunk_gated_delta):
            with torch.inference_mode(False), torch.enable_grad():
                leaves = [t.to(device).requires_grad_() for t in x]
                o, S = f(*leaves)
                results.append([o, S, *torch.autograd.grad(o.square().sum() + S.square().sum(), leaves)])
        for what, a, b in zip(("output", "state", "dq", "dk", "dv", "dbeta", "dg"), *results, strict=True):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            if not err <= 1e-2 * (1 + scale):
                return f"{what} differs from the torch path by {err:.3g} (of {scale:.3g})"
        return None


PART = GatedDeltaPart()
register_backend("naive", recurrent_gated_delta, kind=GATED_DELTA.name)
register_backend("chunk", chunk_gated_delta, kind=GATED_DELTA.name)
register_check(GATED_DELTA.name, PART.check)
