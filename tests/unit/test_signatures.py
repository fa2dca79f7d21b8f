"""Functions take the objects their values belong to (issue 53): no function of hybrid_scale/ takes more than
MAX parameters, except the attention ops, which follow fla's convention: the tensors they compute on positional
(q, k, v, phi_q, phi_k, gamma; a decode state or explicit positions at most), every setting keyword-only, so that a
call cannot swap two settings. A stage function that needs more takes the object they belong to (Stage1, Trained,
Sources, Scoring, Zero3, ShardPlan, Draft, Projections, Shape)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX = 6  # parameters of any function (self and cls not counted)
OPS = "hybrid_scale/attention/"  # where the ops' convention applies
OP_TENSORS = 8  # the most positional parameters of an op: q, k, v, fq, fk, gamma and a state or two positions


def violations(root: Path, package: str = "hybrid_scale") -> list[str]:
    """'path:line name (n): why' of every function over the limit."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            positional = [x.arg for x in a.posonlyargs + a.args if x.arg not in ("self", "cls")]
            n = len(positional) + len(a.kwonlyargs)
            if n <= MAX:
                continue
            where = f"{rel}:{node.lineno} {node.name} ({n})"
            if not rel.startswith(OPS):
                out.append(f"{where}: over {MAX} parameters; take the object they belong to")
            elif a.defaults or len(positional) > OP_TENSORS:
                out.append(f"{where}: an op's settings must be keyword-only (positional: {', '.join(positional)})")
    return out


def test_no_function_takes_more_than_six_parameters_but_the_attention_ops_keyword_only_settings():
    assert violations(ROOT) == []


def test_the_rule_sees_a_long_signature_and_a_positional_setting(tmp_path):
    """Planted: a stage function of 7 parameters, and an attention op whose setting is positional."""
    (tmp_path / "hybrid_scale" / "attention").mkdir(parents=True)
    (tmp_path / "hybrid_scale" / "stage.py").write_text("def f(s, a, b, c, d, e, g):\n    pass\n")
    (tmp_path / "hybrid_scale" / "attention" / "op.py").write_text(
        "def op(q, k, v, fq, fk, gamma, *, window, mode='hybrid'):\n    pass\n"
        "def bad(q, k, v, fq, fk, gamma, window=4):\n    pass\n"
    )
    found = violations(tmp_path)
    assert [v.split(":")[0] for v in found] == ["hybrid_scale/attention/op.py", "hybrid_scale/stage.py"], found
    assert "bad (7)" in found[0] and "f (7)" in found[1]
