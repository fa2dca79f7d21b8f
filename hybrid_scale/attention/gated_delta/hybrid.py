"""The hybrid with a gated delta-rule LA: its read-out joined to the window's softmax and the sinks.

Query n's LA reads the state of the keys that have left its window, S_(n-w) (lag w), so for n < w the layer is exact
softmax attention. Its keys are the layer's real tokens, minus the first S when the hybrid keeps its sinks (they are
softmax terms; the recurrence skips them: beta = 0, alpha = 1). With E_nj = exp(s q_n.k_j - c_n) over the window (and
the sinks), c_n their max, and has_n = 1 once the LA holds a key (n - w >= S, or n >= w without own sinks), as
`attention.la_combine` says:
  * normaliser: y_n = (sum E v + gamma_h has_n o_n) / (sum E + gamma_h has_n): the LA's read-out counts as gamma_h
    keys' worth of mass against the window's, whose largest term is 1 (one shared normaliser);
  * mix:        y_n = (1 - m_n has_n) y_soft + m_n has_n o_n, y_soft the window's softmax, m_n in (0, 1) a gate
    per query head from the hidden state.
Modes keep their meaning: la_only is o_n with lag 0 (the delta rule alone over the same keys), swa_only / swa_sinks /
sinks_only / none have no LA and are exactly the Hedgehog kind's. The LA share (balance report) is the LA's weight in
the output: gamma has / (sum E + gamma has) (normaliser), m has (mix).

The window's softmax terms are computed by the Hedgehog hybrid's forms with no features (its L terms are then 0):
one implementation of the window, exact in both kinds.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..hedgehog.chunk import chunk_hybrid_attention
from ..hedgehog.naive import masked_attention, naive_hybrid_attention
from ..options import AttentionOptions
from ..settings import LA_COMBINES
from ..window.chunk import gather_time, pack_real
from ..window.naive import EPS, compute_dtype, real_positions
from .chunk import chunk_gated_delta, lagged_delta
from .naive import DeltaGates, l2norm, recurrent_gated_delta

COMBINES = LA_COMBINES  # the values of attention.la_combine


def recurrence_gates(gates: DeltaGates, pos: torch.Tensor, *, sinks: int, hybrid_sinks: bool):
    """beta and g with the steps the recurrence skips set to the identity (beta = 0, g = 0): padding (pos < 0) and,
    when the hybrid keeps its sinks, the first S real tokens. pos [B,T] real-token index."""
    skip = (pos < 0) | ((pos < sinks) if hybrid_sinks else torch.zeros_like(pos, dtype=torch.bool))
    keep = (~skip)[:, None, :]
    return torch.where(keep, gates.beta, 0.0), torch.where(keep, gates.g, 0.0)


def has_past(pos: torch.Tensor, o: AttentionOptions) -> torch.Tensor:
    """[B,T] bool: the LA holds a key for this query (some real key j <= n - w outside the own sinks)."""
    return pos - o.window >= (o.sinks if o.hybrid_sinks else 0)


def combine(y_soft, den_soft, o, gamma, mix, has, *, how: str):
    """The hybrid's output from its softmax part (y_soft [B,H,T,Dv], its denominator den_soft [B,H,T]) and the LA's
    read-out o [B,H,T,Dv]; has [B,T] (or [B,H,T]: per head, with a cache). Returns (y, soft weight [B,H,T], LA
    weight [B,H,T]) (see the module doc)."""
    h = (has[:, None, :] if has.dim() == 2 else has).to(o.dtype)
    if how == "normaliser":
        lin = gamma.to(o.dtype).view(1, -1, 1) * h
        den = den_soft.to(o.dtype) + lin
        y = (y_soft.to(o.dtype) * den_soft.to(o.dtype)[..., None] + lin[..., None] * o) / (den[..., None] + EPS)
        return y, den_soft.to(o.dtype), lin
    if how == "mix":
        lam = mix.to(o.dtype) * h
        return (1 - lam)[..., None] * y_soft.to(o.dtype) + lam[..., None] * o, 1 - lam, lam
    raise ValueError(f"unknown attention.la_combine '{how}'; available: {', '.join(COMBINES)}")


def _soft_part(q, k, v, o: AttentionOptions, dense: bool):
    """The hybrid's softmax terms alone on unpadded input: (y_soft, sum of E), E = exp(a - c) (gamma 1) over the window
    and, with the own sinks, the first S tokens. The Hedgehog path's hybrid with all-zero features is exactly that."""
    B, H, T, _ = q.shape
    zq, zk = q.new_zeros(B, H, T, 1), k.new_zeros(B, k.shape[1], T, 1)
    ones = torch.ones(H, dtype=compute_dtype(q), device=q.device)
    soft = replace(o, mode="hybrid", return_denominators=True)
    if dense:
        pos = real_positions(None, B, T, q.device)
        y, den, _ = masked_attention(q, k, v, zq, zk, ones, pos, pos, soft)
    else:
        y, den, _ = chunk_hybrid_attention(q, k, v, zq, zk, ones, soft)
    return y, den


