"""What the hybrid attention is timed against, written once for every benchmark (benchmarks/device/: the speed
benchmark and the pipeline check's attention part, benchmarks/attention/kernels.py through benchmarks/registry.py):

- `sdpa_prefill`: causal SDPA over inputs {q [B,H,T,D], k, v [B,Hkv,T,D]}: on CUDA the flash kernel with the KV heads
  as they are (enable_gqa) when this torch has it, forward and backward (probed once), else k/v repeated to the query
  heads with the backend torch chooses; `sdpa_gqa` is SDPA with enable_gqa and no backend forced;
- `kv_cache_step`: one decode step of softmax attention over a static KV cache (the new token's k/v written into a
  preallocated [1, Hkv, ctx, D] cache with index_copy_, SDPA of its query over the whole cache), the step a hybrid
  decode step replaces; it writes the same slot every call, so it can be replayed (CUDA graphs) and timed;
- `fla_simple_gla`: fla-core's chunk_simple_gla (the linear-attention baseline; [B, T, H, *] inputs, a per-head
  constant decay `g_gamma` in log space), with the Triton autotuner of each of its kernels trimmed to `keep` configs
  (fla autotunes ~100 configs on a first call, about 2 minutes of a 5-minute device run), and `fla_inputs`, the
  hybrid's inputs in its layout. `g_gamma` rather than the per-token `g`: fla-core 0.6.0 refuses the backward with
  `g` on Hopper with triton < 3.7.1 (chunk_o.py: "produces incorrect results for gated chunk_bwd_dqkwg"), and the
  hybrid's decay is a per-head constant anyway (rho per KV head; g_gamma = -rho). fla gives g_gamma no gradient.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.report_table import one_line

FLA_MODULES = ("fla.ops.simple_gla", "fla.ops.common", "fla.ops.utils")  # where chunk_simple_gla's kernels live


def sdpa_gqa(x):
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)


def sdpa_flash(x):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)


def sdpa_repeat(x):
    rep = x["q"].shape[1] // x["k"].shape[1]
    k, v = x["k"].repeat_interleave(rep, 1), x["v"].repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(x["q"], k, v, is_causal=True)


def sdpa_prefill(shape: dict, device, dtype) -> tuple:
    """(the SDPA function to time, what it is): flash with enable_gqa where a probe at `shape` (256 tokens, forward
    and backward) runs on this CUDA device, else k/v repeated."""
    if torch.device(device).type != "cuda":
        return sdpa_repeat, "k/v repeated to the query heads, backend chosen by torch (CPU)"
    g = torch.Generator(device=device).manual_seed(0)
    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    probe = {
        n: torch.randn(1, h, 256, D, generator=g, device=device, dtype=dtype).requires_grad_()
        for n, h in (("q", H), ("k", Hkv), ("v", Hkv))
    }
    try:
        sdpa_flash(probe).sum().backward()
        return sdpa_flash, "flash kernel, is_causal, enable_gqa (KV heads not repeated)"
    except RuntimeError as e:
        return sdpa_repeat, f"k/v repeated, backend chosen by torch (flash with enable_gqa: {one_line(e)})"


def kv_cache_step(x: dict, ctx: int):
    """(step, bytes of the cache): the static KV cache of x's first ctx - 1 tokens (k, v [1, Hkv, T, D], T >= ctx);
    step() writes token ctx - 1's k/v into slot ctx - 1 and returns SDPA of its query over the ctx slots."""
    kc = torch.zeros_like(x["k"][:, :, :ctx])
    vc = torch.zeros_like(kc)
    kc[:, :, : ctx - 1], vc[:, :, : ctx - 1] = x["k"][:, :, : ctx - 1], x["v"][:, :, : ctx - 1]
    q1, k1, v1 = (x[n][:, :, ctx - 1 : ctx].clone() for n in "qkv")
    pos = torch.tensor([ctx - 1], device=kc.device)

    def step():
        kc.index_copy_(2, pos, k1)
        vc.index_copy_(2, pos, v1)
        return F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True)

    return step, 2 * kc.numel() * kc.element_size()


def pick_configs(configs: list, keep: int) -> list:
    """`keep` of an autotuner's configs: those nearest 4 warps and 2 stages (the least shared memory of the usual),
    the one with the smallest tiles first (it fits anywhere), then the largest, then the rest in order."""
    ranked = sorted(configs, key=lambda c: (abs(c.num_warps - 4), abs(c.num_stages - 2)))
    first = ranked[0]
    best = [c for c in ranked if (c.num_warps, c.num_stages) == (first.num_warps, first.num_stages)]
    by_size = sorted(best, key=lambda c: math.prod(v for v in c.kwargs.values() if isinstance(v, int)))
    out = []
    for c in [by_size[0], by_size[-1], *ranked]:
        if len(out) < keep and c not in out:
            out.append(c)
    return out


def autotuner_of(obj):
    """The triton Autotuner inside a kernel object (under its heuristics), or None."""
    try:
        from triton.runtime.autotuner import Autotuner  # noqa: PLC0415
    except ImportError:
        return None
    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def trim_autotune(prefixes: tuple, keep: int) -> dict:
    """Every autotuned kernel of the loaded modules under `prefixes` left with at most `keep` configs; returns
    {module.kernel: [configs before, after]}."""
    trimmed = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            tuner = autotuner_of(value)
            if tuner is None or len(tuner.configs) <= keep:
                continue
            before = len(tuner.configs)
            tuner.configs = pick_configs(list(tuner.configs), keep)
            trimmed[f"{name}.{attr}"] = [before, len(tuner.configs)]
    return trimmed


def fla_simple_gla(keep: int = 2) -> tuple:
    """(chunk_simple_gla or None, why not, {kernel: [configs before, after]}): its autotuners trimmed to `keep`
    configs each (0: fla's own autotuning, untouched)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: PLC0415  (the baseline: optional)
    except Exception as e:  # noqa: BLE001  (not installed, or it does not import with this torch / triton)
        return None, one_line(e), {}
    return chunk_simple_gla, None, trim_autotune(FLA_MODULES, keep) if keep else {}


def fla_inputs(x: dict, rho: torch.Tensor) -> dict:
    """The hybrid's phi_q, phi_k and v in fla's layout ([B, T, H, *], KV heads repeated to the query heads) and its
    decay as fla's g_gamma ([H], log space: -rho of each head's KV head)."""
    H = x["q"].shape[1]
    out = {}
    for n in ("fq", "fk", "v"):
        t = x[n].repeat_interleave(H // x[n].shape[1], 1) if x[n].shape[1] != H else x[n]
        out[n] = t.transpose(1, 2).contiguous()
    out["g_gamma"] = (-rho.float().repeat_interleave(H // rho.shape[0])).contiguous()
    return out


def fla_call(chunk_simple_gla):
    """The function of fla_inputs' dict that a benchmark times: o [B, T, H, D] (scale 1; fla has no normaliser)."""

    def run(z):
        return chunk_simple_gla(z["fq"], z["fk"], z["v"], g_gamma=z["g_gamma"], scale=1.0)[0]

    return run
