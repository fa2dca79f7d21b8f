"""The Hedgehog LA beside a cache (../cache/): its terms over the keys that have reached it, and its self-recall score.

With d_j a key's drop time (../cache/select.py) the LA of query n holds the candidates j with d_j <= n:
    L_nj = phi_q(q_n) . phi_k(k_j) alpha^(n - d_j)      (alpha^(n - w - j) without a cache: d_j = j + w)
    y_n = (gamma_h sum E v + sum L v) / (gamma_h sum E + sum L + EPS)
E the softmax terms over the sinks, the window and the cache (../cache/naive.py). The chunked form feeds the keys in
the order they reach the LA (slot d_j) to the chunked hybrid (chunk.py) as keys w steps earlier, whose LA then holds
exactly those with d_j <= n, weighted alpha^(n - d_j), with its softmax weighted 0.
Self-recall score of key j: ||v_j - sum_(first <= i < j) (phi_k(k_j).phi_k(k_i)) v_i / sum_(first <= i < j)
phi_k(k_j).phi_k(k_i)||: how badly the state of the keys before it predicts its value (the chunked hybrid with a
window of 1 and keys as queries computes the read-out).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.select import fold_order, gather_slots
from ..options import AttentionOptions
from ..window.naive import EPS, compute_dtype
from .chunk import chunk_hybrid_attention
from .naive import decay_weight


def _la_only(fq, fk, v, o, window, la_decay, *, sinks=0):
    """(num, den) of the chunked hybrid's LA alone: gamma 0 and zero softmax inputs (one column)."""
    B, H, T, _ = fq.shape
    zq, zk = fq.new_zeros(B, H, T, 1), fk.new_zeros(B, fk.shape[1], T, 1)
    opts = AttentionOptions(window=window, mode="hybrid", sinks=sinks, hybrid_sinks=sinks > 0, scale=1.0,
                            chunk_size=o.chunk_size, return_denominators=True)  # fmt: skip
    y, _, den = chunk_hybrid_attention(zq, zk, v, fq, fk, fq.new_zeros(H), opts, la_decay=la_decay)
    return y * (den + EPS)[..., None], den


def la_terms(fq, fk, v, drop, first, o, la_decay, *, dense):
    """(num [B,H,T,Dv], den [B,H,T]) of the LA over the keys that have reached it (module doc)."""
    B, H, T, _ = fq.shape
    K = fk.shape[1]
    G = H // K
    if dense:
        d = drop.repeat_interleave(G, 1)[:, :, None, :]
        n = torch.arange(T, device=fq.device)[:, None]
        j = torch.arange(T, device=fq.device)[None, :]
        lin = torch.where((j >= first) & (d <= n), fq @ fk.repeat_interleave(G, 1).transpose(-1, -2), 0.0)
        if la_decay is not None:
            rho = la_decay.to(lin.dtype).repeat_interleave(G).view(1, H, 1, 1)
            lin = lin * decay_weight(rho, n - d)
        return lin @ v.repeat_interleave(G, 1), lin.sum(-1)
    w = o.window
    slots = fold_order(drop)
    fk_s, v_s = (F.pad(gather_slots(t, slots)[:, :, w:], (0, 0, 0, min(w, T))) for t in (fk, v))
    return _la_only(fq, fk_s, v_s, o, w, la_decay)


def cached_join(x, gamma, o, soft, drop, first, *, la_decay=None, dense=False):
    """The hybrid's output from the softmax part (num, den, parts: ../cache/) and the LA: (y, {memory: weight})."""
    num, den, parts = soft
    acc = num.dtype
    fq, fk = x.fq.to(acc), x.fk.to(acc)
    n_la, d_la = la_terms(fq, fk, x.v.to(acc), drop, first, o, la_decay, dense=dense)
    g = gamma.to(acc).view(1, -1, 1)
    y = (g[..., None] * num + n_la) / (g * den + d_la + EPS)[..., None]
    return y, {name: g * w for name, w in parts.items()} | {"la": d_la}


