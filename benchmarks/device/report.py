"""device_speed.md: the device benchmark's figures (Run.data) as markdown, one section per part in run order, every
table written by benchmarks/report_table.py."""

from __future__ import annotations

from benchmarks.device.settings import LOLCATS_A100_HOURS, PEAK_TFLOPS, TARGETS
from benchmarks.report_table import fmt, skipped_row, table


def header(d: dict) -> list[str]:
    cfg, info, v = d["settings"], d.get("device_info", {}), d.get("versions", {})
    s = cfg["shape"]
    memory = f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else ""
    lines = [
        "# Device speed (issues 51, 60)"
        + (" -- CPU dry run, toy shapes: timings mean nothing" if d["dry_run"] else ""),
        "",
        f"- date: {d['date']}; command: `{d['command']}`",
        f"- device: {info.get('gpu') or info.get('cpu') or '?'}{memory}; {cfg['dtype']}; attention backend "
        f"{cfg['backend']}",
        f"- torch {v.get('torch')} (CUDA {v.get('cuda')}), triton {v.get('triton')}, transformers "
        f"{v.get('transformers')}, fla-core {d.get('fla_core')}",
        f"- shape: {s['H']} heads, {s['Hkv']} KV heads, head dim {s['D']}, phi {s['F']} features, window "
        f"{cfg['window']}, {cfg['sinks']} sinks (the hybrid's own), LA decay; batch 1",
        "",
    ]
    parts = [[f"{k}: {p['title']}", p["status"], p["seconds"], p["note"]] for k, p in d["parts"].items()]
    lines += table(["part", "status", "seconds", "note"], parts, digits=3)
    lines += ["", "## Targets (issue 51, H200; issue 60's counts)", ""]
    ratios = d["ratios"]
    rows = []
    for key, target in TARGETS.items():
        r = ratios.get(key)
        status = "not measured" if r is None else ("met" if r["met"] else "MISSED")
        rows.append([key, fmt(r["value"]) if r else "n/a", f"{target:.3g}", status])
    lines += table(["figure", "measured", "target (at most)", "status"], rows)
    others = [[k, fmt(r["value"]), r["note"]] for k, r in ratios.items() if k not in TARGETS]
    if others:
        lines += ["", "Other ratios:", ""] + table(["figure", "value", "note"], others)
    return lines


def gradients(g: dict) -> list[str]:
    lines = ["", "## 1. bf16 gradients against the fp32 chunked path", "",
             f"Tested: `{g['tested']}`; reference: `{g['reference']}` on the same bf16-rounded inputs. Error: "
             "max |a - b| / max |b| per tensor (absolute where the reference is all zero).", ""]  # fmt: skip
    rows = []
    for r in g["rows"]:
        if "skipped" in r:
            rows.append(skipped_row([r["mode"], r["T"]], r["skipped"]))
            continue
        for name, err in r["errors"].items():
            ok = "FAILED" if name in r["failed"] else "ok"
            rows.append([r["mode"], r["T"], "y" if name == "y" else f"d{name}", fmt(err), g["tolerances"][name], ok])
    return lines + table(["mode", "T", "tensor", "max rel. error", "tolerance", "status"], rows)


def prefill(a: dict) -> list[str]:
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


def profile(p: dict) -> list[str]:
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


def tiles(t: dict) -> list[str]:
    lines = ["", "## 2c. Tile variants of the chunked prefill (DEVICE_SPEED_TILES)", ""]
    if t.get("skipped_part"):
        return lines + [f"Not run: {t['skipped_part']}."]
    lines += [f"Settings: {t['where']}[{t['head_dim']}], default {t['default']}; each variant patched over it "
              f"(unittest.mock.patch.dict). {t['note']}", ""]  # fmt: skip
    rows = []
    for r in t["rows"]:
        changes = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "(default)"
        if "skipped" in r:
            rows.append(skipped_row([r["variant"], changes, r["T"]], r["skipped"]))
            continue
        rows.append([r["variant"], changes, r["T"], *(fmt(r.get(k)) for k in ("compile_s", "fwd_ms", "fwd_bwd_ms",
                     "fwd_x_default", "fwd_bwd_x_default")), r.get("bwd_error", "")])  # fmt: skip
    head = ["variant", "settings", "T", "compile s", "fwd ms", "fwd+bwd ms", "fwd x default", "fwd+bwd x default",
            "note"]  # fmt: skip
    return lines + table(head, rows)


def decode(b: dict) -> list[str]:
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


