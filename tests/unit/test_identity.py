"""run/identity.py: the one rule for "is this output current", as every stage uses it: stage 1's refusal lines,
stage 2's and the cells' changed keys, the pipeline's evaluation and export."""

import ast
from pathlib import Path

from hybrid_scale.run.identity import changes, differing, is_current

PACKAGE = Path(__file__).resolve().parents[2] / "hybrid_scale"


def test_a_key_that_differs_or_that_one_side_lacks_is_changed():
    recorded, now = {"a": 1, "b": [1, 2], "c": "x"}, {"a": 2, "b": [1, 2], "d": None}
    assert differing(recorded, now) == ["a", "c", "d"]
    assert changes(recorded, now) == ["a 1 -> 2", "c x -> (not recorded)", "d (not recorded) -> null"]
    assert is_current({"a": (1, 2)}, {"a": [1, 2]})  # as JSON holds it
    assert not is_current(None, {}) and not is_current({"a": 1}, {"a": 1, "b": 0})


def test_every_stage_and_the_pipeline_decide_with_it_and_nothing_else_compares_identities():
    """The four stages' modules (and the pipeline) import run/identity; no other module defines a comparison of
    recorded settings (a `differing`, `changes` or `is_current` of its own)."""
    users = {
        "distill/identity.py",
        "finetune/stage.py",
        "evaluate/cells.py",
        "pipeline.py",  # the evaluation's and the export's identity, when the pipeline decides to rerun them
    }
    for name in users:
        text = (PACKAGE / name).read_text()
        assert "run.identity import" in text, name
    defined = {
        f"{path.relative_to(PACKAGE)}:{node.name}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in ("differing", "changes", "is_current")
    }
    assert defined == {"run/identity.py:differing", "run/identity.py:changes", "run/identity.py:is_current"}
