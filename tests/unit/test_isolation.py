"""hybrid_scale/attention/*.py imports only torch, transformers and each other (the export copies them)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ATTENTION = Path(__file__).resolve().parents[2] / "hybrid_scale" / "attention"


def test_no_imports_from_the_toolkit_or_triton():
    allowed = {"torch", "transformers", "__future__", "math", "copy", "dataclasses", "collections", "typing"}
    allowed |= {"importlib", "warnings"}  # backends.py: installed backends by entry point; a failed self-check
    allowed |= {"contextlib", "threading"}  # backends.py: the self-check runs in a thread of its own
    for path in ATTENTION.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


def test_imports_in_isolation(tmp_path):
    shutil.copytree(ATTENTION, tmp_path / "standalone_attention", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; sys.modules.pop('hybrid_scale', None)\n"
        "import builtins; real = builtins.__import__\n"
        "def guard(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    assert level or name.split('.')[0] not in ('hybrid_scale', 'triton'), name\n"
        "    return real(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = guard\n"
        "from standalone_attention import naive, chunked, recurrent, feature_maps, hybrid\n"
        "print(hybrid.HybridAttention.__name__, len(naive.MODES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HybridAttention 6"
