"""The GPU check's entry point: `python benchmarks/gpu_check [--help]` (from benchmarks/ also `python -m
gpu_check`); bash benchmarks/gpu_check.sh runs it on the GPU machine. The package's docstring (gpu_check/__init__.py,
what --help prints) describes the steps and the GPU_CHECK_* variables; settings.py and common.py hold what the steps
share, build.py, pipeline.py, big.py, attention.py, kernel_bench.py and report.py steps a-f, driver.py their
order and the child processes."""

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/gpu_check`: benchmarks/ on sys.path in place of this folder (the
    # package importable, and kernel_speed for step d; the modules here are never top-level names)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from gpu_check.driver import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
