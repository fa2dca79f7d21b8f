"""Child processes for tests (torchrun, a CLI run): their own process group, killed whole on timeout."""

import atexit
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import warm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], env_extra: dict | None = None, timeout: int = 600, ranks: int = 0, script=None,
        cold: bool = False):  # fmt: skip
    """`python -m hybrid_scale.cli ARGS`, or `python SCRIPT ARGS` (under torchrun with `ranks` processes when
    ranks > 0). Forked from tests/warm.py's pre-imported server unless `cold` (a fresh python and a real torchrun:
    for a test that reads torchrun's own report), HYBRID_SCALE_TEST_COLD=1, or an environment the server cannot
    give (warm.differs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    if not cold and os.environ.get("HYBRID_SCALE_TEST_COLD") != "1":
        server = _warm_server()
        if not warm.differs(env, server.env):  # (env_extra's import-time variables: a fresh process)
            return server.run(args, env, timeout, ranks, script)
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


class _Warm:
    """tests/warm.py started once per test process; stopped by its PID when the process exits."""

    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="hs-warm-")
        self.path = os.path.join(self.dir, "sock")
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "warm.py"), self.path],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        atexit.register(self.stop)
        for line in self.proc.stdout:  # (DeepSpeed logs its accelerator to stdout first)
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"tests/warm.py did not start (exit {self.proc.wait()})")
        self.proc.stdout.close()
        self.count = itertools.count(1)  # (runs may come from several threads)

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def run(self, args, env, timeout, ranks, script):
        n = next(self.count)
        out, err = (os.path.join(self.dir, f"{n}.{s}") for s in ("out", "err"))
        script = str(script) if script else None
        cmd = ["warm:", *([f"torchrun --nproc-per-node={ranks}"] if ranks else []), script or "hybrid_scale.cli", *args]
        req = dict(args=args, script=script, ranks=ranks, port=free_port(), env=env, cwd=os.getcwd(), out=out, err=err)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            f = s.makefile("rw")
            f.write(json.dumps(req) + "\n")
            f.flush()
            pids = json.loads(f.readline())["pids"]
            s.settimeout(timeout)
            try:
                code = json.loads(f.readline())["status"]
            except TimeoutError:
                for pid in pids:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                raise AssertionError(f"{' '.join(cmd)} timed out after {timeout} s; stderr: "
                                     f"{Path(err).read_text()[-2000:]}") from None  # fmt: skip
        result = subprocess.CompletedProcess(cmd, code, Path(out).read_text(), Path(err).read_text())
        os.unlink(out)
        os.unlink(err)
        return result


_servers: dict[frozenset, _Warm] = {}


def _warm_server() -> _Warm:
    """The server for this process's environment as it is now: a test may leave a variable set that a library reads
    at import, and a server started before it would then be bypassed by every later run."""
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    key = frozenset((k, v) for k, v in base.items() if not k.startswith(warm.RUNTIME_PREFIXES))
    server = _servers.get(key)
    if server is None or server.proc.poll() is not None:
        server = _servers[key] = _Warm(base)
    return server
