"""Part 4, profile: one torch.profiler pass over the hybrid's forward+backward at T = profile_T (prefill.py's hybrid
method, already compiled by the prefill part) and over one decode step of the hybrid (decode.py's converted 4-layer
model at its batch, eager; the step part decode left, else built here), each written into the report as a table of
CUDA kernels: microseconds and launches per call, the longest first (benchmarks/device/timing.py's kernel_tables; a
kernel is counted where its start falls in a function's time range, `unplaced` where in neither)."""

from __future__ import annotations

import torch

from benchmarks.device import decode, prefill
from benchmarks.device.run import Run, out_of_time
from benchmarks.device.timing import kernel_tables
from benchmarks.report_table import fmt, one_line, table
from hybrid_scale import convert_model


def decode_step(run: Run):
    """(the hybrid's eager decode step, what it is): the one part decode left, else a model built and converted."""
    if "decode_step" in run.kept:
        return run.kept.pop("decode_step")
    d = run.cfg["decode"]
    model = convert_model(decode.llama(run, run.cfg["model"], d["prompt"] + 64), decode.attention_settings(run))
    step, _ = decode.hybrid_step(model, d["batch"], d["prompt"])
    return step, f"hybrid decode step, B={d['batch']}, {run.cfg['model']['layers']} layers"


def part_profile(run: Run) -> dict:
    cfg = run.cfg
    end = run.part_deadline("profile")
    T = cfg["profile_T"]
    x, gy = prefill.prefill_inputs(run, T)
    _, fwd_bwd, _ = prefill.calls(prefill.hybrid_method(run, "hybrid"), x, gy)
    step, what = decode_step(run)
    why = out_of_time(end, f"the profile budget ({cfg['budgets']['profile']:.0f} s)")
    if why:
        return dict(skipped_part=why)
    try:
        tables = kernel_tables(run.cuda, {"fwd_bwd": fwd_bwd, "decode": step}, cfg["profile_steps"])
    except torch.cuda.OutOfMemoryError:
        return dict(failed="out of memory")
    except Exception as e:  # noqa: BLE001
        return dict(failed=one_line(e))
    tables["fwd_bwd"]["what"], tables["decode"]["what"] = f"hybrid fwd+bwd, T={T}", what
    for t in tables.values():
        print(f"device_speed: profile {t['what']}: {t['total_us']:,.1f} us per call", flush=True)
    run.free()
    return tables


def section(d: dict) -> list[str]:
    """The report's section of part profile (none when it did not run)."""
    p = d.get("profile")
    if not p:
        return []
    lines = ["", "## 4. Profiler: kernels per call (one pass)"]
    if p.get("skipped_part") or p.get("failed"):
        return lines + ["", f"Not measured: {p.get('skipped_part') or p.get('failed')}."]
    for key in ("fwd_bwd", "decode"):
        t = p[key]
        lines += ["", f"{t['what']}: {t['calls']} profiled calls; per call {t['total_us']:,.1f} us in "
                  f"{t['launches']:,.0f} launches ({t['kind']}; {t['unplaced']} outside both functions' "
                  "ranges)."]  # fmt: skip
        rows = [[f"`{r['kernel']}`", fmt(r["us"]), fmt(r["launches"]),
                 fmt(r["us"] / t["total_us"] if t["total_us"] else None)] for r in t["rows"]]  # fmt: skip
        lines += [""] + table(["kernel", "us per call", "launches per call", "share"], rows)
    return lines
