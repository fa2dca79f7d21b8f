"""The README and docs/ are tested: every command in them either runs here (cheap ones, in-process) or is parsed by the
real tool it calls, so the documentation cannot drift from the code. How a command is found and checked, per program,
is in doc_commands.py; the tests over every document are here.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re

import pytest
from doc_commands import (
    COMMANDS,
    DOCS,
    KNOWN,
    README_MAX_LINES,
    ROOT,
    SECTIONS,
    Command,
    Doc,
    all_spans,
    bash_commands,
    build_parser,
    check,
    check_hybrid_scale,
    fenced_blocks,
    line_of,
    prose,
    split_command,
    strip_comment,
    subcommands,
    written_files,
)
from omegaconf import OmegaConf

import hybrid_scale.cli
from hybrid_scale.config import PRESETS, Config, ConfigError, load_config


@pytest.fixture
def readme_files(tmp_path, monkeypatch):
    """Run from the repository root (where the README's commands run); the files the README tells you to write are
    written to tmp_path and their names in commands point there. main() uses the parser built once."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(hybrid_scale.cli, "build_parser", build_parser)
    files = {}
    for name, body in written_files().items():
        (tmp_path / name).write_text(body)
        files[name] = str(tmp_path / name)
    return files


def test_the_readme_commands_are_found():
    """The extraction itself: bash blocks and prose both yield commands, including each launcher."""
    assert len([c for c in COMMANDS if c.where == "bash block"]) >= 10 and len(COMMANDS) >= 30
    progs = {split_command(c.text)[0][0] for c in COMMANDS}
    assert {"make", "torchrun", "deepspeed", ".venv/bin/hybrid-scale", "hybrid-scale", "launch/torchrun.sh"} <= progs
    assert {doc.name for doc in DOCS} >= {"README.md", "docs/reference/config.md", "docs/guide/scale.md"}
    for doc in DOCS:  # a bash block holds only commands: an unknown program is an error, not prose
        for c in bash_commands(doc):
            for words in split_command(c.text):
                assert words[0] in KNOWN, f"{c}\nunknown program {words[0]!r}: teach doc_commands.py how to check it"


def test_readme_starts_with_the_two_setup_commands_and_stays_short():
    readme = DOCS[0]
    _, body, fence = fenced_blocks(readme, "bash")[0]
    assert "\n## " not in readme.text[:fence], "the set-up commands come before any section"
    words = [split_command(line)[0] for line in body.splitlines() if strip_comment(line).strip()]
    assert words == [["make", "quickstart"], ["make", "test"]], words
    n = readme.text.count("\n")
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/guide/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.doc}:L{c.line}-{c.text[:50]}")
def test_readme_command(cmd, readme_files):
    for words in split_command(cmd.text):
        check(words, cmd, readme_files)


def test_readme_deepspeed_line_uses_the_runner_flag():
    """The issue this file came from: the DeepSpeed runner has no -m (it is --module)."""
    from deepspeed.launcher import runner

    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        runner.parse_args(["--num_gpus", "8", "-m", "hybrid_scale.cli", "finetune"])
    assert [c for c in COMMANDS if c.text.startswith("deepspeed ")], "the docs lost their deepspeed command"


def test_yaml_blocks_load(readme_files):
    assert readme_files, "no ```yaml block in the docs"
    for name, path in readme_files.items():
        try:
            load_config(path)
        except ConfigError as e:
            pytest.fail(f"the docs' {name}: {e}")


def test_python_blocks_compile_and_name_real_attributes():
    blocks = [(doc, *b) for doc in DOCS for b in fenced_blocks(doc, "python")]
    assert blocks
    for doc, line, body, _ in blocks:
        where = f"{doc.name}:{line}"
        tree = compile(body, where, "exec", ast.PyCF_ONLY_AST)
        compile(tree, where, "exec")
        aliases = {
            a.asname or a.name: a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for a in node.names
            if a.name.split(".")[0] == "hybrid_scale"
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = importlib.import_module(aliases[node.value.id])
                assert hasattr(module, node.attr), f"{where}: {aliases[node.value.id]} has no {node.attr}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybrid_scale"):
                module = importlib.import_module(node.module)
                for a in node.names:
                    assert hasattr(module, a.name), f"{where}: {node.module} has no {a.name}"


