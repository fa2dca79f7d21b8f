"""Chunked hybrid attention vs the naive spec vs SDPA over sequence length, and decode cost vs context length.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hedgehog phi of size 128), batch 1, fp32, CPU.
Prints times and the growth ratio t(T)/t(2k) side by side (linear in T: ratio ~ T/2k; quadratic: ~ (T/2k)^2), then
the time of one decode step and the bytes held per layer at context 512 and 8k, for the hybrid state and for a
softmax KV cache. Writes benchmarks/out/attention_scaling.json (docs/results/attention_scaling.md has the figures).

    .venv/bin/python -m benchmarks.run scaling [--max-len 32768] [--repeats 3] [--verify]    # make bench

The shapes, inputs and backends are benchmarks/registry.py's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks import registry
from hybrid_scale.attention.hedgehog import chunk as chunked
from hybrid_scale.attention.hedgehog import recurrent
from hybrid_scale.attention.shape import Shape

NAME = "smollm2-135m"
SHAPE = registry.SHAPES[NAME]
H, HKV, D, FEAT = SHAPE["H"], SHAPE["Hkv"], SHAPE["D"], SHAPE["F"]
WINDOW, SINKS = registry.WINDOW, registry.SINKS


def inputs(T, seed=0):
    return registry.inputs(SHAPE, T, seed=seed)


def best_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def scaling(max_len, naive_max, repeats):
    rows = []
    T = 1024
    spec = registry.prefill(WINDOW)["naive"]
    while T <= max_len:
        x = inputs(T)
        row = {"T": T}
        with torch.no_grad():
            row["chunked_s"] = best_time(lambda x=x: chunked.chunk_hybrid_attention(**x, window=WINDOW), repeats)
            row["sdpa_s"] = best_time(lambda x=x: registry.sdpa(x), repeats)
            if T <= naive_max:
                row["naive_s"] = best_time(lambda x=x: spec(x), repeats)
        rows.append(row)
        T *= 2
    ref = next((r for r in rows if r["T"] == 2048), rows[0])  # (2048 unless --max-len is below it)
    for r in rows:
        for key in ("chunked_s", "sdpa_s", "naive_s"):
            if key in r:
                r[key.replace("_s", "_vs_2k")] = r[key] / ref[key]
    return rows


def decode(contexts, steps, repeats):
    rows = []
    for ctx in contexts:
        x = inputs(ctx + steps, seed=1)
        state = recurrent.DecodeState.empty(
            Shape(
                kv_heads=HKV, head_dim=D, value_dim=D, features=FEAT, window=WINDOW, sinks=SINKS, dtype=torch.float32
            ),
            1,
            WINDOW,
            "cpu",
        )
        with torch.no_grad():
            recurrent.extend(state, **{n: t if n == "gamma" else t[:, :, :ctx] for n, t in x.items()}, window=WINDOW)

            def step_all(state=state, x=x, ctx=ctx):
                for t in range(ctx, ctx + steps):
                    one = {n: v if n == "gamma" else v[:, :, t : t + 1] for n, v in x.items()}
                    recurrent.extend(state, **one, window=WINDOW)

            t0 = time.perf_counter()
            step_all()
            step_s = (time.perf_counter() - t0) / steps
        kv_cache_bytes = 2 * HKV * (ctx + steps) * D * 4  # what a softmax layer would hold
        rows.append(
            {"context": ctx, "step_s": step_s, "hybrid_bytes": state.nbytes, "softmax_kv_bytes": kv_cache_bytes}
        )
    return rows


def add_arguments(ap) -> None:
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--naive-max", type=int, default=4096, help="naive is O(T^2) memory: larger would not fit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--contexts", default="512,8192", help="decode: the context lengths, compared first to last")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "out" / "attention_scaling.json"))


def run(args) -> int:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, B=1 H={H} Hkv={HKV} D={D} F={FEAT}")
    rows = scaling(args.max_len, args.naive_max, args.repeats)
    print(f"\n{'T':>6} {'chunked s':>10} {'x vs 2k':>8} {'naive s':>9} {'x vs 2k':>8} {'sdpa s':>9} {'x vs 2k':>8}")
    for r in rows:
        nv = f"{r['naive_s']:9.4f} {r['naive_vs_2k']:8.2f}" if "naive_s" in r else f"{'skip':>9} {'':>8}"
        ch = f"{r['chunked_s']:10.4f} {r['chunked_vs_2k']:8.2f}"
        print(f"{r['T']:>6} {ch} {nv} {r['sdpa_s']:9.4f} {r['sdpa_vs_2k']:8.2f}")
    contexts = [int(c) for c in str(args.contexts).split(",")]
    dec = decode(contexts, args.decode_steps, args.repeats)
    print(f"\n{'context':>8} {'step ms':>8} {'hybrid bytes':>13} {'softmax KV bytes':>17}   (one layer)")
    for r in dec:
        print(f"{r['context']:>8} {1e3 * r['step_s']:8.3f} {r['hybrid_bytes']:>13} {r['softmax_kv_bytes']:>17}")
    a, b = dec[0], dec[-1]
    ratio = {key: b[key] / a[key] for key in ("step_s", "hybrid_bytes", "softmax_kv_bytes")}
    print(
        f"\n{b['context']} / {a['context']}: decode step time x{ratio['step_s']:.2f}, hybrid bytes "
        f"x{ratio['hybrid_bytes']:.2f}, softmax KV bytes x{ratio['softmax_kv_bytes']:.2f}"
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k in ("max_len", "naive_max", "repeats", "decode_steps")}
    out.write_text(json.dumps({"scaling": rows, "decode": dec, "args": settings}, indent=2))
    print(f"wrote {out}")
    return 0
