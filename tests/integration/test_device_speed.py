"""The device harness's speed benchmark (benchmarks/device/speed.py, issues 51 and 60) as its CPU dry run: every part
at toy shapes with the torch path (no Triton, CUDA graphs, torch.compile or fla), in seconds, in the order the GPU run
takes them; its table and JSON have every row the GPU run would fill; a row its budget leaves out says why; and the
pieces that only a GPU exercises fully are checked here on their own: fla's autotuners trimmed, DEVICE_SPEED_TILES
parsed, generate's recompile counting, the gradient test's printed errors read back into the table. The scripts and
the make target that start it on the device at least parse."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.device", "speed"]  # from the repository root
LENGTHS, CONTEXTS = (64, 128), (48, 96)  # the dry run's (benchmarks/device/settings.py, DRY)
PARTS = ["grad", "prefill", "profile", "tiles", "decode", "generate", "big", "tests"]
TILES = "a:warps=8,stages=2;b:dchunk=64;c:nosuch=1"
GRADIENTS = "tests/unit/test_triton_kernels_bf16.py::test_bf16_gradients_at_the_llama3_8b_shape"


def dry_run(out: Path, **env) -> tuple[str, str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
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


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("device_speed"), DEVICE_SPEED_TILES=TILES)


def test_the_dry_run_writes_every_row_in_the_issues_order(whole):
    stdout, table, data = whole
    assert stdout.strip().splitlines()[-1].startswith("device_speed: every part ran; 0 of 0 targets missed;"), stdout
    assert list(data["parts"]) == PARTS and all(p["status"] == "ok" for p in data["parts"].values())
    for row in (
        "| grad: 1. bf16 gradients: triton_hybrid_attention vs the fp32 chunked path | ok |",
        "| prefill: 2. prefill vs SDPA and fla | ok |",
        "| tests: 6. gpu-marked tests, chunked path first | ok |",
        "| prefill fwd+bwd hybrid/fla, T=16384 | n/a | 1.25 | not measured |",  # the targets, every one listed
        "| decode kernel us per layer, ctx=32768 | n/a | 4 | not measured |",
        "| generate: dynamo recompiles after the first decode step (every row) | n/a | 0 | not measured |",
        "| generate: CUDA-graph skips (every row) | n/a | 0 | not measured |",
        "| all |  | skipped: no gradient measured (the test was skipped or cut) |",  # (a GPU's: a row per tensor)
        *(f"| {T} | {m} | " for T in LENGTHS for m in ("sdpa", "hybrid", "la_only")),
        *(f"| {T} | fla | skipped: fla: dry run: fla's kernels need CUDA |" for T in LENGTHS),
        "hybrid fwd+bwd, T=64: 2 profiled calls",
        "hybrid decode step, context 48: 2 profiled calls",
        "| a | warps=8, stages=2 | 64 | ",
        "| c | nosuch=1 | 64 | skipped: unknown settings nosuch (known: ",
        *(f"| {c} | {m} | eager (no CUDA: no graphs) | " for c in CONTEXTS for m in ("hybrid", "kv_cache")),
        *(f"| {c} | {m} | eager | " for c in CONTEXTS for m in ("base", "hybrid")),
        "| stage 1: tokens/s (feature-map training) / MFU |",
        "| stage 2: tokens/s / MFU |",
        *(f"| {r} | 4,194,304 | " for r in ("hedgecats", "la_only", "lolcats", "ssd")),
        "beside LoLCATs' 6.5 A100-hours",
    ):
        assert row in table, f"missing row {row!r} in\n{table}"
    assert "FAILED" not in table and "spent" not in table


def test_each_part_keeps_its_figures(whole):
    _, _, data = whole
    grad = data["grad"]  # the gradient test, both modes collected (and skipped on a CPU), nothing else
    assert grad["order"] == [GRADIENTS] and grad["counts"] == {"skipped": 2} and grad["rows"] == [], grad
    prefill = data["prefill"]
    assert set(prefill["warm"]) == {"sdpa", "hybrid", "la_only"} and prefill["warm_T"] == 32
    assert [(r["T"], r["method"]) for r in prefill["rows"]] == [
        (T, m) for T in LENGTHS for m in ("sdpa", "hybrid", "la_only", "fla")
    ]
    for r in prefill["rows"]:
        if r["method"] != "fla":
            assert r["finite"] and 0 < r["fwd_ms"] and 0 < r["fwd_bwd_ms"] and r["fwd_bwd_x_sdpa"] > 0, r
    for key in ("fwd_bwd", "decode"):
        assert data["profile"][key]["total_us"] > 0 and data["profile"][key]["rows"]
    tiles = data["tiles"]
    assert tiles["where"] and [r["variant"] for r in tiles["rows"]] == ["default", "a", "b", "c"]
    assert all(r["fwd_bwd_x_default"] > 0 for r in tiles["rows"][:3])
    decode = data["decode"]["rows"]
    assert [(r["context"], r["method"]) for r in decode] == [(c, m) for c in CONTEXTS for m in ("hybrid", "kv_cache")]
    state = {(r["context"], r["method"]): r["bytes_state"] for r in decode}
    assert state[48, "hybrid"] == state[96, "hybrid"]  # the ring and the LA state: independent of the context
    assert state[96, "kv_cache"] == 2 * state[48, "kv_cache"]
    generate = data["generate"]["rows"]
    assert [(r["context"], r["model"]) for r in generate] == [(c, m) for c in CONTEXTS for m in ("base", "hybrid")]
    for r in generate:
        assert r["new_tokens"] == 8 and r["ms_per_token"] > 0 and not r["compiled"]
        assert (r["dynamo_graphs"], r["recompiles"], r["cudagraph_skips"]) == (0, 0, 0)
    ratios = data["ratios"]
    for c in CONTEXTS:
        assert ratios[f"generate ms/token hybrid/base, ctx={c}"]["value"] > 0
        assert ratios[f"decode step per layer hybrid/kv_cache, ctx={c}"]["value"] > 0
    for T in LENGTHS:
        assert ratios[f"prefill fwd+bwd hybrid/sdpa, T={T}"]["value"] > 0
    big = data["big"]
    for key in ("stage1_tokens_per_s", "stage1_mfu", "stage1_teacher_mfu", "stage2_tokens_per_s", "stage2_mfu"):
        assert math.isfinite(big[key]) and big[key] > 0, key
    p = big["projection"]["ssd"]  # the 8B preset: 2048 x 1024 tokens x 2 epochs per layer; 2000 x 64 x 1024 in stage 2
    assert (p["stage1_tokens_per_layer"], p["stage2_tokens"], p["layers"]) == (4194304, 131072000, 32)
    tests = data["tests"]
    assert tests["counts"].get("skipped", 0) > 0  # the gpu-marked tests: collected, skipped on a CPU
    assert f"--deselect {GRADIENTS}" in tests["command"]  # (part grad ran it)
    order = tests["order"]  # the chunked kernels' first, fla's gated delta rule, the bf16 file last
    assert "test_chunk" in order[0] and order[-2:] == [
        "tests/unit/test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu",
        "tests/unit/test_triton_kernels_bf16.py",
    ]


def test_a_spent_budget_skips_rows_and_says_why(tmp_path):
    """With no time for the prefill's rows, the warm-up still runs and every row says what ran out."""
    _, table, data = dry_run(tmp_path, DEVICE_SPEED_PARTS="prefill", DEVICE_SPEED_BUDGETS="prefill=0")
    rows = data["prefill"]["rows"]
    assert len(rows) == 8 and set(data["prefill"]["warm"]) == {"sdpa", "hybrid", "la_only"}
    for r in rows:
        want = "fla: dry run" if r["method"] == "fla" else f"T={r['T']}'s share of the prefill budget (0 s) spent"
        assert r["skipped"].startswith(want), r
    assert list(data["parts"]) == ["prefill"] and "| 128 | hybrid | skipped: T=128's share" in table


