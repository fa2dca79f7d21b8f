"""tests/warm.py: a run forked from the pre-imported server behaves as a fresh process (or torchrun) would, as far
as a test can see: exit status, stdout, stderr, environment, working directory, ranks."""

import os
import signal
import sys

import procs
import pytest
import warm

SCRIPT = """
import os, sys, time
rank = int(os.environ.get("RANK", "0"))
print("rank", rank, "of", os.environ.get("WORLD_SIZE"), "in", os.getcwd(), "argv", sys.argv[1:], flush=True)
print("err", rank, os.environ.get("HYBRID_SCALE_PROBE"), file=sys.stderr)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(60)  # torchrun's rule: a failed rank stops the others
    print("rank", rank, "slept on", flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow  # ~12 s: a cold CLI process / a second server; `make test` runs it
def test_a_warm_cli_run_equals_a_cold_one():
    """The same refused command line: the same status and the same error line."""
    a = procs.run(["nonsense"])
    b = procs.run(["nonsense"], cold=True)
    assert a.args[0] == "warm:" and b.args[0] == sys.executable  # one of each
    assert a.returncode == b.returncode == 2
    assert a.stderr.splitlines()[-1] == b.stderr.splitlines()[-1]
    assert "invalid choice: 'nonsense'" in a.stderr


def test_ranks_get_torchruns_variables_and_a_failure_stops_the_group(script, tmp_path):
    ok = procs.run(["ok"], {"HYBRID_SCALE_PROBE": "x"}, ranks=2, script=script)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == [f"rank {r} of 2 in {tmp_path} argv ['ok']" for r in (0, 1)]
    assert sorted(ok.stderr.splitlines()) == ["err 0 x", "err 1 x"]
    failed = procs.run(["fail"], ranks=2, script=script)
    assert failed.returncode == 1 and "slept on" not in failed.stdout  # rank 0 was terminated, not waited for
    killed = procs.run(["kill"], script=script)
    assert killed.returncode == -signal.SIGKILL


def test_only_variables_read_at_run_time_may_differ_from_the_servers():
    """What procs.run sends to a fresh process instead: any other variable that differs (a library may read it at
    import)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert warm.differs({**base, "HYBRID_SCALE_FAULT": "step:3", "SLURM_JOB_ID": "7"}, base) == []
    assert warm.differs({**base, "PYTHONPATH": "/x"}, base) == ["PYTHONPATH"]
    assert warm.differs({**base, "PYTHONPATH": warm.CHECKER}, base) == []  # the collective checker: run by the child
    assert warm.differs({**base, "TRITON_INTERPRET": "0"}, base) == ["TRITON_INTERPRET"]


@pytest.mark.slow  # ~12 s: a cold CLI process / a second server; `make test` runs it
def test_a_variable_left_set_by_another_test_gets_its_own_server(monkeypatch):
    """A test that leaves an import-time variable set (CI once had one) must not turn every later run cold."""
    assert procs.run(["nonsense"]).args[0] == "warm:"  # a server for the environment as it was
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    assert procs.run(["nonsense"]).args[0] == "warm:"
