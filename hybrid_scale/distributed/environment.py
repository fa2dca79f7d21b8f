"""Where this process sits in a Slurm job, read from the environment: the first host of the node list, the job's
rendezvous port, and -- under `srun` with one task per rank (launch.launcher=srun) -- the torch.distributed
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from Slurm's (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the first host of SLURM_JOB_NODELIST). Used by the runtime (joining the group) and slurm.py (launch
commands)."""

from __future__ import annotations

import os
import re
import subprocess


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list, e.g. 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def job_port(base: int, env=os.environ) -> int:
    """The rendezvous port of this job: launch.master_port + SLURM_JOB_ID mod 1000 (two jobs on a node differ)."""
    return base + int(env.get("SLURM_JOB_ID", "0")) % 1000


def srun_environment(env=os.environ, port: int = 29500) -> dict[str, str]:
    """torch.distributed variables for a task started by srun (one task per rank); {} outside srun. The sbatch
    script sets MASTER_PORT from launch.master_port; `port` is the base when it did not."""
    if "SLURM_PROCID" not in env or "RANK" in env or "SLURM_STEP_ID" not in env:
        return {}
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": first_host(env.get("SLURM_JOB_NODELIST", "localhost")),
        "MASTER_PORT": env.get("MASTER_PORT", str(job_port(port, env))),
    }
