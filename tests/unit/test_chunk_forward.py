"""The chunked forward (kernels/hybrid_scale_kernels/chunk_o.py: `_chunk_output`; chunk_h.py: the states) without
autograd against the naive spec, what the entry refuses, and that every path runs the chunked kernels.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) in fp32, with the 64-token chunks
they have on a GPU: T = 200 is four chunks, the last one partial, so chunk 3 reads a state that has carried two
chunks (its decay carried twice). Every mode, windows 1 / 16 / 64 / 100 (two chunks back), with and without the
LA's decay (a slow and a fast KV head), the hybrid with and without its own sinks, GQA 4:2 and 6:2, head dims
16 / 32 / 64, feature dim 32 (and 80: two feature chunks, the second partly masked), lengths under one chunk, of
exactly one and two chunks. The compiled bf16 check (marked `gpu`) runs at a Llama-3-8B-like head shape.
"""

import pytest
import torch
from conftest import HYBRID_SINKS, variant
from kernel_inputs import make, with_keywords

from hybrid_scale.attention.hedgehog import naive

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
triton_attention = with_keywords(kernels.triton_hybrid_attention)

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RHO = (0.02, 0.3)  # the LA's decay per KV head: a slow and a fast one (alpha^64 = 0.28 and 5e-9)


def inputs(T, B=2, H=4, Hkv=2, D=32, F=32, dtype=torch.float32, device="cpu", seed=0):
    return make(T, B, H, Hkv, D, F, dtype, device, seed, requires_grad=False)


def check(x, atol=2e-5, decay=False, **options):
    """The forward's y (no autograd) against the fp64 spec on the same inputs; returns y."""
    hkv = x["k"].shape[1]
    rho = torch.tensor(RHO * (hkv // 2) + RHO[:1] * (hkv % 2)) if decay else None
    with torch.no_grad():
        y = triton_attention(**x, **options, la_decay=None if rho is None else rho.to(x["q"].device))
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
] + [("hybrid", 100, True), ("swa_sinks", 100, False), ("la_only", 100, True)]


@pytest.mark.parametrize(("mode", "window", "decay"), CASES)
def test_it_equals_the_spec(mode, window, decay):
    D = {1: 16, 16: 32, 64: 64, 100: 32}[window]
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
    for options, why in (
        (dict(window=0, mode="hybrid"), "window: must be >= 1"),
        (dict(window=8, mode="swa_sinks", sinks=65), "at most 64 sinks"),
        (dict(window=8, mode="hybrid", hybrid_sinks=True, sinks=65), "at most 64 sinks"),
        (dict(window=8, mode="nope"), "mode: .nope. is not allowed"),
        (dict(window=8, mode="hybrid", la_decay=torch.zeros(3)), "one rho per KV head"),
    ):
        with pytest.raises(ValueError, match=why):
            triton_attention(**{**x, "sinks": 4, **options})
    with pytest.raises(ValueError, match="value dim"):
        triton_attention(**{**x, "v": x["v"][..., :8]}, window=8)
    y = triton_attention(**x, window=8, mode="none", sinks=4)
    assert y.shape == x["q"].shape and not y.any()
    with pytest.raises(TypeError, match="takes the call's settings as one AttentionOptions"):
        kernels.forward(**x, window=8)  # the keyword contract before it (an older export's attention files)


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels launched (they still run)."""
    from hybrid_scale_kernels import chunk_o

    cls = type(chunk_o._chunk_output)  # (the interpreter's function class on CPU)
    real, names = cls.run, []

    def spy(self, *args, **kwargs):
        names.append(getattr(self, "fn", self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", spy)
    return names


CHUNKED = {"_chunk_states", "_segment_fix", "_chunk_output", "_chunk_bwd_dq", "_chunk_dstates", "_chunk_bwd_dkv"}


def test_every_path_runs_the_chunked_kernels(launched):
    """No second generation: a prefill, training, a padding mask with a hole, an initial state, the denominators and a
    window of two chunks each launch only the chunked kernels, and equal the spec."""
    x = inputs(150, seed=2)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :5] = 0
    mask[1, 70:74] = 0
    g = torch.Generator().manual_seed(1)
    state = (torch.rand(2, 2, 32, 32, generator=g), torch.rand(2, 2, 32, generator=g))
    paths = {"prefill": {}, "mask": dict(attention_mask=mask), "window 100": dict(window=100)}
    for name, extra in paths.items():
        launched.clear()
        opts = dict(window=16, mode="hybrid", sinks=3) | extra
        with torch.no_grad():
            y = triton_attention(**x, **opts)
        ref = naive.naive_hybrid_attention(**{n: t.double() for n, t in x.items()}, **opts)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-5, msg=name)
        assert set(launched) <= CHUNKED and "_chunk_output" in launched, (name, launched)
    launched.clear()
    leaf = {n: t.clone().requires_grad_() for n, t in x.items()}
    triton_attention(**leaf, window=16, attention_mask=mask, initial_state=state).sum().backward()
    assert set(launched) == CHUNKED - {"_segment_fix"}, launched
    launched.clear()
    y, den_e, den_l = triton_attention(**x, window=16, attention_mask=mask, return_denominators=True)
    ref = naive.naive_hybrid_attention(**{n: t.double() for n, t in x.items()}, window=16, attention_mask=mask,
                                       return_denominators=True)  # fmt: skip
    torch.testing.assert_close(y.double(), ref[0].double(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(den_l.double(), ref[2].double(), rtol=1e-5, atol=2e-5)
    # the sum of gamma E is the normaliser less the L sum: exact to fp32's rounding of the normaliser
    total = (ref[1] + ref[2]).double()
    assert ((den_e.double() - ref[1].double()).abs() <= 1e-6 * total + 1e-5 * ref[1].double().abs() + 1e-6).all()
    assert set(launched) <= CHUNKED


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
