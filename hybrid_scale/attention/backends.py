"""Backends of the hybrid attention entry point (hybrid.attend, HybridAttention.attend): a name -> function registry.

Registered here: "naive" (naive.naive_hybrid_attention, the O(T^2) spec) and "chunk" (chunked.chunk_hybrid_attention,
O(T (w + C)), fp32 state). A faster implementation, e.g. a Triton kernel, registers itself from its own module with
`register_backend("triton", fn)`; attention never imports it, so an exported model (these files copied next to a
modeling file) runs on the torch backends alone.

A backend is called with the tensors positionally and everything else by keyword:

    fn(q, k, v, fq, fk, gamma, *, window, mode, sinks, scale, attention_mask, chunk_size, return_denominators)

q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F], fk [B,Hkv,T,F], gamma [H] in (0,1), window >= 1, mode one of
naive.MODES, sinks S, scale (None = 1/sqrt(D)), attention_mask [B,T] or None (1 = token, 0 = padding), chunk_size (a
hint; a backend without chunks ignores it). It returns y [B,H,T,D] in q's dtype, or with return_denominators
(y, sum of E [B,H,T], sum of L [B,H,T]), and must equal the naive backend in outputs and gradients (DESIGN.md
section 7); what it cannot do it refuses with a ValueError.

This file imports only its siblings (the export copies it next to a modeling file).
"""

from __future__ import annotations

from collections.abc import Callable

from .chunked import chunk_hybrid_attention
from .naive import naive_hybrid_attention

BUILTIN = ("naive", "chunk")
_BACKENDS: dict[str, Callable] = {}


def _naive(q, k, v, fq, fk, gamma, *, chunk_size, **options):
    return naive_hybrid_attention(q, k, v, fq, fk, gamma, **options)  # the spec has no chunks


def register_backend(name: str, fn: Callable) -> Callable:
    """Make `fn` the backend called `name` (registering a name again replaces it; the built-ins cannot be)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an attention backend needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend '{name}' must be callable, got {type(fn).__name__}")
    if name in BUILTIN and name in _BACKENDS and _BACKENDS[name] is not fn:
        raise ValueError(f"attention backend '{name}' is built in and cannot be replaced; register another name")
    _BACKENDS[name] = fn
    return fn


def available() -> tuple[str, ...]:
    """Names of the registered backends, sorted."""
    return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> Callable:
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend '{name}'; available: {', '.join(available())}") from None


register_backend("naive", _naive)
register_backend("chunk", chunk_hybrid_attention)
