"""The device harness's pipeline check (the GPU check, benchmarks/device/check.py) end to end on the CPU at toy sizes
(everything but the GPU itself): the gpu-marked tests collected, the tiny model and its byte-level tokenizer, the
pipeline through the CLI in bfloat16 checked against float32, the 1B-shaped timing at a toy shape, attention vs SDPA;
and `make gpu-wheels` / device.sh / gpu_check.sh / the harness's --help at least parse."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.device", "check"]  # from the root: the package's __main__.py


def _numbers(x):
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)


METHODS = ("triton", "torch", "sdpa")  # kernel_speed's prefill methods here (flash_attn is not installed)


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """About 70 s: the device script runs as one program on a device machine with a short, costly budget, so every
    part of it (the pipeline through the CLI, the shaped timings, the comparisons, the report) must run here first,
    in one process as it will there; the parts alone are tested faster elsewhere, their wiring only here."""
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_DTYPE": "bfloat16",
        "GPU_CHECK_REF_DEVICE": "cpu",
        "GPU_CHECK_REF_DTYPE": "float32",
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "OMP_NUM_THREADS": "1",
        "GPU_CHECK_DEADLINE": "850",
        # step e checks that every measurement it plans was made: room for a loaded machine (it takes ~40 s idle)
        "GPU_CHECK_KERNEL_BUDGET": "400",
    }
    cmd = [sys.executable, *SCRIPT, "--dry-run", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: PASSED; steps tests ok, a ok, b ok, c ok, d ok, e ok;"), last
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    for row in (
        "| tests: gpu-marked tests: the compiled kernels against the spec | ok |",
        "| a: build the tiny model, tokenizer and task data | ok |",
        "| b: pipeline via the CLI, checked vs reference | ok |",
        "| c: 1B-shaped stage-1 layer and stage-2 step | ok |",
        "| d: hybrid attention vs SDPA | ok |",
        "| e: Triton kernels vs SDPA: prefill and decode | ok |",
        "## e. Fused Triton kernels (benchmarks/attention/kernels.py)",
        "| tiny | 80 | triton |",
        "| tiny | 72 | kv_cache |",
        "| stage 1 final loss, layer 0 |",
        "| stage 1 final loss, layer 1 |",
        "| stage 2 held-out loss, hybrid |",
        "| stage 2 held-out loss, la_only |",
        "| perplexity la_only 16-64 |",
        "| perplexity hybrid 64-128 |",
        "| export held-out loss (trust_remote_code load) |",
        "| stage 1: s per layer (",
        "| stage 2: s per optimizer step (",
        "| 512 | chunk |",
        "| 512 | naive |",
        "| 512 | sdpa |",
    ):
        assert row in table, f"missing row {row!r} in\n{table}"
    assert "FAILED" not in table
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["tests"]["counts"].get("skipped", 0) > 0 and not data["tests"].get("failed")  # collected, skipped here
    assert data["compare"] and all(r["status"] == "ok" for r in data["compare"])
    assert all(math.isfinite(r[k]) for r in data["compare"] for k in ("value", "ref", "rel"))
    assert len(data["checks"]) == 8 and all(r["status"] == "ok" for r in data["checks"])
    collectives = [r for r in data["checks"] if "collectives" in r["check"]]
    assert len(collectives) == 2 and all(r["value"] > 0 for r in collectives)  # ZeRO-3's gathers, on the cpu
    big = data["big"]
    assert big["stage1_layer_timing"] == "distill.transfer per layer" and len(big["stage1_layer_s"]) == 2
    assert len(big["stage2_step_s"]) == 3
    attention = data["attention"]["rows"]
    measured = {(r["T"], r["backend"]) for r in attention}
    assert measured >= {(T, b) for T in (256, 512) for b in ("sdpa", "chunk", "naive")}
    for r in attention:
        assert r["finite"] and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
    kernel = data["kernel_speed"]
    assert [(r["T"], r["method"]) for r in kernel["prefill"]] == [(T, m) for T in (48, 80) for m in METHODS]
    assert all(r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in kernel["prefill"])
    decode = {(r["context"], r["method"]): r["bytes_per_step"] for r in kernel["decode"]}
    assert decode[40, "triton"] == decode[72, "triton"] == decode[72, "torch"]  # the ring and state: context-free
    assert decode[72, "kv_cache"] == 72 / 40 * decode[40, "kv_cache"]
    assert kernel["self_check"] is None
    assert "Self-check of the kernels against the torch path (what attention.backend=auto relies on): passed" in table
    for section in ("big", "attention", "build"):
        assert all(math.isfinite(x) for x in _numbers(data[section])), section


def test_gpu_wheels_target_and_script_parse():
    if shutil.which("make"):
        proc = subprocess.run(["make", "-n", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "-m tools.gpu_wheels --dest .whl" in proc.stdout
        proc = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and "-m benchmarks.device check" in proc.stdout, proc.stderr
    for script in (ROOT / "benchmarks" / "device.sh", ROOT / "benchmarks" / "gpu_check.sh"):  # the driver, its alias
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    alias = (ROOT / "benchmarks" / "gpu_check.sh").read_text()  # the one driver's pipeline check
    assert 'exec bash "$(dirname "$0")/device.sh" check "$@"' in alias
    proc = subprocess.run([sys.executable, *SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "GPU_CHECK_DEADLINE" in proc.stdout, proc.stderr
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()
    from tools import gpu_wheels as wheels

    pins = wheels.pins()  # every package the device lacks is installed here, at one version each
    names = [p.split("==")[0] for p in pins]
    assert {"deepspeed", "omegaconf", "datasets", "pydantic"} <= set(names) and len(set(names)) == len(names)