def recall_scores(x, first, o, *, dense=False):
    """Each key's self-recall error [B,Hkv,T] (module doc), fp32."""
    acc = compute_dtype(x.fk)
    fk, v = x.fk.to(acc), x.v.to(acc)
    T = fk.shape[2]
    if dense:
        i = torch.arange(T, device=fk.device)
        before = (i[None, :] < i[:, None]) & (i[None, :] >= first)
        s = torch.where(before, fk @ fk.transpose(-1, -2), 0.0)
        pred = (s @ v) / (s.sum(-1, keepdim=True) + EPS)
    else:
        num, den = _la_only(fk, fk, v, o, 1, None, sinks=first)
        pred = num / (den + EPS)[..., None]
    return (v - pred).norm(dim=-1)


# the decode side (../cache/recurrent.py): the self_recall shadow, the LA's fold and its join, one token at a time


def decode_recall(state, v, fk, gates, take):
    """The self_recall score [B,Hkv] of the key leaving the window (v [B,Hkv,Dv], fk [B,Hkv,F]) from the shadow sums of
    every candidate before it (module doc); the shadow then takes it where `take` [B]."""
    acc = state.shadow_kv.dtype
    f, v = fk.to(acc), v.to(acc)
    num = torch.einsum("bhf,bhfv->bhv", f, state.shadow_kv)
    den = (f * state.shadow_ksum).sum(-1, keepdim=True)
    score = (v - num / (den + EPS)).norm(dim=-1)
    f = f * take[:, None, None].to(acc)
    state.shadow_kv.add_(f[..., :, None] * v[..., None, :])
    state.shadow_ksum.add_(f)
    return score


def decode_fold(state, v, fk, gates, fold, real, la_decay):
    """The LA state moves on to this step (a decay: alpha once on a real row) and takes the key that left the cache
    with weight 1 (fold [B,Hkv])."""
    acc = state.kv.dtype
    kv, ksum = state.kv, state.ksum
    if la_decay is not None:
        carry = decay_weight(la_decay.to(acc).view(1, -1), real.long()[:, None])  # [B, Hkv]
        kv, ksum = kv * carry[..., None, None], ksum * carry[..., None]
    f = fk.to(acc) * fold[..., None].to(acc)
    state.kv.copy_(kv + f[..., :, None] * v.to(acc)[..., None, :])
    state.ksum.copy_(ksum + f)


def decode_join(state, x, gamma, o, num, den):
    """y [B,Hkv,G,Dv] from the softmax part (num [B,Hkv,G,Dv], den [B,Hkv,G]) and the LA state's read-out, as
    cached_join joins them."""
    B, K, G, _ = num.shape
    fq = x.fq.to(num.dtype).view(B, K, G, -1)
    n_la = fq @ state.kv.to(num.dtype)
    d_la = (fq @ state.ksum.to(num.dtype)[..., None])[..., 0]
    g = gamma.to(num.dtype).view(1, K, G)
    return (g[..., None] * num + n_la) / (g * den + d_la + EPS)[..., None]


def prefill_la(state, x, drop, end, la_decay, *, chunk_size=None):
    """The LA state after step `end` ([B,1,1]: each row's last real token; x on real tokens first): the keys with
    d_j <= end, each weighted alpha^(end - d_j) (module doc)."""
    acc = state.kv.dtype
    fk, v = x.fk.to(acc), x.v.to(acc)
    w = (drop <= end).to(acc)  # [B, Hkv, T]
    if la_decay is not None:
        w = w * decay_weight(la_decay.to(acc).view(1, -1, 1), end - drop)
    f = fk * w[..., None]
    state.assign("kv", f.transpose(-1, -2) @ v)
    state.assign("ksum", f.sum(2))


def prefill_shadow(state, x, taken, *, chunk_size=None):
    """self_recall's shadow sums over the candidates `taken` [B,T] (those that have left the window)."""
    acc = state.shadow_kv.dtype
    f = x.fk.to(acc) * taken[:, None, :, None].to(acc)
    state.assign("shadow_kv", f.transpose(-1, -2) @ x.v.to(acc))
    state.assign("shadow_ksum", f.sum(2))


class SIDE:
    """This LA's side of the cache's decode (../cache/recurrent.py's `side`)."""

    decode_recall = staticmethod(decode_recall)
    decode_fold = staticmethod(decode_fold)
    decode_join = staticmethod(decode_join)
    prefill_la = staticmethod(prefill_la)
    prefill_shadow = staticmethod(prefill_shadow)
