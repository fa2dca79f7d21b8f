"""`make quickstart` -> `hybrid-scale quickstart`: the whole pipeline on the embedded default (SmolLM2-135M-Instruct)
on CPU: assets -> stage 1 -> stage 2 (recipe ssd) -> component-ablation evaluation (base + five modes on PIQA and
ARC-Easy, perplexity by position bucket) -> export. Budgets come from configs/quickstart.yaml and are tiny (a smoke
demo: about 7 minutes on 2 cores once installed, docs/results/quickstart.md); `make reproduce` is the real
measurement.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .config import load_config
from .data import assets
from .stages import rundir
from .stages.pipeline import pipeline


def main(run_dir: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    t0 = time.perf_counter()
    print(
        "hybrid_scale quickstart: SmolLM2-135M -> hybrid (SWA + linear attention) on CPU, tiny budgets (a smoke demo)"
    )
    extra = [*([f"run_dir={run_dir}"] if run_dir else []), *overrides]
    cfg = load_config("quickstart.yaml", extra)
    if cfg.model.path is None:
        assets.prepare()  # converts and caches the embedded default once (about a minute)
    timings = pipeline(cfg)
    run, eval_dir = Path(cfg.run_dir), rundir.eval_dir(cfg)
    results = json.loads((eval_dir / "results.json").read_text())
    print("\n" + (eval_dir / "table.md").read_text())
    print(f"Verdict on the linear attention: {results.get('verdict', 'n/a')}")
    print("Stage times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    print(f"Total {(time.perf_counter() - t0) / 60:.1f} min. Run directory: {run.resolve()}")
    print(f"Export (load with trust_remote_code=True): {rundir.export_dir(cfg).resolve()}")
    print("These numbers come from a few minutes of training on 16 sequences: they show the pipeline works, not how")
    print("good a recipe is. The full comparison of recipes is `make reproduce`.")
    return 0
