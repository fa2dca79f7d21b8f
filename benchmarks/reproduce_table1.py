"""Reproduce the paper's Table 1 on SmolLM2 (the embedded default): every recipe through stage 1, stage 2 and the
component-ablation evaluation, at a stated budget, into one combined table. Resumable: each stage resumes or is
skipped when finished (`make reproduce` runs it with the defaults below).

    .venv/bin/python benchmarks/reproduce_table1.py [--steps 16 --eval-limit 25 ...]

Stage 1 is shared by the recipes with the same objective (hedgecats, ssd and la_only all use weights_xent).
Each stage runs as its own `hybrid-scale` process, as a user would run it. The la_only row's `hybrid` column is the
LA-only-trained model with SWA added at inference and gamma at its initial value (attention.gamma_init); the row
after it is the paper's inference-time hybridisation proper: the la_only run exported with `export.mode=hybrid
export.calibrate_gamma=true` (gamma fitted per layer and head so the hybrid matches softmax attention) and the
export evaluated (`--no-calibrated-row` skips it).

Every recipe also runs with the hybrid's own sinks (`--variants plain sinks`, the default: a "+sinks" row per recipe,
its own stage 1, `attention.hybrid_sinks=true` plus `--sinks-overrides`, by default the exploration's winner in
docs/results/quickstart.md). For each row the table says whether the hybrid beats its own no-LA mode (swa_only: for a
hybrid with sinks that is its window plus the same sinks) and swa_sinks beyond the window: "yes" when the 95% CI of
the NLL gain lies above 0, "no" when below, "~" when it includes 0.

Writes {run_root}/table1.json and {run_root}/table1.md (copy the latter to docs/results/ with the command).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hybrid_scale.recipes import RECIPES as RECIPE_TABLE

RECIPES = ("lolcats", "hedgecats", "ssd", "la_only")
MODES = ("hybrid", "swa_only", "swa_sinks", "la_only", "none")
ACCURACY_MODES = ("hybrid", "swa_only", "la_only", "none")  # the table's accuracy columns
CALIBRATED = "la_only + SWA, gamma calibrated (export)"
SINKS = "+sinks"  # a recipe's row with the hybrid's own sinks
SINKS_OVERRIDES = ["attention.hybrid_sinks=true", "attention.gamma_param=exp", "attention.gamma_init=30.0"]


def hybrid_scale(*args: str) -> float:
    """Run one stage; returns its wall time (s)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "hybrid_scale.cli", *args]
    print("$ hybrid-scale " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def timed(run_dir: Path, name: str, fn) -> float:
    """Wall time of a stage, recorded once (a skipped or resumed stage keeps the first complete figure)."""
    path = run_dir / f"wall_{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    seconds = fn()
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(seconds))
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs/reproduce")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--stage1-sequences", type=int, default=160)
    ap.add_argument("--stage1-seq-len", type=int, default=512)
    ap.add_argument("--stage1-epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="stage-2 optimizer steps")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256, help="stage-2 sequence length")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--tasks", nargs="+", default=["piqa", "arc_easy"])
    ap.add_argument("--eval-limit", type=int, default=25)
    ap.add_argument("--ppl-seq-len", type=int, default=512)
    ap.add_argument("--ppl-sequences", type=int, default=4)
    ap.add_argument("--passkey-distances", nargs="+", type=int, default=[32, 128, 512])
    ap.add_argument("--passkey-trials", type=int, default=10)
    ap.add_argument("--no-calibrated-row", action="store_true", help="skip la_only + calibrated gamma (export)")
    ap.add_argument("--variants", nargs="+", default=["plain", "sinks"], choices=["plain", "sinks"],
                    help="each recipe as it is (plain) and with the hybrid's own sinks (sinks)")  # fmt: skip
    ap.add_argument("--sinks-overrides", nargs="*", default=SINKS_OVERRIDES, help="config overrides of the +sinks rows")
    args = ap.parse_args()
    root = Path(args.run_root)
    common = [f"attention.window={args.window}", "seed=0"]
    variants = {"plain": ("", []), "sinks": (SINKS, list(args.sinks_overrides))}
    variants = {v: variants[v] for v in args.variants}
    stage1 = {}
    for (suffix, extra), objective in ((variants[v], o) for v in variants
                                       for o in sorted({RECIPE_TABLE[r].objective for r in args.recipes})):  # fmt: skip
        recipe = next(r for r in args.recipes if RECIPE_TABLE[r].objective == objective)
        run = root / f"stage1_{objective}{suffix.replace('+', '_')}"
        overrides = [
            *common,
            *extra,
            f"run_dir={run}",
            f"distill.recipe={recipe}",
            f"data.num_sequences={args.stage1_sequences}",
            f"data.seq_len={args.stage1_seq_len}",
            f"distill.epochs={args.stage1_epochs}",
        ]
        key = objective + suffix
        stage1[key] = {"dir": run / "stage1" / "converted"}
        stage1[key]["wall_s"] = timed(run, "stage1", lambda o=overrides: hybrid_scale("distill", *o))

    evaluation = [
        f"eval.tasks=[{','.join(args.tasks)}]",
        f"eval.limit={args.eval_limit}",
        f"eval.ppl_seq_len={args.ppl_seq_len}",
        f"eval.ppl_sequences={args.ppl_sequences}",
        f"eval.buckets=[{','.join(str(b) for b in sorted({0, args.window, 64, 256}))}]",
        f"eval.la_share_seq_len={args.ppl_seq_len}",
        f"eval.passkey_distances=[{','.join(map(str, args.passkey_distances))}]",
        f"eval.passkey_trials={args.passkey_trials}",
    ]
    modes = [f"eval.modes=[{','.join(MODES)}]", f"eval.passkey_modes=[{','.join(m for m in MODES if m != 'none')}]"]
    base_run = root / "base"
    timed(
        base_run,
        "eval",
        lambda: hybrid_scale(
            "evaluate",
            *common,
            *evaluation,
            "eval.modes=[base]",
            "eval.passkey_modes=[base]",
            f"run_dir={base_run}",
            "eval.la_share_seq_len=0",
        ),
    )
    rows = {"base": json.loads((base_run / "eval" / "results.json").read_text())}
    walls = {}
    for recipe, (suffix, extra) in ((r, variants[v]) for r in args.recipes for v in variants):
        run = root / (recipe + suffix.replace("+", "_"))
        objective = RECIPE_TABLE[recipe].objective + suffix
        finetune = [
            *common,
            *extra,
            f"run_dir={run}",
            f"finetune.model={stage1[objective]['dir']}",
            f"finetune.recipe={recipe}",
            f"finetune.max_steps={args.steps}",
            f"finetune.global_batch={args.global_batch}",
            f"finetune.seq_len={args.seq_len}",
            f"finetune.lr={args.lr}",
            f"finetune.warmup_steps={max(1, args.steps // 10)}",
            f"finetune.eval_every={args.eval_every}",
            f"finetune.save_every={args.eval_every}",
            "finetune.heldout_sequences=4",
        ]
        w2 = timed(run, "stage2", lambda f=finetune: hybrid_scale("finetune", *f))
        model = (run / "stage2" / "output").resolve()
        we = timed(
            run,
            "eval",
            lambda r=run, m=model, x=extra: hybrid_scale(
                "evaluate", *common, *x, *evaluation, f"eval.model={m}", *modes, f"run_dir={r}"
            ),
        )
        rows[recipe + suffix] = json.loads((run / "eval" / "results.json").read_text())
        curves = json.loads((run / "stage2" / "curves.json").read_text())
        walls[recipe + suffix] = {"stage1": stage1[objective]["wall_s"], "stage2": w2, "eval": we, "curves": curves}
    if (
        "la_only" in args.recipes and "plain" in variants and not args.no_calibrated_row
    ):  # inference-time hybridisation, gamma calibrated
        run = root / "la_only"
        exported = run / "export_hybrid_calibrated"
        wx = timed(
            run,
            "export_calibrated",
            lambda: hybrid_scale(
                "export",
                *common,
                f"run_dir={run}",
                f"export.model={(run / 'stage2' / 'output').resolve()}",
                f"export.out_dir={exported}",
                "export.mode=hybrid",
                "export.calibrate_gamma=true",
                "export.report_sequences=0",  # the evaluation below measures the perplexity
            ),
        )
        we = timed(
            run,
            "eval_calibrated",
            lambda: hybrid_scale(
                "evaluate",
                *common,
                *evaluation,
                f"eval.model={exported}",
                *modes,
                f"eval.out_dir={run / 'eval_calibrated'}",
                f"run_dir={run}",
            ),
        )
        rows[CALIBRATED] = json.loads((run / "eval_calibrated" / "results.json").read_text())
        walls[CALIBRATED] = {**walls["la_only"], "eval": we, "export": wx, "curves": None}
    out = {"args": vars(args), "results": rows, "walls": walls}
    (root / "table1.json").write_text(json.dumps(out, indent=1))
    text = table(out)
    (root / "table1.md").write_text(text)
    print(text)


