"""The pipeline check's part d, attention (run in its own process): hybrid attention, every registered backend (the
Triton kernels on CUDA only; naive only up to GPU_CHECK_NAIVE_MAX), against SDPA at the 1B head shape: forward and
forward+backward time after warm-up (benchmarks/registry.py's Clock) and peak memory, with the ratios to SDPA;
`section`, its part of the report."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.device.machine import device_info
from benchmarks.report_table import fmt, skipped_row, table

GRAD_KEYS = ("q", "k", "v", "fq", "fk")  # the inputs the attention benchmark differentiates


def part_attention(s: dict, work: Path) -> dict:
    import torch

    from benchmarks.baselines import sdpa_prefill
    from benchmarks.registry import Clock
    from benchmarks.registry import inputs as attention_inputs
    from benchmarks.report_table import one_line
    from hybrid_scale.attention import backends
    from hybrid_scale.attention import layer as hybrid

    a, device, dtype = s["attn"], s["device"], getattr(torch, s["dtype"])
    cuda = torch.device(device).type == "cuda"
    H, Hkv, D, Fdim = a["heads"], a["kv"], a["head_dim"], a["feature"]
    shape = dict(H=H, Hkv=Hkv, D=D, F=Fdim)

    def inputs(T):  # (hedgehog-like features: two softmaxes over F/2 features each; gamma 0.1)
        return attention_inputs(shape, T, device, dtype, seed=T)

    # native GQA in the flash kernel when this torch has it (forward and backward), else k/v repeated
    sdpa, sdpa_kind = sdpa_prefill(shape, device, dtype)

    def call(name, x):
        if name == "sdpa":
            return sdpa(x)
        return hybrid.attend(
            x["q"],
            x["k"],
            x["v"],
            x["fq"],
            x["fk"],
            gamma=x["gamma"],
            window=a["window"],
            mode="hybrid",
            chunk_size=64,
            backend=name,
        )

    clock = Clock(device, a["warmup"], a["repeats"])  # CUDA events after warm-up; peak memory above the inputs

    # the Triton kernels are timed on CUDA only (in the interpreter they are a correctness tool, not a speed)
    names = ["sdpa", *(b for b in backends.available() if cuda or b != "triton")]
    rows = []
    for T in a["lengths"]:
        x = inputs(T)
        gy = torch.randn(1, H, T, D, device=device, dtype=dtype)
        for name in names:
            row = {"T": T, "backend": name}
            if name == "naive" and T > a["naive_max"]:
                rows.append(row | {"skipped": f"T > GPU_CHECK_NAIVE_MAX ({a['naive_max']})"})
                continue
            xg = {k: (v.detach().requires_grad_(k in GRAD_KEYS)) for k, v in x.items()}

            def fwd(name=name, x=x):
                with torch.no_grad():
                    return call(name, x)

            def fwd_bwd(name=name, xg=xg, gy=gy):
                for k in GRAD_KEYS:
                    xg[k].grad = None
                call(name, xg).backward(gy)

            try:
                y = fwd()
                row["finite"] = bool(torch.isfinite(y).all())
                del y
                row["fwd_ms"] = clock.ms(fwd)
                row["fwd_peak_mib"] = clock.peak_mib(fwd)
                row["fwd_bwd_ms"] = clock.ms(fwd_bwd)
                for k in GRAD_KEYS:  # the last timed call's gradients would count in the base, not the peak
                    xg[k].grad = None
                row["fwd_bwd_peak_mib"] = clock.peak_mib(fwd_bwd)
            except torch.cuda.OutOfMemoryError:  # what was measured before stays in the JSON; the table skips it
                row["skipped"] = "out of memory" + (" in fwd+bwd" if "fwd_ms" in row else "")
            except Exception as e:  # one backend failing at one length must not lose the other rows
                row["skipped"] = row["error"] = one_line(e, 200)
            for k in GRAD_KEYS:
                xg[k].grad = None
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    sdpa = {r["T"]: r for r in rows if r["backend"] == "sdpa" and "skipped" not in r}
    for r in rows:
        ref = sdpa.get(r["T"])
        if ref and "skipped" not in r:
            r["fwd_x_sdpa"] = r["fwd_ms"] / ref["fwd_ms"]
            r["fwd_bwd_x_sdpa"] = r["fwd_bwd_ms"] / ref["fwd_bwd_ms"]
            if r.get("fwd_bwd_peak_mib") is not None and ref.get("fwd_bwd_peak_mib"):
                r["mem_x_sdpa"] = r["fwd_bwd_peak_mib"] / ref["fwd_bwd_peak_mib"]
    shape = dict(batch=1, heads=H, kv_heads=Hkv, head_dim=D, feature=Fdim, window=a["window"], chunk=64)
    return {"rows": rows, "shape": shape, "sdpa": sdpa_kind, "dtype": s["dtype"], "device_info": device_info(device)}


def section(d: dict) -> list[str]:
    att, s = d.get("attention"), d["settings"]
    if not att:
        return []
    sh = att["shape"]
    lines = ["## d. Hybrid attention vs SDPA (hybrid mode)", "",
             f"batch 1, {sh['heads']} heads, {sh['kv_heads']} KV heads, head_dim {sh['head_dim']}, features "
             f"{sh['feature']}, window {sh['window']}, chunk {sh['chunk']}, {att['dtype']} on {s['device']}; median "
             f"of {s['attn']['repeats']} after {s['attn']['warmup']} warm-up; peak = max_memory_allocated above "
             f"the inputs. SDPA: is_causal, {att.get('sdpa', '?')}. Hybrid: phi inputs given (hedgehog-like "
             "features), the feature maps themselves not timed.", ""]  # fmt: skip
    rows = []
    for r in att["rows"]:
        if "skipped" in r:
            rows.append(skipped_row([r["T"], r["backend"]], r["skipped"]))
            continue
        rows.append([r["T"], r["backend"], *(fmt(r[k], 4) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_peak_mib",
                     "fwd_bwd_peak_mib")), *(fmt(r.get(k), 3) for k in ("fwd_x_sdpa", "fwd_bwd_x_sdpa",
                     "mem_x_sdpa"))])  # fmt: skip
    lines += table(["T", "backend", "fwd ms", "fwd+bwd ms", "fwd peak MiB", "fwd+bwd peak MiB", "fwd x SDPA",
                    "fwd+bwd x SDPA", "mem x SDPA"], rows)  # fmt: skip
    return lines + [""]
