"""The chunked path equals the naive spec in outputs and in gradients of q, k, v, fq, fk and gamma."""

import pytest
import torch
from conftest import HYBRID_SINKS, attention_inputs, variant

from hybrid_scale.attention.hedgehog import chunk as chunked
from hybrid_scale.attention.hedgehog import naive
from hybrid_scale.attention.settings import MODES

NAMES = ("q", "k", "v", "fq", "fk", "gamma")


def padding_mask(T):
    if T < 4:
        return None
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, : T // 5] = 0  # left padding
    mask[1, -(T // 7 + 1) :] = 0  # right padding
    mask[1, T // 2] = 0  # a hole in the middle
    return mask


def run(fn, x, **kw):
    y = fn(**x, **kw)
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype)
    grads = torch.autograd.grad((y * grad_out).sum(), [x[n] for n in NAMES], allow_unused=True)
    return y, {n: (torch.zeros_like(x[n]) if g is None else g) for n, g in zip(NAMES, grads, strict=True)}


NO_CACHE = [m for m in MODES if m not in ("none", "cache_only")]  # (the cache's modes: test_cache.py)


@pytest.mark.parametrize("T", [1, 63, 100])
@pytest.mark.parametrize("window", [1, 5, 64, 150])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("mode", [*NO_CACHE, HYBRID_SINKS])
def test_chunked_equals_naive(T, window, chunk, mode):
    x = attention_inputs(B=2, H=4, Hkv=2, T=T, D=8, F=6, requires_grad=True, seed=T + window)
    mask = padding_mask(T)
    options = dict(window=window, **variant(mode), sinks=4, attention_mask=mask)
    y_ref, g_ref = run(naive.naive_hybrid_attention, x, **options)
    y, g = run(chunked.chunk_hybrid_attention, x, **options, chunk_size=chunk)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-11)
    for n in NAMES:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-8, atol=1e-10, msg=f"grad of {n}")
    if mode in ("hybrid", "la_only", HYBRID_SINKS) and T > window + 4:
        assert g["fk"].abs().max() > 0  # the linear part really is in the graph


def test_none_mode_is_zero_and_fp32_accumulation_for_bf16():
    x = attention_inputs(T=40, D=8, F=6, dtype=torch.float32)
    y = chunked.chunk_hybrid_attention(**x, window=8, mode="none")
    assert torch.equal(y, torch.zeros_like(y))
    bf = {n: t.to(torch.bfloat16) for n, t in x.items()}
    y_bf = chunked.chunk_hybrid_attention(**bf, window=8, mode="hybrid", chunk_size=16)
    assert y_bf.dtype == torch.bfloat16
    ref = naive.naive_hybrid_attention(**{n: t.float() for n, t in bf.items()}, window=8, mode="hybrid")
    torch.testing.assert_close(y_bf.float(), ref, rtol=2e-2, atol=2e-2)


def test_bad_window_is_a_clear_error():
    x = attention_inputs(T=4)
    with pytest.raises(ValueError, match=r"^attention window: must be >= 1, got 0$"):
        chunked.chunk_hybrid_attention(**x, window=0)
    with pytest.raises(ValueError, match="^attention mode: 'mixed' is not allowed; choose one of: hybrid, "):
        chunked.chunk_hybrid_attention(**x, window=2, mode="mixed")


@pytest.mark.parametrize("mode", ["hybrid", "la_only", "swa_only"])
def test_block_groups_equal_naive(monkeypatch, mode):
    """Long inputs are processed a group of blocks at a time; group edges must not change anything."""
    monkeypatch.setattr(chunked, "GROUP_TOKENS", 32)  # 2 blocks of 16 per group, 7 groups
    x = attention_inputs(B=2, H=4, Hkv=2, T=100, D=8, F=6, requires_grad=True, seed=11)
    for window in (5, 40):
        y_ref, g_ref = run(naive.naive_hybrid_attention, x, window=window, mode=mode, attention_mask=padding_mask(100))
        y, g = run(
            chunked.chunk_hybrid_attention, x, window=window, mode=mode, attention_mask=padding_mask(100), chunk_size=16
        )
        torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-11)
        for n in NAMES:
            torch.testing.assert_close(g[n], g_ref[n], rtol=1e-8, atol=1e-10, msg=f"grad of {n}")


def test_denominator_parts_match_the_formula():
    """sum E and sum L, the two parts of the shared normaliser, against dense sums from the naive masks."""
    x = attention_inputs(B=1, H=4, Hkv=2, T=30, D=8, F=6, seed=3)
    y, soft, lin = chunked.chunk_hybrid_attention(**x, window=5, mode="hybrid", chunk_size=8, return_denominators=True)
    torch.testing.assert_close(y, naive.naive_hybrid_attention(**x, window=5, mode="hybrid"))
    q, k, fq, fk = x["q"], x["k"].repeat_interleave(2, 1), x["fq"], x["fk"].repeat_interleave(2, 1)
    a = q @ k.transpose(-1, -2) / 8**0.5
    n, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    win, past = (j <= n) & (j > n - 5), j <= n - 5
    c = a.masked_fill(~win, float("-inf")).amax(-1, keepdim=True)
    e = x["gamma"].view(1, 4, 1, 1) * torch.exp(a - c).masked_fill(~win, 0)
    torch.testing.assert_close(soft, e.sum(-1))
    torch.testing.assert_close(lin, (fq @ fk.transpose(-1, -2)).masked_fill(~past, 0).sum(-1))
    assert torch.equal(lin[..., :5], torch.zeros_like(lin[..., :5])) and (lin[..., 5:] > 0).all()
