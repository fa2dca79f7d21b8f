"""The pipeline check's part e, the kernels' own benchmark: benchmarks/attention/kernels.py (the Triton kernels vs SDPA,
FlashAttention and the torch path; prefill and decode) run as a child within GPU_CHECK_KERNEL_BUDGET seconds; its
kernel_speed.md/json land beside the report, whose section e (`section`) quotes its tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.device.run import Run, run_child


def kernel_speed(run: Run, reserve: int = 0) -> dict:
    s, out = run.cfg, run.out
    cmd = [sys.executable, "-m", "benchmarks.run", "kernels", "--budget", str(s["kernel_budget"])]
    cmd += ["--out", str(out), *(["--small"] if s["small"] else ["--device", s["device"], "--dtype", s["dtype"]])]
    rc, stdout, err, _ = run_child(cmd, "kernel_speed", run.log, s["kernel_budget"] + 120, reserve=reserve)
    print(stdout[-4000:], end="", flush=True)
    if rc != 0:
        tail = (stdout + err).strip()[-2000:]
        raise RuntimeError(f"benchmarks.run kernels failed (exit {rc}); its output ends with:\n{tail}")
    return json.loads((out / "kernel_speed.json").read_text())


def section(d: dict, out: Path) -> list[str]:
    """benchmarks/attention/kernels.py's own tables (kernel_speed.md in `out`) under the check's heading."""
    kernel_md = out / "kernel_speed.md"
    if not d.get("kernel_speed") or not kernel_md.is_file():
        return []
    lines = ["## e. Fused Triton kernels (benchmarks/attention/kernels.py)", ""]
    return lines + [line for line in kernel_md.read_text().splitlines()[1:] if not line.startswith("Command:")]
