"""A warm start for the tests' CLI and script runs: a server that has imported torch, transformers, peft and
DeepSpeed once and forks each run's processes (`python -m hybrid_scale.cli ARGS` or `python SCRIPT ARGS`, one
process or the ranks of a `torchrun --nproc-per-node=N`), each without the ~7 s of imports a fresh process pays
(nor the few seconds of what the stages import later: DeepSpeed's Muon check, matplotlib, datasets; see main).

Each child is a real process of its own: its own pid and session (a signal or a kill of its group reaches it
alone), its exit status, its environment and working directory as the test gave them. It imports hybrid_scale
itself, after its environment is set (the kernels read TRITON_INTERPRET when they load). Ranks get the variables
torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; rank 0 hosts the TCP store, the
env:// rendezvous of torch.distributed) and share one stdout and one stderr, unbuffered, as under torchrun. As
torchrun does, the run fails (status 1) when a rank fails, and the other ranks get SIGTERM, then SIGKILL 30 s later.
What is not torchrun's: its own failure report on stderr (tests that read it pass `cold=True` to procs.run).

A run whose environment differs from the server's in a variable that a pre-imported library may read when it loads
(anything but HYBRID_SCALE_*, SLURM_* and PYTEST_*) is not sent here: tests/procs.py starts it fresh.
HYBRID_SCALE_TEST_COLD=1 starts every run fresh. The collective checker (tests/collectives, put first on PYTHONPATH
by procs.checked) is the exception: a child whose PYTHONPATH adds it runs its sitecustomize.py itself, as a fresh
interpreter would at start-up, before anything of the run is imported.

Protocol (one JSON line each way per connection): {"args", "script", "ranks", "port", "env", "cwd", "out", "err"}
-> {"pids"}, then {"status"} when the run ends.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
import threading
import time

RUNTIME_PREFIXES = ("HYBRID_SCALE_", "SLURM_", "PYTEST_")  # read when the code runs, not when a library loads
CHECKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives")  # its sitecustomize.py


def differs(env: dict, base: dict) -> list[str]:
    """The variables, other than those read at run time, in which env and base differ."""
    keys = set(env) ^ set(base) | {k for k in set(env) & set(base) if env[k] != base[k]}
    if _paths(env) == _paths(base):  # PYTHONPATH differs only by the collective checker, which a child runs itself
        keys.discard("PYTHONPATH")
    return sorted(k for k in keys if not k.startswith(RUNTIME_PREFIXES))


def _paths(env: dict) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != CHECKER]


def _worker_env(env: dict, rank: int, ranks: int, port: int) -> dict:
    """What torchrun --nproc-per-node=ranks (one node, no restarts) sets for one of its workers."""
    each = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "ROLE_NAME": "default",
            "WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": ranks,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
            "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1, "PYTHONUNBUFFERED": 1}  # fmt: skip
    return {**env, **{k: str(v) for k, v in each.items()}}


def _child(req: dict, env: dict) -> None:
    """In the forked child: become the process the test asked for, then exit with its status."""
    code = 1
    try:
        os.setsid()
        fd_in = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd_in, 0)
        os.close(fd_in)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        if req["ranks"]:
            sys.stdout.reconfigure(write_through=True)  # python -u, as torchrun starts its workers
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        import runpy

        if CHECKER in map(os.path.abspath, env.get("PYTHONPATH", "").split(os.pathsep)):
            sys.path.insert(1, CHECKER)  # where PYTHONPATH would put it (after the script's directory)
            runpy.run_path(os.path.join(CHECKER, "sitecustomize.py"), run_name="sitecustomize")

        try:
            if req["script"]:
                sys.argv = [req["script"], *req["args"]]
                sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
                runpy.run_path(req["script"], run_name="__main__")
            else:
                sys.argv = ["hybrid_scale.cli", *req["args"]]
                sys.path[0] = os.getcwd()  # python -m puts the working directory first
                runpy.run_module("hybrid_scale.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | type(None)):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve(conn: socket.socket) -> None:
    with conn, conn.makefile("rw") as f:
        req = json.loads(f.readline())
        for path in (req["out"], req["err"]):
            open(path, "w").close()
        envs = [req["env"]]
        if req["ranks"]:
            envs = [_worker_env(req["env"], r, req["ranks"], req["port"]) for r in range(req["ranks"])]
        pids = []
        for env in envs:
            pid = os.fork()
            if pid == 0:
                _child(req, env)
            pids.append(pid)
        f.write(json.dumps({"pids": pids}) + "\n")
        f.flush()
        codes = _wait(pids)
        code = codes[0] if not req["ranks"] else int(any(codes))
        f.write(json.dumps({"status": code}) + "\n")
        f.flush()


def _wait(pids: list[int]) -> list[int]:
    """Every child's exit status (-N for signal N); when one fails, SIGTERM to the others, SIGKILL 30 s later."""
    codes: dict[int, int] = {}
    stop_at = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                if codes[pid] and stop_at is None and len(pids) > 1:
                    stop_at = time.monotonic() + 30
                    _signal([p for p in pids if p not in codes], signal.SIGTERM)
        if stop_at is not None and time.monotonic() > stop_at:
            _signal([p for p in pids if p not in codes], signal.SIGKILL)
        time.sleep(0.02)
    return [codes[p] for p in pids]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(path: str) -> None:
    import deepspeed  # noqa: F401  (the heavy imports, once; nothing of them runs here)
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    # what every stage imports later, here once: DeepSpeed's ZeRO optimizer check imports its Muon optimizer and with
    # it torch._dynamo and inductor (3-4 s per process: every rank of every stage-2 run); the plots matplotlib, the
    # evaluation's task data datasets (about 1 s each)
    for lazy in ("deepspeed.runtime.zero.muon.muon_optimizer", "matplotlib.pyplot", "datasets"):
        try:
            importlib.import_module(lazy)
        except ImportError:  # another DeepSpeed release: the child imports what it needs itself
            pass

    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1])
