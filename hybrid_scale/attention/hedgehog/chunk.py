"""Chunked hybrid attention: O(T (w + C)) time, equal to the naive spec in outputs and gradients.

Queries are processed in blocks of C. Block b (queries bC .. bC+C-1) needs
  * the keys bC-w+1 .. bC+C-1 densely: the softmax window of every query in the block, and the few keys that have
    already left some queries' windows (j <= n - w) but not the block's start;
  * the linear-attention state of keys j <= bC - w, which lie in P(n) of every query in the block.
Left-padding the key sequence with w-1 zeros aligns both: the dense span of block b is padded keys [bC, bC+w+C-1),
and the state of block b is the sum of the padded keys' chunks before chunk b (an exclusive cumsum over chunks).
The state is accumulated in fp32. With a decay (la_decay, rho per KV head) block b's state is kept as query bC sees it
(key j weighted alpha^(bC - w - j)), carried from block to block as S_(b+1) = alpha^C S_b + the chunk's keys weighted
alpha^(C - 1 - r); query bC + i takes it times alpha^i, and the dense span's L terms alpha^(n - w - j).
Padding anywhere in a row is handled by moving each row's real tokens to the front (stable), computing, and moving
the outputs back; padded query rows give exactly 0.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..options import AttentionOptions
from ..window.chunk import gather_time, pack_real, sinks_attention
from ..window.naive import EPS, compute_dtype, real_positions
from .naive import decay_weight


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the chunks before each chunk (dim 2)."""
    return torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1].cumsum(2)], dim=2)


GROUP_TOKENS = 4096  # queries processed together: bounds the working set so time stays linear in T


SCAN_GROUP = 16  # chunks per group of the decayed state scan: dense within a group, carried between groups