KEY = re.compile(rf"^((?:{'|'.join(SECTIONS)})\.[a-z_]+(?:\.[a-z_]+)*|run_dir|seed|allow_config_change)(=.*)?$")


def test_config_keys_in_prose_exist():
    """`finetune.keep`, `eval.window=16`, `distill.objectives={...}`: the key is in the schema and the value has its
    type (value checks that need the rest of a config, e.g. tensor_parallel vs ranks, are the commands' business)."""
    schema = OmegaConf.structured(Config)
    seen = 0
    for doc, line, span in all_spans():
        m = KEY.match(span)
        if not m or re.search(r"\.(sbatch|ya?ml|json|md|png|py|safetensors)$", span):  # `export.sbatch`: a file
            continue
        seen += 1
        key, value = m.group(1), m.group(2)
        assert OmegaConf.select(schema, key, default="<missing>") != "<missing>", f"{doc}:{line}: no key {key}"
        if value and value != "=":
            try:
                OmegaConf.merge(schema, OmegaConf.from_dotlist([span]))
            except Exception as e:
                pytest.fail(f"{doc}:{line}: `{span}`: {e}")
    assert seen >= 10


def test_repository_paths_in_prose_exist():
    seen = 0
    for doc, line, span in all_spans():
        if not re.fullmatch(
            r"(configs|docs|benchmarks|tools|experiments|slurm|launch|hybrid_scale|tests|kernels)/[\w./*-]*", span
        ):
            continue
        seen += 1
        if "*" in span:
            assert list(ROOT.glob(span)), f"{doc}:{line}: nothing matches {span}"
        else:
            assert (ROOT / span).exists(), f"{doc}:{line}: {span} does not exist"
    for doc, line, span in all_spans():  # preset names: `models/llama3-8b.yaml`
        if re.fullmatch(r"(models|recipes)/[\w.-]+\.yaml", span):
            seen += 1
            assert (PRESETS / span).is_file(), f"{doc}:{line}: no preset configs/{span}"
        if re.fullmatch(r"hybrid_scale(\.\w+)+", span):  # a module, or an entry-point group the package declares
            seen += 1
            group = importlib.metadata.entry_points(group=span)
            assert group or importlib.util.find_spec(span), f"{doc}:{line}: no module {span}"
    assert seen >= 10


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """[text](other.md#anchor): the file exists, and so does the heading the anchor names."""
    seen = 0
    for doc in DOCS:
        for m in re.finditer(r"\]\(([^)\s]+)\)", prose(doc)):
            target = m.group(1)
            if re.match(r"[a-z]+://", target):
                continue
            seen += 1
            file, _, anchor = target.partition("#")
            path = (doc.path.parent / file).resolve() if file else doc.path
            where = f"{doc.name}:{line_of(m.start(), doc.text)}"
            assert path.exists(), f"{where}: link to {target}: no file {path}"
            if anchor:
                headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
                assert anchor in headings, f"{where}: link to {target}: no such heading in {file or doc.name}"
    assert seen >= 5


def _prose_match(pattern: str) -> tuple[Doc, re.Match]:
    found = [(doc, m) for doc in DOCS if (m := re.search(pattern, prose(doc), re.M | re.S))]
    assert len(found) == 1, f"{len(found)} documents match {pattern!r}; update this test"
    return found[0]


def test_presets_list_matches_configs():
    """'Presets in `configs/`: models `...`; recipes `...`; `quickstart.yaml`' names exactly the files there."""
    _, m = _prose_match(r"^- Presets in `configs/`:(.*?)(?=^- |\Z)")
    names = set(re.findall(r"`([^`]+)`", m.group(1)))
    files = {p.stem for p in PRESETS.glob("models/*.yaml")} | {p.stem for p in PRESETS.glob("recipes/*.yaml")}
    files |= {p.name for p in PRESETS.glob("*.yaml")}
    assert names == files, f"the docs name {sorted(names - files)} that are not presets; omit {sorted(files - names)}"


