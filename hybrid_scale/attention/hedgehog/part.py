"""The Hedgehog LA as a part of the hybrid layer (../part.py's interface): phi_q per query head and phi_k per KV head
(feature_maps.py), an optional decay rho per KV head, its terms summed under the window's normaliser (naive.py, the
spec; chunk.py; recurrent.py, decode). Registers its built-in implementations ("naive", "chunk") and its self-check
with the backend registry; the kernels package registers "triton" and its fused decode step for it.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..backends import get_backend, get_decode, register_backend, register_check, resolve
from ..cache.attend import cached_attend, uses_cache
from ..cache.recurrent import extend as cache_extend
from ..cache.recurrent import step as cache_step
from ..kinds import HEDGEHOG
from ..options import AttentionOptions
from ..part import Part, Projections
from ..shape import Shape
from ..window.naive import real_positions
from ..window.recurrent import DecodeState
from .cached import SIDE, cached_join, recall_scores
from .chunk import chunk_hybrid_attention
from .feature_maps import make_feature_map
from .naive import masked_attention, naive_hybrid_attention
from .recurrent import extend, step


def _naive(q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, initial_state=None, la_decay=None, **settings):
    opts = AttentionOptions.of(opts, **settings)
    if initial_state is None:
        return naive_hybrid_attention(q, k, v, fq, fk, gamma, opts, attention_mask=attention_mask, la_decay=la_decay)
    pos = real_positions(attention_mask, q.shape[0], q.shape[2], q.device)
    ref = opts.window - 1  # with a decay, an initial state is as the row's query w-1 sees it
    return masked_attention(
        q, k, v, fq, fk, gamma, pos, pos, opts, state=initial_state, state_ref=ref, la_decay=la_decay
    )


class HedgehogPart(Part):
    kind = HEDGEHOG
    modules = ("feature_map_q", "feature_map_k")

    def build(self, layer: nn.Module, settings: dict, dtype: torch.dtype) -> None:
        ref = layer.q_proj.weight
        for name, heads in (("feature_map_q", layer.num_heads), ("feature_map_k", layer.num_key_value_heads)):
            fmap = make_feature_map(settings["feature_map"], heads, layer.head_dim, settings["feature_dim"])
            setattr(layer, name, fmap.to(device=ref.device, dtype=dtype))
        layer.feature_dim = layer.feature_map_q.feature_dim
        if settings["la_decay"]:  # the LA's decay rho per KV head (naive.py): from 0, exactly the hybrid without it,
            horizon = settings["la_decay_horizon"]  # or from 1/horizon (alpha^horizon = 1/e)
            rho0 = 1.0 / horizon if horizon else 0.0
            rho = torch.full((layer.num_key_value_heads,), rho0, device=ref.device, dtype=dtype)
            layer.la_decay_rho = nn.Parameter(rho)

    def project(self, layer, raw, rotated, hidden, mask=None, tails=None) -> Projections:
        q_rot, k_rot = rotated
        return Projections(q_rot, k_rot, raw[2], layer.feature_map_q(q_rot), layer.feature_map_k(k_rot))

    def attend(self, x, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None, backend="auto"):
        q, k, v, fq, fk = x[:5]
        o = opts.own()
        shape = Shape.of(q, k, v, fq, o, la_decay=la_decay is not None)
        name = resolve(backend, q.device, shape)
        if uses_cache(opts):  # the cache's path computes its LA with the chunked torch form (or the spec's)
            return cached_attend(self, x, gamma, opts, attention_mask=attention_mask, initial_state=initial_state,
                                 la_decay=la_decay, dense=name == "naive")  # fmt: skip
        fn = get_backend(name, self.kind.name)
        return fn(q, k, v, fq, fk, gamma, o, attention_mask=attention_mask, initial_state=initial_state,
                  la_decay=la_decay)  # fmt: skip

    def recall_scores(self, x, opts, first, *, impl=None, dense=False):
        return recall_scores(x, first, opts, dense=dense)

    def cached_join(self, x, gamma, opts, soft, drop, first, *, la_decay=None, impl=None, dense=False):
        return cached_join(x, gamma, opts, soft, drop, first, la_decay=la_decay, dense=dense)

    def decode_shape(self, layer, x, opts) -> Shape:
        return Shape.of(*x[:4], opts, la_decay=layer.la_decay is not None)

    def decode(self, cache_layer, layer, x, mask):
        """The layer's attention of the new tokens over the cache layer's state: the compiled one-token step (the
        resolved backend's fused step, or recurrent.step), else recurrent.extend (a prompt through the backend)."""
        q, k, v, fq, fk = x[:5]
        o, rho, gamma = layer.options().own(), layer.la_decay, layer.gamma
        if uses_cache(o):  # the cache of exact keys: its torch step (cache/recurrent.py), token by token
            if cache_layer.state is None:
                shape = self.decode_shape(layer, x, o)
                cache_layer.allocate(layer, shape, k.shape[0], k.device)
                cache_layer.step = get_decode(resolve(layer.backend, q.device, shape), self.kind.name) or step
            cache_layer.check(layer)
            if q.shape[2] == 1 and cache_layer.is_compileable:
                return cache_step(cache_layer.state, x, gamma, layer.options(), side=SIDE, attention_mask=mask,
                                  la_decay=rho)  # fmt: skip
            whole = lambda x, m: self.attend(x, gamma, layer.options(), attention_mask=m, la_decay=rho,  # noqa: E731
                                             backend=layer.backend)  # fmt: skip
            return cache_extend(cache_layer.state, x, gamma, layer.options(), side=SIDE, attention_mask=mask,
                                la_decay=rho, forward=whole, part=self)  # fmt: skip
        if cache_layer.state is not None and q.shape[2] == 1 and cache_layer.is_compileable:  # (the compiled step)
            cache_layer.check(layer)
            y = cache_layer.step(cache_layer.state, q, k, v, fq, fk, gamma, o, attention_mask=mask, la_decay=rho)
            if y is not None:
                return y
            return step(cache_layer.state, q, k, v, fq, fk, gamma, o, attention_mask=mask, la_decay=rho)
        shape = self.decode_shape(layer, x, o)
        backend = resolve(layer.backend, q.device, shape)
        if cache_layer.state is None:
            cache_layer.allocate(layer, shape, k.shape[0], k.device)
            cache_layer.step = get_decode(backend, self.kind.name) or step
        return extend(cache_layer.state, q, k, v, fq, fk, gamma, o, attention_mask=mask, la_decay=rho,
                      prefill=get_backend(backend, self.kind.name))  # fmt: skip

    def narrow(self, layer, start, stop, group) -> None:
        layer.feature_map_q.narrow(start, stop)
        layer.feature_map_k.narrow(start // group, stop // group)
        rho = getattr(layer, "la_decay_rho", None)
        if rho is not None:
            kept = rho.detach()[start // group : stop // group].clone()
            layer.la_decay_rho = nn.Parameter(kept, requires_grad=rho.requires_grad)

    def check(self, fn, decode, device, shape) -> str | None:
        """`fn` at `shape` against the chunked torch path: a forward of 2 rows across several tiles, unpadded
        (training's and a prefill's path) and with one row left-padded, in hybrid mode (with its sinks if the shape's
        hybrid keeps them), the output and the gradients of q, k, v, phi_q, phi_k and gamma (and of the LA's decay
        rho, if the shape has one); and (if it has a fused decode step) 20 decode steps past the window against
        recurrent.extend."""
        half = shape.dtype in (torch.float16, torch.bfloat16)
        tol = 3e-2 if half else 1e-4
        B, H, Hkv, D, Dv, F, w, S = 2, shape.heads, shape.kv_heads, shape.head_dim, shape.value_dim, \
            shape.features, shape.window, shape.sinks  # fmt: skip
        T = 2 * w + 48  # past the window, across several tiles, not a multiple of them
        gen = torch.Generator().manual_seed(0)

        def make(*size, positive=False):
            x = torch.rand(*size, generator=gen) if positive else torch.randn(*size, generator=gen)
            return x.to(device=device, dtype=shape.dtype)

        def differs(what, a, b):
            err, scale = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
            ok = err <= tol * (1 + scale)
            return None if ok else f"{what} differs from the torch path by {err:.3g} (of {scale:.3g})"

        with torch.inference_mode(False), torch.enable_grad():
            x = [make(B, H, T, D), make(B, Hkv, T, D), make(B, Hkv, T, Dv), make(B, H, T, F, positive=True)]
            x += [make(B, Hkv, T, F, positive=True), torch.full((H,), 0.3, device=device)]
            mask = torch.ones(B, T, dtype=torch.long, device=device)
            mask[1, :7] = 0
            opts = AttentionOptions(window=w, mode="hybrid", sinks=S, hybrid_sinks=shape.hybrid_sinks, chunk_size=16)
            rho = torch.linspace(0.01, 0.2, Hkv, device=device) if shape.la_decay else None
            for batch, attention_mask in (("unpadded", None), ("padded", mask)):
                results = []
                for f in (fn, chunk_hybrid_attention):
                    inputs = [t.detach().requires_grad_() for t in (*x, *([rho] if shape.la_decay else []))]
                    decay = inputs[6] if shape.la_decay else None
                    y = f(*inputs[:6], opts, attention_mask=attention_mask, initial_state=None, la_decay=decay)
                    results.append([y, *torch.autograd.grad(y.float().square().sum(), inputs)])
                names = ("output", "dq", "dk", "dv", "dphi_q", "dphi_k", "dgamma", "drho")
                for what, a, b in zip(names[: len(results[0])], *results, strict=True):  # (drho with a decay)
                    if (why := differs(f"{what} ({batch} batch)", a, b)) is not None:
                        return why
        if decode is not None:
            with torch.no_grad():
                fused = DecodeState.empty(shape, B, w, device)
                t0 = T - 20
                extend(fused, *(t[:, :, :t0] for t in x[:5]), x[5], opts, attention_mask=mask[:, :t0], la_decay=rho)
                ref = copy.deepcopy(fused)
                for t in range(t0, T):
                    token = [u[:, :, t : t + 1] for u in x[:5]]
                    got = decode(fused, *token, x[5], opts, attention_mask=None, la_decay=rho)
                    want = extend(ref, *token, x[5], opts, la_decay=rho)
                    if got is None or (why := differs(f"decode step {t}", got, want)) is not None:
                        return why or "the decode step declined a plain one-token step"
        return None


PART = HedgehogPart()
register_backend("naive", _naive, kind=HEDGEHOG.name)
register_backend("chunk", chunk_hybrid_attention, kind=HEDGEHOG.name)
register_check(HEDGEHOG.name, PART.check)
