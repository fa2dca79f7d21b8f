"""The repository's layout (issue 53): benchmarks/ is performance only, tools/ the maintained tools, experiments/ one
folder per question, docs/results/ the figures the README and the guides cite. Every script in benchmarks/ and tools/
is run by a test or a make target (named by its module, `benchmarks.memory.distill`, or its path); none of them
reaches another through sys.path (they are packages, run from the root as `python -m`); each experiment says its
question, status, the commit of its figures and the command that reproduces them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def scripts(top: str) -> dict[str, Path]:
    """{the name a test or the Makefile runs it by: file} of every script under `top`: a module with a
    `__main__` block (a package's __main__.py: the package) and a shell script."""
    out = {}
    for path in sorted((ROOT / top).rglob("*")):
        rel = path.relative_to(ROOT)
        if path.suffix == ".sh":
            out[str(rel)] = path
        elif path.suffix == ".py" and '__name__ == "__main__"' in path.read_text():
            parts = rel.with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__main__" else parts)] = path
    return out


def runners() -> str:
    """The Makefile and every test (this one aside), a path spelt `ROOT / "a" / "b.sh"` read as a/b.sh."""
    tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != Path(__file__).name]
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *tests])
    return text.replace('" / "', "/")


def unrun(tops=("benchmarks", "tools")) -> list[str]:
    text = runners()
    names = {name: path for top in tops for name, path in scripts(top).items()}
    return sorted(
        name
        for name, path in names.items()
        if not any(re.search(rf"{re.escape(n)}(?![\w.])", text) for n in (name, str(path.relative_to(ROOT))))
    )


def test_every_script_in_benchmarks_and_tools_is_run_by_a_test_or_a_make_target():
    found = {name for top in ("benchmarks", "tools") for name in scripts(top)}
    assert {"benchmarks.run", "benchmarks.device", "benchmarks/device.sh", "tools.kernel_compile"} <= found
    missing = unrun()
    assert not missing, f"run these by a test or a make target, or remove them: {missing}"


def test_the_check_finds_a_script_nothing_runs(tmp_path, monkeypatch):
    """The check above, against a planted script that nothing names."""
    planted = ROOT / "tools" / "planted_unrun_script.py"
    planted.write_text('if __name__ == "__main__":\n    pass\n')
    try:
        assert unrun() == ["tools.planted_unrun_script"]
    finally:
        planted.unlink()


def test_no_script_reaches_another_through_sys_path():
    """One way to import: the packages, from the repository root (pytest: pythonpath in pyproject.toml)."""
    for top in ("benchmarks", "tools", "experiments"):
        assert (ROOT / top / "__init__.py").is_file(), top
        for path in (ROOT / top).rglob("*.py"):
            assert "sys.path" not in path.read_text(), f"{path.relative_to(ROOT)} changes sys.path"
            if path.parent != ROOT / top:
                assert (path.parent / "__init__.py").is_file(), f"{path.parent.relative_to(ROOT)} is not a package"


def test_each_experiment_says_its_question_status_commit_and_command():
    folders = sorted(p for p in (ROOT / "experiments").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert {"reproduce_table1", "la_length"} <= {p.name for p in folders}
    for folder in folders:
        readme = folder / "README.md"
        assert readme.is_file(), f"{folder.relative_to(ROOT)} has no README.md"
        text = readme.read_text()
        for part in ("**Question.**", "**Status.**", "**Commit of the figures.**", "**Reproduce.**"):
            assert part in text, f"{readme.relative_to(ROOT)}: no {part}"
        assert re.search(r"\b[0-9a-f]{7,40}\b|own commit", text), f"{readme.relative_to(ROOT)}: no commit"
        for name in scripts(f"experiments/{folder.name}"):  # each runner is named by some experiment's command
            assert any(name in r.read_text() for r in (ROOT / "experiments").glob("*/README.md")), name


def test_docs_results_holds_only_what_the_readme_the_guides_or_a_test_cite():
    """A file of docs/results/ is cited by its path (or its folder's, or as the JSON beside a cited page) in the
    README, docs/, kernels/README.md, the Makefile or a test; anything else belongs to an experiment or to history."""
    citing = [ROOT / "README.md", ROOT / "Makefile", ROOT / "kernels" / "README.md", *(ROOT / "docs").rglob("*.md")]
    citing += [*(ROOT / "tests").rglob("*.py")]
    results = ROOT / "docs" / "results"
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        rel = path.relative_to(ROOT)
        names = {str(rel), f"{rel.parent}/", str(rel.with_suffix(".md"))}
        text = "\n".join(p.read_text() for p in citing if p != path)
        assert any(n in text for n in names if n != "docs/results/"), f"nothing cites {rel}"
