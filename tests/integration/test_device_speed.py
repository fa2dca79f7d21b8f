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
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.device", "speed"]  # from the repository root
LENGTHS, CONTEXTS = (64, 128), (48, 96)  # the dry run's (benchmarks/device/settings.py, DRY)
PARTS = ["grad", "delta", "prefill", "tiles", "decode", "profile", "tests", "generate", "big"]
TILES = "a:warps=8,stages=2;b:dchunk=64;c:nosuch=1"
GRADIENTS = "tests/unit/test_triton_kernels_bf16.py::test_bf16_gradients_at_the_llama3_8b_shape"
GATED_DELTA = "tests/unit/test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu"


def dry_env(**env) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    env.pop("OUT", None)
    return env


def dry_run(out: Path, **env) -> tuple[str, str, dict]:
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=dry_env(**env),
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
        "| grad: 1a. bf16 gradients: triton_hybrid_attention vs the fp32 chunked path | ok |",
        "| delta: 1b. fla's gated delta rule vs the torch form | ok |",
        "| prefill: 2. prefill vs SDPA and fla | ok |",
        "| decode: 3. decode throughput, a batch of sequences, CUDA graphs | ok |",
        "| profile: 4. profiler: hybrid fwd+bwd and one decode step, one pass | ok |",
        "| tests: 5. gpu-marked tests, chunked path first | ok |",
        "| prefill fwd+bwd hybrid/fla, T=16384 | n/a | at most 1.25 | not measured |",  # the targets, every one listed
        "| decode tokens/s hybrid/kv_cache, B=32, ctx=32768 | n/a | at least 4 | not measured |",
        "| generate: dynamo recompiles after the first decode step (every row) | n/a | at most 0 | not measured |",
        "| generate: CUDA-graph skips (every row) | n/a | at most 0 | not measured |",
        "| all |  | skipped: no gradient measured (the test was skipped or cut) |",  # (a GPU's: a row per tensor)
        "Tested: `naive` (dry run: fla's Triton kernel needs CUDA; the spec loop (gated_delta/naive.py) stands in",
        "| dinitial_state | ",
        *(f"| {T} | {m} | " for T in LENGTHS for m in ("sdpa", "hybrid", "la_only")),
        *(f"| {T} | fla | skipped: fla: dry run: fla's kernels need CUDA |" for T in LENGTHS),
        "hybrid fwd+bwd, T=64: 2 profiled calls",
        "hybrid decode step, B=4, 2 layers: 2 profiled calls",
        "| a | warps=8, stages=2 | 64 | ",
        "| c | nosuch=1 | 64 | skipped: unknown settings nosuch (known: ",
        *(f"| kv_cache | {c} | 4 | eager (no CUDA: no graphs) | " for c in CONTEXTS),
        "| hybrid | any | 4 | eager (no CUDA: no graphs) | ",
        *(f"| {m} | {c} | fit: " for m, c in (("kv_cache", 96), ("hybrid", "any"))),
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
    delta = data["delta"]  # the spec loop standing in for fla (no CUDA), against the chunked torch form
    assert (delta["tested"], delta["self_check"], delta["auto"], delta["over"]) == ("naive", None, "chunk", [])
    assert list(delta["errors"]) == ["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"]
    assert all(0 <= e < 1e-5 for e in delta["errors"].values()), delta["errors"]
    decode = data["decode"]["rows"]
    assert [(r["method"], r["context"], r["fit"]) for r in decode] == [
        *(("kv_cache", c, False) for c in CONTEXTS), ("kv_cache", 96, True), ("hybrid", None, False),
        ("hybrid", None, True)]  # fmt: skip
    kv48, kv96, kv_fit, hybrid, hybrid_fit = decode
    assert kv96["bytes_per_sequence"] == 2 * kv48["bytes_per_sequence"]  # the KV cache grows with the context
    assert hybrid["bytes_per_sequence"] < kv96["bytes_per_sequence"]
    for measured, fit in ((kv96, kv_fit), (hybrid, hybrid_fit)):  # the dry run's 24 MiB stand-in, allocated
        assert measured["batch"] == 4 and measured["tokens_per_s"] > 0 and measured["transient_per_sequence"] is None
        assert fit["free_bytes"] == 24 * 2**20 and fit["bytes_per_sequence"] == measured["bytes_per_sequence"]
        assert fit["batch"] == int(fit["free_bytes"] // fit["bytes_per_sequence"]) > 4 and fit["allocated"], fit
        per = measured["bytes_per_sequence"]  # (a cache at that batch; the state has a few bytes not per sequence)
        assert fit["allocated_bytes"] == pytest.approx(fit["batch"] * per, rel=1e-3)
    generate = data["generate"]["rows"]
    assert [(r["context"], r["model"]) for r in generate] == [(c, m) for c in CONTEXTS for m in ("base", "hybrid")]
    for r in generate:
        assert r["new_tokens"] == 8 and r["ms_per_token"] > 0 and not r["compiled"]
        assert (r["dynamo_graphs"], r["recompiles"], r["cudagraph_skips"]) == (0, 0, 0)
    ratios = data["ratios"]
    for c in CONTEXTS:
        assert ratios[f"generate ms/token hybrid/base, ctx={c}"]["value"] > 0
        assert ratios[f"decode tokens/s hybrid/kv_cache, B=4, ctx={c}"]["value"] > 0
    for T in LENGTHS:
        assert ratios[f"prefill fwd+bwd hybrid/sdpa, T={T}"]["value"] > 0
    profile = data["profile"]  # one pass over both functions, every aten op placed in one of them
    assert [profile[k]["unplaced"] for k in ("fwd_bwd", "decode")] == [0, 0]
    big = data["big"]
    for key in ("stage1_tokens_per_s", "stage1_mfu", "stage1_teacher_mfu", "stage2_tokens_per_s", "stage2_mfu"):
        assert math.isfinite(big[key]) and big[key] > 0, key
    p = big["projection"]["ssd"]  # the 8B preset: 2048 x 1024 tokens x 2 epochs per layer; 2000 x 64 x 1024 in stage 2
    assert (p["stage1_tokens_per_layer"], p["stage2_tokens"], p["layers"]) == (4194304, 131072000, 32)
    tests = data["tests"]
    assert tests["counts"].get("skipped", 0) > 0  # the gpu-marked tests: collected, skipped on a CPU
    assert f"--deselect {GRADIENTS} --deselect {GATED_DELTA}" in tests["command"]  # (parts grad and delta ran them)
    order = tests["order"]  # the chunked kernels' first, fla's gated delta rule (the check's), the bf16 file, fp32's
    assert "test_chunk" in order[0]
    assert order[-3:] == [GATED_DELTA, "tests/unit/test_triton_kernels_bf16.py", "tests/unit/test_fp32_calls.py"]


def test_a_run_killed_after_its_first_part_keeps_that_parts_rows(tmp_path):
    """The device tool kills a run at its timeout: the report on disk then still has every part that ended (written
    before the next one starts, each file whole) and names the part the run was killed in."""
    cmd = [sys.executable, *SCRIPT, "--dry-run", "--out", str(tmp_path)]
    env = dry_env(DEVICE_SPEED_PARTS="grad,prefill")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("== part prefill:"):
                proc.kill()  # (SIGKILL, as a timeout's)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    data = json.loads((tmp_path / "device_speed.json").read_text())
    assert list(data["parts"]) == ["grad", "prefill"] and "prefill" not in data
    assert data["parts"]["grad"]["status"] == "ok" and data["grad"]["order"] == [GRADIENTS]
    assert data["parts"]["prefill"]["status"] == "cut"
    table = (tmp_path / "device_speed.md").read_text()
    assert "| grad: 1a. bf16 gradients: triton_hybrid_attention vs the fp32 chunked path | ok |" in table
    assert "| prefill: 2. prefill vs SDPA and fla | cut | 0 | started; the run ended inside it |" in table
    assert "## 1a. bf16 gradients against the fp32 chunked path" in table
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("fault", ["decay_ignored", "beta_ignored"])
def test_the_gated_delta_comparison_fails_a_planted_fault(tmp_path, monkeypatch, fault):
    """Part delta against an implementation with the decay or the write strength ignored: FAILED, by tensor."""
    from benchmarks.device import delta
    from benchmarks.device.run import Run
    from benchmarks.device.settings import speed_settings
    from hybrid_scale.attention.gated_delta.naive import recurrent_gated_delta

    name = {"decay_ignored": "g", "beta_ignored": "beta"}[fault]

    def planted(**x):
        x[name] = torch.zeros_like(x[name]) if name == "g" else torch.ones_like(x[name])
        return recurrent_gated_delta(**x)

    monkeypatch.setattr(delta.backends, "get_backend", lambda impl, kind: planted)
    monkeypatch.delenv("DEVICE_SPEED_PARTS", raising=False)
    result = delta.part_delta(Run("speed", "device_speed", speed_settings(True), tmp_path, "test", str))
    assert result["failed"].endswith(f"over {delta.TOLERANCE:g} against the torch form") and "o" in result["over"]


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
