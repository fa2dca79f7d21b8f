"""The Triton hybrid attention against SDPA, FlashAttention (if importable), flash-linear-attention's
chunk_linear_attn (fla-core, if importable: the la_only part alone) and the torch chunked path.

Prefill (hybrid mode, window --window, batch 1, every length in --lengths, the SmolLM2-135M and Llama-3-8B head
shapes): forward and forward+backward time (CUDA events, median of --repeats after warm-up), the achieved TFLOP/s and
the peak memory above the inputs, with the ratios to SDPA side by side. FLOP counts (stated so the TFLOP/s can be
checked): causal softmax attention does 2 * 2 * H * D * T^2 / 2 in the forward (q.k and p.v over the causal half); the
hybrid does 4 * H * D * T * w (the window's q.k and p.v) + 2 * H * F * D * T (each query's state read) +
2 * Hkv * F * D * T (the block states); forward+backward = 3.5 x forward for both (the backward is counted as 2.5
forwards, the usual convention for attention kernels).

Decode (one new token per step after a --contexts long prompt, the same shapes): time per step and tokens/s of one
layer's attention, and the bytes one step reads, for the fused decode step (ring buffer of w keys + the fp32 state:
independent of the context) against a KV-cache decode (benchmarks/baselines.py's kv_cache_step: the new token's k/v
written into a static cache, SDPA of its query over it) and the torch decode step (recurrent.extend).

    python -m benchmarks.run kernels [--budget 150] [--out docs/results] [--verify]    # a CUDA machine, triton

Writes kernel_speed.md and kernel_speed.json into --out. Stops starting new measurements after --budget seconds
(what was measured is written). The pipeline check (benchmarks/device/, part e) runs it. `--small` is the CPU dry
run of the tests (tiny shapes, the Triton interpreter, timings meaningless). The shapes, inputs and backends are
benchmarks/registry.py's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks import registry
from benchmarks.baselines import kv_cache_step
from benchmarks.registry import Clock, inputs
from benchmarks.report_table import fmt, one_line, skipped_row, table
from hybrid_scale.attention import backends


def flops(method, shape, T, window):
    H, Hkv, D, Fd = shape["H"], shape["Hkv"], shape["D"], shape["F"]
    if method in ("sdpa", "flash_attn"):
        return 2 * H * D * T * T
    if method == "fla":  # linear attention only: each query's state read, the chunk states, the intra-chunk terms
        return 2 * H * Fd * D * T + 2 * H * Fd * D * T + 2 * H * 64 * T * (Fd + D)
    w = min(window, T)
    return 4 * H * D * T * w + 2 * H * Fd * D * T + 2 * Hkv * Fd * D * T


def prefill_methods(window, device, shape, dtype):
    """The hybrid's fast backends and the baselines (the spec, `naive`, is only for --verify: O(T^2) memory)."""
    fast = {k: v for k, v in registry.prefill(window, device).items() if k != "naive"}
    return fast | registry.baselines(device, shape, dtype)


