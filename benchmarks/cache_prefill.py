"""What the cache of exact keys costs a prefill on CPU (issue 66's target: at most 2x the hybrid without it at 4k
tokens): one layer's attention at the quickstart's shape (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64;
window 16, 8 sinks of its own, the LA's decay), the forward (and, with --backward, the backward) of the chunked torch
path without a cache and with `--cache` keys per KV head for each selection, interleaved repeats side by side in one
run; printed: the median seconds and the ratio to the hybrid without a cache. Both LA kinds.

    python -m benchmarks.cache_prefill [--tokens 4096] [--cache 32] [--repeats 3] [--backward]   (make cache-speed)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybrid_scale.attention.gated_delta.naive import DeltaGates
from hybrid_scale.attention.layer import attend
from hybrid_scale.attention.settings import CACHE_SELECTS

H, K, D, W, S = 9, 3, 64, 16, 8


def inputs(kind: str, T: int):
    g = torch.Generator().manual_seed(0)
    F = 2 * D if kind == "hedgehog" else D
    x = [torch.randn(1, heads, T, D, generator=g) for heads in (H, K, K)]
    x += [torch.rand(1, heads, T, F, generator=g) for heads in (H, K)]
    gates = None
    if kind == "gated_delta":
        gates = DeltaGates(torch.rand(1, K, T, generator=g), -0.05 * torch.rand(1, K, T, generator=g),
                           torch.rand(1, H, T, generator=g))  # fmt: skip
    rho = torch.full((K,), 1 / 64) if kind == "hedgehog" else None
    return x, gates, rho


def timed(kind, x, gates, rho, backward: bool, **settings) -> float:
    leaves = [t.detach().requires_grad_(backward) for t in x]
    start = time.perf_counter()
    y = attend(*leaves, torch.full((H,), 30.0), backend="chunk", window=W, sinks=S, hybrid_sinks=True, la_kind=kind,
               gates=gates, la_decay=rho, **settings)  # fmt: skip
    if backward:
        y.square().sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cache", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--kinds", nargs="+", default=["hedgehog", "gated_delta"])
    args = parser.parse_args(argv)
    what = "forward + backward" if args.backward else "forward"
    print(f"one layer's {what} at T={args.tokens}, {torch.get_num_threads()} threads, cache {args.cache} keys/KV head")
    print(f"{'kind':<12} {'cache':<22} {'median s':>9} {'x no cache':>11}")
    for kind in args.kinds:
        x, gates, rho = inputs(kind, args.tokens)
        variants = {"none": {}} | {
            f"{args.cache} by {s}": dict(cache=args.cache, cache_select=s) for s in CACHE_SELECTS
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for kw in variants.values():  # one warm-up each
            timed(kind, x, gates, rho, args.backward, **kw)
        for _ in range(args.repeats):  # interleaved: a slower moment of the machine hits every variant alike
            for name, kw in variants.items():
                times[name].append(timed(kind, x, gates, rho, args.backward, **kw))
        base = statistics.median(times["none"])
        for name, t in times.items():
            print(f"{kind:<12} {name:<22} {statistics.median(t):>9.3f} {statistics.median(t) / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
