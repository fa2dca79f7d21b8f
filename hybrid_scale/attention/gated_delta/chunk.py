"""The gated delta rule in chunks of C (the WY representation, fp32), equal to the spec (naive.py) in outputs and
gradients, and the lagged read-out the hybrid takes from it (hybrid.py). fla-core's kernel, registered by the kernels
package as this part's "fla" backend, takes the same contract (backends.py resolves and self-checks it).

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..window.naive import compute_dtype
from .naive import grouped


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
    qg = grouped(q.to(acc), Hkv)
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


def lagged_delta(q, k, v, beta, g, *, lag, initial_state=None, impl=None, chunk_size=64):
    """o_i = S^T q_i with S the state after keys 0..i-lag (the state before them, initial_state, for i < lag): the
    hybrid's read-out (lag = the window) or the LA alone (lag 0). Runs the recurrence with queries moved lag steps
    earlier. Returns o [B,H,T,Dv] (fp32)."""
    T = q.shape[2]
    fn = chunk_gated_delta if impl is None else impl
    opts = {"chunk_size": chunk_size}
    if lag == 0:
        return fn(q, k, v, beta, g, initial_state=initial_state, **opts)[0]
    early = F.pad(q[:, :, lag:], (0, 0, 0, min(lag, T)))  # query i + lag asked at step i
    o = fn(early, k, v, beta, g, initial_state=initial_state, **opts)[0]
    head = q[:, :, : min(lag, T)].to(o.dtype)
    if initial_state is None:
        first = torch.zeros_like(o[:, :, : head.shape[2]])
    else:
        first = torch.einsum("bhgtk,bhkv->bhgtv", grouped(head, k.shape[1]), initial_state.to(o.dtype))
        first = first.reshape(*head.shape[:3], -1)
    return torch.cat([first, o[:, :, : T - head.shape[2]]], dim=2)
