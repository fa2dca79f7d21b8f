"""The package's import graph: every import of one hybrid_scale module by another (at the top of a file or inside a
function, where a cycle would otherwise hide) forms a graph without cycles; internal imports sit at the top of
files; the attention package imports nothing else of hybrid_scale (exports copy it into a model directory)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hybrid_scale"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def internal_imports():
    """{module: {imported module: [(line, at top level?)]}} over every hybrid_scale module."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        edges = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = resolve(name, path.name == "__init__.py", node)
            else:
                continue
            for t in targets:
                if t in modules and t != name:
                    edges.setdefault(t, []).append((node.lineno, id(node) in top))
        graph[name] = edges
    return graph


def cycles(graph) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in graph.get(m, {}):
            if state.get(t) == "open":
                found.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(internal_imports()) == []


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == [["a", "b", "c", "a"]]


def packages(graph) -> dict[str, dict[str, list]]:
    """The module graph folded onto the package's top level: hybrid_scale.run.lock -> run, hybrid_scale.entry ->
    entry (a module of the top level is its own node); edges inside one of them dropped."""
    top = {}
    for m, edges in graph.items():
        a = (m.split(".") + [""])[1] or m
        for t, where in edges.items():
            b = (t.split(".") + [""])[1] or t
            if a != b and m != "hybrid_scale" and t != "hybrid_scale":
                top.setdefault(a, {}).setdefault(b, []).extend((m, t, line) for line, _ in where)
    return top


def test_the_packages_import_each_other_without_a_cycle():
    """The layers read one way (e.g. storage, distributed < run < models < preflight < entry < the stages < cli): a
    package that imports another is never imported by it, directly or through others."""
    top = packages(internal_imports())
    found = cycles(top)
    assert found == [], [[top[a][b][0] for a, b in zip(c, c[1:], strict=False)] for c in found]


def test_a_package_cycle_through_modules_without_a_module_cycle_is_found():
    graph = {"hybrid_scale.run.entry": {"hybrid_scale.preflight.plan": [(1, True)]},
             "hybrid_scale.preflight.plan": {"hybrid_scale.run.resolved": [(2, True)]}}  # fmt: skip
    assert cycles(graph) == [] and cycles(packages(graph)) == [["preflight", "run", "preflight"]]


# The CLI imports each stage inside its subcommand: a process then loads only its own stage (seconds per process
# start: a rank of finetune never imports the evaluation, `--help` no stage). Its edges still count for the cycles.
# requeue.py imports runtime (torch) inside request() only: the CLI imports it for its exit code and Requeue. The run
# dir's lock imports runtime (torch) only where the ranks agree, so `status` (which reads the lock) imports no torch.
LAZY = {"hybrid_scale.cli", "hybrid_scale.distributed.requeue", "hybrid_scale.run.lock"}


def test_internal_imports_sit_at_the_top_of_files():
    inside = [
        f"{m}:{line} imports {t}"
        for m, edges in internal_imports().items()
        for t, where in edges.items()
        for line, top in where
        if not top and m not in LAZY
    ]
    assert inside == []


STAGES = ("distill", "finetune", "evaluate", "export", "preflight", "pipeline")


def test_the_cli_loads_no_stage_until_a_subcommand_runs():
    prefixes = tuple(f"hybrid_scale.{s}" for s in STAGES)
    code = f"import sys, hybrid_scale.cli; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


NO_TORCH = """
import atexit, sys
HEAVY = ("torch", "transformers", "deepspeed")
atexit.register(lambda: print("imported:", sorted(m for m in HEAVY if m in sys.modules)))
from hybrid_scale.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["config", "run_dir=RUN", "attention.window=32"],
        ["submit", "--help"],
        ["launch", "export", "run_dir=RUN", "launch.nodes=2"],  # on node 1 (SLURM_NODEID): nothing to do
    ],
    ids=["help", "config", "submit-help", "launch"],
)
def test_commands_that_only_parse_a_config_import_no_torch(args, tmp_path):
    """`hybrid-scale launch` (every batch job and launcher wrapper starts with it, before torchrun imports torch
    again), `submit`, `config` and `--help` start in a fraction of a second: hybrid_scale's top-level names load on
    first use and the config's choices come from attention/settings.py."""
    env = {**os.environ, "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "localhost"}
    args = [a.replace("RUN", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "imported: []", out.stdout[-2000:]


def test_the_torch_free_choices_are_the_implemented_ones():
    """The config's choices (settings.py, kinds.py: torch-free) are what the torch side implements: every feature map
    has its module, every kind its part, and every backend a kind names is one the kind has or a plugin's."""
    from hybrid_scale.attention import kinds, parts
    from hybrid_scale.attention import settings as choices
    from hybrid_scale.attention.hedgehog import feature_maps
    from hybrid_scale.attention.window import naive

    assert sorted(choices.FEATURE_MAPS) == sorted(feature_maps.FEATURE_MAPS)
    assert naive.MODES is choices.MODES and sorted(parts.PARTS) == sorted(kinds.KINDS)
    named = {b for k in kinds.KINDS.values() for b in k.backends} | {"auto", "torch"}
    assert named - {"naive", "chunk"} == set(choices.BACKENDS)


@pytest.mark.parametrize("module", sorted(m for m in internal_imports() if m.startswith("hybrid_scale.attention")))
def test_attention_imports_nothing_else_of_the_package(module):
    assert [t for t in internal_imports()[module] if not t.startswith("hybrid_scale.attention")] == []


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module that needs it gets a public name. Also in
    the kernels' package (kernels/hybrid_scale_kernels) and the tools."""
    private = []
    roots = (PACKAGE, PACKAGE.parent / "kernels" / "hybrid_scale_kernels", PACKAGE.parent / "tools")
    for path in (p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith(("hybrid_scale", "tools"))
            ):
                private += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")
                            and not a.name.startswith("__")]  # fmt: skip
    assert private == []