def generate(c: dict) -> list[str]:
    m = c["model"]
    lines = ["", "## 4. Decode, whole model: `generate`", "",
             f"Llama, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, {m['kv']} KV heads, head dim "
             f"{m['head_dim']}, intermediate {m['inter']}, vocab {m['vocab']} ({c['params']:,} parameters), random "
             "weights; prompt = context - new tokens; ms per token = median interval over the last half of the new "
             "tokens. Counted per call (benchmarks/device/generate.py): dynamo graphs compiled "
             "(counters['stats']['unique_graphs']), recompiles (torch's `recompiles` log records; in brackets those "
             "after the first decode step, expected 0) and CUDA-graph skips (counters['inductor']['cudagraph_skips'], "
             "expected 0). " + " ".join(c["notes"]), ""]  # fmt: skip
    rows = []
    for r in c["rows"]:
        if "skipped" in r:
            rows.append(skipped_row([r["context"], r["model"]], r["skipped"]))
            continue
        note = r.get("compile_error") or r.get("compile_note") or ""
        reasons = "; ".join(f"at token {x['tokens']}: {x['reason'] or x['what']}" for x in r["recompile_reasons"])
        counts = f"{r['recompiles']} ({r['recompiles_after_first_step']})"
        rows.append([r["context"], r["model"], r["timed"], fmt(r["ms_per_token"]), fmt(r["first_interval_ms"]),
                     fmt(r.get("x_base")), r["dynamo_graphs"], counts, r["cudagraph_skips"],
                     "; ".join(filter(None, [note, reasons]))])  # fmt: skip
    head = ["context", "model", "timed", "ms per token", "first interval ms", "x base", "graphs compiled",
            "recompiles (after 1st step)", "CUDA-graph skips", "note"]  # fmt: skip
    return lines + table(head, rows)


def big(big: dict, bc: dict) -> list[str]:
    lines = ["", "## 5. 8B-shaped stage 1 and stage 2 (random weights)", "",
             f"Llama, {bc['layers']} layers, hidden {bc['hidden']}, {bc['heads']} heads, {bc['kv']} KV heads, head dim "
             f"{bc['head_dim']}, intermediate {bc['inter']}, vocab {bc['vocab']} ({big['params']:,} parameters); "
             f"{bc['sequences']} sequences x {bc['seq_len']} tokens; stage 1 batch {bc['distill_batch']}, stage 2 "
             f"{bc['global_batch']} sequences per step (micro-batch {bc['micro_batch']}, gradient checkpointing). MFU "
             f"= model FLOPs / time / {PEAK_TFLOPS:g} TFLOP/s (the counts: benchmarks/device/big.py, "
             "stage1_flops_per_sequence and stage2_flops_per_token).", ""]  # fmt: skip
    lines += table(["figure", "value"], [
        ["stage 1: s per layer (one epoch; median after the first layer)", fmt(big["stage1_layer_s"])],
        ["stage 1: tokens/s (feature-map training) / MFU",
         f"{fmt(big['stage1_tokens_per_s'])} / {fmt(big['stage1_mfu'])}"],
        ["stage 1: teacher pass tokens/s / MFU",
         f"{fmt(big['stage1_teacher_tokens_per_s'])} / {fmt(big['stage1_teacher_mfu'])}"],
        ["stage 1: peak GiB", fmt(big["stage1_peak_gib"])],
        ["stage 2: s per step (median after the first)", fmt(big["stage2_step_s"])],
        ["stage 2: tokens/s / MFU", f"{fmt(big['stage2_tokens_per_s'])} / {fmt(big['stage2_mfu'])}"],
        ["stage 2: peak GiB", fmt(big["stage2_peak_gib"])],
    ])  # fmt: skip
    lines += ["", f"Projected GPU-hours of an 8B conversion on this GPU ({big['projection_note']}), beside LoLCATs' "
              f"{LOLCATS_A100_HOURS} A100-hours:", ""]  # fmt: skip
    rows = [[recipe, f"{p['stage1_tokens_per_layer']:,}", f"{p['stage2_tokens']:,}", fmt(p["stage1_gpu_hours"]),
             fmt(p["stage2_gpu_hours"]), fmt(p["total"]), fmt(p["total"] / LOLCATS_A100_HOURS)]
            for recipe, p in big["projection"].items()]  # fmt: skip
    head = ["recipe", "stage 1 tokens per layer", "stage 2 tokens", "stage 1 GPU-h", "stage 2 GPU-h", "total GPU-h",
            "x LoLCATs"]  # fmt: skip
    return lines + table(head, rows)


def tests(t: dict) -> list[str]:
    counts = ", ".join(f"{n} {k}" for k, n in t["counts"].items())
    lines = ["", "## 6. gpu-marked tests (chunked path first)", ""]
    lines.append(f"`{t['command']}` (timeout {t['timeout']} s): exit {t['rc']}, {counts}, {t['seconds']:.0f} s")
    if t.get("failed_tests"):
        lines += ["", "Failed: " + ", ".join(f"`{n}`" for n in t["failed_tests"])]
    if t["errors"]:
        lines += ["", "```", *t["errors"], "```"]
    return lines


def markdown(d: dict) -> str:
    lines = header(d)
    for key, write in (("grad", gradients), ("prefill", prefill), ("profile", profile), ("tiles", tiles),
                       ("decode", decode), ("generate", generate)):  # fmt: skip
        if d.get(key):
            lines += write(d[key])
    if d.get("big") and "stage1_layer_s" in d["big"]:
        lines += big(d["big"], d["settings"]["big"])
    if d.get("tests"):
        lines += tests(d["tests"])
    return "\n".join(lines) + "\n"
