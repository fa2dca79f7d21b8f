"""Child processes for tests (torchrun, a CLI run): their own process group, killed whole on timeout."""

import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], env_extra: dict | None = None, timeout: int = 600, ranks: int = 0, script=None):
    """`python -m hybrid_scale.cli ARGS`, or `python SCRIPT ARGS` (under torchrun with `ranks` processes when
    ranks > 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    target = [str(script)] if script else ["-m", "hybrid_scale.cli"]
    launcher = (
        ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port()}"] if ranks else []
    )
    cmd = [sys.executable, *launcher, *target, *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout} s; stderr: {err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
