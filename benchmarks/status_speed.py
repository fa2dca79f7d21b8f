"""How fast `hybrid-scale status` answers on a login node, timed here rather than asserted in a test (issue 65, item
7; tests/unit/test_lock.py checks only that it imports no torch): a fresh interpreter imports the CLI and answers
`status` of a run directory, `--repeats` times; printed: whether torch was imported, the seconds inside the
interpreter (the import and the answer; the target: under 1 s) and the wall time of the whole process (the
interpreter's own start-up included), the median of the repeats.

    python -m benchmarks.status_speed [--repeats 5]        (make status-speed)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = (
    "import sys, time; t = time.perf_counter(); from hybrid_scale.cli import main; "
    "rc = main(['status', sys.argv[1]]); print('torch' in sys.modules, rc, time.perf_counter() - t)"
)


def status_in_a_fresh_interpreter(run: Path) -> dict:
    """`hybrid-scale status RUN` in a fresh interpreter: torch_imported, rc, inside_s (import and answer), wall_s."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CODE, str(run)], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"status failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    torch_imported, rc, inside = lines[-1].split()
    return dict(torch_imported=torch_imported == "True", rc=int(rc), inside_s=float(inside), wall_s=wall)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        (run / "stage1").mkdir(parents=True)
        results = [status_in_a_fresh_interpreter(run) for _ in range(args.repeats)]
    inside = statistics.median(r["inside_s"] for r in results)
    wall = statistics.median(r["wall_s"] for r in results)
    torch_imported = any(r["torch_imported"] for r in results)
    print(f"status_speed: torch imported: {torch_imported}; median of {args.repeats}: {inside:.3f} s inside the "
          f"interpreter (target < 1 s), {wall:.3f} s wall with its start-up")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
