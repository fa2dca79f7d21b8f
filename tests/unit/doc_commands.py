"""How tests/unit/test_readme.py reads and checks the README and docs/: every command in them either runs there
(cheap ones, in-process) or is parsed by the real tool it calls, so the documentation cannot drift from the code.

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
- `python -m benchmarks.X ARGS` (and `tools.X`, `experiments.Q.X`; a module or a package with __main__.py): the
  module exists and, when it uses argparse, its own parser accepts ARGS (it runs in-process only up to its
  `parse_args`).
- PARSED_ONLY programs (not installed here, or never run by a test): split into words, and a command they wrap
  (`srun ... launch/torchrun.sh ...`) is checked as above. Any other program fails the test.

Besides commands: ```yaml blocks load through `load_config` (written under the name a document gives them, which
the commands of every document then use), ```python blocks compile and name only attributes hybrid_scale has, config
keys in prose exist in the schema, repository paths, presets and relative links in prose exist, and the list of
subcommands is the CLI's. The README itself: the two set-up commands first, and at most ~150 lines.
The extraction and the per-program checkers (this file) serve README and every docs/ page alike, and the checkers
call each other (srun wraps a launcher, a launcher wraps the CLI); the tests over them are in test_readme.py.
"""

from __future__ import annotations

import argparse
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
from hybrid_scale.config import JOBS, Config, ConfigError, load_config

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


DOCS = [
    Doc(p, p.read_text())
    for p in [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "kernels" / "README.md",
              *sorted((ROOT / "experiments").glob("*/README.md"))]
]  # fmt: skip

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


def line_of(offset: int, text: str) -> int:
    return text.count("\n", 0, offset) + 1


def fenced_blocks(doc: Doc, lang: str) -> list[tuple[int, str, int]]:
    """(line of the first body line, body, offset of the fence) of each ```lang block."""
    return [
        (line_of(m.start(1), doc.text), m.group(1), m.start())
        for m in re.finditer(rf"^```{lang}[ \t]*\n(.*?)^```[ \t]*$", doc.text, re.M | re.S)
    ]


def prose(doc: Doc) -> str:
    """The document without its fenced blocks (replaced by as many newlines, so line numbers stay)."""
    return re.sub(r"^```.*?^```[ \t]*$", lambda m: "\n" * m.group().count("\n"), doc.text, flags=re.M | re.S)


def inline_spans(doc: Doc) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of the prose; a span may wrap onto the next line, never a paragraph."""
    text = prose(doc)
    spans = re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text)
    return [(line_of(m.start(), text), " ".join(m.group(1).split())) for m in spans]


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


def _parse(parser: argparse.ArgumentParser, args: list[str], who: str, cmd: Command) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{cmd}\n{who} rejects {args} (exit {e.code}):\n{err.getvalue()}")


def subcommands() -> dict[str, argparse.ArgumentParser]:
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
            choices = [[s] for s in (subcommands() if helps and not (i and args[i - 1] == "launch") else JOBS)]
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


SCRIPT_PACKAGES = ("benchmarks", "tools", "experiments")  # run from the repository root as `python -m PACKAGE.X`


def check_script(module: str, args: list[str], cmd: Command) -> None:
    """`python -m benchmarks.X ARGS`: the module (or package with __main__.py) exists, and one that uses argparse
    accepts ARGS: it runs in-process until its parser has parsed them, then stops."""
    path = ROOT / module.replace(".", "/")
    main_file = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
    assert main_file.is_file(), f"{cmd}\n{module} does not exist"
    sources = [*path.rglob("*.py")] if path.is_dir() else [main_file]
    if module == "benchmarks.run":  # the runner's suites' arguments are in benchmarks/attention/
        sources += [*(ROOT / "benchmarks" / "attention").glob("*.py")]
    if not any("argparse" in p.read_text() for p in sources):
        assert not args, f"{cmd}\n{module} takes no argparse arguments, but the command passes {args}"
        return
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        if argv is None:
            _parse(self, args, module, cmd)  # fails the test on a rejected argument
            raise _Parsed
        return real(self, argv, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        mp.setattr("sys.argv", [str(main_file), *args])
        mp.syspath_prepend(str(ROOT))  # what `python -m` from the root gives (run_path: pytest's import hook would
        with pytest.raises(_Parsed):  # claim tools/test_time.py, a test_*.py name, and cannot give runpy its code)
            runpy.run_path(str(path if path.is_dir() else main_file), run_name="__main__")


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
        if len(args) >= 2 and args[0] == "-m" and args[1].split(".")[0] in SCRIPT_PACKAGES:
            check_script(args[1], args[2:], cmd)
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
        pytest.fail(f"{cmd}\nunknown program {prog!r}: teach tests/unit/doc_commands.py how to check it")
