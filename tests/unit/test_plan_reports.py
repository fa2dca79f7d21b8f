"""`plan` across a change of the preflight (issue 61: each stage declares its inputs, preflight asks each one): every
preset's report, the command's and each stage's own, equals the one written at a6a285a, before the change
(tests/unit/plan_reports.txt, `python -m tools.plan_reports`), the free disk space fixed. A change meant to move a
figure writes the file again and says why in its commit."""

from dataclasses import replace
from pathlib import Path

import pytest

from tools import plan_reports

HERE = Path(__file__).resolve().parent


def test_every_presets_plan_is_the_one_before_the_stages_declared_their_inputs():
    assert plan_reports.reports() == (HERE / "plan_reports.txt").read_text()


def test_the_comparison_sees_a_moved_figure(monkeypatch):
    """Planted: stage 1 planned from its model's base (the embedded default's config.json), not from model.arch as
    before, changes the quickstart's report."""
    from hybrid_scale.pipeline import STAGE_INPUTS

    monkeypatch.setitem(STAGE_INPUTS, "distill", replace(STAGE_INPUTS["distill"], plans_from_model=True))
    assert plan_reports.reports() != (HERE / "plan_reports.txt").read_text()


def stage_branches(source: str) -> list[int]:
    """Lines of `source` that compare a name with a stage's name (stage == "distill", stage in ("finetune", ...))."""
    import ast

    from hybrid_scale.config import STAGES

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name):
            names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if names & set(STAGES):
                found.append(node.lineno)
    return found


def test_preflight_asks_each_stage_and_branches_on_no_stages_name():
    """Each stage declares what it reads (its inputs.py: StageInputs); preflight asks it. Planted: preflight's
    inputs.py as it was at a6a285a (10 branches on the stage's name) is found."""
    import subprocess

    root = HERE.parents[1]
    for path in sorted((root / "hybrid_scale" / "preflight").glob("*.py")):
        assert stage_branches(path.read_text()) == [], path.name
    old = subprocess.run(["git", "show", "a6a285a:hybrid_scale/preflight/inputs.py"], cwd=root, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert len(stage_branches(old)) >= 6


@pytest.mark.slow  # a benchmark's smoke run (31 s): make test, not the inner loop
def test_the_preflight_benchmark_runs_and_keeps_the_text(smollm2, tmp_path, capsys):
    """benchmarks/preflight_speed.py at one repeat: both `plan`s run, and the stages' reads pack nothing when the
    packings are kept (3 packings, the checks') and 3 more when they are not."""
    from benchmarks import preflight_speed

    assert preflight_speed.main(["--repeats", "1", "--out", str(tmp_path / "t.md")]) == 0
    table = (tmp_path / "t.md").read_text()
    assert "6 packings (packed again)" in table and "3 packings (kept)" in table and "(a6a285a)" in table
