"""hybrid_scale/attention/ imports only torch, transformers and itself (the export copies it, flattened)."""

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
    for path in ATTENTION.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


# what a process runs first: hybrid_scale forgotten, and any import of it or of triton an error
GUARD = (
    "import sys; sys.modules.pop('hybrid_scale', None)\n"
    "import builtins; real = builtins.__import__\n"
    "def guard(name, globals=None, locals=None, fromlist=(), level=0):\n"
    "    assert level or name.split('.')[0] not in ('hybrid_scale', 'triton'), name\n"
    "    return real(name, globals, locals, fromlist, level)\n"
    "builtins.__import__ = guard\n"
)


def alone(folder: Path, code: str) -> str:
    """What `code` prints, run after GUARD in a process of its own from `folder`."""
    out = subprocess.run([sys.executable, "-c", GUARD + code], cwd=folder, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_imports_in_isolation(tmp_path):
    shutil.copytree(ATTENTION, tmp_path / "standalone_attention", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "from standalone_attention import layer, settings\n"
        "from standalone_attention.hf import cache\n"
        "print(layer.HybridAttention.__name__, len(settings.MODES))\n"
    )
    assert alone(tmp_path, code) == "HybridAttention 7"


def test_the_flattened_remote_code_imports_alone(tmp_path):
    """What an export carries (export/remote_code.py: the package flattened, its relative imports rewritten to flat
    siblings, the form transformers follows) imports as one flat folder, without hybrid_scale or triton."""
    from hybrid_scale.export.remote_code import remote_code

    folder = tmp_path / "flat_remote"
    folder.mkdir()
    for name, text in remote_code().items():
        assert "from .." not in text, name
        (folder / name).write_text(text)
    (folder / "__init__.py").write_text("")
    code = (
        "from flat_remote import cache, layer, hedgehog_naive, gated_delta_recurrent\n"
        "print(cache.HybridCache.__name__, layer.HybridAttention.__name__)\n"
    )
    assert alone(tmp_path, code) == "HybridCache HybridAttention"
