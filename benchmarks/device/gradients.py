"""Part 1, grad: a bf16 forward and backward of `hybrid_scale_kernels.triton_hybrid_attention` at the Llama-3-8B
attention shape (B 1, H 32, Hkv 8, head dim 128, feature dim 256 of hedgehog-like positive features, window 64, the
hybrid's 8 sinks, LA decay; T 4096; modes hybrid and la_only) against the chunked torch path
(`hybrid_scale.attention.hedgehog.chunk.chunk_hybrid_attention`) in fp32 on the same bf16-rounded inputs and output
gradient. Per tensor (y, and the gradients of q, k, v, phi_q, phi_k, gamma and rho) the max relative error
max |a - b| / max |b| (the absolute error where the reference is all zero, e.g. gamma's gradient in la_only), against
TOL. bf16 carries 2^-8 relative; y is an average of values of size ~1, each gradient a sum over up to T terms
accumulated in fp32 by both, so the bounds are a few bf16 units: 2e-2 for y, 5e-2 for every gradient. In the dry run
the tested function is the chunked path itself in the run's dtype (no Triton on a CPU): the part's code runs, its
errors are ~0 by construction."""

from __future__ import annotations

import time

import torch

from benchmarks.device.run import Run, out_of_time
from benchmarks.registry import inputs as attention_inputs
from benchmarks.report_table import one_line
from hybrid_scale.attention.options import AttentionOptions

TOL = {"y": 2e-2, "q": 5e-2, "k": 5e-2, "v": 5e-2, "fq": 5e-2, "fk": 5e-2, "gamma": 5e-2, "rho": 5e-2}
LEAVES = ("q", "k", "v", "fq", "fk", "gamma", "rho")
MODES = ("hybrid", "la_only")


def tested(run: Run):
    """(the function under test, its name)."""
    from hybrid_scale.attention.hedgehog.chunk import chunk_hybrid_attention  # noqa: PLC0415

    if not run.cuda:
        return chunk_hybrid_attention, "chunk_hybrid_attention in the run's dtype (dry run: no Triton on a CPU)"
    import hybrid_scale_kernels  # noqa: PLC0415

    return hybrid_scale_kernels.triton_hybrid_attention, "hybrid_scale_kernels.triton_hybrid_attention"


def value_and_grads(fn, x: dict, gy: torch.Tensor, opts: dict) -> dict:
    """{y, and each leaf's gradient (None: the function gave it none)} of fn at x, backward from gy."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    y = fn(*(leaves[n] for n in LEAVES[:6]), AttentionOptions(**opts), la_decay=leaves["rho"])
    grads = torch.autograd.grad(y, list(leaves.values()), gy, allow_unused=True)
    return {"y": y.detach(), **dict(zip(LEAVES, grads, strict=True))}


def relative_error(a, b) -> float:
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a  # (no gradient: a zero one, e.g. gamma's in la_only)
    b = torch.zeros_like(a) if b is None else b
    diff = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    return diff / scale if scale > 0 else diff


def part_gradients(run: Run) -> dict:
    cfg, s = run.cfg, run.cfg["shape"]
    end = run.part_deadline("grad")
    T = cfg["grad_T"]
    fn, name = tested(run)
    from hybrid_scale.attention.hedgehog.chunk import chunk_hybrid_attention  # noqa: PLC0415

    x = attention_inputs(s, T, run.device, run.dtype, seed=1)
    x["rho"] = torch.linspace(0.01, 0.1, s["Hkv"], device=run.device)
    g = torch.Generator(device=run.device).manual_seed(2)
    gy = torch.randn(x["q"].shape, generator=g, device=run.device, dtype=run.dtype)
    ref_x = {n: t.float() for n, t in x.items()}  # the same (bf16-rounded) values in fp32
    rows = []
    for mode in MODES:
        row = dict(mode=mode, T=T)
        why = out_of_time(end, f"the grad budget ({cfg['budgets']['grad']:.0f} s)")
        if why:
            rows.append(row | {"skipped": why})
            continue
        opts = dict(window=cfg["window"], mode=mode, sinks=cfg["sinks"], hybrid_sinks=mode == "hybrid")
        t0 = time.perf_counter()
        try:
            got = value_and_grads(fn, x, gy, opts)
            ref = value_and_grads(chunk_hybrid_attention, ref_x, gy.float(), opts)
        except torch.cuda.OutOfMemoryError:
            rows.append(row | {"skipped": "out of memory"})
            continue
        except Exception as e:  # noqa: BLE001  (one mode failing must not lose the other)
            rows.append(row | {"skipped": one_line(e), "error": one_line(e)})
            continue
        row["seconds"] = time.perf_counter() - t0
        row["errors"] = {n: relative_error(got[n], ref[n]) for n in TOL}
        row["failed"] = sorted(n for n, e in row["errors"].items() if not e <= TOL[n])  # (NaN fails too)
        del got, ref
        run.free()
        rows.append(row)
        print(f"device_speed: grad {mode}: {row['errors']} {'FAILED ' + str(row['failed']) if row['failed'] else 'ok'}")
    failed = any(r.get("failed") or r.get("error") for r in rows)
    return dict(rows=rows, tested=name, reference="chunk_hybrid_attention, fp32", tolerances=TOL, failed=failed)
