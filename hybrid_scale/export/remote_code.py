"""The remote code an export carries: the attention package (torch + transformers only), flattened into one folder.

transformers loads remote code from the files next to config.json and follows only the `from .sibling import name`
form (dynamic_module_utils.get_relative_imports: no subpackage, no `..`), so the package's folders are written flat:
`window/naive.py` becomes `window_naive.py`, and every relative import is rewritten to its flat sibling. The Hugging
Face integration (`hf/`: modeling_hybrid_scale.py and configuration_hybrid_scale.py, which config.json's auto_map
names, the cache, generation) keeps its bare file names. The export then loads without hybrid_scale installed.
"""

from __future__ import annotations

import re
from pathlib import Path

ATTENTION_DIR = Path(__file__).resolve().parents[1] / "attention"
BARE = ("hf",)  # folders whose files keep their own names in the export
_IMPORT = re.compile(r"^(\s*)from (\.+)([\w.]*) import ", flags=re.M)


def flat_name(module: tuple[str, ...]) -> str:
    """The flat module name of an attention module given by its path parts inside the package."""
    return module[-1] if module[:-1] and module[0] in BARE else "_".join(module)


def _modules() -> dict[tuple[str, ...], Path]:
    return {
        p.relative_to(ATTENTION_DIR).with_suffix("").parts: p
        for p in sorted(ATTENTION_DIR.rglob("*.py"))
        if p.name != "__init__.py"
    }


def remote_code() -> dict[str, str]:
    """{file name: source} of every attention module, flattened, with its relative imports rewritten."""
    modules = _modules()
    out: dict[str, str] = {}
    for parts, path in modules.items():

        def rewrite(m: re.Match, parts: tuple[str, ...] = parts) -> str:
            package, up = parts[:-1], len(m[2]) - 1
            base = package[: len(package) - up] if up else package
            target = (*base, *filter(None, m[3].split(".")))
            if target not in modules:
                raise ValueError(f"attention/{'/'.join(parts)}.py imports {m[2]}{m[3]}, which is not a module")
            return f"{m[1]}from .{flat_name(target)} import "

        name = flat_name(parts) + ".py"
        if name in out:
            raise ValueError(f"two attention modules flatten to {name}: rename one")
        out[name] = _IMPORT.sub(rewrite, path.read_text())
    return out


def write_remote_code(folder: Path) -> list[str]:
    """Write the flattened attention modules into `folder`; returns their file names."""
    code = remote_code()
    for name, text in code.items():
        (folder / name).write_text(text)
    return sorted(code)
