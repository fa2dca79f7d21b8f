"""The settings of one attention call, the same for every op: each part's spec, chunked form and decode step
(hedgehog/, gated_delta/), the entry point (layer.attend) and every registered backend (backends.py: the Triton
kernels read it by attribute). An op takes its
tensors positionally, then one `AttentionOptions`; the optional tensors (attention_mask, initial_state, la_decay) are
keywords, because they are tensors and not settings.

    op(q, k, v, fq, fk, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None)

`AttentionOptions.of(opts, **settings)` is how an op reads its settings: the object it was given, or one made from
keywords (`op(..., window=16, mode="la_only")`, the tests' and notebooks' form), or the object with some replaced. No
op lists the settings: a new one is a `call` setting of settings.py's record and a field here, read where it
matters.

The fields that are settings take their defaults and checks from settings.py's record (the ones marked `call`).
This file imports only settings.py (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .settings import SETTINGS, defaults, problems

CALL = {s.name for s in SETTINGS if s.call}  # the record's settings an op's options hold


_D = defaults()  # the record's defaults (settings.py): one default per setting, here as in the config


@dataclass(frozen=True)
class AttentionOptions:
    window: int  # the softmax window w >= 1 (query n sees keys n - w < j <= n): every op needs it given
    mode: str = _D["mode"]  # one of settings.MODES
    sinks: int = _D["sinks"]  # S: the first S real tokens (swa_sinks, sinks_only; and the hybrid's own)
    hybrid_sinks: bool = _D["hybrid_sinks"]  # hybrid mode: its softmax also covers the S sinks, its LA leaves them out
    scale: float | None = None  # of q.k; None = 1/sqrt(head dim) (the layer's own scaling: not a setting)
    chunk_size: int = _D["chunk_size"]  # a hint: the chunked forms' chunk (a backend without chunks ignores it)
    la_combine: str = _D["la_combine"]  # how a gated delta-rule LA joins the window (Hedgehog ignores it)
    cache: int = _D["cache"]  # exact keys per KV head beside the window (cache/; 0 = off)
    cache_select: str = _D["cache_select"]  # the score a key competes on for the cache (settings.CACHE_SELECTS)
    # the cache's size per KV head (a tuple of ints, attention.cache_heads=retrieval: the layer's cache_budget), or
    # None: `cache` for every head (which stays the heads' average)
    cache_budget: tuple | None = None
    return_denominators: bool = False  # also return (sum of E, sum of L) [B,H,T]: the LA-share diagnostic
    return_parts: bool = False  # also return each memory's weight {window, sinks, cache, la} [B,H,T] (cache/)

    def __post_init__(self):
        """The record's checks of the settings this call holds (settings.py), one ValueError naming the first."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, why in problems({k: v for k, v in given.items() if k in CALL}):
            raise ValueError(f"attention {name}: {why}")
        b = self.cache_budget
        if b is not None and (not isinstance(b, tuple) or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                                              for c in b)):  # fmt: skip
            raise ValueError(f"attention cache_budget: a tuple of ints >= 0 (keys per KV head), got {b!r}")

    @classmethod
    def of(cls, opts: AttentionOptions | None = None, /, **settings) -> AttentionOptions:
        """`opts` (with `settings` replacing its fields, if any), or the options the keywords `settings` name."""
        if opts is None:
            if "window" not in settings:
                raise TypeError("an attention op needs its AttentionOptions, or at least window=... as a keyword")
            return cls(**settings)
        if not isinstance(opts, cls):
            raise TypeError(f"an attention op's settings are an AttentionOptions, got {type(opts).__name__}")
        return replace(opts, **settings) if settings else opts

    @property
    def budget(self) -> int | tuple:
        """The cache's size per KV head: cache_budget where given, else `cache` for every head (cache/select.py's
        `budget`)."""
        return self.cache if self.cache_budget is None else self.cache_budget

    def own(self) -> AttentionOptions:
        """What a layer in this mode computes when its hybrid keeps its own sinks or not: hybrid_sinks only in hybrid
        mode, and the no-LA ablation of a hybrid with S sinks (swa_only) is its window plus the same S sinks
        (swa_sinks)."""
        if self.hybrid_sinks and self.mode == "swa_only":
            return replace(self, mode="swa_sinks", hybrid_sinks=False)
        if self.hybrid_sinks and self.mode != "hybrid":
            return replace(self, hybrid_sinks=False)
        return self

    @property
    def keeps_sinks(self) -> bool:
        """The softmax keeps the S sinks beside the window (swa_sinks, or a hybrid with its own)."""
        return self.mode == "swa_sinks" or (self.mode == "hybrid" and self.hybrid_sinks)