def delta_hybrid_attention(
    q, k, v, fq, fk, gamma, gates: DeltaGates, opts=None, *, attention_mask=None, impl=None, **settings
):
    """The hybrid with a gated delta-rule LA (module doc). q/k/v [B,*,T,D] after RoPE (the softmax part's),
    fq [B,H,T,Dk] and fk [B,Hkv,T,Dk] the delta rule's queries and keys (L2-normalised here), gamma [H] > 0
    (normaliser: the LA's mass), gates the per-token DeltaGates; impl the recurrence's implementation
    (naive.recurrent_gated_delta: the spec, beside a dense softmax; None = chunk.chunk_gated_delta, the WY chunks,
    beside the O(T (w + C)) softmax; or a registered one with their contract, e.g. fla's). Padding anywhere: each
    row's real tokens are moved to the front, computed, moved back (padded query rows give 0). Returns y [B,H,T,Dv]
    in q's dtype; with return_denominators (y, soft weight, LA weight), each [B,H,T] (module doc: the LA share is
    LA / (soft + LA)). opts: the call's AttentionOptions (options.py; or its fields as keywords); hybrid_sinks is the
    model's (its recurrence skips the sinks in every mode)."""
    o = AttentionOptions.of(opts, **settings)
    recurrence = chunk_gated_delta if impl is None else impl
    dense = recurrence is recurrent_gated_delta  # the spec: dense softmax beside the recurrent loop
    mode, window, sinks, hybrid_sinks = o.mode, o.window, o.sinks, o.hybrid_sinks
    B, H, T, _ = q.shape
    out_dtype, acc = q.dtype, compute_dtype(q)
    if mode not in ("hybrid", "la_only"):  # no LA: the Hedgehog kind's modes, the same math
        zq, zk = q.new_zeros(B, H, T, 1), k.new_zeros(B, k.shape[1], T, 1)
        if dense or o.return_denominators:
            return naive_hybrid_attention(q, k, v, zq, zk, gamma, o.own(), attention_mask=attention_mask)
        return chunk_hybrid_attention(q, k, v, zq, zk, gamma, o.own(), attention_mask=attention_mask)
    pos = real_positions(attention_mask, B, T, q.device)
    real = pos >= 0
    packed = attention_mask is not None and not bool(real.all())
    if packed:  # real tokens first (stable): positions are then 0..n-1 and padding trails
        order, inverse = pack_real(real)
        q, k, v, fq, fk = (gather_time(t, order) for t in (q, k, v, fq, fk))
        gates = DeltaGates(
            *(None if t is None else t.gather(2, order[:, None].expand(-1, t.shape[1], -1)) for t in gates)
        )
        pos = pos.gather(1, order)
    beta, g = recurrence_gates(gates, pos, sinks=sinks, hybrid_sinks=hybrid_sinks)
    lag = window if mode == "hybrid" else 0
    read = lagged_delta(
        l2norm(fq.to(acc)), l2norm(fk.to(acc)), v.to(acc), beta, g, lag=lag, impl=recurrence, chunk_size=o.chunk_size
    )
    if mode == "la_only":
        y, soft_w, lin_w = read, read.new_zeros(B, H, T), read.new_ones(B, H, T)
    else:
        y_soft, den_soft = _soft_part(q, k, v, o, dense)
        has = has_past(pos, o)
        y, soft_w, lin_w = combine(y_soft, den_soft, read, gamma, gates.mix, has, how=o.la_combine)
    if packed:
        y = gather_time(y, inverse)
        soft_w, lin_w = (t.gather(2, inverse[:, None].expand(-1, H, -1)) for t in (soft_w, lin_w))
    keep = (pos >= 0) if not packed else real
    y = torch.where(keep[:, None, :, None], y, 0.0).to(out_dtype)
    if o.return_denominators:
        return y, torch.where(keep[:, None], soft_w, 0.0), torch.where(keep[:, None], lin_w, 0.0)
    return y
