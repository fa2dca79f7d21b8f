"""Base SmolLM2-135M-Instruct (the embedded default) on the first 200 validation items of PIQA and ARC-Easy, next to
the reference figures from an independent scorer (PIQA acc 0.640, ARC-E acc 0.500). Also prints the share of scored
tokens beyond w = 16 and w = 64. Writes benchmarks/out/eval_reference.json.

    .venv/bin/python -m experiments.eval_reference.run [--limit 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybrid_scale.config import load_config
from hybrid_scale.evaluate.stage import evaluate

REFERENCE = {"piqa": 0.640, "arc_easy": 0.500}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=200)
    args = ap.parse_args()
    out = Path(__file__).parent / "out"
    cfg = load_config(
        overrides=[
            "eval.tasks=[piqa,arc_easy]",
            f"eval.limit={args.limit}",
            "eval.modes=[base]",
            "eval.ppl_sequences=0",
            "eval.passkey_trials=0",
            f"eval.out_dir={out / 'eval_reference'}",
        ]
    )
    r = evaluate(cfg)
    rows = {}
    print(f"\n{'task':<10} {'acc':>6} {'ref':>6} {'stderr':>7} {'n':>4} {'>=w16':>7} {'>=w64':>7}")
    for task, ref in REFERENCE.items():
        m, bw = r.modes["base"].tasks[task], r.tasks[task].beyond_window
        rows[task] = {"acc": m.acc, "reference": ref, "stderr": m.stderr, "n": m.n, **bw}
        print(
            f"{task:<10} {m.acc:6.3f} {ref:6.3f} {m.stderr:7.3f} {m.n:>4} {bw[16]:7.3f} {bw[64]:7.3f}"
            f" {r.timings_s['base']:7.0f}"
        )
    (out / "eval_reference.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
