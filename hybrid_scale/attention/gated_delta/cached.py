"""The gated delta-rule LA beside a cache (../cache/): its recurrence over the keys in the order they reach it, and
its self-recall score.

Slot s of the recurrence folds the key j with d_j = s (../cache/select.py: at most one a step), with its own write
strength beta_j and forget gate g_j; a slot that folds nothing leaves the state as it is (beta = 0, g = 0). Without a
cache slot s folds key s - w: the lagged read-out of hybrid.py. Query n reads the state after slot n, o_n = S_n^T q_n,
and joins it to the softmax over the sinks, the window and the cache as hybrid.combine says (has_n: the state holds
a key, per KV head).
Self-recall score of key j: ||v_j - alpha_j S_(j-1)^T k_j||, the delta rule's own residual at j over the candidates
before it in their order (the state the key would be written into if nothing were cached).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch

from ..cache.select import fold_order, gather_slots
from ..window.naive import EPS, compute_dtype
from .chunk import chunk_gated_delta, lagged_delta
from .hybrid import combine, recurrence_gates
from .naive import l2norm


def cached_join(x, gamma, o, soft, drop, first, *, impl, la_decay=None, dense=False):
    """The hybrid's output from the softmax part (num, den, parts: ../cache/) and the LA: (y, {memory: weight})."""
    num, den, parts = soft
    acc = num.dtype
    B, H, T, _ = num.shape
    K = x.k.shape[1]
    slots = fold_order(drop)
    beta, g = (gather_slots(t.to(acc)[..., None], slots)[..., 0] for t in (x.gates.beta, x.gates.g))
    k_s, v_s = gather_slots(l2norm(x.fk.to(acc)), slots), gather_slots(x.v.to(acc), slots)
    read = lagged_delta(l2norm(x.fq.to(acc)), k_s, v_s, beta, g, lag=0, impl=impl, chunk_size=o.chunk_size)
    has = (slots >= 0).to(torch.int8).cummax(-1).values.bool().repeat_interleave(H // K, 1)
    y_soft = num / (den[..., None] + EPS)
    y, soft_w, la_w = combine(y_soft, den, read, gamma, x.gates.mix, has, how=o.la_combine)
    share = soft_w / (den + EPS)
    return y, {name: share * w for name, w in parts.items()} | {"la": la_w}


def recall_scores(x, first, o, *, impl):
    """Each key's self-recall error [B,Hkv,T] (module doc), fp32."""
    acc = compute_dtype(x.fk)
    kk, v = l2norm(x.fk.to(acc)), x.v.to(acc)
    T = kk.shape[2]
    pos = torch.arange(T, device=kk.device).expand(kk.shape[0], T)
    beta, g = recurrence_gates(x.gates, pos, sinks=first, hybrid_sinks=True)
    beta, g = beta.to(acc), g.to(acc)
    pred = lagged_delta(kk, kk, v, beta, g, lag=1, impl=impl, chunk_size=o.chunk_size)
    return (v - g.exp()[..., None] * pred).norm(dim=-1)


# the decode side (../cache/recurrent.py): the self_recall shadow, the LA's fold and its join, one token at a time


def _delta_step(S, kk, v, beta, g):
    """One step of the delta rule: S [B,Hkv,Dk,Dv] decayed by exp(g), then written with key kk (normalised), value v
    and strength beta ([B,Hkv] each)."""
    S = S * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", kk, S))
    return S + kk[..., :, None] * u[..., None, :]


def decode_recall(state, v, fk, gates, take):
    """The self_recall score [B,Hkv] of the key leaving the window (v, fk unnormalised, gates [B,Hkv,2]: beta, g) from
    the shadow state of every candidate before it (module doc); the shadow then takes it where `take` [B]."""
    acc = state.shadow_kv.dtype
    kk, v, gates = l2norm(fk.to(acc)), v.to(acc), gates.to(acc)
    S = state.shadow_kv
    score = (v - gates[..., 1].exp()[..., None] * torch.einsum("bhk,bhkv->bhv", kk, S)).norm(dim=-1)
    bg = gates * take[:, None, None].to(acc)
    state.shadow_kv.copy_(_delta_step(S, kk, v, bg[..., 0], bg[..., 1]))
    return score


def decode_fold(state, v, fk, gates, fold, real, la_decay):
    """The key that left the cache (fold [B,Hkv]) is run into the LA state with its own beta and g."""
    acc = state.kv.dtype
    bg = gates.to(acc) * fold[..., None].to(acc)
    state.kv.copy_(_delta_step(state.kv, l2norm(fk.to(acc)), v.to(acc), bg[..., 0], bg[..., 1]))
    if state.la_has.shape[1]:  # (kept with a cache)
        state.la_has.logical_or_(fold)


def decode_join(state, x, gamma, o, num, den):
    """y [B,Hkv,G,Dv] from the softmax part (num [B,Hkv,G,Dv], den [B,Hkv,G]) and the state's read-out, as
    cached_join joins them (has: the LA holds a key)."""
    B, K, G, Dv = num.shape
    acc = num.dtype
    qn = l2norm(x.fq.to(acc)).view(B, K, G, -1)
    read = (qn @ state.kv.to(acc)).reshape(B, K * G, 1, Dv)
    has = state.la_has[:, :, None].expand(B, K, G).reshape(B, K * G, 1)
    mix = None if x.gates.mix is None else x.gates.mix
    y_soft = (num / (den[..., None] + EPS)).reshape(B, K * G, 1, Dv)
    y = combine(y_soft, den.reshape(B, K * G, 1), read, gamma, mix, has, how=o.la_combine)[0]
    return y.view(B, K, G, Dv)


def _final_state(kk, v, beta, g, chunk_size):
    """The delta rule's state after running keys kk (normalised) [B,Hkv,T,Dk] through it from 0."""
    B, K, T, D = kk.shape
    return chunk_gated_delta(kk.new_zeros(B, K, T, D), kk, v, beta, g, chunk_size=chunk_size or 64)[1]


def prefill_la(state, x, drop, end, la_decay, *, chunk_size=None):
    """The LA state after step `end` ([B,1,1]: each row's last real token; x on real tokens first): the keys with
    d_j <= end run through the delta rule in the order they left the cache, each with its own beta and g."""
    acc = state.kv.dtype
    slots = fold_order(drop)
    T = slots.shape[-1]
    slots = torch.where(torch.arange(T, device=slots.device) <= end, slots, -1)
    beta, g = (gather_slots(t.to(acc)[..., None], slots)[..., 0] for t in (x.gates.beta, x.gates.g))
    kk, v = gather_slots(l2norm(x.fk.to(acc)), slots), gather_slots(x.v.to(acc), slots)
    state.assign("kv", _final_state(kk, v, beta, g, chunk_size))
    if state.la_has.shape[1]:
        state.assign("la_has", (slots >= 0).any(-1))


def prefill_shadow(state, x, taken, *, chunk_size=None):
    """self_recall's shadow state: the candidates `taken` [B,T] (those that have left the window) in position order."""
    acc = state.shadow_kv.dtype
    keep = taken[:, None].to(acc)
    beta, g = x.gates.beta.to(acc) * keep, x.gates.g.to(acc) * keep
    state.assign("shadow_kv", _final_state(l2norm(x.fk.to(acc)), x.v.to(acc), beta, g, chunk_size))


class SIDE:
    """This LA's side of the cache's decode (../cache/recurrent.py's `side`)."""

    decode_recall = staticmethod(decode_recall)
    decode_fold = staticmethod(decode_fold)
    decode_join = staticmethod(decode_join)
    prefill_la = staticmethod(prefill_la)
    prefill_shadow = staticmethod(prefill_shadow)
