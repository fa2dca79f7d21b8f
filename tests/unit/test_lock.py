"""The run directory's lock (hybrid_scale/run/lock.py) and `hybrid-scale status`: a live holder refuses a second
writer with one line naming it and the fix, writing nothing; a dead one (a pid gone or reused, a killed process not
yet reaped, this Slurm job's run before a requeue, an empty lock left by a taker that died writing it, a job
squeue no longer runs) never blocks; a holder that cannot be checked from here (another process of this job on
another node) is refused with the exact command that breaks the lock; a process that holds it goes on (the pipeline
around its stages). The stages take it: tests/integration (test_finetune, test_pipeline) run two writers at once and
kill a holder."""

import json
import os
import socket
import subprocess
import sys

import pytest

from hybrid_scale.errors import RunDirBusyError
from hybrid_scale.run import lock, status


def write_lock(run, **holder):
    run.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start": lock._start_time(os.getpid()),
              "slurm_job": None, "slurm_step": None, "stage": "finetune", "command": "hybrid-scale finetune x.yaml",
              "since": "2026-12-02 10:00:00"} | holder  # fmt: skip
    lock.lock_path(run).write_text(json.dumps(record))
    return record


def files(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture
def other_process():
    """A live process on this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_refuses_a_second_writer_which_writes_nothing(tmp_path, other_process):
    run = tmp_path / "run"
    write_lock(run, pid=other_process.pid, start=lock._start_time(other_process.pid))
    (run / "stage2").mkdir()
    (run / "stage2" / "log.txt").write_text("step 3\n")
    before = files(run)
    with pytest.raises(RunDirBusyError) as e, lock.holding(run, "distill"):
        pass
    msg = str(e.value)
    assert msg == (
        f"{run.resolve()} is in use by finetune (pid {other_process.pid} on {socket.gethostname()}, since "
        "2026-12-02 10:00:00: hybrid-scale finetune x.yaml); wait for it to finish, or choose another run_dir"
    )
    assert files(run) == before  # nothing written, the holder's lock untouched


def test_a_dead_holder_a_reused_pid_or_an_unreaped_one_never_blocks(tmp_path, other_process):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not reaped until wait()
    while lock._stat(zombie.pid)[0] != "Z":
        pass
    zombie_start = lock._start_time(zombie.pid)  # its own: only its state says it is dead
    for holder in (
        {"pid": gone.pid},
        {"pid": other_process.pid, "start": "1"},
        {"pid": zombie.pid, "start": zombie_start},
    ):
        run = tmp_path / str(holder)
        write_lock(run, **holder)
        with lock.holding(run, "distill"):
            taken = lock.read(run)
            assert taken["pid"] == os.getpid() and taken["stage"] == "distill"
        assert lock.read(run) is None  # released at the end
    zombie.wait()


def test_this_slurm_jobs_earlier_run_is_gone_and_squeue_decides_elsewhere(tmp_path, monkeypatch):
    """A requeued job keeps its id: a lock held under that id on another node is its own earlier run. A lock of
    another job on another node is broken when squeue no longer runs it, kept when it does, and when squeue cannot
    answer the refusal names the command that breaks it."""
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(run, host="node-7", pid=1, slurm_job="4242", slurm_step="0", slurm_restart="0")
    with lock.holding(run, "finetune"):
        assert lock.read(run)["slurm_job"] == "4242" and lock.read(run)["host"] == socket.gethostname()
        assert lock.read(run)["slurm_restart"] == "1"
    write_lock(run, host="node-7", pid=1, slurm_job="4242", slurm_step="0")  # (a lock written before the count)
    with lock.holding(run, "finetune"):
        pass
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for state, refused in (("RUNNING", True), ("", False)):
        squeue.write_text(f"#!/bin/sh\necho '{state}'\n")
        squeue.chmod(0o755)
        write_lock(run, host="node-7", pid=1, slurm_job="99", slurm_step="0")
        if refused:
            with pytest.raises(RunDirBusyError, match=r"Slurm job 99 step 0.*wait for it to finish, or choose"):
                with lock.holding(run, "finetune"):
                    pass
        else:
            with lock.holding(run, "finetune"):
                pass
    squeue.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1\n")
    write_lock(run, host="node-7", pid=1, slurm_job="99")
    with pytest.raises(RunDirBusyError) as e, lock.holding(run, "finetune"):
        pass
    assert str(e.value).endswith(
        f"if it is no longer running (it cannot be checked from {socket.gethostname()}): rm {lock.lock_path(run)}"
    )


def test_another_process_of_the_same_run_of_a_slurm_job_is_not_taken_for_its_earlier_run(
    tmp_path, monkeypatch, other_process
):
    """Two processes in one allocation (a second srun step, or two shells of one salloc) share the job id and its
    restart count: the holder is checked by its pid on this host, and cannot be told from another host."""
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    live = dict(pid=other_process.pid, start=lock._start_time(other_process.pid), slurm_job="4242", slurm_restart="0")
    write_lock(run, slurm_step="1", **live)
    with pytest.raises(RunDirBusyError, match=r"Slurm job 4242 step 1.*wait for it to finish, or choose"):
        with lock.holding(run, "finetune"):
            pass
    write_lock(run, host="node-7", pid=1, slurm_job="4242", slurm_restart="0")
    with pytest.raises(RunDirBusyError, match=r"it cannot be checked from .*: rm "), lock.holding(run, "finetune"):
        pass
    write_lock(run, slurm_step="1", **(live | {"pid": 2**22 + 1}))  # that pid is gone: the lock is broken
    with lock.holding(run, "finetune"):
        pass


def test_an_empty_lock_left_by_a_taker_that_died_while_writing_it_is_broken_once_old(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    path = lock.lock_path(run)
    path.write_text("")
    monkeypatch.setattr(lock.time, "sleep", lambda s: None)
    with pytest.raises(RunDirBusyError, match=rf"changes hands constantly.*: rm {path}"), lock.holding(run, "x"):
        pass  # (a young empty lock: its taker may still be writing it)
    old = path.stat().st_mtime - lock.UNWRITTEN_S - 1
    os.utime(path, (old, old))
    with lock.holding(run, "finetune"):
        assert lock.read(run)["pid"] == os.getpid()
    assert not path.exists()


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    run = tmp_path / "run"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lock.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"), lock.holding(run, "finetune"):
        pass
    assert not lock.lock_path(run).exists()


def test_an_explicit_path_to_the_runs_model_takes_the_lock(tmp_path):
    from hybrid_scale.config import load_config
    from hybrid_scale.run.layout import RunLayout

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    for stage, key, out in (("evaluate", "eval.model", "eval.out_dir"), ("export", "export.model", "export.out_dir")):
        inside = load_config(overrides=[f"run_dir={run}", f"{key}={run / 'stage2' / 'output'}", f"{out}={elsewhere}"])
        outside = load_config(overrides=[f"run_dir={run}", f"{key}={tmp_path / 'model'}", f"{out}={elsewhere}"])
        assert lock.needed(inside, stage, RunLayout.of(inside)) and not lock.needed(
            outside, stage, RunLayout.of(outside)
        )


def test_the_holder_goes_on_and_releases_only_its_own_lock(tmp_path):
    run = tmp_path / "run"
    with lock.holding(run, "pipeline"):
        with lock.holding(run, "distill"):  # the pipeline's stages
            assert lock.read(run)["stage"] == "pipeline"
        assert lock.read(run) is not None  # still the pipeline's
    assert lock.read(run) is None
    with pytest.raises(ValueError, match="boom"), lock.holding(run, "finetune"):
        raise ValueError("boom")
    assert lock.read(run) is None  # released on an error too


def test_status_names_the_holder_and_what_is_committed(tmp_path, other_process):
    run = tmp_path / "run"
    write_lock(run, pid=other_process.pid, start=lock._start_time(other_process.pid))
    (run / "stage2" / "step_00000003").mkdir(parents=True)  # not committed: no marker
    (run / "stage2" / "log.txt").write_text("a\nb\nstart: recipe ssd\nstep 3: held-out loss 2.0\n")
    text = status.status(run)
    assert f"lock: held by finetune (pid {other_process.pid} on {socket.gethostname()}" in text
    assert text.splitlines()[1].endswith(": running")
    assert "stage 1: not started" in text and "stage 2: running or stopped (checkpoints: no committed step)" in text
    assert text.endswith("last lines of stage2/log.txt:\n  a\n  b\n  start: recipe ssd\n  step 3: held-out loss 2.0")
    other_process.kill()
    other_process.wait()
    assert "gone (the next run breaks this lock)" in status.status(run)


def test_status_exits_2_on_a_path_that_is_not_a_run_directory(tmp_path, capsys):
    """A script can tell: a missing path and a file each get one line on stderr and exit 2."""
    from hybrid_scale.cli import main

    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"hybrid-scale status: {tmp_path / 'nowhere'}: no such run directory"
    (tmp_path / "file").write_text("x")
    assert main(["status", str(tmp_path / "file")]) == 2
    assert "a file, not a run directory" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert main(["status", str(tmp_path / "run")]) == 0
    assert "stage 1: not started" in capsys.readouterr().out


def test_status_follows_the_recorded_out_dirs(tmp_path):
    """The evaluation and the export written where the run's recorded config (config.yaml) put them."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (elsewhere / "eval" / "cells").mkdir(parents=True)
    (elsewhere / "eval" / "cells" / "hybrid.json").write_text("{}")
    run.mkdir()
    (run / "config.yaml").write_text(f"eval: {{out_dir: {elsewhere / 'eval'}}}\nexport: {{out_dir: null}}\n")
    text = status.status(run)
    assert f"evaluate: 1 cell(s) committed ({elsewhere / 'eval'})" in text


def test_status_imports_no_torch(tmp_path):
    """On a login node: `hybrid-scale status` in a fresh interpreter imports no torch (how fast it answers:
    `make status-speed`, benchmarks/status_speed.py, which prints it)."""
    from benchmarks.status_speed import status_in_a_fresh_interpreter

    (tmp_path / "run" / "stage1").mkdir(parents=True)
    got = status_in_a_fresh_interpreter(tmp_path / "run")
    assert (got["torch_imported"], got["rc"]) == (False, 0), got
