"""The chunked prefill forward (kernels/hybrid_scale_kernels/chunk_prefill.py: `_chunk_output`; chunk_scan.py)
against the naive spec, and when `triton_hybrid_attention` takes it (and the chunked backward).

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) in fp32, with the 64-token chunks
they have on a GPU: T = 200 is four chunks, the last one partial, so chunk 3 reads a state that has carried two
chunks (its decay carried twice). Every mode the path takes, windows 1 / 16 / 64, with and without the LA's decay
(a slow and a fast KV head), the hybrid with and without its own sinks, GQA 4:2 and 6:2, head dims 16 / 32 / 64,
feature dim 32 (and 80: two feature chunks, the second partly masked), lengths under one chunk, of exactly one and
two chunks. The compiled bf16 check (marked `gpu`) runs at a Llama-3-8B-like head shape.
"""

import pytest
import torch
from conftest import HYBRID_SINKS, variant
from kernel_inputs import make

from hybrid_scale.attention import naive

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
from hybrid_scale_kernels import chunk_backward as cb  # noqa: E402
from hybrid_scale_kernels import chunk_prefill as cp  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RHO = (0.02, 0.3)  # the LA's decay per KV head: a slow and a fast one (alpha^64 = 0.28 and 5e-9)


def inputs(T, B=2, H=4, Hkv=2, D=32, F=32, dtype=torch.float32, device="cpu", seed=0):
    return make(T, B, H, Hkv, D, F, dtype, device, seed, requires_grad=False)


