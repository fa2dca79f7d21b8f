"""The device harness's entry point, from the repository root: `python -m benchmarks.device speed|check [--dry-run]
[--out DIR]` (`--help` after the harness's name prints what it runs and the environment that changes it);
benchmarks/device.sh runs it on the GPU machine. Also `--part NAME --work DIR --json FILE`: one part of a harness in
its own process (run.py's child_part starts it; the harness's CHILDREN answer it)."""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from benchmarks.device import check, speed
from benchmarks.device.settings import check_settings, speed_settings

HARNESSES = {"speed": (speed, speed_settings, "DEVICE_SPEED_"), "check": (check, check_settings, "GPU_CHECK_")}
INTERNAL = ("GPU_CHECK_WORK",)  # (a path of this run, not a setting)


def command_line(prefix: str, argv: list[str]) -> str:
    """The command as the report records it: device.sh's (DEVICE_COMMAND), else this one with its settings."""
    if os.environ.get("DEVICE_COMMAND"):
        return os.environ["DEVICE_COMMAND"]
    keys = sorted(k for k in os.environ if k.startswith(prefix) and k not in INTERNAL)
    settings = [f"{k}={shlex.quote(os.environ[k])}" for k in keys]
    return " ".join([*settings, "python -m benchmarks.device", *map(shlex.quote, argv)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harnesses = parser.add_subparsers(dest="harness", required=True)
    for name, (module, _, _) in HARNESSES.items():
        sub = harnesses.add_parser(
            name, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sub.add_argument("--dry-run", action="store_true", help="CPU, toy sizes (seconds to minutes)")
        sub.add_argument("--out", help=f"folder of {module.NAME}.md/.json (default: $OUT, else docs/results)")
        sub.add_argument("--part", choices=sorted(module.CHILDREN), help=argparse.SUPPRESS)
        sub.add_argument("--work", help=argparse.SUPPRESS)
        sub.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    module, settings, prefix = HARNESSES[args.harness]
    if args.part:  # a part in its own process
        result = module.CHILDREN[args.part](settings(args.dry_run), Path(args.work))
        Path(args.json).write_text(json.dumps(result, default=str))
        return 0
    args.command = command_line(prefix, sys.argv[1:] if argv is None else argv)
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
