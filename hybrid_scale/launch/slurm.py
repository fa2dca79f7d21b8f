"""Launch a stage on N processes / nodes, and Slurm batch scripts for the stages and the pipeline.

- `launch_command()`: the torchrun / deepspeed command that starts a stage on this node, its rendezvous read from the
  Slurm environment (first host, port, node rank); one process per node runs it.
- `render()`: an sbatch script from a template in slurm/ (stage.sbatch; export.sbatch for the one-process export; a
  <stage>.sbatch in slurm.template_dir overrides) filled from the config (partition, account, nodes, GPUs per node,
  time per stage, site set-up lines), with --requeue, --open-mode=append, --signal=B:USR1@lead trapped by the script
  and forwarded to the training processes as SIGTERM (torchrun forwards TERM to its workers; with srun every rank
  gets it directly); on the stage's "saved, please requeue" exit (75) the job requeues itself while
  SLURM_RESTART_COUNT < slurm.max_restarts.
- `submit()`: the stages as jobs chained with afterok; returns the job ids.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import JOBS, on_gpus
from ..config.schema import Config
from ..distributed.environment import first_host, job_port
from ..distributed.requeue import REQUEUE_MARKER
from ..errors import ConfigError
from ..resources import data_dir
from ..run.layout import RunLayout

GPU_JOBS = tuple(j for j in JOBS if j != "export")  # export is one CPU process


def launch_command(cfg: Config, stage: str, args: list[str], env=os.environ) -> list[str] | None:
    """The command that starts `stage` on this node with cfg.launch's launcher (torchrun or deepspeed). Export is one
    process's work: node 0 runs it without a launcher, the other nodes have nothing to do (None)."""
    launch = cfg.launch
    if stage == "export":
        return [sys.executable, "-m", "hybrid_scale.cli", stage, *args] if env.get("SLURM_NODEID", "0") == "0" else None
    host = first_host(env.get("SLURM_JOB_NODELIST", "localhost"))
    node_rank = env.get("SLURM_NODEID", "0")
    port = str(job_port(launch.master_port, env))
    module = ["-m", "hybrid_scale.cli", stage, *args]
    if launch.launcher == "deepspeed":
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            f"--num_nodes={launch.nodes}",
            f"--num_gpus={launch.procs_per_node}",
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
        f"--nnodes={launch.nodes}",
        f"--nproc-per-node={launch.procs_per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={host}",
        f"--master-port={port}",
        f"--shutdown-timeout={grace_s(cfg)}",  # after TERM, the workers' time to reach a step boundary and save
        *module,
    ]


REQUEUE_MARGIN_S = 15  # of the signal lead, left for the script to requeue the job after the save


def grace_s(cfg: Config) -> int:
    """How long torchrun waits for its workers to save and exit after passing TERM on, before SIGKILL (its default,
    30 s, would cut a longer save): the signal lead, less the time the batch script needs to requeue."""
    return max(30, cfg.slurm.signal_lead_s - REQUEUE_MARGIN_S)


TEMPLATES = data_dir("slurm")  # the repository's slurm/ (in a wheel install, its copy in the package)
PLACEHOLDER = re.compile(r"@([a-z_]+)@")


def template(cfg: Config, stage: str) -> Path:
    """slurm.template_dir's {stage}.sbatch, else (not for the one-process export) its stage.sbatch, else the
    repository's slurm/{stage}.sbatch or slurm/stage.sbatch: a site overrides only the files it provides."""
    own = Path(cfg.slurm.template_dir) if cfg.slurm.template_dir else None
    names = [f"{stage}.sbatch", "stage.sbatch"]
    candidates = [own / n for n in names[: 1 if stage == "export" else 2]] if own else []
    candidates += [TEMPLATES / n for n in names]
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        return found
    raise ConfigError(
        f"no sbatch templates in {TEMPLATES} (this installation lacks the repository's slurm/ folder): copy it from "
        "the repository and set slurm.template_dir to it"
    )


SBATCH_SPECIAL = re.compile(r"[\s\"'\\#]")


