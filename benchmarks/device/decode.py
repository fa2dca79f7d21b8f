"""Part 3, decode: one layer, one token at context 1k, 8k, 32k. The hybrid step through a converted layer's HybridCache
(phi_q and phi_k of the new token, gamma, rho, the fused decode kernel; after a prefill of the context) against a
static KV cache step (benchmarks/baselines.py's kv_cache_step: the new k/v written into a preallocated
[1, 8, ctx, 128] cache, SDPA of one query over it), both captured in CUDA graphs and timed over `replays` replays;
and torch.profiler's kernel time per step (the `_decode` kernels' microseconds, and every kernel's). The deadline is
checked before every row. Also the helpers the other model parts share: the converted layers' attention settings
and the 8B-shaped random Llama."""

from __future__ import annotations

import json

import torch

from benchmarks import baselines
from benchmarks.device.machine import llama_config
from benchmarks.device.run import Run, out_of_time
from benchmarks.device.timing import graphed, kernel_table, per_call_ms
from benchmarks.registry import inputs as attention_inputs
from benchmarks.report_table import fmt, one_line, skipped_row, table

METHODS = ("hybrid", "kv_cache")


def attention_settings(run: Run) -> dict:
    """The converted layers' attention: the 8B preset's (window, the hybrid's own sinks, LA decay), hedgehog f = d."""
    return dict(window=run.cfg["window"], sinks=run.cfg["sinks"], hybrid_sinks=True, la_decay=True,
                feature_map="hedgehog", backend=run.cfg["backend"])  # fmt: skip


def llama(run: Run, m: dict, seed: int = 0):
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    config = llama_config(m, m["vocab"], max(run.cfg["contexts"]) + 64, tie=False)
    torch.manual_seed(seed)
    with torch.device(run.device):
        return LlamaForCausalLM(config).to(run.dtype).eval()


def one_layer(run: Run):
    """(a converted one-layer model, its HybridAttention): its MLP and vocabulary play no part in a decode step."""
    from hybrid_scale import convert_model  # noqa: PLC0415
    from hybrid_scale.attention.layer import hybrid_layers  # noqa: PLC0415

    m = dict(run.cfg["model"], layers=1, vocab=256, inter=128)
    model = convert_model(llama(run, m), attention_settings(run))
    return model, hybrid_layers(model)[0]


def hybrid_step(layer_of, x: dict, ctx: int):
    """(step, state bytes): the converted layer's decode step of token ctx - 1 after a prefill of the ctx - 1 before
    it, through a fresh HybridCache; layer_of = one_layer()'s (model, module)."""
    from hybrid_scale import HybridCache  # noqa: PLC0415
    from hybrid_scale.attention.layer import Projections  # noqa: PLC0415

    model, module = layer_of
    layer = HybridCache(model).layers[0]
    with torch.no_grad():
        q, k, v = (x[n][:, :, : ctx - 1] for n in "qkv")
        layer.hybrid_attend(module, Projections(q, k, v, module.feature_map_q(q), module.feature_map_k(k)), None)
    q1, k1, v1 = (x[n][:, :, ctx - 1 : ctx].clone() for n in "qkv")

    def step():
        with torch.no_grad():
            fq, fk = module.feature_map_q(q1), module.feature_map_k(k1)
            return layer.hybrid_attend(module, Projections(q1, k1, v1, fq, fk), None)

    return step, layer.nbytes


