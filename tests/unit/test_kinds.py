"""The LA's kinds are named in one registry (attention/kinds.py): no comparison with a kind's name anywhere else in
hybrid_scale/ (`== "hedgehog"`, `!= "gated_delta"`, `in ("gated_delta", ...)`), so that stage code asks the kind or
its part (attention/part.py) and a new kind is one record and one folder, not a branch in every file."""

import ast
from pathlib import Path

from hybrid_scale.attention.kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = "hybrid_scale/attention/kinds.py"


def kind_comparisons(root: Path) -> list[str]:
    """'path:line' of every comparison whose operands name a kind (a string constant, or a tuple/list/set of them)."""
    names = set(KINDS)

    def names_a_kind(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(names_a_kind(e) for e in node.elts)
        return False

    out = []
    for path in sorted((root / "hybrid_scale").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(names_a_kind(x) for x in (node.left, *node.comparators)):
                out.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.match_case) and names_a_kind(getattr(node.pattern, "value", None) or ast.Pass()):
                out.append(f"{rel}:{node.pattern.lineno}")
    return out


def test_no_kind_is_compared_by_name_outside_its_registry():
    assert kind_comparisons(ROOT) == []


def test_the_scan_finds_a_planted_comparison(tmp_path):
    """Planted: a stage that branches on the kind, three ways; and the registry's own comparisons are allowed."""
    (tmp_path / "hybrid_scale" / "attention").mkdir(parents=True)
    (tmp_path / "hybrid_scale" / "stage.py").write_text(
        "def f(cfg):\n"
        "    if cfg.la_kind == 'gated_delta':\n        return 1\n"
        "    if 'hedgehog' != cfg.la_kind:\n        return 2\n"
        "    return cfg.la_kind in ('gated_delta', 'other')\n"
    )
    (tmp_path / REGISTRY).write_text("def g(k):\n    return k == 'hedgehog'\n")
    assert kind_comparisons(tmp_path) == [
        "hybrid_scale/stage.py:2",
        "hybrid_scale/stage.py:4",
        "hybrid_scale/stage.py:6",
    ]
