"""The rendered stage script's exit-code protocol, run by bash with stand-ins for srun / scontrol / scancel on PATH
(the real-Slurm tests in tests/slurm cover a live requeue; these cover every branch, in seconds)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybrid_scale.config import JOBS, ConfigError, load_config
from hybrid_scale.distributed.requeue import REQUEUE_MARKER
from hybrid_scale.launch.slurm import render, sbatch_header, sbatch_quote

SRUN = """#!/bin/bash
# the job step: exits with $FAKE_CODE, or, with FAKE_SLEEP, waits for TERM and exits 75 (saved, please requeue);
# with FAKE_ARGS, it first writes its arguments there, one a line
[ -n "${FAKE_ARGS:-}" ] && printf '%s\\n' "$@" > "$FAKE_ARGS"
if [ -n "${FAKE_SLEEP:-}" ]; then
  trap 'echo "step: TERM" >> "$FAKE_LOG"; exit 75' TERM
  echo "step: started" >> "$FAKE_LOG"
  for _ in $(seq 300); do sleep 0.1; done
  exit 0
fi
[ -n "${FAKE_MARKER:-}" ] && touch "$FAKE_MARKER"
exit "${FAKE_CODE:-0}"
"""
RECORD = """#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
exit {code}
"""


def make_job(tmp_path, run, stage="finetune", overrides=()):
    """The rendered script of `stage` for run_dir `run`, and how to run it with bash: srun / scontrol / scancel and
    the Python interpreter (the export step runs it directly) are stand-ins on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (
        ("srun", SRUN),
        ("python", SRUN),  # the export step: `exec python -m hybrid_scale.cli export ...`
        ("scontrol", RECORD.format(code=0)),
        ("scancel", RECORD.format(code=1)),  # fails: the script then signals its step itself
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    cfg = load_config(overrides=[f"run_dir={json.dumps(str(run))}", "slurm.max_restarts=2", *overrides])
    script = tmp_path / f"{stage}.sbatch"
    script.write_text(render(cfg, stage, None, [f"run_dir={run}"], python="python"))
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "localhost",
        "FAKE_LOG": str(log),
    }

    def start(**extra):
        return subprocess.Popen(
            ["bash", str(script)], env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def calls():
        return log.read_text().splitlines() if log.is_file() else []

    return start, calls, script


@pytest.fixture
def job(tmp_path):
    run = tmp_path / "run"
    start, calls, _ = make_job(tmp_path, run)
    return start, calls, run


@pytest.mark.parametrize(
    "code, restarts, marker, want_exit, requeued",
    [
        ("75", "0", False, 0, True),  # saved: requeue
        ("75", "2", False, 75, False),  # saved, but slurm.max_restarts (2) reached
        ("1", "1", True, 0, True),  # torchrun turns the worker's 75 into 1: the marker says "saved"
        ("3", "0", False, 3, False),  # a real failure: no requeue, its exit code
        ("0", "0", False, 0, False),  # done
    ],
)
def test_exit_codes(job, code, restarts, marker, want_exit, requeued):
    start, calls, run = job
    extra = {"FAKE_CODE": code, "SLURM_RESTART_COUNT": restarts}
    if marker:
        run.mkdir(parents=True, exist_ok=True)
        extra["FAKE_MARKER"] = str(run / REQUEUE_MARKER)
    proc = start(**extra)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == want_exit, out
    assert ("scontrol requeue 42" in calls()) == requeued, (calls(), out)
    assert not (run / REQUEUE_MARKER).exists()  # consumed
    if restarts == "2":
        assert "saved, but slurm.max_restarts (2) is reached" in out


def test_usr1_is_forwarded_as_term_and_the_saved_job_requeues(job):
    start, calls, _ = job
    proc = start(FAKE_SLEEP="1", SLURM_RESTART_COUNT="0")
    while "step: started" not in calls() and proc.poll() is None:  # (the step starts, or the script has ended)
        time.sleep(0.05)
    assert "step: started" in calls(), calls()
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@lead delivers to the batch script
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert calls() == ["step: started", "scancel --signal=TERM 42", "step: TERM", "scontrol requeue 42"]
    assert "USR1: asking the stage to save" in out and "saved; requeueing" in out


# a run directory that a shell would split, expand or run, and sbatch would split or cut at its `#`
HOSTILE = 'my run $(touch pwned) `touch pwned2` #1 it\'s "q" 100%x ~'


def sbatch_arguments(script: str) -> list[str]:
    """The arguments sbatch reads from a script's #SBATCH lines, as Slurm's own parser does (src/sbatch/opt.c:
    _opt_batch_script / get_argument, Slurm 22.05 to 25.x): lines starting with #SBATCH up to the first command line;
    whitespace separates arguments; "..." and '...' group, the quotes dropped; a backslash takes the next character;
    an unquoted # ends the line."""
    args = []
    for line in script.splitlines():
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break  # the first command: sbatch stops reading directives
            continue
        ptr, n = line[len("#SBATCH") :], len(line) - len("#SBATCH")
        i = 0
        while True:
            while i < n and ptr[i].isspace():
                i += 1
            if i >= n:
                break
            arg, quote, escape = [], None, False
            while i < n and (quote or not ptr[i].isspace()):
                c = ptr[i]
                if escape:
                    escape = False
                elif c == "\\":
                    escape, i = True, i + 1
                    continue
                elif quote:
                    if c == quote:
                        quote, i = None, i + 1
                        continue
                elif c in "\"'":
                    quote, i = c, i + 1
                    continue
                elif c == "#":
                    i = n
                    break
                arg.append(c)
                i += 1
            assert quote is None, f"sbatch: unmatched {quote} in {line!r}"
            if arg:
                args.append("".join(arg))
    return args


def slurm_file_name(pattern: str, job_name: str, job_id: str) -> str:
    """Slurm's --output pattern (src/slurmd/common/fname.c): %% is %, %x the job name, %j the job id."""
    assert "\\" not in pattern, "a backslash turns the replacement off"
    return pattern.replace("%%", "\0").replace("%x", job_name).replace("%j", job_id).replace("\0", "%")


@pytest.mark.parametrize("value", ["plain", "a b", 'say "hi"', "it's", "#1", "back\\slash", "\ttab", ""])
def test_sbatch_quote_is_read_back_as_one_argument(value):
    assert sbatch_arguments(f"#!/bin/bash\n#SBATCH --comment={sbatch_quote(value)} --requeue\n") == [
        f"--comment={value}",
        "--requeue",
    ]
    assert sbatch_quote("2-00:00:00") == "2-00:00:00"  # plain values stay as they are


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_run_dir_with_spaces_and_shell_syntax_renders_scripts_that_bash_and_sbatch_read_intact(tmp_path, launcher):
    run = tmp_path / HOSTILE
    overrides = [f"run_dir={json.dumps(str(run))}", f"launch.launcher={launcher}", "slurm.partition=gpu,gpu-long"]
    cfg = load_config(overrides=overrides)
    for stage in JOBS:
        script = render(cfg, stage, None, [f"run_dir={run}"])
        check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert check.returncode == 0, (check.stderr, script)
        args = sbatch_arguments(script)
        outputs = [a for a in args if a.startswith("--output=")]
        assert len(outputs) == 1, args
        pattern = outputs[0].removeprefix("--output=")
        assert slurm_file_name(pattern, f"hybrid_scale-{stage}", "42") == f"{run}/slurm/hybrid_scale-{stage}-42.out"
        assert f"--job-name=hybrid_scale-{stage}" in args and "--partition=gpu,gpu-long" in args
        assert "--requeue" in args and "--open-mode=append" in args and "--time=24:00:00" in args


def test_a_run_dir_with_a_backslash_is_refused_for_slurm_output(tmp_path):
    run = str(tmp_path / "a\\b")
    cfg = load_config(overrides=[f"run_dir={json.dumps(run)}"])
    with pytest.raises(ConfigError, match="config key 'run_dir': .* contains a backslash, which Slurm's --output"):
        sbatch_header(cfg, "finetune")


def run_hostile(tmp_path, monkeypatch, stage, **env):
    """Render `stage` for a hostile run_dir in tmp_path (also the working directory, where `touch pwned` would land)
    and run its body with bash."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / HOSTILE
    start, calls, _ = make_job(tmp_path, run, stage)
    argv_file = tmp_path / "argv.txt"
    proc = start(FAKE_ARGS=str(argv_file), **env)
    out, _ = proc.communicate(timeout=30)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("pwned")], out  # nothing ran
    assert (run / "slurm").is_dir(), out  # mkdir -p of the log directory, inside the run directory
    return proc.returncode, out, calls(), argv_file.read_text().splitlines(), run


def test_a_hostile_run_dir_in_the_stage_script_body_runs_nothing_and_lands_in_the_run_dir(tmp_path, monkeypatch):
    marker = Path(tmp_path / HOSTILE / REQUEUE_MARKER)
    marker.parent.mkdir(parents=True)
    code, out, calls, argv, run = run_hostile(
        tmp_path, monkeypatch, "finetune", FAKE_CODE="1", FAKE_MARKER=str(marker), SLURM_RESTART_COUNT="0"
    )
    assert code == 0 and "scontrol requeue 42" in calls, (out, calls)  # the marker at its quoted path was seen
    assert not marker.exists()  # and removed: rm -f "$marker"
    assert argv[-3:] == ["launch", "finetune", f"run_dir={run}"], argv  # the override arrives as one argument


def test_a_hostile_run_dir_in_the_export_script_body_runs_nothing(tmp_path, monkeypatch):
    code, out, calls, argv, run = run_hostile(tmp_path, monkeypatch, "export", FAKE_CODE="0")
    assert code == 0, out
    assert argv == ["-m", "hybrid_scale.cli", "export", f"run_dir={run}"], argv