def sbatch_quote(value) -> str:
    """`value` as one argument of an #SBATCH line. sbatch splits those lines itself, not through a shell
    (src/sbatch/opt.c, get_argument): whitespace separates arguments, "..." or '...' group (the quotes are
    dropped), a backslash takes the next character literally, an unquoted # starts a comment, and a line ends at its
    newline whatever the quoting (config validation refuses line breaks). A plain value stays as it is; any other is
    put in double quotes with its backslashes and double quotes escaped."""
    text = str(value)
    if text and not SBATCH_SPECIAL.search(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(run_dir: Path) -> str:
    """--output's file name: {run_dir}/slurm/%x-%j.out with the directory's own % written %% (Slurm's filename
    pattern). A backslash anywhere in it would switch the %x / %j replacement off (src/slurmd/common/fname.c)."""
    if "\\" in str(run_dir):
        raise ConfigError(
            f"config key 'run_dir': {str(run_dir)!r} contains a backslash, which Slurm's --output file names do not "
            "allow (it turns off the %x-%j.out replacement); use a directory without one for Slurm jobs"
        )
    return str(run_dir).replace("%", "%%") + "/slurm/%x-%j.out"


def sbatch_header(cfg: Config, stage: str) -> list[str]:
    """The #SBATCH lines: export is one process on one node without GPUs; the others take the launch shape. Values
    go through sbatch_quote (a run_dir with a space); slurm.extra items are sbatch syntax already and go as given."""
    launch, slurm = cfg.launch, cfg.slurm
    run_dir = Path(cfg.run_dir).resolve()
    single = stage == "export"
    per_node = launch.procs_per_node if launch.launcher == "srun" and not single else 1
    q = sbatch_quote
    lines = [
        f"--job-name={q(f'{slurm.job_name}-{stage}')}",
        f"--nodes={1 if single else launch.nodes}",
        f"--ntasks-per-node={per_node}",
        f"--cpus-per-task={slurm.cpus_per_task}",
        f"--time={q(slurm.times.get(stage, slurm.time))}",
        f"--output={q(output_pattern(run_dir))}",
        "--open-mode=append",
        "--requeue",
    ]
    if not single:  # export has no checkpoint to save: a requeued export starts over
        lines.append(f"--signal=B:USR1@{slurm.signal_lead_s}")
    if on_gpus(cfg.model.device) and stage in GPU_JOBS:
        lines.append(f"--gpus-per-node={launch.procs_per_node}")
    lines += [f"--{key}={q(slurm[key])}" for key in ("partition", "account") if slurm[key]]
    lines += [f"--mem={q(slurm.mem)}"] if slurm.mem not in (None, "") else []  # --mem=0: the whole node's memory
    lines += list(slurm.extra)
    return [f"#SBATCH {x}" for x in lines]


def render(cfg: Config, stage: str, config_path: str | None, overrides: list[str], python: str = "python") -> str:
    """The sbatch script of one stage (or of the whole pipeline): its template with the config's values filled in."""
    if stage not in JOBS:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(JOBS)}")
    launch, slurm = cfg.launch, cfg.slurm
    run_dir = Path(cfg.run_dir).resolve()
    args = shlex.join(([str(Path(config_path).resolve())] if config_path else []) + list(overrides))
    cli = f"{shlex.quote(python)} -m hybrid_scale.cli"
    if stage == "export":  # rank 0's work only: no launcher
        step = f"{cli} export {args}"
    elif launch.launcher == "srun":  # one task per rank; each maps SLURM_PROCID etc. to RANK etc. (srun_environment)
        port = f"$(({launch.master_port} + SLURM_JOB_ID % 1000))"  # job_port(), in the shell
        step = f"MASTER_PORT={port} srun --kill-on-bad-exit=0 {cli} {stage} {args}"
    else:  # one task per node, each starting torchrun / the deepspeed launcher (launch_command)
        step = f"srun --ntasks-per-node=1 {cli} launch {stage} {args}"
    path = template(cfg, stage)
    values = {
        "sbatch": "\n".join(sbatch_header(cfg, stage)),
        "stage": stage,
        "template": str(path),
        "workdir": shlex.quote(str(Path.cwd())),
        "setup": "\n".join(slurm.setup) if slurm.setup else "# (slurm.setup: no site set-up lines)",
        "log_dir": shlex.quote(str(run_dir / "slurm")),
        "lead": str(slurm.signal_lead_s),
        "max_restarts": str(slurm.max_restarts),
        "marker": shlex.quote(str(run_dir / REQUEUE_MARKER)),
        "step": step,
    }
    text = path.read_text()
    unknown = sorted(set(PLACEHOLDER.findall(text)) - set(values))
    if unknown:
        raise ConfigError(f"sbatch template {path}: unknown placeholder(s) {', '.join('@' + u + '@' for u in unknown)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def submit(
    cfg: Config, config_path: str | None, overrides: list[str], stages: list[str], python: str = "python"
) -> list[str]:
    """Write one sbatch script per stage under {run_dir}/slurm and submit them chained with afterok."""
    out = RunLayout.of(cfg).slurm
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
