"""The attention benchmarks' one registry: the head shapes they time (the model presets' own, read from
configs/models/), the inputs built at a shape, and the backends to time, each a function of those inputs.

- PREFILL: the hybrid's own backends (`naive`, the spec; `torch`, the chunked path; `triton`, the Triton kernels when
  installed), which `python -m benchmarks.run --verify` checks against `naive` before anything is timed;
- BASELINES: what the hybrid is compared with (SDPA, benchmarks/baselines.py's; FlashAttention and fla-core's
  chunk_linear_attn when they import), never checked against the spec (they compute other attentions);
- DECODE: one token per step after a prefill (`torch`: recurrent.extend; `triton`: the fused decode step), also
  checked against the spec, and the softmax KV-cache step it replaces (`kv_cache`, a baseline).

Every benchmark of the attention (benchmarks/run.py, the device harness's, benchmarks/device/) takes its shapes and
inputs from here; tests/unit/test_benchmarks.py checks that the shapes are the presets'.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.baselines import sdpa_gqa, sdpa_prefill
from hybrid_scale.attention import backends
from hybrid_scale.attention import layer as hybrid
from hybrid_scale.attention.hedgehog import naive
from hybrid_scale.attention.hedgehog.feature_maps import make_feature_map
from hybrid_scale.attention.hedgehog.recurrent import extend
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.shape import Shape
from hybrid_scale.attention.window.recurrent import DecodeState
from hybrid_scale.config import load_config

WINDOW, SINKS = 64, 8  # the presets' window and sinks (configs/models/*.yaml)


def preset_shape(preset: str) -> dict:
    """A model preset's attention: query heads H, KV heads Hkv, head dim D, feature dim F (the feature map's)."""
    cfg = load_config(f"models/{preset}.yaml")
    arch, a = cfg.model.arch, cfg.attention
    d = arch.head_dim or arch.hidden_size // arch.num_attention_heads
    f = make_feature_map(a.feature_map, 1, d, a.feature_dim).out_dim
    return dict(H=arch.num_attention_heads, Hkv=arch.num_key_value_heads, D=d, F=f)


SHAPES = {  # the embedded default's and the main job's
    "smollm2-135m": preset_shape("smollm2-135m"),
    "llama3-8b": preset_shape("llama3-8b"),
}
SMALL_SHAPES = {"tiny": dict(H=3, Hkv=1, D=16, F=32)}  # the CPU dry runs (the Triton interpreter)


def shapes_named(names: str | list[str]) -> dict[str, dict]:
    """SHAPES (and SMALL_SHAPES) by name, comma-separated; one clear error for a name that is not there."""
    known = SHAPES | SMALL_SHAPES
    names = names.split(",") if isinstance(names, str) else names
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"benchmarks: unknown shape {', '.join(unknown)}; the registry has {', '.join(known)}")
    return {n: known[n] for n in names}


def inputs(shape: dict, T: int, device="cpu", dtype=torch.float32, seed: int = 0) -> dict:
    """One attention call's inputs at `shape` and T tokens, batch 1: q, k, v, the feature maps' outputs (Hedgehog-like:
    two softmaxes over F/2 features) and gamma (0.1 for every head)."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, Hkv, D, Fd = shape["H"], shape["Hkv"], shape["D"], shape["F"]

    def r(*s):
        return torch.randn(*s, generator=g, device=device, dtype=dtype)

    def features(heads):
        x = torch.randn(1, heads, T, Fd // 2, generator=g, device=device)
        return torch.cat([x.softmax(-1), (-x).softmax(-1)], -1).to(dtype)

    gamma = torch.full((H,), 0.1, device=device)
    return dict(q=r(1, H, T, D), k=r(1, Hkv, T, D), v=r(1, Hkv, T, D), fq=features(H), fk=features(Hkv), gamma=gamma)


def _spec(window: int) -> Callable:
    def run(x):
        return naive.naive_hybrid_attention(x["q"], x["k"], x["v"], x["fq"], x["fk"], x["gamma"], window=window)

    return run


def _hybrid_on(backend: str, window: int) -> Callable:
    def run(x):
        return hybrid.attend(x["q"], x["k"], x["v"], x["fq"], x["fk"], gamma=x["gamma"], window=window,
                             backend=backend)  # fmt: skip

    return run


def triton_runs_on(device) -> bool:
    """The Triton kernels are installed and can run here (a CUDA device, or the Triton interpreter on a CPU)."""
    import os  # noqa: PLC0415

    if "triton" not in backends.available():
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def prefill(window: int = WINDOW, device="cpu") -> dict[str, Callable]:
    """The hybrid's backends: `naive` (the spec) first, then the fast ones that run on `device` (the kernels first)."""
    out = {"naive": _spec(window)}
    if triton_runs_on(device):
        out["triton"] = _hybrid_on("triton", window)
    return out | {"torch": _hybrid_on("torch", window)}


def flash_attn_func():
    try:
        from flash_attn import flash_attn_func as fn  # noqa: PLC0415  (optional: measured when installed)
    except ImportError:
        return None
    return fn


def fla_chunk_linear_attn():
    """flash-linear-attention's chunked linear attention (fla-core), the reference for linear-attention kernels, or
    None when it does not import."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: PLC0415  (optional: measured when installed)
    except Exception:  # noqa: BLE001  (not installed, or a triton it cannot use)
        return None
    return chunk_linear_attn


sdpa = sdpa_gqa  # (causal, enable_gqa, the backend torch chooses: benchmarks/attention/scaling.py's)


def baselines(device="cpu", shape: dict | None = None, dtype=torch.float32) -> dict[str, Callable]:
    """What the hybrid is timed against: SDPA (benchmarks/baselines.py's sdpa_prefill at `shape`: flash with
    enable_gqa on CUDA where it runs), FlashAttention (if importable), fla's la_only part (on CUDA)."""
    out = {"sdpa": sdpa_prefill(shape, device, dtype)[0] if shape else sdpa}
    fa = flash_attn_func()
    if fa is not None:
        out["flash_attn"] = lambda x: fa(*(x[n].transpose(1, 2) for n in "qkv"), causal=True).transpose(1, 2)
    fla = fla_chunk_linear_attn() if torch.device(device).type == "cuda" else None
    if fla is not None:  # la_only's math (phi_q, phi_k, v; normalised), its GQA groups repeated to every head

        def fla_la(x):
            rep = x["q"].shape[1] // x["k"].shape[1]
            q, k, v = (
                t.repeat_interleave(rep, 1) if t.shape[1] != x["q"].shape[1] else t for t in (x["fq"], x["fk"], x["v"])
            )
            y, _ = fla(*(t.transpose(1, 2) for t in (q, k, v)), scale=1.0, normalize=True)
            return y.transpose(1, 2)

        out["fla"] = fla_la
    return out


def decode_backends(device="cpu") -> list[str]:
    """The hybrid's decode steps that run on `device` (DECODE's names; `kv_cache` is the baseline beside them)."""
    return ["triton", "torch"] if triton_runs_on(device) else ["torch"]


def decode_state(shape: dict, x: dict, ctx: int, window: int, device, dtype, backend: str) -> DecodeState:
    """A decode state after a prefill of x's first ctx tokens."""
    state = DecodeState.empty(
        Shape(
            kv_heads=shape["Hkv"],
            head_dim=shape["D"],
            value_dim=shape["D"],
            features=shape["F"],
            window=window,
            sinks=SINKS,
            dtype=dtype,
        ),
        1,
        window,
        device,
    )
    kernels = backends.get_backend("triton") if backend == "triton" else None
    with torch.no_grad():
        extend(state, *(x[k][:, :, :ctx] for k in ("q", "k", "v", "fq", "fk")), x["gamma"], window=window,
               prefill=kernels)  # fmt: skip
    return state


def decode_step(state: DecodeState, x: dict, t: int, window: int, backend: str):
    """Token t of x through the decode step of `backend`; its output [1, H, 1, D]."""
    token = (x[k][:, :, t : t + 1] for k in ("q", "k", "v", "fq", "fk"))
    with torch.no_grad():
        if backend == "triton":
            return backends.get_decode("triton")(state, *token, x["gamma"], AttentionOptions(window=window))
        return extend(state, *token, x["gamma"], window=window)


class Clock:
    """Median milliseconds of `repeats` calls after `warmup` (CUDA events on a GPU); peak memory above the inputs."""

    def __init__(self, device, warmup, repeats):
        self.cuda = torch.device(device).type == "cuda"
        self.warmup, self.repeats = warmup, repeats

    def ms(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    def peak_mib(self, fn):
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
