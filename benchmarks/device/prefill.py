"""Part 2, prefill: forward and forward+backward at T = 4096 and 16384 of the hybrid (`hybrid.attend(...,
backend="triton")`, modes hybrid and la_only) against SDPA (benchmarks/baselines.py: flash, causal, GQA) and fla-core's
chunk_simple_gla with g_gamma = -rho (baselines.fla_simple_gla: its autotuners trimmed; its inputs laid out in its
layout before the clock starts; scale 1; fla has no normaliser and gives g_gamma no gradient).

Every method is first compiled, autotuned and warmed at warm_T (1024; the attention backend's self-check runs there,
on its first call), forward and backward, so no clock holds a compile (the budget prefill_warm). Then each length gets
an equal share of the rows' budget (prefill; a length that finishes early leaves its time to the next), checked before
every row; a row not measured says why. A method whose backward raises (in the warm-up or at a length) keeps its
forward and records the backward's one-line error. CUDA events, median of `repeats` calls after `warmup`; peak memory =
max_memory_allocated above the inputs (reset before each). Each row keeps its own ratios to SDPA and to fla."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from benchmarks import baselines
from benchmarks.device.run import Run, out_of_time, until
from benchmarks.registry import Clock
from benchmarks.registry import inputs as attention_inputs
from benchmarks.report_table import fmt, one_line, skipped_row, table

METHODS = ("sdpa", "hybrid", "la_only", "fla")
PAIRS = (("hybrid", "sdpa"), ("la_only", "sdpa"), ("hybrid", "fla"), ("la_only", "fla"))


class Method(NamedTuple):
    fn: Callable  # of its inputs -> its output
    grads: tuple  # the inputs it differentiates
    layout: Callable  # the hybrid's inputs -> its own (made before the clock starts)
    out_grad: Callable  # the hybrid's output gradient -> its own


def same(x):
    return x


def hybrid_method(run: Run, mode: str) -> Method:
    """hybrid.attend in `mode` with the 8B preset's settings (window, the hybrid's own sinks, LA decay rho)."""
    from hybrid_scale.attention import layer as hybrid  # noqa: PLC0415

    cfg = run.cfg
    opts = dict(window=cfg["window"], sinks=cfg["sinks"], hybrid_sinks=True, backend=cfg["backend"], mode=mode)

    def fn(z):
        return hybrid.attend(z["q"], z["k"], z["v"], z["fq"], z["fk"], gamma=z["gamma"], la_decay=z["rho"], **opts)

    return Method(fn, ("q", "k", "v", "fq", "fk", "gamma", "rho"), same, same)


def methods(run: Run) -> tuple[dict, dict, dict]:
    """({name: Method} of what can run here, {name: why not} of what cannot, {what SDPA and fla are})."""
    cfg = run.cfg
    sdpa, sdpa_kind = baselines.sdpa_prefill(cfg["shape"], run.device, run.dtype)
    out = {"sdpa": Method(sdpa, ("q", "k", "v"), same, same)}
    why, info = {}, {"sdpa": sdpa_kind}
    out |= {mode: hybrid_method(run, mode) for mode in ("hybrid", "la_only")}
    if run.cuda:
        chunk_simple_gla, fla_why, trimmed = baselines.fla_simple_gla(cfg["fla_configs"])
    else:
        chunk_simple_gla, fla_why, trimmed = None, "dry run: fla's kernels need CUDA", {}
    info["fla"] = fla_why or "chunk_simple_gla(phi_q, phi_k, v, g_gamma=-rho, scale=1)"
    info["fla_autotune"] = (
        f"{len(trimmed)} autotuned kernels trimmed to at most {cfg['fla_configs']} configs each: {trimmed}"
        if trimmed else "fla's own autotuning" if chunk_simple_gla else "n/a"
    )  # fmt: skip
    if chunk_simple_gla is None:
        why["fla"] = f"fla: {fla_why}"
    else:
        out["fla"] = Method(
            baselines.fla_call(chunk_simple_gla),
            ("fq", "fk", "v"),
            lambda x: baselines.fla_inputs(x, x["rho"]),
            lambda gy: gy.transpose(1, 2).contiguous(),
        )
    return out, why, info


def prefill_inputs(run: Run, T: int) -> tuple[dict, torch.Tensor]:
    s = run.cfg["shape"]
    x = attention_inputs(s, T, run.device, run.dtype, seed=T)
    x["rho"] = torch.linspace(0.01, 0.1, s["Hkv"], device=run.device)
    g = torch.Generator(device=run.device).manual_seed(T + 1)
    return x, torch.randn(x["q"].shape, generator=g, device=run.device, dtype=run.dtype)


def calls(method: Method, x: dict, gy: torch.Tensor):
    """(fwd, fwd_bwd, clear): the timed calls on the method's own inputs, laid out here (before any clock)."""
    z = method.layout(x)
    zg = {n: t.detach().requires_grad_(n in method.grads) for n, t in z.items()}
    og = method.out_grad(gy)

    def fwd():
        with torch.no_grad():
            return method.fn(z)

    def clear():
        for t in zg.values():
            t.grad = None

    def fwd_bwd():
        clear()
        method.fn(zg).backward(og)

    return fwd, fwd_bwd, clear


