"""Every preset's `plan` report, the command's (no stage) and each stage's own (what its preflight plans), with the
free disk space fixed, as one text: the figure that tests/unit/test_plan_reports.py holds `plan` to across a change of
the preflight (tests/unit/plan_reports.txt was written at a6a285a, before each stage declared its own inputs).

    .venv/bin/python -m tools.plan_reports > tests/unit/plan_reports.txt   # after a change meant to move a figure
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybrid_scale.config import STAGES, load_config
from hybrid_scale.preflight import costs, plan

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("quickstart.yaml", *(f"models/{p.name}" for p in sorted((ROOT / "configs" / "models").glob("*.yaml"))))
RUN_DIR = "/nonexistent/plan-reports/run"  # (never created: plan writes nothing)
FREE = 10**13  # bytes free on every disk, so that the report does not depend on the machine


def stage_report(cfg, stage: str | None) -> str:
    """`plan`'s table (stage None), or the one a stage's preflight makes (at a6a285a: plan(cfg, stage))."""
    if stage is None:
        return plan.plan(cfg).table()
    try:
        from hybrid_scale.pipeline import STAGE_INPUTS  # noqa: PLC0415
        from hybrid_scale.run.resolved import Resolved  # noqa: PLC0415
    except ImportError:  # (before each stage declared its inputs)
        return plan.plan(cfg, stage).table()
    return plan.stage_plan(cfg, stage, STAGE_INPUTS[stage], Resolved.of(cfg, stage)).table()


def reports() -> str:
    real = plan.free_at
    plan.free_at = costs.free_at = lambda path: (real(path)[0], FREE)
    out = []
    try:
        for preset in PRESETS:
            cfg = load_config(preset, [f"run_dir={RUN_DIR}"])
            for stage in (None, *STAGES):
                try:
                    text = stage_report(cfg, stage)
                except Exception as e:  # noqa: BLE001  (a stage whose model is not there: its error is the figure)
                    text = f"{type(e).__name__}: {e}"
                out.append(f"## {preset} {stage or 'plan'}\n{text}\n")
    finally:
        plan.free_at = costs.free_at = real
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reports())
