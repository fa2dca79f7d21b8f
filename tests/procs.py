"""Child processes for tests (torchrun, a CLI run): their own process group, killed whole on timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


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


COLLECTIVES = Path(__file__).parent / "collectives"  # sitecustomize.py: the collective checker


def checked(prefix: Path) -> dict:
    """Environment for a child process whose torch.distributed collectives are recorded to <prefix>.rank<R> and
    refused off the rank's device (tests/collectives/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(COLLECTIVES), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HYBRID_SCALE_COLLECTIVES": str(prefix), "HYBRID_SCALE_COLLECTIVES_DEVICE": "cpu"}


def collective_calls(prefix: Path, world: int) -> list[dict]:
    """Rank 0's recorded collectives, after checking that every rank made the same calls (op, dtypes, shapes) in the
    same order, each on the device it computes on (cpu here)."""
    ranks = []
    for r in range(world):
        path = Path(f"{prefix}.rank{r}")
        ranks.append([json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else [])
    key = [[(c["op"], c["dtype"], c["shape"]) for c in calls] for calls in ranks]
    for r in range(1, world):
        for j, (a, b) in enumerate(zip(key[0], key[r], strict=False)):
            where = ranks[0][j]["where"], ranks[r][j]["where"]
            assert a == b, f"collective {j}: rank 0 {a} at {where[0]}, rank {r} {b} at {where[1]}"
        assert len(key[0]) == len(key[r]), f"rank 0 made {len(key[0])} collectives, rank {r} {len(key[r])}"
    assert all(d == "cpu" for calls in ranks for c in calls for d in c["device"])
    return ranks[0]
