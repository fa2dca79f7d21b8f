"""The GPU check's entry point: `python -m benchmarks.gpu_check [--help]` from the repository root; bash
benchmarks/gpu_check.sh runs it on the GPU machine. The package's docstring (gpu_check/__init__.py,
what --help prints) describes the steps and the GPU_CHECK_* variables; settings.py and common.py hold what the steps
share, build.py, pipeline.py, big.py, attention.py, kernel_bench.py and report.py steps a-f, driver.py their
order and the child processes."""

import sys

from benchmarks.gpu_check.driver import main

if __name__ == "__main__":
    sys.exit(main())
