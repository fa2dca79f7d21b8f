"""The settings of one attention call, the same for every op: the spec (naive.py), the chunked torch form
(chunked.py), decoding (recurrent.py, delta_decode.py), the gated delta-rule hybrid (delta.py), the entry point
(hybrid.attend) and every registered backend (backends.py: the Triton kernels read it by attribute). An op takes its
tensors positionally, then one `AttentionOptions`; the optional tensors (attention_mask, initial_state, la_decay) are
keywords, because they are tensors and not settings.

    op(q, k, v, fq, fk, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None)

`AttentionOptions.of(opts, **settings)` is how an op reads its settings: the object it was given, or one made from
keywords (`op(..., window=16, mode="la_only")`, the tests' and notebooks' form), or the object with some replaced. No
op lists the settings: a new one is a field here, read where it matters.

This file imports only choices.py (the export copies it next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .settings import LA_COMBINES, MODES


@dataclass(frozen=True)
class AttentionOptions:
    window: int  # the softmax window w >= 1 (query n sees keys n - w < j <= n)
    mode: str = "hybrid"  # one of MODES (naive.py)
    sinks: int = 8  # S: the first S real tokens (swa_sinks, sinks_only; and the hybrid's own with hybrid_sinks)
    hybrid_sinks: bool = False  # hybrid mode: its softmax also covers the S sinks and its LA leaves them out
    scale: float | None = None  # of q.k; None = 1/sqrt(head dim)
    chunk_size: int = 64  # a hint: the chunked forms' chunk (a backend without chunks ignores it)
    la_combine: str = "normaliser"  # how a gated delta-rule LA joins the window (delta.py; Hedgehog ignores it)
    return_denominators: bool = False  # also return (sum of E, sum of L) [B,H,T]: the LA-share diagnostic

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown attention mode '{self.mode}'; available: {', '.join(MODES)}")
        if self.la_combine not in LA_COMBINES:
            raise ValueError(f"unknown attention.la_combine '{self.la_combine}'; available: {', '.join(LA_COMBINES)}")
        if int(self.window) < 1 or int(self.chunk_size) < 1 or int(self.sinks) < 0:
            raise ValueError(
                "attention needs window >= 1, chunk_size >= 1 and sinks >= 0, got "
                f"window={self.window}, chunk_size={self.chunk_size}, sinks={self.sinks}"
            )

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
