"""benchmarks/device_speed.py (issue 51's device benchmark) as its CPU dry run: every part at toy shapes with the torch
path (no Triton, CUDA graphs, torch.compile or fla), in seconds; its table and JSON have every row the GPU run would
fill, and the scripts and the make target that start it on the device at least parse."""

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
SCRIPT = ["-m", "benchmarks.device_speed"]  # from the repository root
LENGTHS, CONTEXTS = (64, 128), (48, 96)  # the dry run's (device_speed.DRY)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_speed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout, (out / "device_speed.md").read_text(), json.loads((out / "device_speed.json").read_text())


@pytest.mark.fast
def test_the_dry_run_writes_every_row(dry_run):
    stdout, table, data = dry_run
    assert stdout.strip().splitlines()[-1].startswith("device_speed: every part ran; 0 of 0 targets missed;"), stdout
    for row in (
        "| e. bf16 kernel tests | ok |",
        "| a. prefill vs SDPA and fla | ok |",
        "| b. decode per layer, CUDA graphs | ok |",
        "| c. decode, whole model (generate) | ok |",
        "| d. 8B-shaped stage 1 and stage 2 | ok |",
        "| prefill fwd+bwd hybrid/fla, T=16384 | n/a | 1.25 | not measured |",  # the targets, every one listed
        "| decode kernel us per layer, ctx=32768 | n/a | 4 | not measured |",
        "| generate ms/token hybrid/base, ctx=1024 | n/a | 1.1 | not measured |",
        "`pytest -q -rP -p no:cacheprovider -m gpu tests/unit/test_triton_kernels_bf16.py "
        "tests/unit/test_chunk_prefill.py`",
        *(f"| {T} | {m} | " for T in LENGTHS for m in ("sdpa", "hybrid", "la_only")),
        *(f"| {T} | fla | skipped: fla: dry run: fla's kernels need CUDA |" for T in LENGTHS),
        *(f"| {c} | {m} | eager (no CUDA: no graphs) | " for c in CONTEXTS for m in ("hybrid", "kv_cache")),
        *(f"| {c} | {m} | eager | " for c in CONTEXTS for m in ("base", "hybrid")),
        "| stage 1: tokens/s (feature-map training) / MFU |",
        "| stage 1: teacher pass tokens/s / MFU |",
        "| stage 2: tokens/s / MFU |",
        *(f"| {r} | 4,194,304 | " for r in ("hedgecats", "la_only", "lolcats", "ssd")),
        "beside LoLCATs' 6.5 A100-hours",
    ):
        assert row in table, f"missing row {row!r} in\n{table}"
    assert "FAILED" not in table and "budget reached" not in table
    assert [p["status"] for p in data["parts"].values()] == ["ok"] * 5
    prefill = data["prefill"]["rows"]
    assert [(r["T"], r["method"]) for r in prefill] == [
        (T, m) for T in LENGTHS for m in ("sdpa", "hybrid", "la_only", "fla")
    ]
    for r in prefill:
        if r["method"] != "fla":
            assert r["finite"] and 0 < r["fwd_ms"] and 0 < r["fwd_bwd_ms"], r
    decode = data["decode"]["rows"]
    assert [(r["context"], r["method"]) for r in decode] == [(c, m) for c in CONTEXTS for m in ("hybrid", "kv_cache")]
    state = {(r["context"], r["method"]): r["bytes_state"] for r in decode}
    assert state[48, "hybrid"] == state[96, "hybrid"]  # the ring and the LA state: independent of the context
    assert state[96, "kv_cache"] == 2 * state[48, "kv_cache"]
    generate = data["generate"]["rows"]
    assert [(r["context"], r["model"]) for r in generate] == [(c, m) for c in CONTEXTS for m in ("base", "hybrid")]
    assert all(r["new_tokens"] == 8 and r["ms_per_token"] > 0 and not r["compiled"] for r in generate)
    ratios = data["ratios"]
    for c in CONTEXTS:
        assert ratios[f"generate ms/token hybrid/base, ctx={c}"]["value"] > 0
        assert ratios[f"decode step per layer hybrid/kv_cache, ctx={c}"]["value"] > 0
    for T in LENGTHS:
        assert ratios[f"prefill fwd+bwd hybrid/sdpa, T={T}"]["value"] > 0
    big = data["big"]
    for key in ("stage1_tokens_per_s", "stage1_mfu", "stage1_teacher_mfu", "stage2_tokens_per_s", "stage2_mfu"):
        assert math.isfinite(big[key]) and big[key] > 0, key
    assert set(big["projection"]) == {"hedgecats", "la_only", "lolcats", "ssd"}
    p = big["projection"]["ssd"]  # the 8B preset: 2048 x 1024 tokens x 2 epochs per layer; 2000 x 64 x 1024 in stage 2
    assert (p["stage1_tokens_per_layer"], p["stage2_tokens"], p["layers"]) == (4194304, 131072000, 32)
    assert data["tests"]["counts"].get("skipped", 0) > 0  # the gpu-marked kernel tests: collected, skipped on a CPU


@pytest.mark.fast
def test_the_device_scripts_parse():
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "device_speed.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("make"):
        proc = subprocess.run(["make", "-n", "device-speed"], cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and "-m benchmarks.device_speed" in proc.stdout, proc.stderr
    from tools import gpu_wheels as wheels

    assert {"fla-core", "einops"} <= {p.split("==")[0] for p in wheels.pins()}  # the baseline reaches the device