def test_subcommand_list_matches_the_cli(readme_files):
    """'Command line (`hybrid-scale --help` ...): `config ...`; `convert ...`; ...' lists every subcommand."""
    doc, m = _prose_match(r"^Command line \(.*?(?=^\s*$)")
    listed = {s.split()[0] for s in re.findall(r"`([^`]+)`", m.group()) if re.fullmatch(r"[a-z]+", s.split()[0])}
    listed -= {"python"}
    assert listed == set(subcommands()), f"the docs list {sorted(listed)}, the CLI has {sorted(subcommands())}"
    for span in re.findall(r"`([^`]+)`", m.group()):  # the synopses: `convert [CONFIG] model.path=DIR [key=value ...]`
        if span.split()[0] in listed:
            args = (
                re.sub(r"\[key=value \.\.\.\]", "", span).replace("[CONFIG]", "CONFIG").replace("=DIR", "=/path/to/dir")
            )
            line = line_of(m.start(), prose(doc))
            check_hybrid_scale(args.split(), Command(line, span, "prose", doc.name), readme_files)


def test_make_targets_run_what_the_readme_says():
    """`make bench` (= `python -m benchmarks.run scaling`): the target's recipe runs that module (or file)."""
    pairs = [p for doc in DOCS for p in re.findall(r"`make ([\w-]+)` \(= `([^`]+)`\)", doc.text)]
    assert pairs
    for target, what in pairs:
        if what.startswith("python -m "):
            what = what.removeprefix("python ")
            module = ROOT / what.split()[1].replace(".", "/")
            assert module.with_suffix(".py").is_file() or (module / "__main__.py").is_file(), what
        else:
            assert (ROOT / what).exists(), what
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
        assert recipe and what in recipe.group(1), f"make {target} does not run {what}"


def test_every_cited_design_section_exists():
    """The code and the docs cite the math as `docs/design.md §N`: the page exists, every cited section is one of
    its headings, and nothing cites the design file that lives outside the repository (upper-case name)."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, flags=re.M))
    cited, stale = set(), []
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "kernels").rglob("*.py"),
             *(ROOT / "kernels").rglob("*.md"), *(ROOT / "hybrid_scale").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
             *(ROOT / "experiments").rglob("*.py"), *(ROOT / "experiments").rglob("*.md")]  # fmt: skip
    for path in files:
        text = path.read_text()
        cited |= {(path.name, n) for n in re.findall(r"docs/design\.md §(\d+)", text)}
        if "DESIGN" + ".md" in text:
            stale.append(path.relative_to(ROOT))
    assert not stale, f"cite docs/design.md, not the design file outside the repository, in {stale}"
    assert cited, "nothing cites docs/design.md"
    assert {n for _, n in cited} <= sections, sorted((f, n) for f, n in cited if n not in sections)


def test_the_reproduce_figures_the_readme_quotes_are_current_rows_as_their_table_prints_them():
    """Every row of the README's reproduce table is a committed row that stale() calls current, and its cells are
    the row file's figures as the reproduce table prints them; the 256-token table (all rows stale) is not quoted."""
    from experiments.reproduce_table1 import run as reproduce

    text = (ROOT / "README.md").read_text()
    head = "| row (budget long) | hybrid / swa_sinks perplexity past the window | NLL gain over swa_sinks [95% CI] |"
    assert head in text
    rows = text.split(head, 1)[1].split("\n\n", 1)[0].strip().splitlines()[2:]  # (the header's end, |---|)
    assert len(rows) == 3
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].split(" (")[0]
        assert tuple(cells[1:]) == reproduce.quoted_cells(name, "long"), name
    # prose quotes of current rows (row, budget, the figures as the README writes them, its minus signs typographic)
    for name, budget, quote in (("lolcats+sinks+decay@delta_mix", "long", "+0.008 [−0.003, +0.019]"),):
        gain = reproduce.quoted_cells(name, budget)[1]
        assert quote.replace("−", "-") == gain and quote in text, (name, gain)
    assert "−2.27 (la_only" not in text and "from −0.011" not in text  # the stale 256-token rows' figures
