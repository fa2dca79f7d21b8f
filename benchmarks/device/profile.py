"""Part 2b, profile: one torch.profiler pass over the hybrid's forward+backward at T = 4096 (prefill.py's hybrid
method, already compiled by the prefill part) and over one decode step at context 8192 (decode.py's converted-layer
step), each written into the report as a table of CUDA kernels: microseconds and launches per call, the longest first
(benchmarks/device/timing.py's kernel_table)."""

from __future__ import annotations

import torch

from benchmarks.device import decode, prefill
from benchmarks.device.run import Run, out_of_time
from benchmarks.device.timing import kernel_table
from benchmarks.registry import inputs as attention_inputs
from benchmarks.report_table import fmt, one_line, table


def part_profile(run: Run) -> dict:
    cfg = run.cfg
    end = run.part_deadline("profile")
    out = {}
    T, ctx = cfg["profile_T"], cfg["profile_context"]
    for key, what in (("fwd_bwd", f"hybrid fwd+bwd, T={T}"), ("decode", f"hybrid decode step, context {ctx}")):
        why = out_of_time(end, f"the profile budget ({cfg['budgets']['profile']:.0f} s)")
        if why:
            out[key] = dict(what=what, skipped=why)
            continue
        try:
            if key == "fwd_bwd":
                x, gy = prefill.prefill_inputs(run, T)
                _, fn, _ = prefill.calls(prefill.hybrid_method(run, "hybrid"), x, gy)
            else:
                x = attention_inputs(cfg["shape"], ctx, run.device, run.dtype, seed=ctx)
                fn, _ = decode.hybrid_step(decode.one_layer(run), x, ctx)
            out[key] = dict(what=what, **kernel_table(run.cuda, fn, cfg["profile_steps"]))
        except torch.cuda.OutOfMemoryError:
            out[key] = dict(what=what, skipped="out of memory")
        except Exception as e:  # noqa: BLE001
            out[key] = dict(what=what, skipped=one_line(e), error=one_line(e))
        print(f"device_speed: profile {what}: {out[key].get('total_us', out[key].get('skipped'))}", flush=True)
        run.free()
    rows = [dict(part=k, skipped=v["skipped"]) for k, v in out.items() if "skipped" in v]
    return dict(out, rows=rows)


def section(d: dict) -> list[str]:
    """The report's section of part profile (none when it did not run)."""
    p = d.get("profile")
    if not p:
        return []
    lines = ["", "## 2b. Profiler: kernels per call"]
    for key in ("fwd_bwd", "decode"):
        t = p.get(key)
        if not t:
            continue
        if "skipped" in t:
            lines += ["", f"{t['what']}: skipped: {t['skipped']}"]
            continue
        lines += ["", f"{t['what']}: {t['calls']} profiled calls; per call {t['total_us']:,.1f} us in "
                  f"{t['launches']:,.0f} launches ({t['kind']})."]  # fmt: skip
        rows = [[f"`{r['kernel']}`", fmt(r["us"]), fmt(r["launches"]),
                 fmt(r["us"] / t["total_us"] if t["total_us"] else None)] for r in t["rows"]]  # fmt: skip
        lines += [""] + table(["kernel", "us per call", "launches per call", "share"], rows)
    return lines
