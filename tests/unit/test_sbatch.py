"""The rendered stage script's exit-code protocol, run by bash with stand-ins for srun / scontrol / scancel on PATH
(the real-Slurm tests in tests/slurm cover a live requeue; these cover every branch, in seconds)."""

import os
import signal
import subprocess
import time

import pytest

from hybrid_scale.config import load_config
from hybrid_scale.dist.checkpoint import REQUEUE_MARKER
from hybrid_scale.dist.slurm import render

SRUN = """#!/bin/bash
# the job step: exits with $FAKE_CODE, or, with FAKE_SLEEP, waits for TERM and exits 75 (saved, please requeue)
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


@pytest.fixture
def job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("srun", SRUN),
        ("scontrol", RECORD.format(code=0)),
        ("scancel", RECORD.format(code=1)),  # fails: the script then signals its step itself
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run}", "slurm.max_restarts=2"])
    script = tmp_path / "finetune.sbatch"
    script.write_text(render(cfg, "finetune", None, [f"run_dir={run}"]))
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
    t0 = time.time()
    while "step: started" not in calls():
        assert time.time() - t0 < 20, calls()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@lead delivers to the batch script
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert calls() == ["step: started", "scancel --signal=TERM 42", "step: TERM", "scontrol requeue 42"]
    assert "USR1: asking the stage to save" in out and "saved; requeueing" in out
