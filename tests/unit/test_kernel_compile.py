"""The compile gate: every Triton kernel compiled for sm_80 and sm_90 on this CPU machine (triton.compile with a
GPUTarget, then the ptxas in the triton wheel), every mode, bf16 / fp16 / fp32, at every model preset's head shapes,
with the tiles the kernels choose on a GPU: no compile error, shared memory within the architecture's limit, no
register spills (benchmarks/kernel_compile.py, SPILL_BUDGET). The table it makes is docs/results/kernel_compile.md
(`make kernel-compile`); a test fails when that page no longer matches the kernels.

The tests run in child processes: this suite runs Triton's interpreter (conftest sets TRITON_INTERPRET=1), under
which @triton.jit makes interpreted functions that cannot be compiled.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels need triton: pip install -e '.[triton]'")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_compile.py"
PAGE = ROOT / "docs" / "results" / "kernel_compile.md"

pytestmark = pytest.mark.slow


def _compiling_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_DEFAULT_FP_FUSION": "1"}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "kernel_compile.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=ROOT,
        env=_compiling_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return proc, out


def test_every_kernel_compiles_for_sm80_and_sm90_within_shared_memory_and_without_spills(gate):
    proc, out = gate
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 over budget" in proc.stdout
    table = out.read_text()
    for kernel in ("_fwd", "_states_fwd", "_bwd_dq", "_bwd_dfq", "_states_bwd", "_bwd_dkv", "_bwd_dfk", "_bwd_sinks",
                   "_decode"):  # fmt: skip
        assert f"| `{kernel}` |" in table, kernel
    for preset in ("smollm2-135m", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b"):
        assert preset in table
    for dtype in ("bf16", "fp16", "fp32"):
        assert f"| {dtype} |" in table


def test_the_committed_table_is_what_the_kernels_compile_to(gate):
    proc, out = gate
    assert proc.returncode == 0
    assert PAGE.read_text() == out.read_text(), "docs/results/kernel_compile.md is stale: run `make kernel-compile`"


PLANTED = """
import sys
import torch
import triton
import triton.language as tl
from hybrid_scale_kernels import compile_check


@triton.jit
def loop_carried(X, Y, N, G: tl.constexpr, BLOCK: tl.constexpr):  # the decode kernel's old bug
    og = tl.arange(0, G)
    a = tl.load(X + og)  # [G]
    for r0 in range(0, N, BLOCK):
        a = tl.load(X + og[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :])  # [G, BLOCK]: a changes type
    tl.store(Y + og, tl.sum(a, 1))


@triton.jit
def too_much_shared(X, Y, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    x = tl.load(X + o[:, None] * BLOCK + o[None, :])
    tl.store(Y + o[:, None] * BLOCK + o[None, :], tl.dot(x, x))


x = torch.empty(1 << 20, device="meta", dtype=torch.float16)
with compile_check.record_launches() as launches:
    loop_carried[(1,)](x, x, 64, G=4, BLOCK=16)
    too_much_shared[(1,)](x, x, BLOCK=512)
try:
    compile_check.compile_launch(launches[0], 90)
    print("loop_carried: compiled")
except Exception as e:
    print("loop_carried: refused", type(e).__name__)
c = compile_check.compile_launch(launches[1], 80)
print("too_much_shared:", c.shared, c.shared_ok, c.spills)
"""


def test_the_gate_catches_what_the_interpreter_lets_through(tmp_path):
    """A loop-carried value that changes type (the decode kernel's old bug) does not compile; a tile too large for
    sm_80 is reported as over its shared memory or as spilling."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    proc = subprocess.run(
        [sys.executable, str(script)], env=_compiling_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loop_carried: refused" in proc.stdout, proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("too_much_shared:"))
    _, shared, ok, spills = line.split()
    assert ok == "False" or int(spills) > 0, line
