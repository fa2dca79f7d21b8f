"""docs/reference/config.md, generated from the dataclasses of `config/schema.py` and the comments on their fields
(the attention section's from attention/settings.py's record, where each setting carries its doc line).

A field's description is its trailing comment plus any comment lines directly above it; every key must have one.
`make docs` (= `python -m hybrid_scale.config_reference docs/reference/config.md`) rewrites the page, and
tests/unit/test_config_reference.py fails when the committed page is stale or a key has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import sys
import tokenize
from pathlib import Path

from .attention.settings import SETTINGS as ATTENTION_SETTINGS
from .config import Config
from .config import schema as config_module

HEADER = """# Configuration reference

Generated from `hybrid_scale/config/schema.py` by `make docs`; do not edit by hand (a test fails when it is stale).
A config is YAML (`defaults: [...]` pulls in presets first) plus `key=value` overrides on the command line, e.g.
`hybrid-scale pipeline models/llama3-8b.yaml attention.window=32`. `hybrid-scale STAGE --help` lists the sections a
stage reads; `hybrid-scale config CONFIG` prints the resolved config.
"""


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_docs(source: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{class name: {field: (annotation, description)}} from the source of config/schema.py."""
    comments = _comments(source)
    lines = source.splitlines()
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, n = [], stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):  # comment lines directly above the field
                above.insert(0, comments[n])
                n -= 1
            trailing = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
            fields[stmt.target.id] = (ast.unparse(stmt.annotation), " ".join(above + trailing))
        out[node.name] = fields
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return ""
    text = "null" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return f"`{text}`" if text != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section_type(f: dataclasses.Field):
    """The dataclass of a section field of Config (model, attention, ...), None for a top-level key."""
    cls = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return cls if cls is not None and dataclasses.is_dataclass(cls) else None


def _annotation(t) -> str:
    plain = isinstance(t, type) and not getattr(t, "__args__", None)
    return t.__name__ if plain else str(t).replace("NoneType", "None")


def _keys() -> list[tuple[str | None, str, dataclasses.Field, str, str]]:
    """(section or None, dotted key, field, annotation, description) of every key, top-level keys first. The
    attention section's keys are documented in attention/settings.py's record, the others by their comments."""
    docs = field_docs(Path(config_module.__file__).read_text())
    docs["AttentionConfig"] = {s.name: (_annotation(s.type), s.doc) for s in ATTENTION_SETTINGS}
    top, nested = [], []
    for f in dataclasses.fields(Config):
        cls = _section_type(f)
        if cls is None:
            top.append((None, f.name, f, *docs["Config"][f.name]))
        else:
            nested += [(f.name, f"{f.name}.{g.name}", g, *docs[cls.__name__][g.name]) for g in dataclasses.fields(cls)]
    return top + nested


def render() -> str:
    section_docs = field_docs(Path(config_module.__file__).read_text())["Config"]
    parts, current = [HEADER], "top"
    for section, key, f, annotation, description in _keys():
        if section != current:  # a new table
            title = "Top level" if section is None else f"`{section}`: {section_docs[section][1]}"
            parts += ([""] if current != "top" else []) + [f"## {title}\n", "| key | type | default | what it does |"]
            parts.append("|---|---|---|---|")
            current = section
        parts.append(f"| `{key}` | `{_cell(annotation)}` | {_cell(_default(f))} | {_cell(description)} |")
    return "\n".join([*parts, ""])


def undocumented() -> list[str]:
    """Keys whose field has no comment."""
    return [key for _, key, _, _, description in _keys() if not description]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
        print(f"wrote {argv[0]}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
