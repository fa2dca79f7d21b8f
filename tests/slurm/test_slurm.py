"""A real single-node Slurm (Debian slurm-wlm + munge, started here and stopped by PID): the tiny pipeline submitted
as afterok-chained jobs, and a stage-2 job signalled before its time limit that saves, requeues itself and resumes.
.ci/run installs slurm-wlm and munge."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch
from conftest import tiny_run_overrides
from safetensors.torch import load_file

import hybrid_scale as hs
from hybrid_scale.evaluate.results import EvalResults

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

SLURM_CONF = """ClusterName=hs
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort={p1}
SlurmdPort={p2}
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=5
JobRequeue=1
SchedulerType=sched/builtin
SchedulerParameters=kill_invalid_depend
FirstJobId={first_job}
NodeName=localhost CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    assert not missing, f"{missing} not installed: apt-get install slurm-wlm munge (.ci/run does)"
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o755)
    (d / "munge" / "munge.key").write_bytes(os.urandom(128))
    (d / "munge" / "munge.key").chmod(0o600)
    conf = d / "slurm.conf"
    # A job's rendezvous port is launch.master_port + its id mod 1000. Two of these clusters on one machine (two
    # checkouts' test runs) would both number their jobs from 1, and their job 2s would both take port 29502: the
    # second failed with EADDRINUSE. Each cluster numbers its jobs from a random first id instead.
    first_job = random.randrange(1, 900_000)  # the port takes the id mod 1000
    ports = dict(p1=procs.free_port(), p2=procs.free_port())
    conf.write_text(SLURM_CONF.format(d=d, **ports, cpus=os.cpu_count(), first_job=first_job))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(
        [
            "munged",
            "-f",
            f"--socket={d}/munge/munge.sock",
            f"--key-file={d}/munge/munge.key",
            f"--log-file={d}/log/munged.log",
            f"--pid-file={d}/munge/munged.pid",
            f"--seed-file={d}/munge/seed",
        ],
        check=True,
    )
    daemons = [
        subprocess.Popen(
            ["slurmctld", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        ),
        subprocess.Popen(
            ["slurmd", "-D", "-N", "localhost", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        for _ in range(60):
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"slurm did not come up: {(d / 'log' / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        pid = int((d / "munge" / "munged.pid").read_text())
        os.kill(pid, signal.SIGTERM)


@pytest.fixture
def tiny(tiny_run_model):
    return tiny_run_model


def overrides(tiny, run_dir, *extra):
    return tiny_run_overrides(
        tiny, run_dir, "finetune.max_steps=8", "finetune.eval_every=4", "slurm.cpus_per_task=1", *extra
    )


def submit(env, args, timeout=120):
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_scale.cli", "submit", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split(": job ") for line in proc.stdout.strip().splitlines())


def queued(env, job: str) -> bool:
    """Whether the job is still in the queue (pending or running)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", job], env=env, capture_output=True, text=True)
    return bool(out.stdout.strip())


def wait_for(env, jobs, timeout=900, logs: Path | None = None):
    """Until the jobs have left the queue. A job whose afterok dependency failed can never start: that is reported
    at once with the jobs' output in `logs`, not after the timeout."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(jobs)], env=env, capture_output=True, text=True
        )
        if not out.stdout.strip():
            return
        if "DependencyNeverSatisfied" in out.stdout:
            text = "".join(p.read_text() for p in sorted(logs.glob("*.out"))) if logs else ""
            raise AssertionError(f"a job these depend on failed:\n{out.stdout}\n{text[-3000:]}")
        time.sleep(2)
    raise AssertionError(f"jobs {jobs} still queued after {timeout} s")


@pytest.fixture(scope="module")
def chained(slurm, tiny_run_model, tmp_path_factory):
    """The tiny pipeline submitted as four afterok-chained jobs and run to the end: the submit test reads it, and the
    requeue test takes its stage 1 and its uninterrupted stage-2 curve (the same settings, also run under Slurm)."""
    run = tmp_path_factory.mktemp("chained") / "run"
    jobs = submit(slurm, overrides(tiny_run_model, run))
    wait_for(slurm, list(jobs.values()), logs=run / "slurm")
    return run, jobs


def test_submit_chains_the_stages_with_afterok(chained):
    run, jobs = chained
    assert list(jobs) == ["distill", "finetune", "evaluate", "export"]
    script = (run / "slurm" / "finetune.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@120" in script and "trap forward USR1" in script
    logs = "".join(p.read_text() for p in (run / "slurm").glob("*.out"))
    assert (run / "stage1" / "converted" / "hybrid_config.json").is_file(), logs[-3000:]
    assert json.loads((run / "stage2" / "curves.json").read_text())["output"] == "final", logs[-3000:]
    results = EvalResults.load(run / "eval" / "results.json")
    assert results.converted and set(results.modes) == {"base", "hybrid", "la_only", "none"}
    assert (run / "export" / "COMMITTED").is_file()
    assert "torch.distributed.run --nnodes=1 --nproc-per-node=1 --node-rank=0 --master-addr=localhost" in logs


def test_stage2_job_signalled_before_its_time_limit_requeues_and_resumes(slurm, chained, tiny, tmp_path):
    """USR1 to the batch script (what --signal=B:USR1@lead sends): forwarded as TERM through torchrun, the stage saves
    at the next step boundary, the job requeues itself and resumes from the committed checkpoint. The reference is
    the chained run's uninterrupted stage 2 (same settings, same stage 1)."""
    ref = chained[0]
    run = tmp_path / "run"
    shutil.copytree(ref / "stage1", run / "stage1")
    env = {**slurm, "HYBRID_SCALE_STEP_SLEEP": "1.5"}  # slow steps, so that the signal lands mid-run
    job = submit(env, [*overrides(tiny, run), "--stages", "finetune"])["finetune"]
    stage2 = run / "stage2"
    while not (stage2 / "step_00000002" / "COMMITTED").is_file() and queued(slurm, job):  # (or the job has ended)
        time.sleep(0.5)
    assert (stage2 / "step_00000002" / "COMMITTED").is_file(), "stage 2 ended before it reached step 2"
    holder = json.loads((run / ".lock").read_text())  # the run dir's lock, taken for the job (run/lock.py)
    assert holder["slurm_job"] == job and holder["stage"] == "finetune"
    # as if the node had died: the lock stays behind, naming another host; the requeued job (same id) takes it over
    (run / ".lock").write_text(json.dumps(holder | {"host": "node-lost", "pid": 1}))
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    wait_for(slurm, [job])
    assert not (run / ".lock").exists()  # the requeued run took the lock over and released it
    log = (stage2 / "log.txt").read_text()
    out = "".join(p.read_text() for p in (run / "slurm").glob("*.out"))
    assert "signal: saved step_0000000" in log, out[-3000:]
    assert "requeueing" in out and "restart 1" in out
    assert "resumed from step_0000000" in log
    got, want = (
        json.loads((stage2 / "curves.json").read_text()),
        json.loads((ref / "stage2" / "curves.json").read_text()),
    )
    assert len(got["train"]) == 8 and abs(got["train"][-1] - want["train"][-1]) <= 1e-6
    assert torch.allclose(torch.tensor(got["train"]), torch.tensor(want["train"]), atol=1e-6)
    assert not (run / "requeue_requested").exists()
    hs.load_converted(stage2 / "output", dtype=torch.float32)


def test_srun_launcher_starts_one_task_per_rank(slurm, tiny, tmp_path):
    """launch.launcher=srun: the batch script's srun starts both ranks; each maps SLURM_PROCID / SLURM_NTASKS /
    SLURM_LOCALID and the node list to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR (srun_environment)."""
    run = tmp_path / "run"
    args = [*overrides(tiny, run, "launch.launcher=srun", "launch.procs_per_node=2"), "--stages", "distill"]
    job = submit(slurm, args)["distill"]
    script = (run / "slurm" / "distill.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "srun --kill-on-bad-exit=0 " in script
    wait_for(slurm, [job])
    out = "".join(p.read_text() for p in (run / "slurm").glob("*.out"))
    assert "start at layer 0 of 2: 2 ranks" in (run / "stage1" / "log.txt").read_text(), out[-3000:]
    ref = tmp_path / "ref"  # the same two ranks under torchrun
    assert procs.run(["distill", *overrides(tiny, ref)], ranks=2, timeout=300).returncode == 0
    a, b = (load_file(r / "stage1" / "converted" / "hybrid_params.safetensors") for r in (run, ref))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_run_dir_with_a_space_gets_its_job_output(slurm, tmp_path, monkeypatch):
    """A run_dir that sbatch would split (a space, a #) or the shell would run ($(...)): the job's --output file lands
    in <run_dir>/slurm/ under its %x-%j name and nothing runs. The export script's step is /bin/true: seconds."""
    from hybrid_scale.config import load_config
    from hybrid_scale.launch.slurm import submit as submit_jobs

    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)  # the script's working directory, where `touch pwned` would land
    run = tmp_path / "my run #1 $(touch pwned) 100%"
    cfg = load_config(overrides=[f"run_dir={json.dumps(str(run))}", "slurm.cpus_per_task=1"])
    [job] = submit_jobs(cfg, None, [], ["export"], python="/bin/true")
    wait_for(slurm, [job], timeout=60)
    out = run / "slurm" / f"hybrid_scale-export-{job}.out"
    assert out.is_file(), sorted(str(p) for p in tmp_path.rglob("*"))
    assert f"job {job} restart 0" in out.read_text()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("pwned")]