def time_step(run: Run, step, row: dict) -> None:
    """Eager ms, the profiler's kernel time, then (on CUDA) the CUDA-graph replay ms; `ms` is what the ratio uses."""
    cfg = run.cfg
    row["eager_ms"] = per_call_ms(run.cuda, step, cfg["replays"])
    table = kernel_table(run.cuda, step, cfg["profile_steps"])
    decode_us = sum(r["us"] for r in table["rows"] if "_decode" in r["kernel"])
    row |= dict(kernels_us=table["total_us"], kernels=table["launches"], top_kernels_us={
        r["kernel"]: r["us"] for r in table["rows"][:5]}, decode_kernel_us=decode_us if run.cuda else None)  # fmt: skip
    if not run.cuda:
        row["timed"] = "eager (no CUDA: no graphs)"
    else:
        try:
            row["graph_ms"] = per_call_ms(True, graphed(step), cfg["replays"])
            row["timed"] = "CUDA graph replays"
        except Exception as e:  # noqa: BLE001  (not capturable on the day: eager, and why)
            row["graph_error"] = one_line(e)
            row["timed"] = "eager (capture failed)"
            print(f"device_speed: decode {row['method']} at {row['context']}: capture failed: {one_line(e)}")
    row["ms"] = row.get("graph_ms", row["eager_ms"])


def part_decode(run: Run) -> dict:
    cfg, s = run.cfg, run.cfg["shape"]
    end = run.part_deadline("decode")
    layer_of = one_layer(run)
    rows = []
    for ctx in cfg["contexts"]:
        x = attention_inputs(s, ctx, run.device, run.dtype, seed=ctx)
        at = {}
        for name in METHODS:
            row = dict(context=ctx, method=name)
            why = out_of_time(end, f"the decode budget ({cfg['budgets']['decode']:.0f} s)")
            if why:
                rows.append(row | {"skipped": why})
                continue
            try:
                if name == "hybrid":
                    step, row["bytes_state"] = hybrid_step(layer_of, x, ctx)
                else:
                    step, row["bytes_state"] = baselines.kv_cache_step(x, ctx)
                time_step(run, step, row)
            except torch.cuda.OutOfMemoryError:
                row["skipped"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row["skipped"] = row["error"] = one_line(e)
            rows.append(row)
            at[name] = row
            print(f"device_speed: decode {json.dumps(row)}", flush=True)
        h, kv = at.get("hybrid", {}), at.get("kv_cache", {})
        if "ms" in h and "ms" in kv:
            h["x_kv_cache"] = h["ms"] / kv["ms"]
            how = h["timed"] if h["timed"] == kv["timed"] else f"{h['timed']} hybrid / {kv['timed']} kv_cache"
            run.ratio(f"decode step per layer hybrid/kv_cache, ctx={ctx}", h["x_kv_cache"], f"({how})")
        if h.get("decode_kernel_us") is not None:
            run.ratio(f"decode kernel us per layer, ctx={ctx}", h["decode_kernel_us"])
        run.free()
    return dict(rows=rows, timed="step = phi_q, phi_k of the new token + HybridCacheLayer.hybrid_attend (hybrid); "
                "index_copy_ of k/v + SDPA over the static cache (kv_cache)")  # fmt: skip


def section(d: dict) -> list[str]:
    """The report's section of part decode (none when it did not run)."""
    b = d.get("decode")
    if not b:
        return []
    lines = ["", "## 3. Decode, one token, one layer", "",
             f"Step: {b['timed']}. Kernel times: torch.profiler over eager steps.", ""]  # fmt: skip
    rows = []
    for r in b["rows"]:
        if "skipped" in r:
            rows.append(skipped_row([r["context"], r["method"]], r["skipped"]))
            continue
        rows.append([r["context"], r["method"], r["timed"], fmt(r["ms"]), fmt(r["eager_ms"]),
                     fmt(r.get("decode_kernel_us")), fmt(r.get("kernels_us")), fmt(r.get("kernels")),
                     f"{r['bytes_state']:,}", fmt(r.get("x_kv_cache"))])  # fmt: skip
    head = ["context", "method", "timed", "ms per step", "eager ms", "`_decode` kernel us", "all kernels us",
            "kernels per step", "state bytes", "x kv_cache"]  # fmt: skip
    lines += table(head, rows)
    errors = [f"{r['method']} at {r['context']}: {r['graph_error']}" for r in b["rows"] if r.get("graph_error")]
    return lines + ([""] + [f"- capture failed, timed eagerly: {e}" for e in errors] if errors else [])
