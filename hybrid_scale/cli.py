"""`hybrid-scale`: a thin command line over the library. Each subcommand takes a config file and key=value overrides."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .config import JOBS, Config, load_config
from .distributed.requeue import EXIT_REQUEUE, Requeue
from .errors import USER_ERRORS, ConfigError

# Each subcommand imports its stage when it runs: a process imports only what its stage needs (a rank of `finetune`
# never loads the evaluation, `--help` loads no stage), which saves seconds per process start.


def cmd_config(args) -> int:
    """Print the resolved, validated config."""
    print(OmegaConf.to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_convert(args) -> int:
    """Convert model.path with the `attention` section; write a converted model to {run_dir}/converted."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(args.config, args.overrides)
    if cfg.model.path is None:
        raise ConfigError("config key 'model.path' is not set: pass model.path=/path/to/a/local/hf/model")
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"config key 'model.path': {path} is not a Hugging Face model directory (no config.json)")
    from .models.convert import convert_model
    from .models.converted import save_converted
    from .run.layout import RunLayout

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.model.dtype), local_files_only=True)
    convert_model(model, cfg.attention)
    out = save_converted(model, RunLayout.of(cfg).converted, base_path=path)
    print(f"converted model written to {out} (base weights referenced from {path.resolve()})")
    return 0


def cmd_assets(args) -> int:
    """Convert and cache the embedded default (SmolLM2-135M-Instruct, the task datasets, held-out text)."""
    from .data import assets

    a = assets.prepare(force=args.force)
    print(f"model:    {a.model}\ndatasets: {a.datasets}\ntext:     {a.train_text.parent}")
    return 0


