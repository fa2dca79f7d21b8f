"""What the metrics cost a stage-2 step at the quickstart's size (SmolLM2-135M, one 1024-token sequence a step, the
quickstart's attention: sinks, gamma = exp(theta), the LA's decay), measured side by side in one run: each step's
time in `train_step` (forward, backward, optimizer) against the time of its `step_metrics` (gamma and rho gathered,
the record written to metrics.jsonl, TensorBoard and an offline W&B run, the progress line).

    .venv/bin/python -m benchmarks.metrics_overhead [--steps 8] [--out docs/results/metrics_overhead.md]

The model is the embedded default converted with untrained feature maps (`hybrid-scale convert`): the step costs the
same as a trained one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid_scale.config import load_config
from hybrid_scale.data import assets
from hybrid_scale.finetune import stage as stage2


def timed(fn, into: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out

    return wrapper


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    model = assets.prepare().model
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        common = [f"run_dir={run}", f"model.path={model}"]
        subprocess.run([sys.executable, "-m", "hybrid_scale.cli", "convert", "quickstart.yaml", *common], check=True)
        overrides = [*common, f"finetune.model={run / 'converted'}", f"finetune.max_steps={a.steps}"]
        overrides += [f"finetune.save_every={a.steps}", f"finetune.eval_every={a.steps}", "finetune.progress=false"]
        overrides += ["log.tensorboard=true", "log.wandb=hybrid-scale-overhead", "log.every_s=0.001"]
        cfg = load_config("quickstart.yaml", overrides)
        steps, logging = [], []
        train_step, step_metrics = stage2.train_step, stage2.step_metrics
        stage2.train_step, stage2.step_metrics = timed(train_step, steps), timed(step_metrics, logging)
        try:
            stage2.finetune(cfg)
        finally:
            stage2.train_step, stage2.step_metrics = train_step, step_metrics
    # the first step warms up (allocations, the autograd graph): left out of both
    step, log = statistics.median(steps[1:]), statistics.median(logging[1:])
    lines = [
        "# What the metrics cost a stage-2 step (quickstart size)",
        "",
        f"<!-- {time.strftime('%Y-%m-%d')}: `.venv/bin/python -m benchmarks.metrics_overhead --steps {a.steps}` on "
        f"{os.cpu_count()} CPU cores; median over steps 2-{a.steps} -->",
        "",
        "Every sink on: metrics.jsonl, TensorBoard and an offline W&B run, gamma and rho of every layer gathered,",
        "and a progress line at every step (log.every_s=0.001; the default is 60 s).",
        "",
        "| | median time (s) |",
        "|---|---:|",
        f"| train_step (forward, backward, AdamW) | {step:.3f} |",
        f"| step_metrics (gather, record, write, progress line) | {log:.4f} |",
        f"| **overhead** | **{100 * log / step:.2f} %** |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
