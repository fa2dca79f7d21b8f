"""Stage 1 on SmolLM2 (the embedded default): weights_xent (hedgecats) vs hybrid_output_mse (lolcats) vs untrained
(identity) feature maps, compared by held-out perplexity per position bucket in la_only, hybrid and none, next to
base and swa_only; with each stage-1 run's wall time. Resumable: a finished stage 1 is not redone.

    .venv/bin/python -m experiments.stage1_objectives.run [--sequences 256 --seq-len 512 --epochs 2 --window 64]

Writes benchmarks/out/stage1_objectives.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybrid_scale.attention.layer import hybrid_layers
from hybrid_scale.config import load_config
from hybrid_scale.data.assets import require
from hybrid_scale.distill.stage import distill
from hybrid_scale.evaluate.stage import _heldout_sequences
from hybrid_scale.measure import perplexity_by_bucket
from hybrid_scale.models.convert import components, convert_model
from hybrid_scale.models.converted import load_converted

RECIPES = {"hedgecats": "weights_xent", "lolcats": "hybrid_output_mse"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--ppl-seq-len", type=int, default=512)
    ap.add_argument("--ppl-sequences", type=int, default=16)
    ap.add_argument("--run-root", default="runs/bench_stage1")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    common = [
        f"data.seq_len={args.seq_len}",
        f"data.num_sequences={args.sequences}",
        f"distill.epochs={args.epochs}",
        f"attention.window={args.window}",
        f"eval.ppl_seq_len={args.ppl_seq_len}",
        f"eval.ppl_sequences={args.ppl_sequences}",
    ]
    results = {"args": vars(args), "stage1_wall_s": {}, "perplexity": {}, "gamma_mean": {}}
    converted = {}
    for recipe in args.recipes:
        run_dir = Path(args.run_root) / recipe
        cfg = load_config(overrides=[*common, f"distill.recipe={recipe}", f"run_dir={run_dir}"])
        timing = run_dir / "stage1_wall_s.json"
        t0 = time.perf_counter()
        converted[recipe] = distill(cfg)
        if not timing.is_file():  # the wall time of a run done in one go (a resumed one keeps its first figure)
            timing.write_text(json.dumps(time.perf_counter() - t0))
        results["stage1_wall_s"][recipe] = json.loads(timing.read_text())

    cfg = load_config(overrides=common)
    path = require().model
    seqs = _heldout_sequences(AutoTokenizer.from_pretrained(path, local_files_only=True), cfg)
    buckets = [0, 64, 128, 256, 512, 1024, 2048]
    buckets = [b for b in buckets if b < args.ppl_seq_len] + [args.ppl_seq_len]

    def ppl(name, model, modes):
        for mode in modes:
            t0 = time.perf_counter()
            if mode == "base":
                r = perplexity_by_bucket(model, seqs, buckets)
            else:
                with components(model, mode):
                    r = perplexity_by_bucket(model, seqs, buckets)
            results["perplexity"][f"{name}/{mode}"] = r
            print(
                f"{name:>18} {mode:>9} " + " ".join(f"{v:9.1f}" for v in r.values()),
                f"({time.perf_counter() - t0:.0f} s)",
            )
            sys.stdout.flush()

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    ppl("base", base, ["base"])
    identity = convert_model(base, cfg.attention)
    ppl("identity", identity, ["swa_only", "la_only", "hybrid", "none"])
    del base, identity
    for recipe in args.recipes:
        model = load_converted(converted[recipe])
        results["gamma_mean"][recipe] = (
            torch.stack([m.gamma.mean() for m in hybrid_layers(model).values()]).mean().item()
        )
        ppl(RECIPES[recipe], model, ["la_only", "hybrid", "none"])
    (out / "stage1_objectives.json").write_text(json.dumps(results, indent=1))
    print(table(results, buckets))


def table(results, buckets) -> str:
    labels = [f"{a}-{b}" for a, b in zip(buckets[:-1], buckets[1:], strict=True)]
    lines = [
        "| model / mode | " + " | ".join(f"ppl {x}" for x in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for key, r in results["perplexity"].items():
        lines.append(f"| {key} | " + " | ".join(f"{r[x]:.1f}" for x in labels) + " |")
    lines.append("")
    for recipe, s in results["stage1_wall_s"].items():
        lines.append(
            f"- stage 1 `{recipe}` ({RECIPES[recipe]}): {s / 60:.1f} min wall; mean gamma "
            f"{results['gamma_mean'].get(recipe, float('nan')):.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
