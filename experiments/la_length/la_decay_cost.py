"""What the LA's decay costs the chunked torch path (issue 39 item 7): forward + backward at 2k and 16k tokens without
and with it (attention.la_decay), measured side by side in one run (the two interleaved within each repeat, best of
the repeats), and t(16k) / t(2k).

Shapes of SmolLM2-135M (9 heads, 3 KV heads, head_dim 64, hedgehog phi of size 128), window 64, 8 sinks kept by the
hybrid, chunk 64, batch 1, fp32, CPU. Gradients flow to q, k, v, phi_q, phi_k, gamma and rho.

    .venv/bin/python -m experiments.la_length.la_decay_cost [--lengths 2048 16384] [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.attention.scaling import FEAT, HKV, D, H, inputs  # the scaling benchmark's SmolLM2-shaped inputs
from hybrid_scale.attention.hedgehog.chunk import chunk_hybrid_attention

WINDOW, SINKS = 64, 8
VARIANTS = {
    "none": {},
    "la_decay": {"la_decay": lambda: torch.full((HKV,), 0.01)},
}


def step(x: dict, variant: str) -> float:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    extra = {n: make().requires_grad_() for n, make in VARIANTS[variant].items()}
    t0 = time.perf_counter()
    y = chunk_hybrid_attention(**leaves, **extra, window=WINDOW, sinks=SINKS, hybrid_sinks=True, chunk_size=64)
    y.square().sum().backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the figures as JSON")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, H={H} Hkv={HKV} D={D} F={FEAT}, "
          f"window {WINDOW}, {SINKS} sinks; forward + backward, best of {a.repeats}")  # fmt: skip
    best = {(T, v): float("inf") for T in a.lengths for v in VARIANTS}
    for T in a.lengths:
        x = inputs(T)
        x["gamma"] = torch.full((H,), 0.5)
        for v in VARIANTS:  # warm-up
            step(x, v)
        for _ in range(a.repeats):
            for v in VARIANTS:  # interleaved: the machine's load falls on every variant alike
                best[T, v] = min(best[T, v], step(x, v))
    lo, hi = a.lengths[0], a.lengths[-1]
    print(
        f"\n{'variant':>9} "
        + " ".join(f"{f'{T} s':>9} {'x none':>7}" for T in a.lengths)
        + f" {f't({hi})/t({lo})':>14}"
    )
    record = {}
    for v in VARIANTS:
        cells = " ".join(f"{best[T, v]:9.3f} {best[T, v] / best[T, 'none']:7.3f}" for T in a.lengths)
        growth = best[hi, v] / best[lo, v]
        print(f"{v:>9} {cells} {growth:14.2f}")
        record[v] = {"seconds": {str(T): best[T, v] for T in a.lengths}, "growth": growth,
                     "vs_none": {str(T): best[T, v] / best[T, "none"] for T in a.lengths}}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