def warm_up(run: Run, method: Method, x: dict, gy: torch.Tensor) -> dict:
    """One forward and one forward+backward (compiles, autotunes, self-checks): seconds, and the errors if any."""
    fwd, fwd_bwd, clear = calls(method, x, gy)
    t0 = time.perf_counter()
    out = {}
    try:
        fwd()
    except Exception as e:  # noqa: BLE001
        return dict(seconds=time.perf_counter() - t0, error=one_line(e))
    try:
        fwd_bwd()
    except Exception as e:  # noqa: BLE001  (fla's backward may raise where its forward runs: the forward is kept)
        out["bwd_error"] = one_line(e)
    clear()
    if run.cuda:
        torch.cuda.synchronize()
    return out | {"seconds": time.perf_counter() - t0}


def measure(run: Run, method: Method, x: dict, gy: torch.Tensor, row: dict) -> None:
    """The row's forward, then (unless its backward is known to raise) its forward+backward: ms and peak MiB."""
    clock = Clock(run.device, run.cfg["warmup"], run.cfg["repeats"])
    fwd, fwd_bwd, clear = calls(method, x, gy)
    try:
        row["finite"] = bool(torch.isfinite(fwd()).all())
        row["fwd_ms"] = clock.ms(fwd)
        row["fwd_peak_mib"] = clock.peak_mib(fwd)
    except torch.cuda.OutOfMemoryError:
        row["skipped"] = "out of memory"
        return
    except Exception as e:  # noqa: BLE001  (one method failing must not lose the others)
        row["skipped"] = row["error"] = one_line(e)
        return
    if "bwd_error" in row:
        return
    try:
        row["fwd_bwd_ms"] = clock.ms(fwd_bwd)
        clear()
        row["fwd_bwd_peak_mib"] = clock.peak_mib(fwd_bwd)
    except torch.cuda.OutOfMemoryError:
        row["bwd_error"] = "out of memory"
    except Exception as e:  # noqa: BLE001  (the forward's figures stay)
        row["bwd_error"] = one_line(e)
    clear()


def row_ratios(rows: list[dict]) -> None:
    """Each row's own ratios to SDPA's and fla's rows at its length: fwd_x_sdpa, fwd_bwd_x_sdpa, mem_x_sdpa, ..."""
    by = {r["method"]: r for r in rows}
    for r in rows:
        for base in ("sdpa", "fla"):
            ref = by.get(base, {})
            for key, tag in (("fwd_ms", "fwd"), ("fwd_bwd_ms", "fwd_bwd"), ("fwd_bwd_peak_mib", "mem")):
                if r.get(key) and ref.get(key):
                    r[f"{tag}_x_{base}"] = r[key] / ref[key]


