"""Part 1b, delta: fla-core's gated delta-rule kernel (`chunk_gated_delta_rule`, through the toolkit's wrapper
hybrid_scale_kernels/gated_delta.py, the gated delta rule's implementation "fla") against the toolkit's chunked torch
form (attention/gated_delta/chunk.py's chunk_gated_delta, itself checked against the spec loop on CPU), issue 59's
check that no GPU had run: fp32, Llama-3-8B's attention shape (32 heads, 8 KV heads, head dim 128), T = delta_T with
an initial state; the max relative error (max |a - b| / max |b|) of the output, the final state and the gradient of
every input (of a random weighting of both), each against TOLERANCE. Also the registry's own verdict on this GPU: the
self-check at the same shape and what `attention.backend=auto` then picks.

fla's autotuned kernels keep `fla_configs` configs each (benchmarks/baselines.py's trim_autotune), as in part prefill.
In the dry run fla's Triton kernel cannot run (it needs CUDA): the spec loop (implementation "naive") stands in for it,
recorded as such, so the comparison's code runs on CPU with a torch form on both sides; a GPU without fla-core skips
the part and says why."""

from __future__ import annotations

import importlib
import importlib.util
import time

import torch

from benchmarks.baselines import trim_autotune
from benchmarks.device.run import Run
from benchmarks.report_table import fmt, table
from hybrid_scale.attention import backends
from hybrid_scale.attention.gated_delta.chunk import chunk_gated_delta
from hybrid_scale.attention.gated_delta.naive import l2norm
from hybrid_scale.attention.kinds import GATED_DELTA
from hybrid_scale.attention.shape import Shape

FLA_MODULES = ("fla.ops.gated_delta_rule", "fla.ops.common", "fla.ops.utils")  # where its kernels live
NAMES = ("q", "k", "v", "beta", "g", "initial_state")
# fla computes its products in tf32 (10 bits of mantissa: about 5e-4 per rounding, over T / 64 chunks of state);
# the registry's self-check, which decides whether auto uses fla, allows 1e-2 of (1 + the largest value)
TOLERANCE = 1e-2


def delta_inputs(shape: dict, T: int, device, seed: int = 0) -> dict:
    """q, k (L2-normalised, as the layer gives them), v, beta in (0, 1), log-decay g in (-0.3, 0), an initial state."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    x = dict(q=l2norm(torch.randn(1, H, T, D, generator=g)), k=l2norm(torch.randn(1, Hkv, T, D, generator=g)),
             v=torch.randn(1, Hkv, T, D, generator=g), beta=torch.rand(1, Hkv, T, generator=g),
             g=-0.3 * torch.rand(1, Hkv, T, generator=g),
             initial_state=torch.randn(1, Hkv, D, D, generator=g))  # fmt: skip
    return {n: t.to(device) for n, t in x.items()}


def outputs_and_grads(fn, x: dict) -> dict:
    """fn's output o and final state S, and the gradient of every input of sum(o * w) + sum(S * u) (w, u fixed; zero
    for an input fn does not use)."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, S = fn(**leaves)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(o.shape, generator=gen).to(o.device)
    u = torch.randn(S.shape, generator=gen).to(S.device)
    loss = (o.float() * w).sum() + (S.float() * u).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # (an input it ignores: a zero)
    out = dict(o=o.detach().float(), S=S.detach().float())
    for (name, t), d in zip(leaves.items(), grads, strict=True):
        out[f"d{name}"] = (torch.zeros_like(t) if d is None else d).float()
    return out


def errors(tested: dict, reference: dict) -> dict[str, float]:
    """Each tensor's max |a - b| / max |b| (absolute where b is all zero; NaN stays NaN)."""
    out = {}
    for name, ref in reference.items():
        scale = ref.abs().max().item()
        out[name] = (tested[name] - ref).abs().max().item() / (scale if scale > 0 else 1.0)
    return out


def implementation(run: Run) -> tuple[str | None, str]:
    """(the implementation to test, what it is), or (None, why the part is skipped)."""
    if not run.cuda:
        return "naive", "dry run: fla's Triton kernel needs CUDA; the spec loop (gated_delta/naive.py) stands in for it"
    if importlib.util.find_spec("fla") is None:
        return None, "fla-core is not installed here (make gpu-wheels puts it into .whl/; carry .whl)"
    importlib.import_module("fla.ops.gated_delta_rule")
    trimmed = trim_autotune(FLA_MODULES, run.cfg["fla_configs"]) if run.cfg["fla_configs"] else {}
    return "fla", f"fla-core's chunk_gated_delta_rule ({len(trimmed)} autotuned kernels trimmed)"


def part_delta(run: Run) -> dict:
    cfg, s = run.cfg, run.cfg["shape"]
    name, what = implementation(run)
    if name is None:
        return dict(skipped_part=what)
    fn = backends.get_backend(name, GATED_DELTA.name)
    x = delta_inputs(s, cfg["delta_T"], run.device)
    t0 = time.perf_counter()
    tested = outputs_and_grads(fn, x)
    seconds = time.perf_counter() - t0
    found = errors(tested, outputs_and_grads(chunk_gated_delta, x))
    over = sorted(n for n, e in found.items() if not e <= TOLERANCE)  # (NaN is over)
    shape = Shape(s["H"], s["Hkv"], s["D"], s["D"], s["D"], cfg["window"], cfg["sinks"], torch.float32,
                  la_kind=GATED_DELTA.name)  # fmt: skip
    check = backends.self_check(name, run.device, shape=shape)
    auto = backends.resolve("auto", run.device, shape)
    print(f"device_speed: delta {name} vs chunk_gated_delta: {', '.join(f'{n} {e:.2e}' for n, e in found.items())}; "
          f"self-check: {check or 'passed'}; auto picks {auto}", flush=True)  # fmt: skip
    result = dict(tested=name, what=what, T=cfg["delta_T"], errors=found, tolerance=TOLERANCE, over=over,
                  self_check=check, auto=auto, first_call_s=seconds)  # fmt: skip
    if over:
        result["failed"] = f"{', '.join(over)} over {TOLERANCE:g} against the torch form"
    return result


def section(d: dict) -> list[str]:
    """The report's section of part delta (none when it did not run)."""
    r = d.get("delta")
    if not r:
        return []
    lines = ["", "## 1b. fla's gated delta rule against the torch form", ""]
    if r.get("skipped_part"):
        return lines + [f"Not run: {r['skipped_part']}."]
    lines += [f"Tested: `{r['tested']}` ({r['what']}); reference: `chunk_gated_delta` (fp32, chunks of 64); T "
              f"{r['T']}, an initial state; the first call (compiles and autotunes) took {fmt(r['first_call_s'])} s. "
              f"The registry's self-check at this shape: {r['self_check'] or 'passed'}; attention.backend=auto picks "
              f"`{r['auto']}`.", ""]  # fmt: skip
    rows = [[n, fmt(e), r["tolerance"], "FAILED" if n in r["over"] else "ok"] for n, e in r["errors"].items()]
    return lines + table(["tensor", "max rel. error", "tolerance", "status"], rows)
