"""What an fp32 call of the chunked kernels computes (kernels/hybrid_scale_kernels/chunk.py, compute_dtype): on a GPU
bf16 inputs and states with fp32 accumulation, y and the gradients in fp32, said in the wrapper's docstring and in one
log line per process; in Triton's interpreter (CPU) fp32. The cast path is checked here on the meta device, which
stands for a GPU (the launches are recorded, not run); the precision on a GPU by the gpu-marked test."""

import logging

import pytest
import torch
from kernel_inputs import make, with_keywords

from hybrid_scale.attention.hedgehog import naive
from tools import compile_check

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
chunk = pytest.importorskip("hybrid_scale_kernels.chunk")

triton_attention = with_keywords(kernels.triton_hybrid_attention)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAMES = ("q", "k", "v", "fq", "fk")
HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # (Triton's names of the dtypes)
OPTS = dict(window=16, mode="hybrid", sinks=4, hybrid_sinks=True)


def meta_inputs(dtype, T=200, requires_grad=True):
    """Inputs on the meta device (a GPU's stand-in): batch 1, 4 query heads on 2 KV heads, head dim 64, F 128."""
    shapes = dict(q=(1, 4, T, 64), k=(1, 2, T, 64), v=(1, 2, T, 64), fq=(1, 4, T, 128), fk=(1, 2, T, 128))
    x = {n: torch.empty(*s, device="meta", dtype=dtype, requires_grad=requires_grad) for n, s in shapes.items()}
    return x | {"gamma": torch.empty(4, device="meta", requires_grad=requires_grad)}


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage() == chunk.FP32_IN_BF16]


def test_an_fp32_call_off_the_cpu_runs_the_kernels_in_bf16_and_says_so_once(caplog):
    chunk._say_fp32_runs_in_bf16.cache_clear()  # (a process that has said it says it no more)
    caplog.set_level(logging.WARNING, logger=chunk.__name__)
    x = meta_inputs(torch.float32)
    with compile_check.record_launches() as launched:
        y = triton_attention(**x, **OPTS)
        y.backward(torch.empty_like(y))
        triton_attention(**{n: t.detach() for n, t in x.items()}, **OPTS)  # a prefill: said once, not twice
    assert y.dtype == torch.float32 and all(x[n].grad.dtype == torch.float32 for n in NAMES)
    assert len(said(caplog)) == 1
    names = {launch.name for launch in launched}
    assert {"_chunk_states", "_chunk_output", "_chunk_bwd_dq", "_chunk_bwd_dkv"} <= names, names
    for launch in launched:  # every chunked kernel computes in bf16: its DT, and its inputs q, k, v, phi as bf16
        assert str(launch.kwargs["DT"]) == "bf16", (launch.name, launch.kwargs["DT"])
    output = next(launch for launch in launched if launch.name == "_chunk_output")
    assert [t.dtype for t in output.args[:5]] == [torch.bfloat16] * 5
    states = next(launch for launch in launched if launch.name == "_chunk_states")
    assert states.args[5].dtype == torch.bfloat16  # the states each chunk reads (hkv)


def test_half_and_cpu_calls_compute_in_their_own_dtype_and_say_nothing(caplog):
    chunk._say_fp32_runs_in_bf16.cache_clear()
    caplog.set_level(logging.WARNING, logger=chunk.__name__)
    for dtype in (torch.bfloat16, torch.float16):
        with compile_check.record_launches() as launched:
            y = triton_attention(**meta_inputs(dtype, requires_grad=False), **OPTS)
        assert y.dtype == dtype
        assert {str(launch.kwargs["DT"]) for launch in launched} == {HALF[dtype]}
    assert chunk.compute_dtype(torch.empty(2, dtype=torch.float32)) == torch.float32  # (the interpreter: fp32)
    assert said(caplog) == []


def test_the_wrapper_says_what_an_fp32_call_computes():
    doc = " ".join(kernels.triton_hybrid_attention.__doc__.split())
    assert "An fp32 call on a GPU is not fp32: it computes in bf16" in doc
    assert "with fp32 accumulation, and returns y and the gradients in fp32; it logs that once per process" in doc
    assert "computes in bf16" in chunk.FP32_IN_BF16 and "accumulate in fp32" in chunk.FP32_IN_BF16


@GPU
@pytest.mark.gpu
def test_an_fp32_call_on_a_gpu_is_a_bf16_call_returned_in_fp32():
    """Compiled: an fp32 call's y is within 3e-2 of the fp64 spec (the docstring's promise), within bf16's rounding
    of y of a bf16 call on the same inputs (it is one), and its gradients are fp32."""
    x = make(1000, B=1, H=8, Hkv=2, D=128, F=256, device="cuda", seed=3)
    x["fq"], x["fk"] = (t.detach() / 128 for t in (x["fq"], x["fk"]))  # (hedgehog's features sum to 2)
    y = triton_attention(**x, **OPTS)
    y.sum().backward()
    with torch.no_grad():
        half = triton_attention(**{n: t.detach().to(torch.bfloat16 if n != "gamma" else t.dtype) for n, t in x.items()},
                                **OPTS)  # fmt: skip
        ref = naive.naive_hybrid_attention(**{n: t.detach().double() for n, t in x.items()}, **OPTS)
    print(f"fp32 call: max |y - y_ref| {(y.double() - ref).abs().max().item():.2e}, max |y - y_bf16| "
          f"{(y - half.float()).abs().max().item():.2e}")  # fmt: skip
    assert y.dtype == torch.float32 and x["q"].grad.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(y.detach(), half.float(), rtol=2**-8, atol=1e-3)