def _ci(d: dict) -> str:
    return f"{100 * d['delta']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _nats(d: dict) -> str:
    return f"{d['delta']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def _beats(d: dict | None) -> str:
    """yes / no / ~ : the 95% CI of the NLL gain above 0, below 0, or around it."""
    if not d:
        return ""
    return "yes" if d["lo"] > 0 else ("no" if d["hi"] < 0 else "~")


def _against_sinks(r: dict) -> dict | None:
    """The hybrid against swa_sinks beyond the window: the verdict's `against` when that is swa_sinks; for a hybrid
    with its own sinks, its swa_only (the same keys: window + the same sinks)."""
    b = r["beyond_window"]
    if b["against"] == "swa_sinks":
        return b
    return b.get("swa_only") if r.get("hybrid_sinks") else None


def _far(r: dict, mode: str, window: int) -> str:
    """Passkey exact match (%) over the distances beyond the window."""
    p = r.get("passkey")
    if not p or mode not in p["by_mode"]:
        return ""
    far = [str(d) for d in p["distances"] if d >= window]
    return f"{100 * sum(p['by_mode'][mode][d]['exact'] for d in far) / max(len(far), 1):.0f}" if far else ""


def table(out: dict) -> str:
    a, rows = out["args"], out["results"]
    tasks = a["tasks"]
    base = rows["base"]["modes"]["base"]
    w = a["window"]
    lines = [
        "# Table 1 on SmolLM2-135M-Instruct (reduced budget)",
        "",
        f"Budget: stage 1 {a['stage1_sequences']} x {a['stage1_seq_len']} tokens, {a['stage1_epochs']} epochs/layer; "
        f"stage 2 {a['steps']} steps x {a['global_batch']} x {a['seq_len']} tokens, lr {a['lr']}; window "
        f"{a['window']}; {a['eval_limit']} items per task ({', '.join(tasks)}); perplexity on {a['ppl_sequences']} "
        f"held-out sequences of {a['ppl_seq_len']}; passkey {a['passkey_trials']} prompts per distance "
        f"{a['passkey_distances']}. Accuracy in points (reported metric per task), AVG over tasks. Beyond the window: "
        f"held-out tokens at positions >= {w}; NLL gains in nats/token with 95% CIs (positive: the hybrid is better).",
        "",
        "| recipe | hybrid | swa_only | la_only | none | dLA [95% CI] | ppl beyond window: hybrid / swa_only / "
        "swa_sinks / la_only | hybrid vs swa_only | hybrid vs swa_sinks | beats its no-LA mode / swa_sinks | "
        "passkey beyond window: hybrid / swa_sinks (%) | verdict | stage 1 / 2 / eval (min) |",
        "|---|" + "---:|" * 12,
    ]
    base_ppl = rows["base"]["perplexity"]["by_mode"]["base"]
    lines.append(
        f"| base (softmax) | {100 * base['avg']:.1f} | | | | | {base_ppl[list(base_ppl)[-1]]:.1f} (last bucket) | | "
        f"| | {_far(rows['base'], 'base', w)} (base) | | |"
    )
    for recipe, r in rows.items():
        if recipe == "base":
            continue
        m, b, wall = r["modes"], r["beyond_window"], out["walls"][recipe]
        ppl = " / ".join(
            f"{b['perplexity'][x]:.1f}" if x in b["perplexity"] else "-"
            for x in ("hybrid", "swa_only", "swa_sinks", "la_only")
        )
        sinks = _against_sinks(r)
        vs_sinks = _nats(sinks) if sinks else ""
        acc = " | ".join(f"{100 * m[x]['avg']:.1f}" if x in m else "-" for x in ACCURACY_MODES)
        vs_swa = _nats(b["swa_only"]) if "swa_only" in b else ""
        lines.append(
            f"| {recipe} | {acc} | {_ci(r['delta_la']['avg'])} | {ppl} | {vs_swa} | {vs_sinks} | "
            + f"{_beats(b.get('swa_only'))} / {_beats(sinks)} | "
            + f"{_far(r, 'hybrid', w)} / {_far(r, 'swa_sinks', w)} | {r['verdict']} | "
            + f"{wall['stage1'] / 60:.0f} / {wall['stage2'] / 60:.0f} / "
            + f"{(wall['eval'] + wall.get('export', 0)) / 60:.0f} |"
        )
    lines += ["", "Stage 2 held-out losses (hybrid / la_only) at each evaluation, and why it stopped:", ""]
    for recipe, w in out["walls"].items():
        c = w["curves"]
        if c is None:  # the calibrated export of the la_only run: no training of its own
            continue
        pts = ", ".join(
            f"{s}: {h:.3f}/{la:.3f}" for s, h, la in zip(c["eval_steps"], c["hybrid"], c["la_only"], strict=True)
        )
        lines.append(f"- {recipe}: {pts}; output = {c['output']}; stop: {c['stopping']['reason'] or 'max_steps'}")
    lines += [
        "",
        "la_only row, `hybrid` column: SWA added at inference, gamma fixed at its init (0.1). The row after it is the "
        "same model exported with export.mode=hybrid export.calibrate_gamma=true and evaluated: its stage-2 column "
        "is the la_only run's, its eval column includes the export"
        + (f" ({out['walls'][CALIBRATED]['export'] / 60:.0f} min)." if CALIBRATED in out["walls"] else "."),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
