"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) as the hybrid's second kind of linear part
(`attention.la_kind: gated_delta`): the spec (a recurrent loop), the chunked torch form (WY representation), and the
hybrid that joins it with the window and the sinks.

Per KV head, on L2-normalised keys k_t (and queries q_t, per query head: a group of queries reads its KV head's state),
with a write strength beta_t in (0, 1) and a forget gate alpha_t = exp(g_t) in (0, 1], both from the hidden state:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T        (S [Dk, Dv], fp32)
    o_t = S_t^T q_t                                                         (no 1/sqrt(d): a matching key returns v)

It writes v - S k: a key's stored value is replaced, not blurred. The state is Dk x Dv per KV head, constant in the
length.

How it joins the window (docs/design.md §2; `attention.la_combine`). Query n's LA reads the state of the keys that
have left its window, S_(n-w) (lag w), so for n < w the layer is exact softmax attention. Its keys are the layer's
real tokens, minus the first S when the hybrid keeps its sinks (they are softmax terms; the recurrence skips them:
beta = 0, alpha = 1). With E_nj = exp(s q_n.k_j - c_n) over the window (and the sinks), c_n their max, and
has_n = 1 once the LA holds a key (n - w >= S, or n >= w without own sinks):
  * normaliser: y_n = (sum E v + gamma_h has_n o_n) / (sum E + gamma_h has_n): the LA's read-out counts as gamma_h
    keys' worth of mass against the window's, whose largest term is 1 (one shared normaliser);
  * mix:        y_n = (1 - m_n has_n) y_soft + m_n has_n o_n, y_soft the window's softmax, m_n in (0, 1) a gate
    per query head from the hidden state.
Modes keep their meaning: la_only is o_n with lag 0 (the delta rule alone over the same keys), swa_only / swa_sinks /
sinks_only / none have no LA and are exactly the Hedgehog kind's (naive.py). The LA share (balance report) is the LA's
weight in the output: gamma has / (sum E + gamma has) (normaliser), m has (mix).

This file imports only torch and its siblings (the export copies it next to a modeling file).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .backends import delta_impl
from .choices import LA_COMBINES
from .chunked import chunk_hybrid_attention, gather_time, pack_real
from .naive import EPS, compute_dtype, masked_attention, naive_hybrid_attention, real_positions
from .options import AttentionOptions

COMBINES = LA_COMBINES  # the values of attention.la_combine


class DeltaGates(NamedTuple):
    """The gated delta rule's per-token gates: beta [B,Hkv,T] in (0, 1) (write strength), g [B,Hkv,T] <= 0 (log of
    the forget gate alpha), mix [B,H,T] in (0, 1) or None (la_combine=mix: the LA's weight per query head)."""

    beta: torch.Tensor
    g: torch.Tensor
    mix: torch.Tensor | None = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim (fla's l2norm: x * rsqrt(sum x^2 + eps))."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B,H,T,D] -> [B,Hkv,G,T,D]."""
    B, H, T, D = q.shape
    return q.reshape(B, kv_heads, H // kv_heads, T, D)


def recurrent_gated_delta(q, k, v, beta, g, *, initial_state=None):
    """The spec: the recurrence above, one token at a time. q [B,H,T,Dk] (already normalised), k [B,Hkv,T,Dk],
    v [B,Hkv,T,Dv], beta/g [B,Hkv,T], initial_state [B,Hkv,Dk,Dv] or None. Returns (o [B,H,T,Dv], S_T) in fp32
    (fp64 for fp64 inputs)."""
    acc = compute_dtype(q)
    B, Hkv, T, Dk = k.shape
    qg = _grouped(q.to(acc), Hkv)
    k, v, beta, g = (t.to(acc) for t in (k, v, beta, g))
    S = k.new_zeros(B, Hkv, Dk, v.shape[-1]) if initial_state is None else initial_state.to(acc)
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., :, None] * u[..., None, :]
        out.append(torch.einsum("bhgk,bhkv->bhgv", qg[:, :, :, t], S))
    o = torch.stack(out, dim=3) if out else qg.new_zeros(*qg.shape[:3], 0, v.shape[-1])
    return o.reshape(B, -1, T, v.shape[-1]), S


def chunk_gated_delta(q, k, v, beta, g, *, initial_state=None, chunk_size=64):
    """The same recurrence in chunks of C (the WY representation, fp32): within a chunk, with b_t the cumulative log
    gate and D_ts = exp(b_t - b_s) for s <= t,
        (I + diag(beta) A) U = diag(beta) (V - diag(exp b) K S_0),  A_ts = D_ts k_t.k_s (s < t): a triangular solve,
        O = diag(exp b) Q S_0 + (D * Q K^T) U,   S_C = exp(b_C) S_0 + (K * exp(b_C - b))^T U,
    carried from chunk to chunk. Same arguments and result as recurrent_gated_delta; differentiable (autograd through
    the solve), equal to the spec in outputs and gradients."""
    acc = compute_dtype(q)
    B, Hkv, T, Dk = k.shape
    Dv, C = v.shape[-1], int(chunk_size)
    qg = _grouped(q.to(acc), Hkv)
    G = qg.shape[2]
    k, v, beta, g = (t.to(acc) for t in (k, v, beta, g))
    S = k.new_zeros(B, Hkv, Dk, Dv) if initial_state is None else initial_state.to(acc)
    pad = (-T) % C
    if pad:  # beta = 0, g = 0: the padded steps leave the state as it is
        k, v, qg = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(qg, (0, 0, 0, pad))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (T + pad) // C
    k, v = k.view(B, Hkv, n, C, Dk), v.view(B, Hkv, n, C, Dv)
    qg = qg.view(B, Hkv, G, n, C, Dk)
    beta, b = beta.view(B, Hkv, n, C), g.view(B, Hkv, n, C).cumsum(-1)
    tri = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = tri & ~torch.eye(C, dtype=torch.bool, device=k.device)  # s < t
    diff = b[..., :, None] - b[..., None, :]  # b_t - b_s [B,Hkv,n,C,C]
    decay = torch.exp(torch.where(tri, diff, float("-inf")))  # D_ts, 0 above the diagonal (never overflows)
    kk = k @ k.transpose(-1, -2)
    A = torch.where(strict, decay * kk, 0.0)
    eye = torch.eye(C, dtype=acc, device=k.device)
    lhs = eye + beta[..., :, None] * A
    # U = T diag(beta) V and W = T diag(beta exp b) K with T = (I + diag(beta) A)^-1: one unit-lower-triangular solve
    rhs = torch.cat([beta[..., None] * v, (beta * b.exp())[..., None] * k], dim=-1)
    UW = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :Dv], UW[..., Dv:]
    qk = torch.einsum("bhgncd,bhnsd->bhgncs", qg, k) * decay[:, :, None]
    outs = []
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ S  # this chunk's new values given the state it starts from
        o = torch.einsum("bhgc,bhgcd,bhdv->bhgcv", b[:, :, None, c].exp(), qg[:, :, :, c], S)
        outs.append(o + torch.einsum("bhgcs,bhsv->bhgcv", qk[:, :, :, c], u))
        last = b[:, :, c, -1:]
        S = last.exp()[..., None] * S + (k[:, :, c] * (last - b[:, :, c]).exp()[..., None]).transpose(-1, -2) @ u
    o = torch.stack(outs, dim=3).reshape(B, Hkv * G, n * C, Dv)[:, :, :T]
    return o, S


_FLA_CHECKED: dict[str, str | None] = {}  # device -> None when fla's kernel matched the chunked form there, else why


def fla_usable(device: torch.device) -> bool:
    """Whether fla-core's kernel (registered by hybrid_scale_kernels as the gated-delta implementation "fla":
    backends.delta_impl; attention never imports fla) agrees with the chunked torch form on `device` (a forward and
    every gradient on a small input, once per device); on a failure a warning says why and the torch form is used.
    fla-core 0.6.0 is known to fail the backward on Hopper with triton < 3.7.1 when gates are passed: this check
    catches that."""
    key = str(device)
    if key not in _FLA_CHECKED:
        fn = delta_impl("fla")
        _FLA_CHECKED[key] = "hybrid_scale_kernels did not register it" if fn is None else _fla_self_check(fn, device)
        if _FLA_CHECKED[key] is not None:
            import warnings

            warnings.warn(f"fla's chunk_gated_delta_rule is not used on {key} ({_FLA_CHECKED[key]}); the chunked "
                          "torch form runs instead", stacklevel=3)  # fmt: skip
    return _FLA_CHECKED[key] is None


def _fla_self_check(fla, device: torch.device) -> str | None:
    """None when `fla` (the registered implementation) equals chunk_gated_delta on `device`, else what differed."""
    try:
        gen = torch.Generator().manual_seed(0)
        B, H, Hkv, T, D = 1, 4, 2, 150, 64
        x = [l2norm(torch.randn(B, H, T, D, generator=gen)), l2norm(torch.randn(B, Hkv, T, D, generator=gen)),
             torch.randn(B, Hkv, T, D, generator=gen), torch.rand(B, Hkv, T, generator=gen),
             -0.1 * torch.rand(B, Hkv, T, generator=gen)]  # fmt: skip
        results = []
        for fn in (fla, chunk_gated_delta):
            with torch.enable_grad():
                leaves = [t.to(device).requires_grad_() for t in x]
                o, S = fn(*leaves)
                results.append([o, S, *torch.autograd.grad(o.square().sum() + S.square().sum(), leaves)])
        for what, a, b in zip(("output", "state", "dq", "dk", "dv", "dbeta", "dg"), *results, strict=True):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            if not err <= 1e-2 * (1 + scale):
                return f"{what} differs by {err:.3g} (of {scale:.3g})"
    except Exception as e:  # noqa: BLE001  (not installed, no driver, a kernel that fails: reported, not raised)
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return None


IMPLS = {"naive": recurrent_gated_delta, "chunk": chunk_gated_delta}


def lagged_delta(q, k, v, beta, g, *, lag, initial_state=None, impl="chunk", chunk_size=64):
    """o_i = S^T q_i with S the state after keys 0..i-lag (the state before them, initial_state, for i < lag): the
    hybrid's read-out (lag = the window) or the LA alone (lag 0). Runs the recurrence with queries moved lag steps
    earlier. Returns o [B,H,T,Dv] (fp32)."""
    T = q.shape[2]
    fn = IMPLS[impl]
    if impl == "chunk" and q.is_cuda and fla_usable(q.device):  # fla-core's kernel where it runs and agrees
        fn = delta_impl("fla")
    opts = {"chunk_size": chunk_size} if impl != "naive" else {}
    if lag == 0:
        return fn(q, k, v, beta, g, initial_state=initial_state, **opts)[0]
    early = F.pad(q[:, :, lag:], (0, 0, 0, min(lag, T)))  # query i + lag asked at step i
    o = fn(early, k, v, beta, g, initial_state=initial_state, **opts)[0]
    head = q[:, :, : min(lag, T)].to(o.dtype)
    if initial_state is None:
        first = torch.zeros_like(o[:, :, : head.shape[2]])
    else:
        first = torch.einsum("bhgtk,bhkv->bhgtv", _grouped(head, k.shape[1]), initial_state.to(o.dtype))
        first = first.reshape(*head.shape[:3], -1)
    return torch.cat([first, o[:, :, : T - head.shape[2]]], dim=2)


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
    read-out o [B,H,T,Dv]; has [B,T]. Returns (y, soft weight [B,H,T], LA weight [B,H,T]) (see the module doc)."""
    h = has[:, None, :].to(o.dtype)
    if how == "normaliser":
        lin = gamma.to(o.dtype).view(1, -1, 1) * h
        den = den_soft.to(o.dtype) + lin
        y = (y_soft.to(o.dtype) * den_soft.to(o.dtype)[..., None] + lin[..., None] * o) / (den[..., None] + EPS)
        return y, den_soft.to(o.dtype), lin
    if how == "mix":
        lam = mix.to(o.dtype) * h
        return (1 - lam)[..., None] * y_soft.to(o.dtype) + lam[..., None] * o, 1 - lam, lam
    raise ValueError(f"unknown attention.la_combine '{how}'; available: {', '.join(COMBINES)}")


def _soft_part(q, k, v, o: AttentionOptions, impl: str):
    """The hybrid's softmax terms alone on unpadded input: (y_soft, sum of E), E = exp(a - c) (gamma 1) over the window
    and, with the own sinks, the first S tokens. The Hedgehog path's hybrid with all-zero features is exactly that."""
    B, H, T, _ = q.shape
    zq, zk = q.new_zeros(B, H, T, 1), k.new_zeros(B, k.shape[1], T, 1)
    ones = torch.ones(H, dtype=compute_dtype(q), device=q.device)
    soft = replace(o, mode="hybrid", return_denominators=True)
    if impl == "naive":
        pos = real_positions(None, B, T, q.device)
        y, den, _ = masked_attention(q, k, v, zq, zk, ones, pos, pos, soft)
    else:
        y, den, _ = chunk_hybrid_attention(q, k, v, zq, zk, ones, soft)
    return y, den


def delta_hybrid_attention(
    q, k, v, fq, fk, gamma, gates: DeltaGates, opts=None, *, attention_mask=None, impl="chunk", **settings
):
    """The hybrid with a gated delta-rule LA (module doc). q/k/v [B,*,T,D] after RoPE (the softmax part's),
    fq [B,H,T,Dk] and fk [B,Hkv,T,Dk] the delta rule's queries and keys (L2-normalised here), gamma [H] > 0
    (normaliser: the LA's mass), gates the per-token DeltaGates; impl "naive" (the spec: dense softmax, the recurrent
    loop) or "chunk" (O(T (w + C)) softmax, the WY chunks). Padding anywhere: each row's real tokens are moved to the
    front, computed, moved back (padded query rows give 0). Returns y [B,H,T,Dv] in q's dtype; with
    return_denominators (y, soft weight, LA
    weight), each [B,H,T] (module doc: the LA share is LA / (soft + LA)). opts: the call's AttentionOptions
    (options.py; or its fields as keywords); hybrid_sinks is the model's (its recurrence skips the sinks in every
    mode)."""
    o = AttentionOptions.of(opts, **settings)
    mode, window, sinks, hybrid_sinks = o.mode, o.window, o.sinks, o.hybrid_sinks
    B, H, T, _ = q.shape
    out_dtype, acc = q.dtype, compute_dtype(q)
    if mode not in ("hybrid", "la_only"):  # no LA: the Hedgehog kind's modes, the same math
        zq, zk = q.new_zeros(B, H, T, 1), k.new_zeros(B, k.shape[1], T, 1)
        if impl == "naive" or o.return_denominators:
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
        l2norm(fq.to(acc)), l2norm(fk.to(acc)), v.to(acc), beta, g, lag=lag, impl=impl, chunk_size=o.chunk_size
    )
    if mode == "la_only":
        y, soft_w, lin_w = read, read.new_zeros(B, H, T), read.new_ones(B, H, T)
    else:
        y_soft, den_soft = _soft_part(q, k, v, o, impl)
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
