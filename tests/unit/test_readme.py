"""The README and docs/ are tested: every command in them either runs here (cheap ones, in-process) or is parsed by the
real tool it calls, so the documentation cannot drift from the code.

Commands are the lines of its ```bash blocks (line continuations joined, `# comments` stripped, `...` placeholders
removed) and the inline `code spans` of its prose that start with a known program. Per program:

- `hybrid-scale` / `.venv/bin/hybrid-scale` / `python -m hybrid_scale[.cli]`: `build_parser().parse_args`, then the
  config file and every `key=value` through `load_config`; `plan` (without its --dry-run, which
  tests/distributed/test_dry_run.py runs), `config` and `--help` really run (in-process).
- `torchrun`: torch's own parser (`torch.distributed.run.get_args_parser`), then the module's arguments as above.
- `deepspeed`: DeepSpeed's runner parser (`deepspeed.launcher.runner.parse_args`), then the module's arguments.
- `make X`: X is a target of the Makefile (and `make -n X`, a dry run that only prints, succeeds).
- `launch/torchrun.sh` / `launch/deepspeed.sh`: executable, `--help` runs, and the arguments are those of
  `hybrid-scale launch STAGE ... launch.launcher=NAME`, which the script runs.
- `python benchmarks/X.py ARGS` (or a benchmark package directory): the script exists and, when it uses argparse,
  its own parser accepts ARGS (the script runs in-process only up to its `parse_args`).
- PARSED_ONLY programs (not installed here, or never run by a test): split into words, and a command they wrap
  (`srun ... launch/torchrun.sh ...`) is checked as above. Any other program fails the test.

Besides commands: ```yaml blocks load through `load_config` (written under the name a document gives them, which
the commands of every document then use), ```python blocks compile and name only attributes hybrid_scale has, config
keys in prose exist in the schema, repository paths, presets and relative links in prose exist, and the list of
subcommands is the CLI's. The README itself: the two set-up commands first, and at most ~150 lines.
The extraction, the per-program checkers and the tests over them serve README and every docs/ page alike, and the
checkers call each other (srun wraps a launcher, a launcher wraps the CLI).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

import hybrid_scale.cli
from hybrid_scale.cli import main
from hybrid_scale.config import JOBS, PRESETS, Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 150


@dataclass(frozen=True)
class Doc:
    path: Path
    text: str

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


DOCS = [Doc(p, p.read_text()) for p in [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "kernels" / "README.md"]]

HYBRID_SCALE = ("hybrid-scale", ".venv/bin/hybrid-scale")
PYTHONS = ("python", "python3", ".venv/bin/python")
MODULES = ("hybrid_scale", "hybrid_scale.cli")
LAUNCH_SCRIPTS = ("launch/torchrun.sh", "launch/deepspeed.sh")
# Programs whose commands are only split into words here (not installed on a CPU test machine, or not to be run by a
# test); a command they wrap is checked on its own.
PARSED_ONLY = ("srun", "sbatch", "pip", "git", "bash", "pytest", ".venv/bin/pytest")
KNOWN = (*HYBRID_SCALE, *PYTHONS, *LAUNCH_SCRIPTS, *PARSED_ONLY, "torchrun", "deepspeed", "make")
KNOWN += ("tensorboard", "wandb")
# Placeholders of the prose (`hybrid-scale plan CONFIG`): what the test puts in their place.
CONFIG_EXAMPLE = "quickstart.yaml"  # "a YAML file (or a preset name ...)"
SECTIONS = tuple(k for k, v in OmegaConf.structured(Config).items() if isinstance(v, DictConfig))  # model, ...


# ---------------------------------------------------------------------------------------------- README extraction


def _line_of(offset: int, text: str) -> int:
    return text.count("\n", 0, offset) + 1


def fenced_blocks(doc: Doc, lang: str) -> list[tuple[int, str, int]]:
    """(line of the first body line, body, offset of the fence) of each ```lang block."""
    return [
        (_line_of(m.start(1), doc.text), m.group(1), m.start())
        for m in re.finditer(rf"^```{lang}[ \t]*\n(.*?)^```[ \t]*$", doc.text, re.M | re.S)
    ]


def prose(doc: Doc) -> str:
    """The document without its fenced blocks (replaced by as many newlines, so line numbers stay)."""
    return re.sub(r"^```.*?^```[ \t]*$", lambda m: "\n" * m.group().count("\n"), doc.text, flags=re.M | re.S)


def inline_spans(doc: Doc) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of the prose; a span may wrap onto the next line, never a paragraph."""
    text = prose(doc)
    spans = re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text)
    return [(_line_of(m.start(), text), " ".join(m.group(1).split())) for m in spans]


def all_spans() -> list[tuple[str, int, str]]:
    """(document, line, text) of every inline code span of every document."""
    return [(doc.name, line, span) for doc in DOCS for line, span in inline_spans(doc)]


def strip_comment(line: str) -> str:
    """Drop a shell comment: an unquoted `#` at the start of a word."""
    quote, escaped = None, False
    for i, c in enumerate(line):
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def split_command(text: str) -> list[list[str]]:
    """Shell words of each simple command in `text` (split at ; && || | &), `...` placeholders removed, redirections
    and leading VAR=value assignments dropped. A command consisting only of placeholders keeps one `...`."""
    lex = shlex.shlex(strip_comment(text), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = ""
    commands, words = [], []
    tokens = list(lex)
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in (";", "&&", "||", "|", "&"):
            commands.append(words)
            words = []
        elif t in (">", ">>", "<", "2>", "&>"):
            i += 1  # the file
        else:
            words.append(t)
        i += 1
    commands.append(words)
    out = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if not words:
            continue
        kept = [w for w in words if w != "..."]
        out.append(kept if len(kept) > 1 or len(kept) == len(words) else [*kept, "..."])
    return out


@dataclass(frozen=True)
class Command:
    line: int
    text: str
    where: str  # "bash block" or "prose"
    doc: str = "README.md"

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} ({self.where}): {self.text}"


