"""Step e, the kernels' own benchmark: benchmarks/attention/kernels.py (the Triton kernels vs SDPA, FlashAttention
and the torch path; prefill and decode) run as a child within GPU_CHECK_KERNEL_BUDGET seconds; its
kernel_speed.md/json land beside the report, whose section e quotes its tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import Log, run_child


def kernel_speed(s: dict, out: Path, log: Log, reserve: int = 0) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.run", "kernels", "--budget", str(s["kernel_budget"])]
    cmd += ["--out", str(out), *(["--small"] if s["small"] else ["--device", s["device"], "--dtype", s["dtype"]])]
    rc, stdout, err, _ = run_child(cmd, "kernel_speed", log, s["kernel_budget"] + 120, reserve=reserve)
    print(stdout[-4000:], end="", flush=True)
    if rc != 0:
        tail = (stdout + err).strip()[-2000:]
        raise RuntimeError(f"benchmarks.run kernels failed (exit {rc}); its output ends with:\n{tail}")
    return json.loads((out / "kernel_speed.json").read_text())
