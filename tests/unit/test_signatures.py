"""Functions take the objects their values belong to (issues 53 and 61): no function of hybrid_scale/ takes more
than MAX parameters, except the attention ops, which follow fla's convention: the tensors they compute on positional
(q, k, v, phi_q, phi_k, gamma; a decode state, gates or explicit positions at most), then the call's settings as one
AttentionOptions (`opts`, options.py), then the optional tensors keyword-only. No function of the attention package
lists a setting of AttentionOptions by hand (the layer's constructor, which holds them, aside). A stage function
that needs more takes the object they belong to (Stage1, Trained, Sources, Scoring, Zero3, ShardPlan, Draft,
Projections, Shape)."""

import ast
import dataclasses
from pathlib import Path

from hybrid_scale.attention.options import AttentionOptions

ROOT = Path(__file__).resolve().parents[2]
MAX = 6  # parameters of any function (self and cls not counted)
OPS = "hybrid_scale/attention/"  # where the ops' convention applies
OP_TENSORS = 8  # the most positional tensors of an op: q, k, v, fq, fk, gamma and a state, gates or two positions
LISTS = 3  # settings by name that make a list of them (a helper may take the one or two it is about)
SETTINGS = {f.name for f in dataclasses.fields(AttentionOptions)}  # what an op takes in `opts`, never by name


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
            where = f"{rel}:{node.lineno} {node.name} ({n})"
            if rel.startswith(OPS):
                listed = sorted(SETTINGS & {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs})
                if len(listed) >= LISTS and node.name != "__init__":
                    out.append(f"{where}: lists the settings {', '.join(listed)}; take an AttentionOptions")
            if n <= MAX:
                continue
            tensors = [x for x in positional if x != "opts"]
            defaults = positional[len(positional) - len(a.defaults) :] if a.defaults else []
            if not rel.startswith(OPS):
                out.append(f"{where}: over {MAX} parameters; take the object they belong to")
            elif len(tensors) > OP_TENSORS or any(x != "opts" for x in defaults):
                out.append(f"{where}: an op takes its tensors, then opts, positionally (got {', '.join(positional)})")
    return out


def test_no_function_takes_more_than_six_parameters_but_the_attention_ops_which_take_one_options_object():
    assert violations(ROOT) == []


def test_the_rule_sees_a_long_signature_and_a_positional_setting(tmp_path):
    """Planted: a stage function of 7 parameters, an attention op whose setting is positional, and one that lists
    the settings by hand (the contract before AttentionOptions)."""
    (tmp_path / "hybrid_scale" / "attention").mkdir(parents=True)
    (tmp_path / "hybrid_scale" / "stage.py").write_text("def f(s, a, b, c, d, e, g):\n    pass\n")
    (tmp_path / "hybrid_scale" / "attention" / "op.py").write_text(
        "def op(q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, la_decay=None, **settings):\n    pass\n"
        "def bad(q, k, v, fq, fk, gamma, mask=None):\n    pass\n"
        "def listed(q, k, v, fq, fk, gamma, *, window, mode='hybrid', sinks=8):\n    pass\n"
    )
    found = violations(tmp_path)
    assert [v.split(":")[0] for v in found] == ["hybrid_scale/attention/op.py"] * 2 + ["hybrid_scale/stage.py"], found
    assert (
        "bad (7)" in found[0]
        and "listed (9): lists the settings mode, sinks, window" in found[1]
        and "f (7)" in found[2]
    )