def test_fla_autotuners_are_trimmed_to_the_configs_that_fit():
    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from benchmarks import baselines

    tuner = Autotuner.__new__(Autotuner)  # (its configs are all the trimming touches)
    tuner.configs = [
        triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk in (32, 64)
        for bv in (32, 64)
        for w in (1, 2, 4, 8)
        for s in (2, 3, 4)
    ]
    module = types.ModuleType("fla.ops.planted_for_test")
    module.kernel = types.SimpleNamespace(fn=tuner)  # under a heuristics wrapper, as fla's chunk_fwd_kernel_h
    sys.modules[module.__name__] = module
    try:
        assert baselines.trim_autotune(("fla.ops.planted_for_test",), 2) == {"fla.ops.planted_for_test.kernel": [48, 2]}
    finally:
        del sys.modules[module.__name__]
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in tuner.configs] == [
        ({"BK": 32, "BV": 32}, 4, 2),
        ({"BK": 64, "BV": 64}, 4, 2),
    ]


def test_fla_inputs_are_its_layout_and_its_log_decay():
    from benchmarks import baselines
    from benchmarks.registry import inputs

    x = inputs(dict(H=4, Hkv=2, D=8, F=16), 24)
    z = baselines.fla_inputs(x, torch.tensor([0.1, 0.2]))
    assert {n: tuple(t.shape) for n, t in z.items()} == {
        "fq": (1, 24, 4, 16),
        "fk": (1, 24, 4, 16),
        "v": (1, 24, 4, 8),
        "g_gamma": (4,),
    }
    assert torch.allclose(z["g_gamma"], torch.tensor([-0.1, -0.1, -0.2, -0.2]))
    assert torch.equal(z["fk"][0, :, 1], x["fk"][0, 0]) and torch.equal(z["fk"][0, :, 2], x["fk"][0, 1])