def prefill_rows(args, shapes, clock, deadline):
    rows = []
    for shape_name, shape in shapes.items():
        for T in args.lengths:
            x = inputs(shape, T, args.device, args.dtype, seed=T)
            gy = torch.randn_like(x["q"])
            for method, fn in prefill_methods(args.window, args.device, shape, args.dtype).items():
                row = dict(shape=shape_name, T=T, method=method)
                if time.monotonic() > deadline:
                    rows.append(row | {"skipped": "--budget reached"})
                    continue
                xg = {n: t.detach().requires_grad_(n != "gamma") for n, t in x.items()}

                def fwd(fn=fn, x=x):
                    with torch.no_grad():
                        return fn(x)

                def fwd_bwd(fn=fn, xg=xg, gy=gy):
                    for t in xg.values():
                        t.grad = None
                    fn(xg).backward(gy)

                try:
                    row["fwd_ms"] = clock.ms(fwd)
                    row["fwd_peak_mib"] = clock.peak_mib(fwd)
                    row["fwd_bwd_ms"] = clock.ms(fwd_bwd)
                    row["fwd_bwd_peak_mib"] = clock.peak_mib(fwd_bwd)
                    work = flops(method, shape, T, args.window)
                    row["fwd_tflops"] = work / row["fwd_ms"] / 1e9
                    row["fwd_bwd_tflops"] = 3.5 * work / row["fwd_bwd_ms"] / 1e9
                except torch.cuda.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                except Exception as e:  # noqa: BLE001  (one method failing must not lose the other rows)
                    row["skipped"] = row["error"] = one_line(e, 200)
                for t in xg.values():
                    t.grad = None
                if clock.cuda:
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
    ref = {(r["shape"], r["T"]): r for r in rows if r["method"] == "sdpa" and "fwd_bwd_ms" in r}
    for r in rows:
        base = ref.get((r["shape"], r["T"]))
        if base and "fwd_bwd_ms" in r:
            r["fwd_speedup_vs_sdpa"] = base["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup_vs_sdpa"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def decode_rows(args, shapes, clock, deadline):
    rows = []
    for shape_name, shape in shapes.items():
        for ctx in args.contexts:
            x = inputs(shape, ctx + args.warmup + args.repeats + 1, args.device, args.dtype, seed=ctx)
            for method in ("triton", "torch", "kv_cache"):
                row = dict(shape=shape_name, context=ctx, method=method)
                if time.monotonic() > deadline:
                    rows.append(row | {"skipped": "--budget reached"})
                    continue
                try:
                    if method == "kv_cache":  # a static cache of ctx slots, the new token written into the last
                        one, row["bytes_per_step"] = kv_cache_step(x, ctx)
                    else:
                        state = registry.decode_state(shape, x, ctx, args.window, args.device, args.dtype, method)
                        pos = [ctx]

                        def one(state=state, pos=pos, method=method, x=x):
                            t = pos[0]
                            pos[0] += 1
                            return registry.decode_step(state, x, t, args.window, method)

                        row["bytes_per_step"] = state.nbytes
                    row["step_ms"] = clock.ms(one)
                    row["tokens_per_s"] = 1000.0 / row["step_ms"]
                except torch.cuda.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                except Exception as e:  # noqa: BLE001
                    row["skipped"] = row["error"] = one_line(e, 200)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def markdown(result) -> str:
    a = result["settings"]
    lines = [
        "# Fused Triton hybrid attention: speed",
        "",
        f"Command: `{result['command']}`",
        f"Device: {result['device']}; dtype {a['dtype']}; window {a['window']}; batch 1; hybrid mode.",
        f"Methods measured: {', '.join(result['methods'])}"
        + ("" if "flash_attn" in result["methods"] else " (flash_attn not importable: not measured)")
        + (
            ""
            if "fla" in result["methods"]
            else " (fla-core's chunk_linear_attn not importable on this device: not measured)"
        ),
        "Self-check of the kernels against the torch path (what attention.backend=auto relies on): "
        + ("passed" if result["self_check"] is None else f"FAILED: {result['self_check']}"),
        "",
        "## Prefill: forward and forward+backward",
        "",
    ]
    rows = []
    for r in result["prefill"]:
        if "skipped" in r:
            rows.append(skipped_row([r["shape"], r["T"], r["method"]], r["skipped"]))
            continue
        rows.append([r["shape"], r["T"], r["method"], *(fmt(r.get(k)) for k in ("fwd_ms", "fwd_tflops", "fwd_bwd_ms",
                     "fwd_bwd_tflops", "fwd_bwd_peak_mib")), f"{fmt(r.get('fwd_bwd_speedup_vs_sdpa'))}x"])  # fmt: skip
    lines += table(["shape", "T", "method", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                    "peak MiB (fwd+bwd)", "fwd+bwd speed-up vs SDPA"], rows)  # fmt: skip
    lines += ["", "## Decode: one token per step, one layer", ""]
    rows = []
    for r in result["decode"]:
        if "skipped" in r:
            rows.append(skipped_row([r["shape"], r["context"], r["method"]], r["skipped"]))
            continue
        rows.append([r["shape"], r["context"], r["method"], fmt(r["step_ms"]), fmt(r["tokens_per_s"], 4),
                     f"{r['bytes_per_step']:,}"])  # fmt: skip
    lines += table(["shape", "context", "method", "ms per step", "tokens/s", "bytes per step"], rows)
    lines += [
        "",
        f"FLOP counts: see the docstring of benchmarks/attention/kernels.py. Wall time {result['seconds']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("--lengths", default="1024,4096,16384,65536")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--shapes", default=",".join(registry.SHAPES), help="the registry's shapes, by name")
    parser.add_argument("--window", type=int, default=registry.WINDOW)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds after which no measurement starts")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "results"))
    parser.add_argument("--small", action="store_true", help="CPU dry run: tiny shapes, the Triton interpreter")


def settle(args) -> dict | int:
    """--small's settings, the shapes and the dtype; 2 (the exit status) where the kernels cannot run."""
    if args.small:
        args.device, args.dtype, args.window = "cpu", "float32", 16
        shapes = registry.SMALL_SHAPES
        args.lengths, args.contexts, args.warmup, args.repeats = "48,80", "40,72", 0, 1
    else:
        shapes = registry.shapes_named(args.shapes)
        if not torch.cuda.is_available() and args.device == "cuda":
            print("kernel_speed: no CUDA device here; the kernels' speed is measured on a GPU (--small: CPU dry run)")
            return 2
    args.lengths = [int(t) for t in str(args.lengths).split(",")]
    args.contexts = [int(t) for t in str(args.contexts).split(",")]
    args.dtype = getattr(torch, args.dtype) if isinstance(args.dtype, str) else args.dtype
    if "triton" not in backends.available():
        print("kernel_speed: the triton backend is not installed (pip install -e '.[triton]')")
        return 2
    return shapes


def run(args, shapes: dict, command: str) -> int:
    t0 = time.monotonic()
    deadline = t0 + args.budget
    clock = Clock(args.device, args.warmup, args.repeats)
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu (Triton interpreter)"
    result = dict(
        command=command,
        device=name,
        versions={"torch": torch.__version__, "triton": __import__("triton").__version__},
        settings=dict(window=args.window, dtype=str(args.dtype).replace("torch.", ""), shapes=shapes),
        self_check=backends.self_check("triton", args.device, args.dtype),  # what attention.backend=auto relies on
        methods=[],
        prefill=[],
        decode=[],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():  # after each part: a run cut short keeps what it measured
        result["seconds"] = time.monotonic() - t0
        (out / "kernel_speed.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "kernel_speed.md").write_text(markdown(result))

    result["prefill"] = prefill_rows(args, shapes, clock, deadline)
    result["methods"] = list(dict.fromkeys(r["method"] for r in result["prefill"]))
    save()
    result["decode"] = decode_rows(args, shapes, clock, deadline)
    save()
    print(markdown(result))
    errors = [r for r in result["prefill"] + result["decode"] if "error" in r]
    return 1 if errors or result["self_check"] is not None else 0