def part_prefill(run: Run) -> dict:
    cfg = run.cfg
    warm_end = run.part_deadline("prefill_warm")
    found, missing, info = methods(run)
    warm = {}
    x, gy = prefill_inputs(run, cfg["warm_T"])
    for name, method in found.items():
        why = out_of_time(warm_end, f"the warm-up budget ({cfg['budgets']['prefill_warm']:.0f} s)")
        warm[name] = {"error": why, "seconds": 0.0} if why else warm_up(run, method, x, gy)
        print(f"device_speed: prefill warm-up {name} at T={cfg['warm_T']}: {json.dumps(warm[name])}", flush=True)
    del x, gy
    end = run.part_deadline("prefill")  # the rows' own budget, from the end of the warm-up
    rows = []
    for i, T in enumerate(cfg["lengths"]):
        limit = until(end, len(cfg["lengths"]) - i)
        share = max(0.0, limit - time.monotonic())
        x, gy = prefill_inputs(run, T)
        at = []
        for name in METHODS:
            row = dict(T=T, method=name)
            w = warm.get(name, {})
            why = missing.get(name) or (w.get("error") and f"warm-up at T={cfg['warm_T']}: {w['error']}")
            why = why or out_of_time(limit, f"T={T}'s share of the prefill budget ({share:.0f} s)")
            if why:
                at.append(row | {"skipped": why})
                continue
            if "bwd_error" in w:
                row["bwd_error"] = f"(warm-up) {w['bwd_error']}"
            measure(run, found[name], x, gy, row)
            run.free()
            at.append(row)
            print(f"device_speed: prefill {json.dumps(row)}", flush=True)
        row_ratios(at)
        rows += at
        by = {r["method"]: r for r in at}
        if by["hybrid"].get("fwd_bwd_ms"):
            run.ratio(f"prefill fwd+bwd hybrid ms, T={T}", by["hybrid"]["fwd_bwd_ms"])
        for a, b in PAIRS:
            for tag, what in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
                if by[a].get(f"{tag}_x_{b}") is not None:
                    run.ratio(f"prefill {what} {a}/{b}, T={T}", by[a][f"{tag}_x_{b}"])
        if by["hybrid"].get("mem_x_sdpa") is not None:
            run.ratio(f"prefill fwd+bwd peak memory hybrid/sdpa, T={T}", by["hybrid"]["mem_x_sdpa"])
        del x, gy
        run.free()
    return dict(rows=rows, warm=warm, warm_T=cfg["warm_T"], **info)


def section(d: dict) -> list[str]:
    """The report's section of part prefill (none when it did not run)."""
    a = d.get("prefill")
    if not a:
        return []
    warm = "; ".join(f"{k} {fmt(w['seconds'])} s" + "".join(f" ({w[e]})" for e in ("error", "bwd_error") if w.get(e))
                     for k, w in a["warm"].items())  # fmt: skip
    lines = ["", "## 2. Prefill, forward and forward+backward", "",
             f"SDPA: {a['sdpa']}. fla: {a['fla']} (autotune: {a['fla_autotune']}). Peak: max_memory_allocated above "
             f"the inputs (reset before each). Warm-up (compile, autotune, self-check) at T={a['warm_T']}, outside "
             f"every clock: {warm}.", ""]  # fmt: skip
    rows = []
    for r in a["rows"]:
        if "skipped" in r:
            rows.append(skipped_row([r["T"], r["method"]], r["skipped"]))
            continue
        rows.append([r["T"], r["method"], *(fmt(r.get(k)) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_peak_mib",
                     "fwd_bwd_peak_mib", "fwd_x_sdpa", "fwd_bwd_x_sdpa", "fwd_x_fla", "fwd_bwd_x_fla", "mem_x_sdpa")),
                     f"backward: {r['bwd_error']}" if r.get("bwd_error") else ""])  # fmt: skip
    head = ["T", "method", "fwd ms", "fwd+bwd ms", "fwd peak MiB", "fwd+bwd peak MiB", "fwd x SDPA", "fwd+bwd x SDPA",
            "fwd x fla", "fwd+bwd x fla", "mem x SDPA", "note"]  # fmt: skip
    return lines + table(head, rows)
