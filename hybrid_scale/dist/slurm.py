"""Launch a stage on N processes / nodes, and Slurm batch scripts for the stages and the pipeline.

- `srun_environment()`: under `srun` with one task per rank (launch.launcher=srun), the torch.distributed variables
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
  the first host of SLURM_JOB_NODELIST).
- `launch_command()`: the torchrun / deepspeed command that starts a stage on this node, its rendezvous read from the
  Slurm environment (first host, port, node rank); one process per node runs it.
- `render()`: an sbatch script from the config (partition, account, nodes, GPUs per node, time), with --requeue,
  --open-mode=append, --signal=B:USR1@lead trapped by the script and forwarded to the training processes as SIGTERM
  (torchrun forwards TERM to its workers; with srun every rank gets it directly); on the stage's "saved, please
  requeue" exit (75) the job requeues itself while SLURM_RESTART_COUNT < slurm.max_restarts.
- `submit()`: the stages as jobs chained with afterok; returns the job ids.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .checkpoint import REQUEUE_MARKER

STAGE_COMMANDS = ("distill", "finetune", "evaluate", "export", "pipeline")
GPU_STAGES = ("distill", "finetune", "evaluate", "pipeline")


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


def srun_environment(env=os.environ, port: int = 29500) -> dict[str, str]:
    """torch.distributed variables for a task started by srun (one task per rank); {} outside srun."""
    if "SLURM_PROCID" not in env or "RANK" in env or "SLURM_STEP_ID" not in env:
        return {}
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": first_host(env.get("SLURM_JOB_NODELIST", "localhost")),
        "MASTER_PORT": env.get("MASTER_PORT", str(port + int(env.get("SLURM_JOB_ID", "0")) % 1000)),
    }


def launch_command(cfg, stage: str, args: list[str], env=os.environ) -> list[str]:
    """The command that starts `stage` on this node with cfg.launch's launcher (torchrun or deepspeed)."""
    lc = cfg.launch
    host = first_host(env.get("SLURM_JOB_NODELIST", "localhost"))
    node_rank = env.get("SLURM_NODEID", "0")
    port = str(lc.master_port + int(env.get("SLURM_JOB_ID", "0")) % 1000)
    module = ["-m", "hybrid_scale.cli", stage, *args]
    if lc.launcher == "deepspeed":
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            f"--num_nodes={lc.nodes}",
            f"--num_gpus={lc.procs_per_node}",
            f"--node_rank={node_rank}",
            f"--master_addr={host}",
            f"--master_port={port}",
            "--no_ssh",
            "--module",
            "hybrid_scale.cli",
            stage,
            *args,
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # = torchrun, from this interpreter's environment
        f"--nnodes={lc.nodes}",
        f"--nproc-per-node={lc.procs_per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={host}",
        f"--master-port={port}",
        *module,
    ]


def render(cfg, stage: str, config_path: str | None, overrides: list[str], python: str = "python") -> str:
    """The sbatch script of one stage (or of the whole pipeline)."""
    if stage not in STAGE_COMMANDS:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGE_COMMANDS)}")
    lc, s = cfg.launch, cfg.slurm
    run_dir = Path(cfg.run_dir).resolve()
    args = ([str(Path(config_path).resolve())] if config_path else []) + list(overrides)
    srun = lc.launcher == "srun"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={s.job_name}-{stage}",
        f"#SBATCH --nodes={lc.nodes}",
        f"#SBATCH --ntasks-per-node={lc.procs_per_node if srun else 1}",
        f"#SBATCH --cpus-per-task={s.cpus_per_task}",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={run_dir}/slurm/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{s.signal_lead_s}",
    ]
    if cfg.model.device.startswith("cuda") and stage in GPU_STAGES:
        lines.append(f"#SBATCH --gpus-per-node={lc.procs_per_node}")
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.mem is not None:
        lines.append(f"#SBATCH --mem={s.mem}")
    lines += [f"#SBATCH {x}" for x in s.extra]
    if srun:
        step = f"srun --kill-on-bad-exit=0 {shlex.quote(python)} -m hybrid_scale.cli {stage} " + shlex.join(args)
    else:
        step = f"srun --ntasks-per-node=1 {shlex.quote(python)} -m hybrid_scale.cli launch {stage} " + shlex.join(args)
    lines += [
        "",
        "# Generated by `hybrid-scale submit` from the run's config. USR1 arrives signal_lead_s before the time limit:",
        "# it is forwarded to the training processes as TERM; they save at the next step boundary and exit 75.",
        "set -u",
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"mkdir -p {shlex.quote(str(run_dir / 'slurm'))}",
        'echo "[$(date +%T)] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
        "forward() {  # to the job's steps (torchrun, or every rank under srun), not to this script",
        '  echo "[$(date +%T)] USR1: asking the stage to save"',
        '  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM "$step" 2>/dev/null',
        "}",
        "trap forward USR1",
        f"{step} &",
        "step=$!",
        'wait "$step"; code=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done  # wait again after the trap',
        f"marker={shlex.quote(str(run_dir / REQUEUE_MARKER))}  # written by a stage that saved on a signal",
        'if [ "$code" -eq 75 ] || [ -f "$marker" ]; then',
        '  rm -f "$marker"',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {s.max_restarts} ]; then',
        '    echo "[$(date +%T)] saved; requeueing"; scontrol requeue "$SLURM_JOB_ID"; exit 0',
        "  fi",
        '  echo "[$(date +%T)] saved, but slurm.max_restarts reached"; exit 75',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def submit(cfg, config_path: str | None, overrides: list[str], stages: list[str], python: str = "python") -> list[str]:
    """Write one sbatch script per stage under {run_dir}/slurm and submit them chained with afterok."""
    out = Path(cfg.run_dir) / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    for stage in stages:
        script = out / f"{stage}.sbatch"
        script.write_text(render(cfg, stage, config_path, overrides, python))
        cmd = ["sbatch", "--parsable"] + ([f"--dependency=afterok:{ids[-1]}"] if ids else []) + [str(script)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"sbatch failed for {script}: {proc.stderr.strip()}")
        ids.append(proc.stdout.strip().split(";")[0])
    return ids
