"""The chunked backward (kernels/hybrid_scale_kernels/chunk.py: `ChunkAttention`; chunk_bwd.py: `_chunk_bwd_dq`,
`_chunk_bwd_dkv`; chunk_h.py: `_chunk_dstates`) against the naive spec's fp64 autograd.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) in fp32, with the 64-token chunks
they have on a GPU. Every gradient (q, k, v, phi_q, phi_k, gamma and the decay rho) of every mode the path takes, at
windows 1 / 16 / 64, with and without the decay (a slow and a fast KV head), the hybrid with and without its own
sinks, GQA 4:2 and 6:2, T = 200 (four chunks, so the reverse state scan carries its gradient over two states) and
130 (two chunks and a little: one state gradient), one chunk or less (no state), head dim 16 and feature dims 16 and
80 (two feature chunks). c_n is not detached: its gradient reaches the argmax key, in the window or among the sinks.
"""

import pytest
import torch
from conftest import HYBRID_SINKS, variant
from kernel_inputs import make, with_keywords
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_scale.attention.hedgehog import naive
from tools.compile_check import record_launches

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
triton_attention = with_keywords(kernels.triton_hybrid_attention)
RHO = (0.02, 0.3)  # the LA's decay per KV head: a slow and a fast one
GRADS = ("q", "k", "v", "fq", "fk", "gamma", "rho")


def inputs(T, B=1, H=4, Hkv=2, D=16, F=16, seed=0):
    """The attention inputs and an output gradient dy."""
    dy = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed + 1000))
    return make(T, B, H, Hkv, D, F, seed=seed, requires_grad=False), dy


def gradients(fn, x, dy, rho, dtype):
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in x.items()}
    r = None if rho is None else rho.detach().to(dtype).requires_grad_()
    y = fn(**leaves, la_decay=r)
    (y.to(dtype) * dy.to(dtype)).sum().backward()
    grads = {n: t.grad for n, t in leaves.items()}
    grads["rho"] = None if r is None else r.grad
    return y, grads


