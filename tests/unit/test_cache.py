"""The cache of exact keys (attention/cache/, issue 66) in the whole-sequence paths: the parallel selection equals the
token-by-token one, the blocked prefill equals the spec in outputs and gradients for both LA kinds, every selection
and the modes a cache changes, a cache of 0 is the hybrid without one, and the three memories hold what select.py
says they hold (nothing dropped in the hybrid, everything under one normaliser)."""

from __future__ import annotations

import pytest
import torch

from hybrid_scale.attention.cache.naive import select_loop
from hybrid_scale.attention.cache.select import drop_times, fold_order
from hybrid_scale.attention.gated_delta.naive import DeltaGates
from hybrid_scale.attention.layer import attend
from hybrid_scale.attention.settings import CACHE_SELECTS

B, H, K, T, D, F, W, S = 2, 4, 2, 45, 8, 6, 5, 3
KINDS = ("hedgehog", "gated_delta")


def inputs(kind: str, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)

    def r(*size, positive=False):
        return (torch.rand if positive else torch.randn)(*size, generator=g, dtype=dtype)

    q, k, v = r(B, H, T, D), r(B, K, T, D), r(B, K, T, D)
    if kind == "hedgehog":
        return [q, k, v, r(B, H, T, F, positive=True), r(B, K, T, F, positive=True)], None
    gates = DeltaGates(r(B, K, T, positive=True), -0.1 * r(B, K, T, positive=True), r(B, H, T, positive=True))
    return [q, k, v, r(B, H, T, D), r(B, K, T, D)], gates


def padded():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :6] = 0
    return mask


def call(kind, x, gates, backend, **settings):
    rho = torch.tensor([0.05, 0.1], dtype=x[0].dtype) if kind == "hedgehog" else None
    gamma = torch.full((H,), 0.7, dtype=x[0].dtype)
    opts = dict(window=W, sinks=S, hybrid_sinks=True, mode="hybrid", chunk_size=8, la_kind=kind, gates=gates,
                la_decay=rho) | settings  # fmt: skip
    return attend(*x, gamma, backend=backend, **opts)


@pytest.mark.parametrize("budget", [0, 1, 3, [2, 6]])
def test_parallel_selection_is_the_token_by_token_one(budget):
    """drop_times (the prefill's) equals select_loop (the spec), ties included (scores from 4 values), per-head
    budgets included; the LA then receives at most one key a step and every candidate that left the cache once."""
    g = torch.Generator().manual_seed(0)
    prio = torch.randint(0, 4, (3, 2, 60), generator=g).float()
    c = torch.tensor(budget) if isinstance(budget, list) else budget
    got = drop_times(prio, c, window=4, first=3)
    assert torch.equal(got, select_loop(prio, c, window=4, first=3))
    slots = fold_order(got)
    folded = (got < 60).sum(-1)
    assert torch.equal((slots >= 0).sum(-1), folded)  # one slot per folded key: no two share a step
    held = (torch.arange(60) + 4 < 60) & (torch.arange(60) >= 3)
    assert torch.equal(folded + torch.as_tensor(c).view(1, -1).expand(3, 2), held.sum().expand(3, 2)) or budget == 0


def test_selection_keeps_the_best():
    """The cache holds the C highest scores among the keys that have left the window: a planted inversion (keeping
    the lowest) fails."""
    prio = torch.tensor([[[0.0, 9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 0.5, 0.2, 0.1, 0.0, 0.0]]])
    drop = drop_times(prio, 2, window=2, first=0)
    T = prio.shape[-1]
    still = (drop[0, 0] >= T).nonzero().flatten().tolist()
    assert still[:2] == [1, 3]  # 9 and 8 stay; the last two keys never left the window


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["hybrid", "swa_sinks"])
@pytest.mark.parametrize("hybrid_sinks", [True, False])
def test_no_cache_is_today(kind, mode, hybrid_sinks):
    """The cache's path with a cache of 0 (what return_parts takes) is the hybrid without one, padded rows
    included, spec and blocked."""
    x, gates = inputs(kind)
    for backend in ("chunk", "naive"):
        for mask in (None, padded()):
            kw = dict(mode=mode, hybrid_sinks=hybrid_sinks, attention_mask=mask)
            want = call(kind, x, gates, backend, **kw)
            got, parts = call(kind, x, gates, backend, return_parts=True, **kw)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            assert float(parts["cache"].abs().max()) == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("mode", ["hybrid", "swa_sinks", "cache_only"])