def cmd_evaluate(args) -> int:
    """Component-ablation evaluation (the `eval` section); writes results.json, table.md and PNGs."""
    from .evaluate.report import table
    from .evaluate.stage import evaluate

    cfg = load_config(args.config, args.overrides)
    results = evaluate(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(table(results))
    return 0


def cmd_distill(args) -> int:
    """Stage 1: layer-by-layer attention transfer (the `data` and `distill` sections); resumes where it stopped."""
    from .distill.stage import distill

    out = distill(load_config(args.config, args.overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"stage 1 done: converted model in {out}")
    return 0


def cmd_finetune(args) -> int:
    """Stage 2: LoRA fine-tuning under DeepSpeed ZeRO-3 with SSD / early stopping (the `finetune` section); resumes
    from the newest committed checkpoint; exits 75 after a signal-triggered save (requeue me)."""
    from .finetune.stage import finetune

    out = finetune(load_config(args.config, args.overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"stage 2 done: {out} -> {out.resolve()}")
    return 0


def cmd_export(args) -> int:
    """Export (the `export` section): merged, self-contained Hugging Face directory (trust_remote_code), with optional
    inference-time hybridisation (export.mode=hybrid, export.gamma or export.calibrate_gamma)."""
    from .export.stage import export

    out = export(load_config(args.config, args.overrides))
    print(f"export written to {out} (load with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))")
    return 0


def cmd_plan(args) -> int:
    """Preflight: per-rank memory, buffer disk, checkpoint sizes, rough times, and blocking problems (exit 1);
    --dry-run checks stage 2's figures against the real model set up on the meta device."""
    from .preflight.plan import plan

    cfg = load_config(args.config, args.overrides)
    result = plan(cfg)
    print(result.table())
    if not args.dry_run:
        return 0 if result.ok else 1
    from .dry_run import dry_run, table

    checked = dry_run(cfg)
    print("\n" + table(checked), flush=True)
    if not result.ok:  # the dry run checks plan's figures; the run itself is still blocked (plan --dry-run && sbatch)
        print(f"plan --dry-run: exit 1: {len(result.problems)} blocking problem(s) listed above", file=sys.stderr)
        return 1
    return 0 if all(row["ok"] for stage in checked.values() for row in stage["rows"]) else 1


def cmd_pipeline(args) -> int:
    """Stage 1 -> stage 2 -> ablation evaluation -> export in one command; skips finished stages, resumes the rest."""
    from .pipeline import pipeline

    timings = pipeline(load_config(args.config, args.overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        print("pipeline done: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    return 0


def cmd_status(args) -> int:
    """What a run directory holds: the stages done, what is committed (layers, steps, eval cells), who holds its
    lock (and whether that process still runs), the last log lines. Reads only; exit 2 when RUN_DIR is not a
    directory."""
    from .run.status import NotARunDir, status

    try:
        print(status(args.run_dir))
    except NotARunDir as e:
        print(f"hybrid-scale status: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_launch(args) -> int:
    """Start a stage on this node with launch.launcher (torchrun / deepspeed), rendezvous from the Slurm environment
    (first host of the node list, port, node rank). Used by the generated sbatch scripts, one task per node."""
    from .launch.slurm import launch_command

    cfg = load_config(args.config, args.overrides)
    rest = ([args.config] if args.config else []) + list(args.overrides)
    cmd = launch_command(cfg, args.stage, rest)
    if cmd is None:
        print(f"{args.stage}: node 0 runs it; nothing to do on this node", flush=True)
        return 0
    print("+ " + " ".join(cmd), flush=True)
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def cmd_submit(args) -> int:
    """Render sbatch scripts from the config (the `slurm` and `launch` sections) and submit the stages chained with
    afterok (or the whole pipeline as one job with --pipeline); prints the job ids."""
    from .launch.slurm import submit

    cfg = load_config(args.config, args.overrides)
    stages = ["pipeline"] if args.pipeline else args.stages.split(",")
    ids = submit(cfg, args.config, list(args.overrides), stages, python=sys.executable)
    for stage, job in zip(stages, ids, strict=True):
        print(f"{stage}: job {job}")
    return 0


def cmd_quickstart(args) -> int:
    """The whole pipeline on the embedded default, CPU, tiny budgets (configs/quickstart.yaml + overrides)."""
    from . import quickstart

    return quickstart.main(args.run_dir, args.overrides)


SECTIONS = ("model", "attention", "data", "distill", "finetune", "eval", "export", "launch", "slurm")
# where each command's code lives; the sections it reads are found in that code (`cfg.<section>`), not kept by hand
CODE = {
    "distill": ("distill",),
    "finetune": ("finetune",),
    "evaluate": ("evaluate",),
    "export": ("export",),
    "pipeline": ("distill", "finetune", "evaluate", "export", "pipeline.py"),
    "plan": ("preflight",),
}
OWN = {"config": SECTIONS, "convert": ("model", "attention"), "launch": ("launch",), "submit": ("launch", "slurm")}


def sections_read(command: str) -> tuple[str, ...]:
    """The config sections a command reads: those its code names as `cfg.<section>` (a stage's preflight also
    reads `launch`), or the command's own (config: all; convert: the model and its attention; launch / submit)."""
    if command not in CODE:
        return OWN.get(command, ())
    root = Path(__file__).parent
    files = [
        p for home in CODE[command] for p in ([root / home] if home.endswith(".py") else (root / home).glob("*.py"))
    ]
    text = "".join(p.read_text() for p in files)
    found = set(re.findall(r"\bcfg\.(" + "|".join(SECTIONS) + r")\b", text)) | {"launch"}
    return tuple(s for s in SECTIONS if s in found)


@functools.cache
def _schema():
    return OmegaConf.structured(Config)  # ~0.1 s: built once, not once per subcommand


def _keys_epilog(command: str) -> str:
    schema = _schema()
    parts = [f"  {section}: {', '.join(schema[section].keys())}" for section in sections_read(command)]
    return (
        "config keys it reads (YAML or key=value), besides run_dir and seed (`hybrid-scale config` prints their "
        "values, docs/reference/config.md says what each does):\n" + "\n".join(parts)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-scale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (
        ("config", cmd_config),
        ("plan", cmd_plan),
        ("convert", cmd_convert),
        ("evaluate", cmd_evaluate),
        ("distill", cmd_distill),
        ("finetune", cmd_finetune),
        ("export", cmd_export),
        ("pipeline", cmd_pipeline),
    ):
        p = sub.add_parser(
            name,
            help=fn.__doc__,
            description=fn.__doc__,
            epilog=_keys_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("config", nargs="?", help="YAML config file (optional)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. attention.window=32")
        if name == "plan":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="also set up stage 2 at the model's real size as rank 0 of the configured mesh, on the meta "
                "device under torch's fake process group, step it once, and compare its per-rank bytes, collectives "
                "and checkpoint bytes with the plan's (exit 1 when they differ by over 10%%)",
            )
        p.set_defaults(fn=fn)
    p = sub.add_parser("launch", help=cmd_launch.__doc__, description=cmd_launch.__doc__)
    p.add_argument("stage", choices=JOBS)
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(fn=cmd_launch)
    p = sub.add_parser(
        "submit",
        help=cmd_submit.__doc__,
        description=cmd_submit.__doc__,
        epilog=_keys_epilog("submit"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--stages", default="distill,finetune,evaluate,export", help="comma-separated, chained afterok")
    p.add_argument("--pipeline", action="store_true", help="one job running the whole pipeline")
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser("status", help=cmd_status.__doc__, description=cmd_status.__doc__)
    p.add_argument("run_dir", help="the run directory (run_dir of the config)")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("assets", help=cmd_assets.__doc__, description=cmd_assets.__doc__)
    p.add_argument("--force", action="store_true", help="redo the conversion and copies")
    p.set_defaults(fn=cmd_assets)
    p = sub.add_parser("quickstart", help=cmd_quickstart.__doc__, description=cmd_quickstart.__doc__)
    p.add_argument("--run-dir", default=None, help="default: runs/quickstart")
    p.add_argument("overrides", nargs="*", help="key=value overrides of configs/quickstart.yaml")
    p.set_defaults(fn=cmd_quickstart)
    return parser


def _launcher_args(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N; torchrun-style env (LOCAL_RANK) is what the stages read."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a.startswith(("--local_rank", "--local-rank")):
            value = a.split("=", 1)[1] if "=" in a else argv[i + 1]
            skip = "=" not in a
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(a)
    return out


NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0")


def name_accelerator() -> None:
    """On a machine with no NVIDIA device, name DeepSpeed's accelerator (DS_ACCELERATOR=cpu, unless set): its
    detection, which transformers reaches through accelerate while it loads any model, logs '[WARNING] Setting
    accelerator to CPU' otherwise. Reads no torch (a command that only parses a config imports none)."""
    if "DS_ACCELERATOR" not in os.environ and not any(Path(p).exists() for p in NVIDIA_DEVICES):
        os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_launcher_args(sys.argv[1:] if argv is None else list(argv)))
    if getattr(args, "config", None) and "=" in args.config:  # only overrides were given
        args.overrides, args.config = [args.config, *args.overrides], None
    name_accelerator()
    try:
        return args.fn(args)
    except Requeue as e:  # finetune, pipeline, quickstart: saved on a signal; the batch script requeues on this code
        print(f"hybrid-scale {args.command}: {e}", file=sys.stderr)
        return EXIT_REQUEUE
    except USER_ERRORS as e:
        print(f"hybrid-scale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a missing or unreadable path, a full disk: one line, what was committed stays
        print(f"hybrid-scale {args.command}: error: {os_error(e)}", file=sys.stderr)
        return 2


def os_error(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    what = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        return (
            f"no space left on the device{where}: the work committed before it is kept; free space there or point "
            "run_dir / distill.buffer_dir / export.out_dir at a larger disk, and run the same command again"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"{what}{where}: make it readable (and writable where the stage writes) for this user, or choose "
            "another path"
        )
    if e.errno == errno.ENOENT:
        return f"{what}{where}: check the path in the config"
    return f"{what}{where}"


if __name__ == "__main__":
    sys.exit(main())
