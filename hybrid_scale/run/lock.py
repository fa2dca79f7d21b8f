"""One writer per run directory: the lock every stage that writes into a run dir takes first.

The lock is the file {run_dir}/.lock, created with O_CREAT | O_EXCL (atomic on a local disk and on NFSv3+ and Lustre,
where fcntl/flock locks depend on the mount options and a lock daemon) and holding who took it: host, pid, the
process's start time, the Slurm job and step if any, the command, the stage and when. Rank 0 takes it for the job
(the ranks agree on the outcome, so none is left waiting in a collective); a stage run inside the pipeline finds it
held by its own process and goes on. It is removed when the stage ends, normally or by an error.

A lock whose holder is gone never blocks the next run:
  * on the same host: the pid is not running, or is another process (its start time differs);
  * a Slurm job that was requeued (the same job id as this process's, another restart count): the holder was this
    job's run before the requeue (another process of the same run of the job, e.g. a second srun step, is checked
    by its pid on the same host, and cannot be told from another host);
  * an empty lock older than UNWRITTEN_S: its taker died between creating and writing it;
  * on another host with a Slurm job: `squeue` says the job is no longer running;
otherwise (another host, no Slurm answer) the holder may be alive, and the refusal names the command that breaks the
lock. A refused writer writes nothing: it reads the lock and exits 2.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.schema import Config
from ..errors import RunDirBusyError
from .layout import LOCK_NAME, RunLayout

if TYPE_CHECKING:
    from ..distributed.runtime import Runtime

ALIVE_STATES = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING")
_HELD: dict[Path, int] = {}  # run dirs this process holds -> nesting depth (the pipeline holds across its stages)


def lock_path(run_dir) -> Path:
    return Path(run_dir) / LOCK_NAME


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when unknown."""
    fields = _stat(pid)
    return fields[19] if fields else None


def me(stage: str) -> dict:
    """This process as a lock holder."""
    env = os.environ
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "slurm_job": env.get("SLURM_JOB_ID"),
        "slurm_step": env.get("SLURM_STEP_ID"),
        "slurm_restart": env.get("SLURM_RESTART_COUNT", "0") if env.get("SLURM_JOB_ID") else None,
        "stage": stage,
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def read(run_dir) -> dict | None:
    """The holder recorded in the run dir's lock, None when there is no lock ({} while it is being written)."""
    try:
        text = lock_path(run_dir).read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def _squeue(job: str) -> str | None:
    """The Slurm job's state ("" when Slurm no longer knows it), None when squeue does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout.strip()


def alive(holder: dict) -> bool | None:
    """Whether the holder still runs: True, False, or None when it cannot be told from here."""
    job = holder.get("slurm_job")
    same_job = bool(job) and job == os.environ.get("SLURM_JOB_ID")
    if same_job and holder.get("slurm_restart") != os.environ.get("SLURM_RESTART_COUNT", "0"):
        return False  # this job's run before its requeue (a requeue keeps the job id, counts the restarts): it ended
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        fields = _stat(pid)
        if fields is not None and fields[0] in "ZX":
            return False  # killed, not yet reaped by its parent
        return holder.get("start") is None or fields is None or fields[19] == holder.get("start")
    if job and not same_job:  # (this job runs: squeue cannot tell about another process of it on another node)
        state = _squeue(job)
        if state is not None:
            return state in ALIVE_STATES
    return None


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    step = f" step {holder['slurm_step']}" if job and holder.get("slurm_step") else ""
    return (
        f"{holder.get('stage', '?')} (pid {holder.get('pid')} on {holder.get('host')}{job}{step}, since "
        f"{holder.get('since')}: {holder.get('command')})"
    )


def _acquire(run_dir: Path, stage: str) -> None:
    path = lock_path(run_dir)
    for _ in range(50):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read(run_dir)
            if holder is None:
                continue  # released meanwhile: try again
            if holder == {} and not _unwritten(path):
                time.sleep(0.1)  # being written by its taker
                continue
            state = False if holder == {} else alive(holder)  # (empty for long: its taker died while writing it)
            if state is False:
                stale = path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
                try:
                    os.replace(path, stale)  # (a concurrent breaker may have done it: then try again)
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            fix = "wait for it to finish, or choose another run_dir"
            if state is None:
                fix += f"; if it is no longer running (it cannot be checked from {socket.gethostname()}): rm {path}"
            raise RunDirBusyError(f"{run_dir} is in use by {describe(holder)}; {fix}") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me(stage)))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)  # (a full disk, a signal: no empty lock left behind)
            raise
        return
    raise RunDirBusyError(
        f"{run_dir}: could not take its lock {path} (it changes hands constantly); try again, or if no run uses "
        f"{run_dir}: rm {path}"
    )


UNWRITTEN_S = 10.0  # an empty lock this old was left by a taker that died between creating and writing it


def _unwritten(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > UNWRITTEN_S
    except FileNotFoundError:
        return False


def _release(run_dir: Path) -> None:
    holder = read(run_dir)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        lock_path(run_dir).unlink(missing_ok=True)


@contextmanager
def holding(run_dir, stage: str, rt: Runtime | None = None):
    """Hold the run dir's lock for the block: rank 0 takes it for the job (the ranks agree: a refusal raises on
    every rank); a process that already holds it (the pipeline, around its stages) goes on."""
    run_dir = Path(run_dir).resolve()
    main = rt is None or rt.main
    if run_dir in _HELD:
        _HELD[run_dir] += 1
        try:
            yield
        finally:
            _HELD[run_dir] -= 1
        return
    error = None
    if main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            _acquire(run_dir, stage)
        except (RunDirBusyError, OSError) as e:  # (an OSError too: the other ranks must not wait for rank 0)
            error = e
    if rt is not None:
        from ..distributed.runtime import all_ranks  # (torch: only a stage that runs ranks gets here)

        agreed = all_ranks(rt, error is None)
    else:
        agreed = error is None
    if not agreed:
        raise error or RunDirBusyError(f"{run_dir} is in use by another run (rank 0 says why); choose another run_dir")
    _HELD[run_dir] = 1
    try:
        yield
    finally:
        del _HELD[run_dir]
        if main:
            _release(run_dir)


def _inside(path: Path, run_dir: Path) -> bool:
    return path.resolve().is_relative_to(run_dir.resolve())


def needed(cfg: Config, stage: str, layout: RunLayout) -> bool:
    """Whether `stage` writes into (or reads the model of) the run dir: stage 1, stage 2 and the pipeline always;
    the evaluation and the export when they read the run's model (by default, or by a path inside the run dir) or
    write inside the run dir."""
    if stage == "evaluate":
        return (
            cfg.eval.model is None
            or _inside(Path(cfg.eval.model), layout.run_dir)
            or _inside(layout.eval, layout.run_dir)
        )
    if stage == "export":
        return (
            cfg.export.model is None
            or _inside(Path(cfg.export.model), layout.run_dir)
            or _inside(layout.export, layout.run_dir)
        )
    return True


@contextmanager
def for_stage(cfg: Config, stage: str, rt: Runtime | None, layout: RunLayout):
    """The run dir's lock around a stage that needs it (`needed`); the block runs unlocked otherwise."""
    if not needed(cfg, stage, layout):
        yield
        return
    with holding(layout.run_dir, stage, rt):
        yield