def test_blocked_prefill_is_the_spec(kind, select, mode):
    """Outputs and the gradients of every input (and gamma) of the blocked prefill equal the spec's (selection token
    by token, dense masks), unpadded and with a left-padded row; the cache changes the output."""
    x, gates = inputs(kind)
    for mask in (None, padded()):
        results = []
        for backend in ("chunk", "naive"):
            leaves = [t.detach().requires_grad_() for t in x]
            y = call(kind, leaves, gates, backend, mode=mode, cache=4, cache_select=select, attention_mask=mask)
            grads = torch.autograd.grad(y.square().sum(), leaves, allow_unused=True)  # (no LA: phi unused)
            results.append([y, *(torch.zeros_like(t) if d is None else d for t, d in zip(leaves, grads, strict=True))])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    without = call(kind, x, gates, "chunk", mode="swa_sinks" if mode == "cache_only" else mode)
    assert float((results[0][0] - without).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_memories_share_one_normaliser(kind):
    """Each memory's weight (return_parts) adds up to the output's normaliser, the cache's is positive once keys
    have left the window, and the hybrid with its cache differs from swa_sinks with the same cache only through the
    LA: nothing the cache lets go is lost (a planted drop of the loser fails the LA's weight)."""
    x, gates = inputs(kind)
    y, parts = call(kind, x, gates, "chunk", cache=3, return_parts=True)
    assert float(parts["cache"][..., S + W :].min()) > 0  # from the first key that left the window
    assert float(parts["la"][..., S + W + 3 :].min()) > 0  # from the first that left the full cache
    assert float(parts["la"][..., : S + W + 3].abs().max()) == 0
    for name, w in parts.items():
        assert float(w.min()) >= 0, name
    y_spec, parts_spec = call(kind, x, gates, "naive", cache=3, return_parts=True)
    for name in parts:
        torch.testing.assert_close(parts[name], parts_spec[name], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("select", CACHE_SELECTS)
def test_a_rank_with_some_heads_computes_their_slice(kind, select):
    """Tensor parallelism over heads: the cache is per KV head (its scores summed over that head's query heads), so a
    rank holding the second KV head and its query heads computes exactly their slice of the whole layer."""
    x, gates = inputs(kind)
    G = H // K
    whole = call(kind, x, gates, "chunk", cache=4, cache_select=select)
    q, k, v, fq, fk = x
    part = [q[:, G:], k[:, 1:], v[:, 1:], fq[:, G:], fk[:, 1:]]
    if gates is not None:
        gates = DeltaGates(gates.beta[:, 1:], gates.g[:, 1:], gates.mix[:, G:])
    rho = torch.tensor([0.1], dtype=q.dtype) if kind == "hedgehog" else None
    y = attend(*part, torch.full((G,), 0.7, dtype=q.dtype), backend="chunk", window=W, sinks=S, hybrid_sinks=True,
               mode="hybrid", chunk_size=8, la_kind=kind, gates=gates, la_decay=rho, cache=4,
               cache_select=select)  # fmt: skip
    torch.testing.assert_close(y, whole[:, G:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("select", CACHE_SELECTS)
def test_bf16_inputs_compute_in_fp32(kind, select):
    """The presets' dtype: bf16 inputs give a bf16 output within bf16's rounding of the fp64 computation on the same
    (rounded) inputs: the arithmetic and the scores are fp32 inside, so the cache holds the same keys."""
    x, gates = inputs(kind)
    low = [t.to(torch.bfloat16) for t in x]
    lg = None if gates is None else DeltaGates(*(t.to(torch.bfloat16) for t in gates))
    got = call(kind, low, lg, "chunk", cache=4, cache_select=select)
    up = None if gates is None else DeltaGates(*(t.double() for t in lg))
    want = call(kind, [t.double() for t in low], up, "chunk", cache=4, cache_select=select)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