def _decayed_states(fk_c, v_c, rho, chunk):
    """Block states of a decayed LA: S_0 = 0, S_(b+1) = alpha^C S_b + sum_r alpha^(C-1-r) phi_k v^T over chunk b,
    i.e. S_b = sum_(c<b) alpha^((b-1-c) C) X_c. fk_c [B,Hkv,nb,C,F], v_c [B,Hkv,nb,C,D], rho [Hkv] ->
    (kv [B,Hkv,nb,F,D], ksum [B,Hkv,nb,F]). Within a group of SCAN_GROUP chunks the sum is one dense product with
    the decay weights (exponents stay below SCAN_GROUP * C * rho: they underflow to 0, never overflow); the groups'
    states are carried in a loop of nb / SCAN_GROUP steps."""
    B, Hkv, nb, C, Fd = fk_c.shape
    dev = fk_c.device
    r = torch.arange(chunk, device=dev)
    fk_w = fk_c * decay_weight(rho.view(-1, 1), chunk - 1 - r)[:, None, :, None]  # alpha^(C-1-r)
    L = min(SCAN_GROUP, nb)
    ng = -(-nb // L)
    i = torch.arange(L, device=dev)
    lag = (i[:, None] - 1 - i[None, :]).clamp(min=0) * chunk  # (b - 1 - c) C within a group
    w = torch.where(i[None, :] < i[:, None], decay_weight(rho.view(-1, 1, 1), lag), 0.0)  # [Hkv, L, L]
    tail = decay_weight(rho.view(-1, 1), (L - 1 - i) * chunk)  # a group's chunks as its end sees them
    carry = decay_weight(rho, torch.tensor(L * chunk, device=dev)).view(1, -1, 1)
    into = decay_weight(rho.view(-1, 1), i * chunk)[None, :, None, :, None]  # chunk i sees its group's start state

    def scan(x):  # [B, Hkv, nb, E] chunk sums -> [B, Hkv, nb, E] states
        x = F.pad(x, (0, 0, 0, ng * L - nb)).view(B, Hkv, ng, L, -1)
        inner = torch.einsum("hbc,zhgce->zhgbe", w, x)  # the chunks before b in b's own group
        total = torch.einsum("hc,zhgce->zhge", tail, x)
        starts = [torch.zeros_like(total[:, :, 0])]  # the state at each group's first chunk
        for t in total.unbind(2)[:-1]:
            starts.append(torch.addcmul(t, carry, starts[-1]))
        return (inner + into * torch.stack(starts, 2)[:, :, :, None]).reshape(B, Hkv, ng * L, -1)[:, :, :nb]

    kv = scan(torch.einsum("bhncf,bhncd->bhnfd", fk_w, v_c).reshape(B, Hkv, nb, -1))
    return kv.reshape(B, Hkv, nb, Fd, -1), scan(fk_w.sum(3))


def _windowed(q, k, v, fq, fk, gamma, o: AttentionOptions, *, scale, state, rho=None):
    """hybrid / swa_only / swa_sinks / la_only on unpadded rows. q [B,Hkv,G,T,D], fq [B,Hkv,G,T,F],
    k/v/fk [B,Hkv,T,*]; scale resolved. In swa_sinks, or the hybrid with its sinks (o.keeps_sinks), the first
    o.sinks keys that have left a query's window join its softmax (gamma weights them as it weights the window); the
    hybrid's LA then leaves them out (the caller zeroes their phi_k, and an initial state holds no sink). rho [Hkv]:
    the LA's decay (an initial state is then as query w-1 sees it)."""
    T, window, mode, chunk, parts = q.shape[-2], o.window, o.mode, o.chunk_size, o.return_denominators
    w = min(window, T)  # a window >= T makes P(n) empty: identical to w = T
    nb = -(-T // chunk)
    Tp = nb * chunk
    span = w + chunk - 1
    softmax, linear = mode in ("hybrid", "swa_only", "swa_sinks"), mode in ("hybrid", "la_only")
    S = min(o.sinks, T) if o.keeps_sinks else 0

    def blocks(x):  # [..., T, d] -> [..., nb, C, d]
        x = F.pad(x, (0, 0, 0, Tp - T))
        return x.reshape(*x.shape[:-2], nb, chunk, x.shape[-1])

    def spans(x):  # [B,Hkv,T,d] -> [B,Hkv,nb,span,d] (a view); padded keys, block b covers [bC, bC+span)
        x = F.pad(x, (0, 0, w - 1, Tp - T))
        return x.unfold(2, span, chunk).transpose(-1, -2)

    qb, fqb, ks, vs = blocks(q), blocks(fq), spans(k), spans(v)
    i = torch.arange(chunk, device=q.device)[:, None]
    s = torch.arange(span, device=q.device)[None, :]
    d = s - i  # key j = n + d - (w - 1): in the window iff 0 <= d <= w-1, left it iff d < 0
    exists = torch.arange(nb, device=q.device)[:, None, None] * chunk - (w - 1) + s >= 0  # [nb, 1, span]
    soft_ok = (d >= 0) & (d <= w - 1)
    lin_ok = (d < 0) if mode == "hybrid" else (d <= w - 1)
    if S:  # sink key j counts for query n once it has left the window: j <= n - w
        n_abs = torch.arange(nb, device=q.device)[:, None, None] * chunk + i[None]  # [nb, C, 1]
        sink_ok = torch.arange(S, device=q.device)[None, None, :] <= n_abs - w  # [nb, C, S]
        k_sink, v_sink = k[:, :, :S], v[:, :, :S]
    if linear:
        fks = spans(fk)
        # state of block b: padded keys [0, bC), i.e. real keys j <= bC - w; exclusive cumsum over chunks
        fk_c = F.pad(fk, (0, 0, w - 1, Tp))[:, :, :Tp].reshape(*fk.shape[:2], nb, chunk, -1)
        v_c = F.pad(v, (0, 0, w - 1, Tp))[:, :, :Tp].reshape(*v.shape[:2], nb, chunk, -1)
        if rho is not None:
            kv, ksum = _decayed_states(fk_c, v_c, rho, chunk)
            rho6 = rho.view(1, -1, 1, 1, 1, 1)
            lag_in = decay_weight(rho6, i.view(1, 1, 1, 1, chunk, 1))  # query bC + i sees block b's state
            span_w = decay_weight(rho6, -d - 1)  # L term of key j = n + d - (w - 1): alpha^(n - w - j)
        else:
            kv = _exclusive_cumsum(torch.einsum("bhncf,bhncd->bhnfd", fk_c, v_c))
            ksum = _exclusive_cumsum(fk_c.sum(3))
        if state is not None and rho is None:
            kv = kv + state[0].to(kv.dtype)[:, :, None]
            ksum = ksum + state[1].to(ksum.dtype)[:, :, None]

    outs, soft_den, lin_den = [], [], []
    step = max(1, GROUP_TOKENS // chunk)
    for g0 in range(0, nb, step):
        sl = slice(g0, g0 + step)
        qg, fqg, vg = qb[:, :, :, sl], fqb[:, :, :, sl], vs[:, :, sl]
        num = torch.zeros_like(qg[..., : v.shape[-1]])
        den = torch.zeros_like(qg[..., :1])
        den_soft = den
        if softmax:
            ok = exists[sl] & soft_ok
            a = scale * torch.einsum("bhgncd,bhnsd->bhgncs", qg, ks[:, :, sl])
            c = torch.where(ok, a, float("-inf")).amax(-1, keepdim=True)
            if S:  # one max over the window and the sinks: a single softmax
                a_sink = scale * torch.einsum("bhgncd,bhsd->bhgncs", qg, k_sink)
                c = torch.maximum(c, torch.where(sink_ok[sl], a_sink, float("-inf")).amax(-1, keepdim=True))
            c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
            e = gamma.view(*gamma.shape, 1, 1, 1) * torch.exp(torch.where(ok, a - c, float("-inf")))
            num = num + torch.einsum("bhgncs,bhnsd->bhgncd", e, vg)
            den = den + e.sum(-1, keepdim=True)
            if S:
                e_sink = gamma.view(*gamma.shape, 1, 1, 1) * torch.exp(
                    torch.where(sink_ok[sl], a_sink - c, float("-inf"))
                )
                num = num + torch.einsum("bhgncs,bhsd->bhgncd", e_sink, v_sink)
                den = den + e_sink.sum(-1, keepdim=True)
            den_soft = den
        if linear:
            scores = torch.einsum("bhgncf,bhnsf->bhgncs", fqg, fks[:, :, sl])
            if rho is None:
                lin = torch.where(exists[sl] & lin_ok, scores, 0.0)
                num = num + torch.einsum("bhgncs,bhnsd->bhgncd", lin, vg)
                den = den + lin.sum(-1, keepdim=True)
                num = num + torch.einsum("bhgncf,bhnfd->bhgncd", fqg, kv[:, :, sl])
                den = den + torch.einsum("bhgncf,bhnf->bhgnc", fqg, ksum[:, :, sl]).unsqueeze(-1)
            else:
                lin = scores * torch.where(exists[sl] & lin_ok, span_w, 0.0)  # (one pass: the mask in the weights)
                d_num, d_den = _decayed_terms(
                    lin, fqg, vg, kv[:, :, sl], ksum[:, :, sl], lag_in, rho=rho, state=state, sl=sl, chunk=chunk,
                    window=window,
                )  # fmt: skip
                num, den = num + d_num, den + d_den
        outs.append(num / (den + EPS))
        if parts:
            soft_den.append(den_soft)
            lin_den.append(den - den_soft)

    def unblock(chunks):
        y = torch.cat(chunks, dim=3)
        return y.reshape(*y.shape[:3], Tp, y.shape[-1])[..., :T, :]

    if parts:
        return unblock(outs), unblock(soft_den)[..., 0], unblock(lin_den)[..., 0]
    return unblock(outs)


def _decayed_terms(lin, fqg, vg, kv, ksum, lag_in, *, rho, state, sl, chunk, window):
    """The decayed LA's numerator and denominator for one group of blocks: the dense span's L terms (lin, already
    weighted alpha^(n - w - j)), the block states (as each block's first query sees them) times alpha^i for query
    bC + i, and an initial state (as query w-1 sees it) times alpha^(n - w + 1)."""
    fq_in = fqg * lag_in
    s_num = torch.einsum("bhgncf,bhnfd->bhgncd", fq_in, kv)
    s_den = torch.einsum("bhgncf,bhnf->bhgnc", fq_in, ksum).unsqueeze(-1)
    if state is not None:
        n = torch.arange(sl.start * chunk, sl.start * chunk + fqg.shape[3] * chunk, device=fqg.device)
        lag = decay_weight(rho.view(1, -1, 1, 1, 1, 1), (n - (window - 1)).view(1, 1, 1, -1, chunk, 1))
        fq_lag = fqg * lag
        s_num = s_num + torch.einsum("bhgncf,bhfd->bhgncd", fq_lag, state[0].to(fqg.dtype))
        s_den = s_den + torch.einsum("bhgncf,bhf->bhgnc", fq_lag, state[1].to(fqg.dtype)).unsqueeze(-1)
    return torch.einsum("bhgncs,bhnsd->bhgncd", lin, vg) + s_num, lin.sum(-1, keepdim=True) + s_den


def chunk_hybrid_attention(
    q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, initial_state=None, la_decay=None, **settings
):
    """Same contract as naive.naive_hybrid_attention, plus chunk_size and an optional initial LA state
    (kv [B,Hkv,F,D], k [B,Hkv,F]) of keys that precede the sequence by more than the window (decode extension; with
    hybrid_sinks it must hold no sink, and the sequence must start at real token 0; with la_decay it is as query w-1
    of the sequence sees it), and la_decay (rho [Hkv], the LA's decay).
    With return_denominators (hybrid / swa_only / la_only / none, no padding): (y, sum of E [B,H,T], sum of L
    [B,H,T]), the two parts of the shared normaliser, for the LA-share diagnostic."""
    o = AttentionOptions.of(opts, **settings)
    mode, sinks, return_denominators = o.mode, o.sinks, o.return_denominators
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if mode == "none" or T == 0:
        y = q.new_zeros(B, H, T, v.shape[-1])
        if return_denominators:  # nothing attended: both parts are 0
            zero = q.new_zeros(B, H, T, dtype=compute_dtype(q))
            return y, zero, zero.clone()
        return y
    out_dtype = q.dtype
    scale = 1.0 / math.sqrt(D) if o.scale is None else o.scale
    real = real_positions(attention_mask, B, T, q.device) >= 0
    packed = attention_mask is not None and not bool(real.all())
    acc = compute_dtype(q)
    q, k, v, fq, fk = (t.to(acc) for t in (q, k, v, fq, fk))
    if packed:
        order, inverse = pack_real(real)
        q, k, v, fq, fk = (gather_time(t, order) for t in (q, k, v, fq, fk))
    q = q.reshape(B, Hkv, H // Hkv, T, D)
    fq = fq.reshape(B, Hkv, H // Hkv, T, fq.shape[-1])
    if return_denominators and (packed or mode in ("sinks_only", "swa_sinks")):
        raise ValueError("return_denominators needs an unpadded input in hybrid, swa_only or la_only mode")
    if mode == "sinks_only":
        y = sinks_attention(q, k, v, sinks, scale)
    else:
        g = gamma.to(q.dtype).view(Hkv, H // Hkv)
        if mode == "swa_sinks":  # no L: plain softmax, gamma does not enter (as in naive)
            g = torch.ones_like(g)
        if mode == "hybrid" and o.hybrid_sinks:  # the sinks are E terms, never L terms (real tokens come first here)
            fk = torch.cat([torch.zeros_like(fk[:, :, :sinks]), fk[:, :, sinks:]], 2)
        rho = la_decay.to(q.dtype) if la_decay is not None and mode in ("hybrid", "la_only") else None
        y = _windowed(q, k, v, fq, fk, g, o, scale=scale, state=initial_state, rho=rho)
        if return_denominators:
            y, den_soft, den_lin = y
            return (y.reshape(B, H, T, -1).to(out_dtype), den_soft.reshape(B, H, T), den_lin.reshape(B, H, T))
    y = y.reshape(B, H, T, -1)
    if packed:
        y = gather_time(y, inverse)
        y = torch.where(real[:, None, :, None], y, 0.0)
    return y.to(out_dtype)
