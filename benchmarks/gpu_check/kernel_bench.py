"""Step e, the kernels' own benchmark: benchmarks/kernel_speed.py (the fused Triton kernels vs SDPA, FlashAttention
and the torch path; prefill and decode) run as a child within GPU_CHECK_KERNEL_BUDGET seconds; its
kernel_speed.md/json land beside the report, whose section e quotes its tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import Log, run_child
from .settings import ROOT


def kernel_speed(s: dict, out: Path, log: Log, reserve: int = 0) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_speed.py"), "--budget", str(s["kernel_budget"])]
    cmd += ["--out", str(out), *(["--small"] if s["small"] else ["--device", s["device"], "--dtype", s["dtype"]])]
    rc, stdout, err, _ = run_child(cmd, "kernel_speed", log, s["kernel_budget"] + 120, reserve=reserve)
    print(stdout[-4000:], end="", flush=True)
    if rc != 0:
        tail = (stdout + err).strip()[-2000:]
        raise RuntimeError(f"kernel_speed.py failed (exit {rc}); its output ends with:\n{tail}")
    return json.loads((out / "kernel_speed.json").read_text())