def bash_commands(doc: Doc) -> list[Command]:
    out = []
    for first, body, _ in fenced_blocks(doc, "bash"):
        pending, start = "", first
        for n, line in enumerate(body.splitlines(), start=first):
            if not pending:
                start = n
            code = strip_comment(line).rstrip()
            if code.endswith("\\"):
                pending += code[:-1] + " "
                continue
            text = (pending + code).strip()
            pending = ""
            if text:
                out.append(Command(start, text, "bash block", doc.name))
        assert not pending, f"{doc.name}:{start}: a line continuation ends the block"
    return out


def prose_commands(doc: Doc) -> list[Command]:
    """Inline spans that start with a known program and pass it something (a bare `torchrun` names a program)."""
    spans = inline_spans(doc)
    return [Command(n, s, "prose", doc.name) for n, s in spans if len(s.split()) > 1 and s.split()[0] in KNOWN]


COMMANDS = [c for doc in DOCS for c in bash_commands(doc) + prose_commands(doc)]


def written_files() -> dict[str, str]:
    """```yaml blocks by the file name a document gives them (the last `*.yaml` named just before the block)."""
    out = {}
    for doc in DOCS:
        for i, (_, body, fence) in enumerate(fenced_blocks(doc, "yaml")):
            names = re.findall(r"`([\w.-]+\.ya?ml)`", doc.text[max(0, fence - 300) : fence])
            out[names[-1] if names else f"{doc.path.stem}_block_{i}.yaml"] = body
    return out


# ------------------------------------------------------------------------------------------------------ checking