def check(x, dy, decay=False, **options):
    """The entry's y and gradients against the fp64 spec's autograd on the same inputs."""
    hkv = x["k"].shape[1]
    rho = torch.tensor(RHO * (hkv // 2) + RHO[:1] * (hkv % 2)) if decay else None
    y, got = gradients(lambda **a: triton_attention(**a, **options), x, dy, rho, torch.float32)
    ref_y, want = gradients(lambda **a: naive.naive_hybrid_attention(**a, **options), x, dy, rho, torch.float64)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=2e-5)
    for name in GRADS:
        if want[name] is None and got[name] is None:
            continue
        ref = torch.zeros_like(got[name], dtype=torch.float64) if want[name] is None else want[name]
        assert got[name] is not None, name
        bound = 2e-5 * max(1.0, ref.abs().max().item())  # (gamma's and rho's: sums over every row)
        torch.testing.assert_close(got[name].double(), ref, rtol=1e-5, atol=bound, msg=lambda m, n=name: f"d{n}: {m}")


CASES = [
    *[("hybrid", w, d) for w in (1, 16, 64) for d in (False, True)],
    *[(HYBRID_SINKS, w, d) for w, d in ((1, True), (16, False), (64, True))],
    *[("la_only", w, d) for w, d in ((1, False), (16, True), (64, True))],
    *[("swa_only", w, False) for w in (16, 64)],
    *[("swa_sinks", w, False) for w in (1, 16)],
    ("sinks_only", 16, False),
    *[("hybrid", 100, d) for d in (False, True)],  # (two chunks back: dq summed over three key blocks)
    ("swa_sinks", 100, False),
    # (the edges where the kernels skip a block with no L term: a query block's last row lin_off = window past the
    # first key of a chunk, 32-row query blocks in _chunk_bwd_dkv, chunk c's own keys in _chunk_bwd_dq and
    # _chunk_output)
    *[("hybrid", w, True) for w in (31, 63, 95)],
]


@pytest.mark.parametrize(("mode", "window", "decay"), CASES)
def test_gradients_equal_the_spec(mode, window, decay):
    x, dy = inputs(200, seed=window)
    check(x, dy, decay=decay, window=window, **variant(mode), sinks=5)


@pytest.mark.parametrize("T", [40, 130])
def test_lengths_without_a_state_gradient(T):
    """One partial chunk (no state at all) and two chunks plus a little (one state, read by the last chunk; its
    gradient reaches chunk 0's keys)."""
    x, dy = inputs(T, seed=T)
    check(x, dy, decay=True, window=16, mode="hybrid", hybrid_sinks=True, sinks=3)


def test_groups_of_three_and_two_feature_chunks():
    """GQA 6:2 (dk, dv, dphi_k sum three query heads), batch 2, F = 80 (two feature chunks, the second masked)."""
    x, dy = inputs(150, B=2, H=6, Hkv=2, D=16, F=80, seed=3)
    for mode in ("hybrid", "la_only"):
        check(x, dy, decay=True, window=8, mode=mode, sinks=2)


def test_the_argmax_key_takes_c_s_gradient():
    """A sink whose key outscores the window for every later query (the hybrid with its sinks): c_n's argmax is that
    sink, whose dk then carries c_n's gradient from every row."""
    x, dy = inputs(150, seed=9)
    u = torch.randn(x["q"].shape[-1], generator=torch.Generator().manual_seed(1))
    x["q"] += 1.5 * u  # (every query shares a direction, and key 1 points along it)
    x["k"][:, :, 1] = 2.0 * u
    scores = x["q"] @ x["k"].repeat_interleave(2, 1).transpose(-1, -2)
    assert (scores[..., 40:, 1] > scores[..., 40:, :].diagonal(0, -2, -1)).float().mean() > 0.9
    check(x, dy, decay=True, window=4, mode="hybrid", hybrid_sinks=True, sinks=4)


def test_the_backward_is_three_launches_and_no_torch_product_or_cast_at_the_8b_shape():
    """At Llama-3-8B's attention (bf16, 32 heads, 8 KV heads, head dim 128, F 256, its own 8 sinks, the decay, 4k
    tokens; meta tensors: the launches are recorded, not run) the backward launches `_chunk_bwd_dq`, `_chunk_dstates`
    and `_chunk_bwd_dkv`, the last one program per (KV head, key chunk) over the whole head dim; between them torch
    makes no product and no cast or other op on T x F elements or more: the sinks' dk, dv and dphi_k are made in
    the kernels, in the inputs' dtype."""
    T, H, Hkv, D, F = 4096, 32, 8, 128, 256

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            big = [t for t in (*args, out) if isinstance(t, torch.Tensor) and t.numel() >= T * F]
            self.ops.append((func.overloadpacket.__name__, bool(big)))
            return out

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    q, k, v, fq, fk = meta(1, H, T, D), meta(1, Hkv, T, D), meta(1, Hkv, T, D), meta(1, H, T, F), meta(1, Hkv, T, F)
    gamma, rho = torch.empty(H, device="meta", requires_grad=True), torch.empty(Hkv, device="meta", requires_grad=True)
    with record_launches() as launches:
        y = triton_attention(q=q, k=k, v=v, fq=fq, fk=fk, gamma=gamma, window=64, sinks=8, hybrid_sinks=True,
                             la_decay=rho)  # fmt: skip
        forward = len(launches)
        with Ops() as ops:
            grads = torch.autograd.grad(y, (q, k, v, fq, fk), torch.empty_like(y))
    names = [x.name for x in launches[forward:]]
    assert names == ["_chunk_bwd_dq", "_chunk_dstates", "_chunk_bwd_dkv"], names
    assert launches[-1].grid == (Hkv, T // 64)
    made = {n for n, big in ops.ops if big} - {"empty", "empty_like", "new_empty", "empty_strided", "detach"}
    assert not made and not {"mm", "bmm", "matmul"} & {n for n, _ in ops.ops}, ops.ops
    assert all(g.dtype == torch.bfloat16 for g in grads)


def test_half_precision_dlz_reads_y_and_its_rounding_error():
    """In half precision the forward stores y once in the inputs' dtype and its rounding error beside it; dlz = do . y
    reads both. gamma's gradient is a sum of residuals that cancel (E dp, dp = do . v - dlz): in fp16 (which the
    interpreter runs; bf16 it does not), window 100, its largest error relative to its largest value is 1.3e-3 with
    the error read and 1.4e-2 from y alone (tools/kernel_grad_precision.py models the same in bf16)."""
    T, window = 320, 100
    x = make(T, B=1, H=2, Hkv=1, D=32, F=32, dtype=torch.float16, seed=3)
    dy = torch.randn(1, 2, T, 32, generator=torch.Generator().manual_seed(5)).half()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    (want,) = torch.autograd.grad(naive.naive_hybrid_attention(**ref, window=window), ref["gamma"], dy.double())
    (got,) = torch.autograd.grad(triton_attention(**x, window=window), x["gamma"], dy)
    assert (got.double() - want).abs().max() / want.abs().max() < 5e-3
