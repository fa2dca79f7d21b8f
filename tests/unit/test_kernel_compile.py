"""The compile gate: every Triton kernel compiled for sm_80 and sm_90 on this CPU machine (triton.compile with a
GPUTarget, then the ptxas in the triton wheel), each architecture with its own settings, every mode, bf16 / fp16 /
fp32, at every model preset's head shapes, every shipped window and lengths that are not a multiple of the chunk: no
compile error, shared memory and registers per block within the architecture's limits, no register spills
(tools/kernel_compile.py, SPILL_BUDGET). The tables it makes are docs/results/kernel_compile.md (`make
kernel-compile`, the project's Triton) and kernel_compile_triton36.md (`make kernel-compile-triton36`, the device
image's Triton 3.6, whose wheel `make test` puts in .triton36/); a test fails when a page no longer matches the
kernels.

The tests run in child processes: this suite runs Triton's interpreter (conftest sets TRITON_INTERPRET=1), under
which @triton.jit makes interpreted functions that cannot be compiled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels need triton: pip install -e '.[triton]'")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "tools.kernel_compile"]  # from the repository root
PAGE = ROOT / "docs" / "results" / "kernel_compile.md"
PAGE36 = ROOT / "docs" / "results" / "kernel_compile_triton36.md"
TRITON36 = ROOT / ".triton36"  # the device image's Triton (make .triton36/.installed; `make test` makes it)

pytestmark = pytest.mark.slow


def _compiling_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_DEFAULT_FP_FUSION": "1"}


def _run_gate(tmp_path_factory, page, env):
    """The whole matrix: each launch whose key (kernel source, launch, Triton version) the committed results hold
    is taken from them, 8 of those (chosen at random each run) compiled again and compared, every other launch
    compiled: a changed kernel is always compiled."""
    out = tmp_path_factory.mktemp("compile") / page.name
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "--out", str(out), "--reuse", str(page.with_suffix(".json")), "--verify", "8"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return proc, out


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return _run_gate(tmp_path_factory, PAGE, _compiling_env())


@pytest.fixture(scope="module")
def gate36(tmp_path_factory):
    if not (TRITON36 / "triton").is_dir():
        pytest.skip("the device image's Triton is not in .triton36/: make .triton36/.installed (make test makes it)")
    path = os.pathsep.join([str(TRITON36), *filter(None, [os.environ.get("PYTHONPATH")])])  # (3.6 first)
    return _run_gate(tmp_path_factory, PAGE36, {**_compiling_env(), "PYTHONPATH": path})


def test_every_kernel_compiles_for_sm80_and_sm90_within_shared_memory_and_without_spills(gate):
    proc, out = gate
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 over budget" in proc.stdout
    table = out.read_text()
    for kernel in ("_chunk_states", "_segment_fix", "_chunk_output", "_chunk_bwd_dq", "_chunk_dstates", "_dstates_fix",
                   "_chunk_bwd_dkv", "_decode"):  # fmt: skip
        assert f"| `{kernel}` |" in table, kernel
    # the chunked prefill's products are wgmma on sm_90 in half precision, at every preset (the script also fails
    # without it: tools/kernel_compile.py WGMMA), and for fp32 calls too: they run the chunked kernels in bf16 on a GPU
    rows = [line for line in table.splitlines() if line.startswith(("| `_chunk_states` |", "| `_chunk_output` |"))]
    half = [line for line in rows if "| bf16 |" in line or "| fp16 |" in line]
    assert half and all(line.rstrip(" |").endswith("wgmma") for line in half), half[:3]
    fp32 = [line for line in rows if "| fp32 |" in line]
    assert fp32 and all(line.rstrip(" |").endswith("wgmma") for line in fp32), fp32[:3]
    assert any("llama3-8b" in line for line in half) and any("smollm2-135m" in line for line in half)
    for preset in ("smollm2-135m", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b"):
        assert preset in table
    for dtype in ("bf16", "fp16", "fp32"):
        assert f"| {dtype} |" in table
    assert "llama3-8b@w16@T96" in table and "llama3-8b@T100" in table  # (the quickstart's window; off the chunk)


def test_the_committed_table_is_what_the_kernels_compile_to(gate):
    """The page and its results match the kernels as they are: no launch needed compiling (a changed kernel, tile
    or Triton makes new keys), and the ones compiled again gave the stored registers, spills and shared memory."""
    proc, out = gate
    assert proc.returncode == 0
    assert "(0 compiled, " in proc.stdout, "the kernels changed since docs/results/kernel_compile.* was made: run " \
        "`make kernel-compile`\n" + proc.stdout[-2000:]  # fmt: skip
    assert "8 of those compiled again" in proc.stdout
    assert PAGE.read_text() == out.read_text(), "docs/results/kernel_compile.md is stale: run `make kernel-compile`"


PLANTED = """
import torch
import triton
import triton.language as tl
from tools import compile_check


@triton.jit
def loop_carried(X, Y, N, G: tl.constexpr, BLOCK: tl.constexpr):  # the decode kernel's old bug
    og = tl.arange(0, G)
    a = tl.load(X + og)  # [G]
    for r0 in range(0, N, BLOCK):
        a = tl.load(X + og[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :])  # [G, BLOCK]: a changes type
    tl.store(Y + og, tl.sum(a, 1))


