"""The naive reference against an independent, loop-level computation of docs/design.md §2."""

import math

import pytest
import torch
from conftest import HYBRID_SINKS, attention_inputs, variant

from hybrid_scale.attention.hedgehog import naive
from hybrid_scale.attention.settings import MODES
from hybrid_scale.attention.window.naive import EPS


def loop_query(q, k, v, fq, fk, gamma, window, mode, sinks, b, h, kh, n, real):
    """y for query n (real index) of row b, head h, from scalar loops over the formula alone (mode may be
    HYBRID_SINKS: the hybrid whose softmax also covers the first S real tokens and whose LA leaves them out)."""
    D = q.shape[-1]
    s = 1 / math.sqrt(D)
    pn = real[n]
    keys = list(enumerate(real[: n + 1]))  # (real index j, position) for every j <= n

    def score(pj):
        return s * sum(float(q[b, h, pn, d]) * float(k[b, kh, pj, d]) for d in range(D))

    def lin(pj):
        return sum(float(fq[b, h, pn, f]) * float(fk[b, kh, pj, f]) for f in range(fq.shape[-1]))

    terms = []  # (weight, position of the key)
    if mode in ("hybrid", "swa_only"):
        win = [pj for j, pj in keys if n - window < j]
        c = max(score(pj) for pj in win)
        terms += [(float(gamma[h]) * math.exp(score(pj) - c), pj) for pj in win]
    if mode == "hybrid":
        terms += [(lin(pj), pj) for j, pj in keys if j <= n - window]
    if mode == HYBRID_SINKS:  # gamma on every softmax term, one max over the window and the sinks
        soft = [pj for j, pj in keys if n - window < j or j < sinks]
        c = max(score(pj) for pj in soft)
        terms += [(float(gamma[h]) * math.exp(score(pj) - c), pj) for pj in soft]
        terms += [(lin(pj), pj) for j, pj in keys if sinks <= j <= n - window]
    if mode == "la_only":
        terms += [(lin(pj), pj) for _, pj in keys]
    if mode == "swa_sinks":  # the window and the first S real tokens, each key once; plain softmax (no gamma)
        both = [pj for j, pj in keys if n - window < j or j < sinks]
        c = max(score(pj) for pj in both)
        terms += [(math.exp(score(pj) - c), pj) for pj in both]
    if mode == "sinks_only":
        sink = [pj for j, pj in keys if j < sinks]
        c = max(score(pj) for pj in sink)
        terms += [(math.exp(score(pj) - c), pj) for pj in sink]
    if mode == "none":
        return [0.0] * D
    den = sum(w for w, _ in terms)
    return [sum(w * float(v[b, kh, pj, d]) for w, pj in terms) / (den + EPS) for d in range(D)]


def loop_reference(q, k, v, fq, fk, gamma, window, mode, sinks, mask):
    B, H, T, D = q.shape
    group = H // k.shape[1]
    y = torch.zeros_like(q)
    for b in range(B):
        real = [t for t in range(T) if mask[b, t]]  # positions of real tokens, in order
        for h in range(H):
            for n, pn in enumerate(real):
                out = loop_query(q, k, v, fq, fk, gamma, window, mode, sinks, b, h, h // group, n, real)
                y[b, h, pn] = torch.tensor(out, dtype=y.dtype)
    return y


def masks(T):
    full = torch.ones(2, T, dtype=torch.long)
    left = full.clone()
    left[0, :3] = 0  # left padding on row 0
    right = full.clone()
    right[1, -4:] = 0  # right padding on row 1
    both = left * right
    both[1, 5] = 0  # and a hole
    return {"none": None, "left": left, "right": right, "mixed": both}


@pytest.mark.parametrize("mode", [*MODES, HYBRID_SINKS])
@pytest.mark.parametrize("window", [1, 3, 20])
@pytest.mark.parametrize("padding", ["none", "left", "right", "mixed"])
def test_naive_matches_loops(mode, window, padding):
    x = attention_inputs(T=12)
    mask = masks(12)[padding]
    got = naive.naive_hybrid_attention(**x, window=window, **variant(mode), sinks=3, attention_mask=mask)
    ref = loop_reference(**x, window=window, mode=mode, sinks=3, mask=torch.ones(2, 12) if mask is None else mask)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["hybrid", "la_only"])