_build_parser = hybrid_scale.cli.build_parser


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, built once (building it takes about a second: a schema per subcommand's --help epilog)."""
    return _build_parser()


@functools.cache
def _load(config: str | None, overrides: tuple[str, ...]) -> None:
    load_config(config, list(overrides))


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


def _parse(parser: argparse.ArgumentParser, args: list[str], who: str, cmd: Command) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{cmd}\n{who} rejects {args} (exit {e.code}):\n{err.getvalue()}")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def expand(args: list[str]) -> list[list[str]]:
    """The concrete commands a prose template stands for: CONFIG -> a preset, STAGE -> every choice at its place,
    [--flag] -> without and with the flag, a{b,c} -> ab and ac (as bash)."""
    variants = [[]]
    for i, a in enumerate(args):
        if a == "CONFIG":
            choices = [[CONFIG_EXAMPLE]]
        elif a == "STAGE":  # a stage of `launch`, any subcommand before --help, else a stage that runs a config
            helps = "--help" in args or "-h" in args
            choices = [[s] for s in (_subcommands() if helps and not (i and args[i - 1] == "launch") else JOBS)]
        elif m := re.fullmatch(r"([^{}]*)\{([\w.-]+(?:,[\w.-]+)+)\}([^{}]*)", a):  # bash's brace expansion
            choices = [[m.group(1) + alt + m.group(3)] for alt in m.group(2).split(",")]
        elif re.fullmatch(r"\[-[^\]]+\]", a):
            choices = [[], a[1:-1].split()]
        else:
            choices = [[a]]
        variants = [[*v, *c] for v in variants for c in choices]
    return variants


def check_hybrid_scale(args: list[str], cmd: Command, files: dict[str, str], who: str = "hybrid-scale") -> None:
    """Arguments of `hybrid-scale`: parsed by its parser; config file and overrides loaded; cheap commands run."""
    if args == ["..."]:
        return  # the README elided every argument
    args = [files.get(a, a) for a in args]
    for argv in expand(args):
        if "-h" in argv or "--help" in argv:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == 0, f"{cmd}\n{who} {argv}: exit {e.value.code}"
            assert "usage: hybrid-scale" in out.getvalue(), f"{cmd}\n{out.getvalue()}"
            continue
        ns = _parse(build_parser(), argv, who, cmd)
        if getattr(ns, "config", None) and "=" in ns.config:  # as main(): only overrides were given
            ns.overrides, ns.config = [ns.config, *ns.overrides], None
        if hasattr(ns, "overrides") and ns.command != "quickstart":
            try:
                _load(ns.config, tuple(ns.overrides))
            except ConfigError as e:
                pytest.fail(f"{cmd}\n{who} {argv}: the config does not load: {e}")
        if ns.command in ("plan", "config"):  # cheap: run them ("exit 1 if doomed", e.g. a placeholder model.path)
            # (plan's --dry-run takes 5-30 s a model: tests/distributed/test_dry_run.py runs it at the presets)
            argv = [a for a in argv if a != "--dry-run"]
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
                rc = main(argv)
            assert rc in ((0, 1) if ns.command == "plan" else (0,)), f"{cmd}\nexit {rc}:\n{err.getvalue()}"
            assert out.getvalue().strip(), f"{cmd}\nprinted nothing"


def check_module(module: str, args: list[str], cmd: Command, files: dict[str, str], who: str) -> None:
    assert module in MODULES, f"{cmd}\n{who} runs module {module!r}; the CLI is one of {MODULES}"
    assert importlib.util.find_spec(f"{module}.__main__" if module == "hybrid_scale" else module), module
    check_hybrid_scale(args, cmd, files, who=f"{who} -m {module}")


class _Parsed(Exception):
    pass


def check_script(script: str, args: list[str], cmd: Command) -> None:
    """`python benchmarks/X.py ARGS`: the script (or package directory with __main__.py) exists, and a script that
    uses argparse accepts ARGS: it runs in-process until its parser has parsed them, then stops."""
    path = ROOT / script
    main_file = path / "__main__.py" if path.is_dir() else path
    assert main_file.is_file(), f"{cmd}\n{script} does not exist"
    sources = [*path.glob("*.py")] if path.is_dir() else [path]
    if not any("argparse" in p.read_text() for p in sources):
        assert not args, f"{cmd}\n{script} takes no argparse arguments, but the command passes {args}"
        return
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        if argv is None:
            _parse(self, args, script, cmd)  # fails the test on a rejected argument
            raise _Parsed
        return real(self, argv, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        mp.setattr("sys.argv", [str(path), *args])
        mp.syspath_prepend(str(path if path.is_dir() else path.parent))
        with pytest.raises(_Parsed):
            runpy.run_path(str(path), run_name="__main__")


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([^\s:#=][^:=]*):(?!=)", text, re.M) for t in line.split()}


def check(words: list[str], cmd: Command, files: dict[str, str]) -> None:
    prog, args = words[0], words[1:]
    if prog in HYBRID_SCALE:
        (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "hybrid-scale"]
        assert script.value == "hybrid_scale.cli:main", script
        check_hybrid_scale(args, cmd, files)
    elif prog in PYTHONS:
        if args and args[0].startswith("benchmarks/"):
            check_script(args[0], args[1:], cmd)
            return
        assert len(args) >= 2 and args[0] == "-m", f"{cmd}\nonly `python -m hybrid_scale[.cli] ...` is known here"
        check_module(args[1], args[2:], cmd, files, prog)
    elif prog == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = _parse(get_args_parser(), args, "torchrun", cmd)
        assert ns.module, f"{cmd}\ntorchrun without -m runs a script file, not the CLI module"
        check_module(ns.training_script, ns.training_script_args, cmd, files, "torchrun")
    elif prog == "deepspeed":
        from deepspeed.launcher import runner

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = runner.parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{cmd}\nthe DeepSpeed runner rejects {args} (exit {e.code}):\n{err.getvalue()}")
        assert ns.module, f"{cmd}\ndeepspeed without --module runs a script file, not the CLI module"
        check_module(ns.user_script, ns.user_args, cmd, files, "deepspeed")
    elif prog == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        assert targets, f"{cmd}\nno target"
        for t in targets:
            assert t in make_targets(), f"{cmd}\nthe Makefile has no target {t!r} (it has {sorted(make_targets())})"
        if shutil.which("make"):  # a dry run: prints the recipe, runs nothing
            r = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"{cmd}\nmake -n: {r.stderr}"
    elif prog == "tensorboard":  # its own flag parser (absl): the flags exist and take these values
        from tensorboard import program

        try:
            program.TensorBoard().configure(argv=["tensorboard", *args])
        except (SystemExit, ValueError) as e:
            pytest.fail(f"{cmd}\ntensorboard rejects {args}: {e}")
    elif prog == "wandb":  # its own command line (click): the subcommand exists and takes these arguments
        import click
        from wandb.cli.cli import cli

        try:
            ctx = cli.make_context("wandb", list(args), resilient_parsing=False)
            name, sub, rest = cli.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
            sub.make_context(name, rest, parent=ctx)
        except click.BadParameter as e:  # a run's folder a test machine has not made: the rest parsed
            if not ("does not exist" in e.format_message() and "runs/" in e.format_message()):
                pytest.fail(f"{cmd}\nwandb rejects {args}: {e.format_message()}")
        except click.ClickException as e:
            pytest.fail(f"{cmd}\nwandb rejects {args}: {e.format_message()}")
    elif prog in LAUNCH_SCRIPTS:
        script = ROOT / prog
        assert script.is_file() and os.access(script, os.X_OK), f"{cmd}\n{script} is not an executable file"
        r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "STAGE" in r.stdout, f"{cmd}\n{prog} --help: {r.returncode} {r.stderr}"
        if args != ["..."]:  # the script runs `hybrid-scale launch STAGE [CONFIG] [key=value ...] launch.launcher=NAME`
            check_hybrid_scale(["launch", *args, f"launch.launcher={script.stem}"], cmd, files, who=prog)
    elif prog in PARSED_ONLY:
        if prog == "bash":  # bash SCRIPT: a repository script that bash accepts (`bash -n`, nothing runs)
            assert args and (ROOT / args[0]).is_file(), f"{cmd}\nno script {args[:1]}"
            r = subprocess.run(["bash", "-n", str(ROOT / args[0])], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"{cmd}\nbash -n: {r.stderr}"
        elif prog in ("pytest", ".venv/bin/pytest"):  # the test paths it names exist
            for a in args:
                if a.startswith("tests"):
                    assert (ROOT / a.split("::")[0]).exists(), f"{cmd}\nno {a}"
        elif prog == "srun":  # srun [options] program [args]: the program is checked on its own
            rest = list(args)
            while rest and rest[0].startswith("-"):
                opt = rest.pop(0)
                if re.fullmatch(r"-[A-Za-z]", opt) and rest:
                    rest.pop(0)  # its value
            assert rest, f"{cmd}\nsrun runs nothing"
            check(rest, cmd, files)
        elif prog == "sbatch":
            scripts = [a for a in args if not a.startswith("-")]
            assert scripts, f"{cmd}\nsbatch without a script"
    else:
        pytest.fail(f"{cmd}\nunknown program {prog!r}: teach tests/unit/test_readme.py how to check it")


# --------------------------------------------------------------------------------------------------------- tests


def test_the_readme_commands_are_found():
    """The extraction itself: bash blocks and prose both yield commands, including each launcher."""
    assert len([c for c in COMMANDS if c.where == "bash block"]) >= 10 and len(COMMANDS) >= 30
    progs = {split_command(c.text)[0][0] for c in COMMANDS}
    assert {"make", "torchrun", "deepspeed", ".venv/bin/hybrid-scale", "hybrid-scale", "launch/torchrun.sh"} <= progs
    assert {doc.name for doc in DOCS} >= {"README.md", "docs/reference/config.md", "docs/guide/scale.md"}
    for doc in DOCS:  # a bash block holds only commands: an unknown program is an error, not prose
        for c in bash_commands(doc):
            for words in split_command(c.text):
                assert words[0] in KNOWN, f"{c}\nunknown program {words[0]!r}: teach this test how to check it"


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
        if not re.fullmatch(r"(configs|docs|benchmarks|slurm|launch|hybrid_scale|tests|kernels)/[\w./*-]*", span):
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
            where = f"{doc.name}:{_line_of(m.start(), doc.text)}"
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
    assert listed == set(_subcommands()), f"the docs list {sorted(listed)}, the CLI has {sorted(_subcommands())}"
    for span in re.findall(r"`([^`]+)`", m.group()):  # the synopses: `convert [CONFIG] model.path=DIR [key=value ...]`
        if span.split()[0] in listed:
            args = (
                re.sub(r"\[key=value \.\.\.\]", "", span).replace("[CONFIG]", "CONFIG").replace("=DIR", "=/path/to/dir")
            )
            line = _line_of(m.start(), prose(doc))
            check_hybrid_scale(args.split(), Command(line, span, "prose", doc.name), readme_files)


def test_make_targets_run_what_the_readme_says():
    """`make bench` (= `benchmarks/attention_scaling.py`): the target's recipe runs that file."""
    pairs = [p for doc in DOCS for p in re.findall(r"`make ([\w-]+)` \(= `([^`]+)`\)", doc.text)]
    assert pairs
    for target, what in pairs:
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
             *(ROOT / "benchmarks").rglob("*.py")]  # fmt: skip
    for path in files:
        text = path.read_text()
        cited |= {(path.name, n) for n in re.findall(r"docs/design\.md §(\d+)", text)}
        if "DESIGN" + ".md" in text:
            stale.append(path.relative_to(ROOT))
    assert not stale, f"cite docs/design.md, not the design file outside the repository, in {stale}"
    assert cited, "nothing cites docs/design.md"
    assert {n for _, n in cited} <= sections, sorted((f, n) for f, n in cited if n not in sections)