x = torch.empty(1 << 12, device="meta", dtype=torch.float16)
with compile_check.record_launches() as launches:
    loop_carried[(1,)](x, x, 64, G=4, BLOCK=16)
bad = compile_check.compile_launch(launches[0], 90)
print("loop_carried:", "refused" if bad.error else "compiled", bad.error)
"""


def test_the_device_images_triton_compiles_them_too(gate36):
    """Triton 3.6 (torch 2.11's, on the device image) allocates registers its own way: the same gate, the same
    budget, and its committed page matches."""
    proc, out = gate36
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 over budget" in proc.stdout and "(0 compiled, " in proc.stdout, proc.stdout[-2000:]
    assert "with triton 3.6.0" in out.read_text()
    assert PAGE36.read_text() == out.read_text(), "kernel_compile_triton36.md is stale: make kernel-compile-triton36"


def test_the_gate_catches_what_the_interpreter_lets_through(tmp_path):
    """A loop-carried value that changes type (the decode kernel's old bug, which the interpreter runs) does not
    compile for sm_90, and the gate reports it as a failure."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**_compiling_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loop_carried: refused" in proc.stdout, proc.stdout


def test_the_gate_fails_on_errors_spills_and_shared_memory_or_registers_over_the_limit():
    from tools import kernel_compile
    from tools.compile_check import Compiled

    def row(arch, **kw):
        fields = dict(kernel="_fwd", arch=arch, registers=200, spill_stores=0, spill_loads=0, stack=0, shared=1024,
                      num_warps=4, wgmma=False, mma_sync=True, seconds=1.0, constants="BLOCK=32")  # fmt: skip
        return kernel_compile.Row("_fwd", "hybrid", "bf16", ["llama3-8b"], {arch: Compiled(**{**fields, **kw})})

    assert kernel_compile.failures([row(80), row(90)]) == []
    assert "8 bytes of spills (budget 0)" in kernel_compile.failures([row(90, spill_loads=8)])[0]
    over = kernel_compile.failures([row(80, shared=164 * 1024)])[0]
    assert "_fwd hybrid bf16 sm_80 (llama3-8b): 167936 bytes of shared memory, over the 166912" in over
    assert kernel_compile.failures([row(90, shared=164 * 1024)]) == []  # sm_90 allows 227 KiB
    assert "does not compile: CompilationError" in kernel_compile.failures([row(90, error="CompilationError: x")])[0]
    assert kernel_compile.failures([row(90, registers=255, num_warps=8)]) == []  # 256 x 32 x 8 = 65536: it fits
    many = kernel_compile.failures([row(90, registers=214, num_warps=16)])[0]  # (a 16-warp try at _chunk_bwd_dq)
    assert "214 registers x 16 warps need 110592 per block, over the 65536 an SM has: it cannot launch" in many


def test_a_run_cut_short_goes_on_where_it_stopped(tmp_path):
    """--progress keeps the results as they come: started again, the run compiles nothing it already had (the gate
    takes an hour on two cores, and a run killed near its end once lost all of it)."""
    kept = tmp_path / "progress.json"
    part = ["--presets", "smollm2-135m", "--archs", "90", "--kernels", "_segment_fix", "--modes", "la_only",
            "--dtypes", "bf16", "--progress", str(kept)]  # fmt: skip
    outs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, *SCRIPT, *part], cwd=ROOT, env=_compiling_env(), capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        outs.append(proc.stdout)
    assert "(1 compiled, 0 reused" in outs[0] and kept.is_file(), outs[0]
    assert "(0 compiled, 1 reused" in outs[1], outs[1]
    other = [*part[:5], "_dstates_fix", *part[6:]]  # a run over another kernel keeps the file's results
    proc = subprocess.run([sys.executable, *SCRIPT, *other], cwd=ROOT, env=_compiling_env(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {r["kernel"] for r in json.loads(kept.read_text())["results"].values()} >= {"_segment_fix"}


KERNEL_SOURCE = """
import triton
import triton.language as tl


@triton.jit
def helper(x):
    return x * 2


@triton.jit
def kernel(X, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(X + o, helper(tl.load(X + o)))
"""


def test_a_compile_key_does_not_move_with_the_lines_above_the_kernels(tmp_path, monkeypatch):
    """The gate's results are keyed by the kernels' source, not by the line each jit function starts on (Triton's own
    cache_key appends it): a docstring grown by a line above the kernels made CI compile 1128 launches again."""
    import importlib

    from tools import compile_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (jit functions, as the gate compiles them)
    (tmp_path / "shifted_a.py").write_text(KERNEL_SOURCE)
    (tmp_path / "shifted_b.py").write_text('"""Three more lines\nabove the kernels.\n"""\n' + KERNEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = importlib.import_module("shifted_a"), importlib.import_module("shifted_b")
    assert a.kernel.cache_key != b.kernel.cache_key  # (Triton's: the lines differ)
    assert compile_check.source_key(a.kernel) == compile_check.source_key(b.kernel)
    assert a.kernel.starting_line_number != b.kernel.starting_line_number  # (put back as they were)
    (tmp_path / "shifted_c.py").write_text(KERNEL_SOURCE.replace("x * 2", "x * 3"))
    assert compile_check.source_key(importlib.import_module("shifted_c").kernel) != compile_check.source_key(a.kernel)
