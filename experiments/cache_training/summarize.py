"""Tables for experiments/cache_training/results.md from the evaluation cells of the runs (runs/<name>/eval/cells).

usage: python experiments/cache_training/summarize.py w16 runs/ct_false runs/ct_true
       python experiments/cache_training/summarize.py w64 runs/w64
Passkey / recall: greedy exact match % (n prompts, mean answer log-likelihood). Perplexity past the window: the
held-out NLL at positions >= window (16-token blocks), and the paired bootstrap (2000 resamples over the blocks) of
the per-token NLL difference between two cells on the same text (negative: the second is better)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path


def cell(run: str, name: str) -> dict | None:
    p = Path(run) / "eval" / "cells" / f"{name}.json"
    return json.loads(p.read_text())["result"] if p.is_file() else None


def probe_table(runs: list[str], probe: str, modes: list[str]) -> str:
    rows, dists = [], None
    for run in runs:
        for mode in modes:
            r = cell(run, f"{probe}.{mode}")
            if r is None:
                continue
            dists = dists or sorted(r, key=int)
            cells = [f"{100 * r[d]['exact']:.0f} ({r[d]['trials']}; {r[d]['loglik']:.1f})" for d in dists]
            rows.append(f"| {Path(run).name} | {mode} | " + " | ".join(cells) + " |")
    if not rows:
        return f"({probe}: no cells)\n"
    head = "| run | mode | " + " | ".join(f"d={d}" for d in dists) + " |\n|---|---|" + "---:|" * len(dists) + "\n"
    return head + "\n".join(rows) + "\n"


def pooled(runs: list[str], probe: str, modes: list[str]) -> str:
    """Exact % per mode and distance, pooled over the runs' cells (the same model evaluated with other seeds)."""
    rows, dists = [], None
    for mode in modes:
        hits, n = {}, {}
        for run in runs:
            r = cell(run, f"{probe}.{mode}")
            for d, s in (r or {}).items():
                hits[d] = hits.get(d, 0) + round(s["exact"] * s["trials"])
                n[d] = n.get(d, 0) + s["trials"]
        if n:
            dists = dists or sorted(n, key=int)
            cells = " | ".join(f"{100 * hits[d] / n[d]:.0f} ({hits[d]}/{n[d]})" for d in dists)
            rows.append(f"| {mode} | {cells} |")
    head = "| mode | " + " | ".join(f"d={d}" for d in dists) + " |\n|---|" + "---:|" * len(dists) + "\n"
    return head + "\n".join(rows) + "\n"


def nll(blocks):
    return sum(b[0] for b in blocks) / sum(b[1] for b in blocks)


def paired(a, b, resamples=2000, seed=0):
    """mean per-token NLL of b minus a, and its 95% bootstrap CI over the blocks (a, b on the same blocks)."""
    assert len(a) == len(b) and all(x[1] == y[1] for x, y in zip(a, b, strict=True))
    rng = random.Random(seed)
    n = len(a)
    diff = [y[0] - x[0] for x, y in zip(a, b, strict=True)]
    cnt = [x[1] for x in a]
    est = sum(diff) / sum(cnt)
    boots = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(sum(diff[i] for i in idx) / sum(cnt[i] for i in idx))
    boots.sort()
    return est, boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]


def ppl_tables(runs: list[str], modes: list[str]) -> str:
    out, cells = [], {}
    buckets = None
    rows = []
    for run in runs:
        for mode in modes:
            r = cell(run, f"perplexity.{mode}")
            if r is None:
                continue
            cells[(Path(run).name, mode)] = r["blocks"]
            buckets = buckets or list(r["buckets"])
            rows.append(
                f"| {Path(run).name} | {mode} | {math.exp(nll(r['blocks'])):.2f} | "
                + " | ".join(f"{r['buckets'][b]:.1f}" for b in buckets)
                + " |"
            )
    if not rows:
        return "(perplexity: no cells)\n"
    out.append(
        "| run | mode | ppl past the window | " + " | ".join(buckets) + " |\n|---|---|---:|" + "---:|" * len(buckets)
    )
    out += rows
    out.append("\nPaired differences in NLL past the window (nats/token, second minus first; 95% bootstrap CI):\n")
    out.append("| first | second | diff | CI |\n|---|---|---:|---|")
    keys = list(cells)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            est, lo, hi = paired(cells[a], cells[b])
            out.append(f"| {' '.join(a)} | {' '.join(b)} | {est:+.4f} | [{lo:+.4f}, {hi:+.4f}] |")
    return "\n".join(out) + "\n"


def main() -> None:
    kind, runs = sys.argv[1], sys.argv[2:]
    if kind == "w16":
        modes = ["hybrid", "hybrid+cache"]
        print("### Passkey (exact %, (n; mean answer log-likelihood))\n")
        print(probe_table(runs, "passkey", modes))
        print("### Associative recall (4 pairs)\n")
        print(probe_table(runs, "recall", modes))
        print("### Perplexity past the window (2 x 1024 held-out tokens, positions >= 16)\n")
        print(ppl_tables(runs, modes))
    else:
        modes = ["base", "hybrid", "hybrid+cache", "swa_sinks", "swa_sinks+cache"]
        print("### Passkey (exact %, (n; mean answer log-likelihood))\n")
        print(probe_table(runs, "passkey", modes))
        print("### Pooled over the runs given (same model, other prompt seeds)\n")
        print(pooled(runs, "passkey", modes))


if __name__ == "__main__":
    main()
