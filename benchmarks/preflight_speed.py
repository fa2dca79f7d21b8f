"""What the preflight costs, measured side by side in one run (issue 61: each stage declares its inputs, the text is
tokenized once):

  * `plan`: every preset's 30 reports (tools/plan_reports.py: the command's and each stage's own) at a commit before
    the change (`--before`, default a6a285a, checked out with git archive) and at this tree, each in its own process,
    alternated, best of `--repeats`;
  * the text: the embedded default's stage-1 and stage-2 text checks (each stage's own preflight), then what the
    stages read (stage 1's training sequences, stage 2's training and held-out ones), with the packings kept by
    data/corpus.pack against the same calls packing again (the memo emptied before each, as before the change).

    .venv/bin/python -m benchmarks.preflight_speed [--repeats 5] [--out docs/results/preflight_speed.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_TIMER = """
import json, sys, time
from tools import plan_reports
plan_reports.reports()  # (the imports and the first reads of the presets: not counted)
times = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    plan_reports.reports()
    times.append(time.perf_counter() - t0)
print(json.dumps(min(times)))
"""


def plan_seconds(tree: Path, repeats: int) -> float:
    """Best seconds of the 30 reports with `tree`'s code (its tools/plan_reports.py is this tree's)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", PLAN_TIMER, str(repeats)], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def text_seconds(kept: bool) -> tuple[float, float, int]:
    """(the text checks' seconds, the stages' reads' seconds, packings done) on the embedded default."""
    from hybrid_scale.config import load_config
    from hybrid_scale.data import assets, corpus
    from hybrid_scale.data.batches import finetune_data
    from hybrid_scale.distill import inputs as distill_inputs
    from hybrid_scale.finetune import inputs as finetune_inputs
    from hybrid_scale.models.converted import load_tokenizer
    from hybrid_scale.run.resolved import Resolved

    packed, real = [], corpus._pack
    corpus._pack = lambda *a: packed.append(1) or real(*a)
    corpus._PACKED.clear()
    try:
        cfg = load_config("quickstart.yaml", ["run_dir=/nonexistent/preflight-speed/run"])
        r = Resolved.of(cfg)
        tokenizer = load_tokenizer(assets.require().model)
        t0 = time.perf_counter()
        distill_inputs.ahead(cfg, r)  # stage 1's own check (`now` on the teacher)
        finetune_inputs.check_text(cfg, r, assets.require().model)  # stage 2's `now` (its tokenizer is the teacher's)
        t1 = time.perf_counter()
        if not kept:
            corpus._PACKED.clear()
        distill_inputs.training_sequences(cfg, tokenizer)
        if not kept:
            corpus._PACKED.clear()
        finetune_data(cfg, tokenizer, r.derived.stage2_seq_len)
        return t1 - t0, time.perf_counter() - t1, len(packed)
    finally:
        corpus._pack = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="a6a285a", help="the commit to compare `plan` with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp)
        archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        (before / "tools" / "plan_reports.py").write_bytes((ROOT / "tools" / "plan_reports.py").read_bytes())
        old, new = [], []
        for _ in range(2):  # alternated: a slower moment of the machine falls on both
            old.append(plan_seconds(before, args.repeats))
            new.append(plan_seconds(ROOT, args.repeats))
    check_kept, read_kept, packs_kept = text_seconds(kept=True)
    check_again, read_again, packs_again = text_seconds(kept=False)
    rows = [
        "| what | before | now | now / before |",
        "|---|---:|---:|---:|",
        f"| `plan`: 30 reports (6 presets x the command and 4 stages), best of {args.repeats} | {min(old):.3f} s "
        f"({args.before}) | {min(new):.3f} s | {min(new) / min(old):.2f} |",
        f"| the stages reading the text after its checks (embedded default; the checks took {check_kept:.2f} s and "
        f"{check_again:.2f} s) | {read_again:.3f} s, {packs_again} packings (packed again) | {read_kept:.3f} s, "
        f"{packs_kept} packings (kept) | {read_kept / read_again:.2f} |",
    ]
    text = (
        f"# The preflight's cost (`python -m benchmarks.preflight_speed --repeats {args.repeats}`, at "
        f"{commit.stdout.strip()}, one run)\n\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