def test_naive_matches_loops_with_all_zero_relu_feature_rows(mode):
    x = attention_inputs(T=12)
    x["fq"] = torch.relu(torch.randn(x["fq"].shape, dtype=x["fq"].dtype))
    x["fk"] = torch.relu(torch.randn(x["fk"].shape, dtype=x["fk"].dtype))
    x["fq"][:, :, ::3] = 0  # all-zero query feature rows
    x["fk"][:, :, 1::4] = 0  # all-zero key feature rows
    mask = masks(12)["mixed"]
    got = naive.naive_hybrid_attention(**x, window=2, mode=mode, attention_mask=mask)
    ref = loop_reference(**x, window=2, mode=mode, sinks=8, mask=mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_relu_zero_feature_rows_and_empty_past():
    """All-zero feature rows give 0 from LA (no NaN); rows with empty P(n) are pure softmax."""
    x = attention_inputs(T=10)
    x["fq"] = torch.relu(x["fq"] - 2.0)  # all zero: LA contributes nothing anywhere
    y = naive.naive_hybrid_attention(**x, window=4, mode="la_only")
    assert torch.equal(y, torch.zeros_like(y))
    hybrid = naive.naive_hybrid_attention(**x, window=4, mode="hybrid")
    swa = naive.naive_hybrid_attention(**x, window=4, mode="swa_only")
    torch.testing.assert_close(hybrid, swa, rtol=1e-5, atol=1e-12)  # eps/(gamma sum E) is the only difference
    # with real features, rows n < w (P(n) empty) of hybrid equal exact causal softmax
    x = attention_inputs(T=10)
    hybrid = naive.naive_hybrid_attention(**x, window=4, mode="hybrid")
    full = torch.nn.functional.scaled_dot_product_attention(
        x["q"], x["k"].repeat_interleave(2, 1), x["v"].repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(hybrid[:, :, :4], full[:, :, :4], rtol=1e-5, atol=1e-6)
    assert (hybrid[:, :, 4:] - full[:, :, 4:]).abs().max() > 1e-3


def test_sinks_before_S_and_padding_rows_are_zero():
    x = attention_inputs(T=8)
    mask = masks(8)["left"]
    y = naive.naive_hybrid_attention(**x, window=2, mode="sinks_only", sinks=5, attention_mask=mask)
    assert torch.equal(y[0, :, :3], torch.zeros_like(y[0, :, :3]))
    # query at real index 0 (position 3 of row 0) sees only itself: output = its value
    torch.testing.assert_close(y[0, :, 3], x["v"][0, :, 3].repeat_interleave(2, 0) / (1 + EPS))


def test_padded_rows_have_zero_gradient():
    x = attention_inputs(T=8, requires_grad=True)
    mask = masks(8)["left"]
    y = naive.naive_hybrid_attention(**x, window=3, mode="hybrid", attention_mask=mask)
    y.sum().backward()
    assert torch.equal(x["q"].grad[0, :, :3], torch.zeros_like(x["q"].grad[0, :, :3]))
    assert torch.equal(x["k"].grad[0, :, :3], torch.zeros_like(x["k"].grad[0, :, :3]))
    assert x["q"].grad[0, :, 3:].abs().max() > 0


def test_swa_sinks_is_the_window_plus_the_first_tokens():
    """swa_sinks with no sinks is swa_only; a window >= T (or sinks >= T) makes it causal softmax; otherwise the
    first S tokens are what it adds to swa_only, beyond the window only."""
    x = attention_inputs(T=12)
    full = torch.nn.functional.scaled_dot_product_attention(
        x["q"], x["k"].repeat_interleave(2, 1), x["v"].repeat_interleave(2, 1), is_causal=True
    )
    swa = naive.naive_hybrid_attention(**x, window=3, mode="swa_only")
    torch.testing.assert_close(naive.naive_hybrid_attention(**x, window=3, mode="swa_sinks", sinks=0), swa)
    torch.testing.assert_close(naive.naive_hybrid_attention(**x, window=12, mode="swa_sinks", sinks=2), full)
    torch.testing.assert_close(naive.naive_hybrid_attention(**x, window=1, mode="swa_sinks", sinks=12), full)
    y = naive.naive_hybrid_attention(**x, window=3, mode="swa_sinks", sinks=2)
    torch.testing.assert_close(y[:, :, :5], full[:, :, :5])  # n < w + S: the window and the sinks cover 0..n
    assert (y[:, :, 5:] - swa[:, :, 5:]).abs().min() > 0  # beyond: the sinks change every output