def test_tile_variants_parse_or_say_what_is_wrong():
    from benchmarks.device.settings import parse_tiles

    assert parse_tiles(" a:warps=8,stages=2 ; b:dchunk=64;") == {"a": {"warps": 8, "stages": 2}, "b": {"dchunk": 64}}
    assert parse_tiles("") == {}
    for bad, says in (("warps=8", "NAME:key=value"), ("a:warps=x", "'warps=x' in 'a:warps=x' is not key=integer"),
                      ("default:warps=8", "not 'default'"), ("a:", "changes nothing")):  # fmt: skip
        with pytest.raises(SystemExit, match=says):
            parse_tiles(bad)


def test_the_gradient_tests_errors_are_read_back_into_rows():
    """What the gpu-marked gradient test prints (grad_line), as pytest -rP repeats it, read back per mode: each tensor's
    error and tolerance, and the tensors over it (NaN among them)."""
    from benchmarks.device.tests import grad_line, grad_rows

    tol = {"y": 2e-2, "q": 5e-2, "gamma": 5e-2}
    hybrid = grad_line("hybrid", 4096, {"y": 6.5e-3, "q": 0.07, "gamma": float("nan")}, tol)
    la_only = grad_line("la_only", 4096, {"y": 1e-3, "q": 0.0, "gamma": 0.05}, tol)
    rows = grad_rows("\n".join([hybrid, "PASSED", f"  {hybrid}", la_only, "1 passed"]))
    assert [(r["mode"], r["T"], r["failed"]) for r in rows] == [("hybrid", 4096, ["gamma", "q"]), ("la_only", 4096, [])]
    assert rows[1]["errors"] == {"y": 1e-3, "q": 0.0, "gamma": 0.05} and rows[1]["tolerances"] == tol


def test_generate_counts_recompiles_and_when_they_came():
    """CompileWatch on a function compiled for CPU: a recompile before the first decode step (one token stamped) and
    one after it; CUDA-graph skips stay 0 (no CUDA graphs here)."""
    from benchmarks.device.generate import CompileWatch, Stamp

    @torch.compile(backend="eager", dynamic=False)
    def f(x):
        return x * 2

    torch._logging.set_logs(recompiles=True)
    try:
        stamp = Stamp(cuda=False)
        with CompileWatch(stamp) as watch:
            f(torch.ones(3))  # the first compile: not a recompile
            stamp(None, None)
            f(torch.ones(4))  # one token stamped: the first decode step's
            stamp(None, None)
            f(torch.ones(5))  # after it: a recompile the decode should not have
    finally:
        torch._logging.set_logs()
    got = watch.figures
    assert (got["dynamo_graphs"], got["recompiles"], got["recompiles_after_first_step"]) == (3, 2, 1), got
    assert got["cudagraph_skips"] == 0 and "size mismatch" in got["recompile_reasons"][0]["reason"]


def test_the_device_scripts_parse():
    for script in (ROOT / "benchmarks" / "device.sh", ROOT / "benchmarks" / "device_speed.sh"):  # the driver, alias
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    alias = (ROOT / "benchmarks" / "device_speed.sh").read_text()  # the one driver's speed benchmark
    assert 'exec bash "$(dirname "$0")/device.sh" speed "$@"' in alias
    if shutil.which("make"):
        proc = subprocess.run(["make", "-n", "device-speed"], cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and "-m benchmarks.device speed" in proc.stdout, proc.stderr
    from tools import gpu_wheels as wheels

    assert {"fla-core", "einops"} <= {p.split("==")[0] for p in wheels.pins()}  # the baseline reaches the device
