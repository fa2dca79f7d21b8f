"""Part 6, tests (last): the gpu-marked tests in one pytest child, cut at what is left of the run: the chunked
kernels' forward and backward files first (tests/unit/test_chunk_forward.py, test_chunk_backward.py), then fla's
gated delta rule against the spec (test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu), then the bf16
tests of the entry and the decode step (tests/unit/test_triton_kernels_bf16.py). Verbose, so that a run cut short
still says which tests passed and failed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from benchmarks.device.run import Run
from benchmarks.gpu_check.common import run_child

ROOT = Path(__file__).resolve().parents[2]
CHUNKED = ("tests/unit/test_chunk_forward.py", "tests/unit/test_chunk_backward.py")  # (in this order)
GATED_DELTA = "tests/unit/test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu"
BF16 = "tests/unit/test_triton_kernels_bf16.py"


def test_files() -> list[str]:
    """The chunked kernels' test files, then fla's gated delta test, then the bf16 file."""
    chunked = [p.relative_to(ROOT).as_posix() for pattern in CHUNKED for p in sorted(ROOT.glob(pattern))]
    rest = [t for t in (GATED_DELTA, BF16) if (ROOT / t.split("::")[0]).is_file()]
    return list(dict.fromkeys(chunked)) + rest


OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def part_tests(run: Run) -> dict:
    timeout = max(1, int(min(run.cfg["budgets"]["tests"], run.left() - 5)))
    files = test_files()
    cmd = [sys.executable, "-m", "pytest", "-v", "-rP", "-p", "no:cacheprovider", "-m", "gpu", *files]
    rc, out, err, seconds = run_child(cmd, "gpu-marked tests", run.log, timeout)
    text = out + err
    print("\n".join([line for line in text.strip().splitlines() if line.strip()][-30:]), flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", text)}
    outcomes = [m.groups() for m in map(OUTCOME.match, text.splitlines()) if m]
    if rc == "timeout" or not counts:  # cut short: count what the verbose lines say
        counts = {}
        for _, outcome in outcomes:
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    errors = [line for line in text.splitlines() if re.match(r"^\S+ w=\d+: max \|y - y_ref\|", line)]
    failed_tests = [name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    result = dict(command=" ".join(cmd[2:]), rc=rc, seconds=seconds, counts=counts, timeout=timeout, errors=errors,
                  failed_tests=failed_tests, order=files)  # fmt: skip
    if rc == "timeout":
        result["failed"] = f"cut at {timeout} s after {len(outcomes)} tests"
    elif rc not in (0, 5):  # 5: nothing collected (no test selected)
        result["failed"] = f"exit {rc}: {len(failed_tests)} failed"
    return result