def check(x, atol=2e-5, decay=False, **options):
    """chunk_prefill's y against the fp64 spec on the same inputs; returns y."""
    hkv = x["k"].shape[1]
    rho = torch.tensor(RHO * (hkv // 2) + RHO[:1] * (hkv % 2)) if decay else None
    y = cp.chunk_prefill(**x, **options, la_decay=None if rho is None else rho.to(x["q"].device))
    assert y is not None, options
    ref = naive.naive_hybrid_attention(
        **{n: t.double() for n, t in x.items()}, **options, la_decay=None if rho is None else rho.double()
    )
    torch.testing.assert_close(y.double().cpu(), ref.cpu(), rtol=1e-5, atol=atol)
    return y


CASES = [
    (mode, window, decay)
    for mode in ("hybrid", HYBRID_SINKS, "swa_only", "swa_sinks", "la_only", "sinks_only")
    for window in (1, 16, 64)
    for decay in ((False, True) if mode in ("hybrid", HYBRID_SINKS, "la_only") else (False,))
]


@pytest.mark.parametrize(("mode", "window", "decay"), CASES)
def test_it_equals_the_spec(mode, window, decay):
    D = {1: 16, 16: 32, 64: 64}[window]
    check(inputs(200, D=D, seed=window), window=window, **variant(mode), sinks=5, decay=decay)


@pytest.mark.parametrize("T", [37, 64, 128, 130])
def test_lengths_around_the_chunk(T):
    """One partial chunk (no state kernel), exactly one and two chunks, and two plus a little."""
    check(inputs(T, seed=T), window=16, mode="hybrid", hybrid_sinks=True, sinks=3, decay=True)


def test_groups_of_three_and_two_feature_chunks():
    """GQA 6:2 (query head h reads KV head h // 3), and F = 80: the interpreter's 64-wide feature chunks walk two,
    the second masked past 80."""
    x = inputs(150, B=1, H=6, Hkv=2, D=24, F=80, seed=3)
    for mode in ("hybrid", "la_only"):
        check(x, window=8, mode=mode, sinks=2, decay=True)


def test_the_hybrid_sinks_leave_the_state():
    """The hybrid with its own sinks: the LA (state and intra terms) leaves the first S keys out, the softmax takes
    them, and both differ from the hybrid without sinks."""
    x = inputs(200, B=1, seed=7)
    x["v"][:, :, :6] += 5.0  # sinks whose values stand out
    with_sinks = check(x, window=4, mode="hybrid", hybrid_sinks=True, sinks=6, decay=True)
    without = check(x, window=4, mode="hybrid", sinks=6, decay=True)
    assert (with_sinks - without)[:, :, 150:].abs().max() > 1e-2


def test_what_it_refuses_and_none():
    x = inputs(20, B=1)
    for options in (
        dict(window=65, mode="hybrid"),
        dict(window=0, mode="hybrid"),
        dict(window=8, mode="swa_sinks", sinks=65),
        dict(window=8, mode="hybrid", hybrid_sinks=True, sinks=65),
        dict(window=8, mode="nope"),
        dict(window=8, mode="hybrid", la_decay=torch.zeros(3)),
    ):
        assert cp.chunk_prefill(**x, **{"sinks": 4, **options}) is None, options
    big = inputs(20, B=1, D=160)
    assert cp.chunk_prefill(**big, window=8, mode="hybrid", sinks=4) is None  # head dim over 128
    y = cp.chunk_prefill(**x, window=8, mode="none", sinks=4)
    assert y.shape == x["q"].shape and not y.any()


@pytest.fixture
def calls(monkeypatch):
    """chunk_prefill's and chunk_attention's calls (name, whether it took the case), as triton_hybrid_attention
    makes them."""
    seen = []

    def spy(name):
        real = getattr(cb, name)  # (chunked_path calls both from chunk_backward.py)

        def call(*args, **kwargs):
            y = real(*args, **kwargs)
            seen.append((name, y is not None))
            return y

        monkeypatch.setattr(cb, name, call)

    spy("chunk_prefill")
    spy("chunk_attention")
    return seen


def test_triton_hybrid_attention_takes_it_with_and_without_gradients(calls):
    """Without gradients chunk_prefill, with them chunk_attention (the chunked backward), where there is no padding
    mask, no initial state, no tiles asked for, no denominators and the case is taken; else the fused kernels."""
    x = inputs(90, B=1, seed=11)
    opts = dict(window=16, mode="hybrid", sinks=3, hybrid_sinks=True, la_decay=torch.tensor(RHO))
    ref = naive.naive_hybrid_attention(**{n: t.double() for n, t in x.items()}, **opts)
    pre, att = ("chunk_prefill", True), ("chunk_attention", True)

    def close(y):
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-5)

    with torch.no_grad():
        close(kernels.triton_hybrid_attention(**x, **opts))
    assert calls == [pre]
    close(kernels.triton_hybrid_attention(**x, **opts))  # autograd on, but nothing requires a gradient
    assert calls == [pre, pre]
    leaf = {n: t.clone().requires_grad_(n == "gamma") for n, t in x.items()}
    y = kernels.triton_hybrid_attention(**leaf, **opts)  # gamma needs one: the chunked backward
    assert calls == [pre, pre, att]
    close(y.detach())
    y.sum().backward()
    ref_leaf = {n: t.double().requires_grad_(n == "gamma") for n, t in x.items()}
    naive.naive_hybrid_attention(**ref_leaf, **opts).sum().backward()
    torch.testing.assert_close(leaf["gamma"].grad.double(), ref_leaf["gamma"].grad, rtol=1e-5, atol=1e-4)
    mask = torch.ones(1, 90, dtype=torch.long)
    close(kernels.triton_hybrid_attention(**leaf, **opts, attention_mask=mask).detach())  # padding mask: fused
    close(kernels.triton_hybrid_attention(**leaf, **opts, block=16).detach())  # tiles asked for: fused
    assert calls == [pre, pre, att]
    with torch.no_grad():
        close(kernels.triton_hybrid_attention(**leaf, **opts))  # ... unless autograd is off
        assert calls == [pre, pre, att, pre]
        close(kernels.triton_hybrid_attention(**x, **opts, return_denominators=True)[0])
        close(kernels.triton_hybrid_attention(**x, **opts, block=16))  # tiles asked for: the fused forward's
        close(kernels.triton_hybrid_attention(**x, **opts, attention_mask=mask))
        assert calls == [pre, pre, att, pre]
        wide = dict(opts, window=65)
        y = kernels.triton_hybrid_attention(**x, **wide)  # refused (window over the chunk): the fused forward
        assert calls == [pre, pre, att, pre, ("chunk_prefill", False)]
        ref_wide = naive.naive_hybrid_attention(**{n: t.double() for n, t in x.items()}, **wide)
        torch.testing.assert_close(y.double(), ref_wide, rtol=1e-5, atol=2e-5)
    y = kernels.triton_hybrid_attention(**leaf, **wide)  # refused with a gradient too: the fused kernels
    assert calls[-1] == ("chunk_attention", False)
    torch.testing.assert_close(y.detach().double(), ref_wide, rtol=1e-5, atol=2e-5)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hybrid", HYBRID_SINKS, "swa_sinks", "la_only"])
@pytest.mark.parametrize("decay", [False, True])
def test_bf16_on_gpu_against_the_spec(mode, decay):
    """Compiled, bf16, 8 query heads on 2 KV heads, head dim 128, feature dim 256, T = 1000 (16 chunks): within 3e-2
    of the fp64 spec on the same bf16 inputs (test_triton_kernels_bf16.py's bound for outputs)."""
    x = inputs(1000, B=1, H=8, Hkv=2, D=128, F=256, dtype=torch.bfloat16, device="cuda", seed=1)
    x["fq"], x["fk"] = x["fq"] / 128, x["fk"] / 128  # (hedgehog's features: a softmax over F / 2, so they sum to 2)
    check(x, atol=3e-2, decay=decay, window=64, **variant(mode), sinks=8)
