"""The gpu-marked tests, run by the harness as pytest children (cut at what is left of the run; verbose, so that a run
cut short still says which tests passed and failed), and their sections of the report.

Part grad of the speed benchmark (first): the bf16 gradients of the kernels at Llama-3-8B's attention shape against the
fp32 chunked path, tests/unit/test_triton_kernels_bf16.py::test_bf16_gradients_at_the_llama3_8b_shape, whose printed
errors (grad_line: `grad MODE T=T: NAME ERROR/TOLERANCE, ...`) become the section's table. Part tests (the speed
benchmark's last, the pipeline check's first): the chunked kernels' forward and backward files first
(tests/unit/test_chunk_forward.py, test_chunk_backward.py), then fla's gated delta rule against the spec
(test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu), then the bf16 tests of the entry and the decode step
(tests/unit/test_triton_kernels_bf16.py), then the fp32 calls' precision (tests/unit/test_fp32_calls.py; in the speed
benchmark without the gradient test part grad ran, and without the gated delta test, whose check part delta makes at the
8B shape). On a CPU every one of them is collected and skipped."""

from __future__ import annotations

import re
import sys

from benchmarks.device.run import Run, run_child
from benchmarks.device.settings import ROOT
from benchmarks.report_table import fmt, skipped_row, table

CHUNKED = ("tests/unit/test_chunk_forward.py", "tests/unit/test_chunk_backward.py")  # (in this order)
GATED_DELTA = "tests/unit/test_gated_delta.py::test_fla_kernel_equals_the_spec_on_a_gpu"
BF16 = "tests/unit/test_triton_kernels_bf16.py"
FP32 = "tests/unit/test_fp32_calls.py"  # (an fp32 call computes in bf16 within what its docstring promises)
GRADIENTS = f"{BF16}::test_bf16_gradients_at_the_llama3_8b_shape"
OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
GRAD_LINE = re.compile(r"^grad (\w+) T=(\d+): (.+)$")
GRAD_ERROR = re.compile(r"(\w+) ([^\s,/]+)/([^\s,]+)")


def test_files() -> list[str]:
    """The chunked kernels' test files, then fla's gated delta test, then the bf16 file and the fp32 calls'."""
    chunked = [p.relative_to(ROOT).as_posix() for pattern in CHUNKED for p in sorted(ROOT.glob(pattern))]
    rest = [t for t in (GATED_DELTA, BF16, FP32) if (ROOT / t.split("::")[0]).is_file()]
    return list(dict.fromkeys(chunked)) + rest


def run_pytest(run: Run, what: str, targets: list[str], timeout: float, extra: tuple[str, ...] = ()) -> dict:
    """The gpu-marked tests of `targets` in one pytest child, cut at `timeout` s or at the run's deadline: its exit,
    counts, the tests that failed, and `failed` when the child failed or was cut."""
    timeout = max(1, int(min(timeout, run.left() - 5)))
    cmd = [sys.executable, "-m", "pytest", "-v", "-rP", "-p", "no:cacheprovider", "-m", "gpu", *extra, *targets]
    rc, out, err, seconds = run_child(cmd, what, run.log, timeout)
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
                  failed_tests=failed_tests, order=targets, output=text)  # fmt: skip
    if rc == "timeout":
        result["failed"] = f"cut at {timeout} s after {len(outcomes)} tests"
    elif rc not in (0, 5):  # 5: nothing collected (no test selected)
        result["failed"] = f"exit {rc}: {len(failed_tests)} failed"
    return result


def grad_line(mode: str, T: int, errors: dict[str, float], tolerances: dict[str, float]) -> str:
    """What the gradient test prints of one mode (grad_rows reads it back)."""
    return f"grad {mode} T={T}: " + ", ".join(f"{n} {e:.3e}/{tolerances[n]:g}" for n, e in errors.items())


def grad_rows(text: str) -> list[dict]:
    """The gradient test's printed lines as rows: mode, T, each tensor's error and tolerance, the tensors over it."""
    rows = []
    for line in text.splitlines():
        m = GRAD_LINE.match(line.strip())
        if not m or any(r["mode"] == m[1] and r["T"] == int(m[2]) for r in rows):  # (-rP repeats the output)
            continue
        found = GRAD_ERROR.findall(m[3])
        errors, tolerances = {n: float(e) for n, e, _ in found}, {n: float(t) for n, _, t in found}
        failed = sorted(n for n, e in errors.items() if not e <= tolerances[n])  # (NaN fails too)
        rows.append(dict(mode=m[1], T=int(m[2]), errors=errors, tolerances=tolerances, failed=failed))
    return rows


def part_gradients(run: Run) -> dict:
    result = run_pytest(run, "the bf16 gradient test", [GRADIENTS], run.cfg["budgets"]["grad"])
    result["rows"] = grad_rows(result.pop("output"))
    if not result.get("failed") and any(r["failed"] for r in result["rows"]):
        result["failed"] = "gradients over their tolerance"
    return result


def part_tests(run: Run) -> dict:
    """The gpu-marked tests; the speed benchmark leaves out the gradient and gated delta tests its parts grad and
    delta ran."""
    budget = run.cfg["budgets"]["tests"] if run.harness == "speed" else run.cfg["timeout"]
    extra = ("--deselect", GRADIENTS, "--deselect", GATED_DELTA) if run.harness == "speed" else ()
    result = run_pytest(run, "gpu-marked tests", test_files(), budget, extra)
    del result["output"]
    return result


def summary(t: dict) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in t["counts"].items())
    return f"`{t['command']}` (timeout {t['timeout']} s): exit {t['rc']}, {counts}, {t['seconds']:.0f} s"


def gradients_section(d: dict) -> list[str]:
    g = d.get("grad")
    if not g:
        return []
    lines = ["", "## 1a. bf16 gradients against the fp32 chunked path", "",
             f"{summary(g)}. Tested: `hybrid_scale_kernels.triton_hybrid_attention`; reference: "
             "`chunk_hybrid_attention` in fp32 on the same bf16-rounded inputs. Error: max |a - b| / max |b| per "
             "tensor (absolute where the reference is all zero).", ""]  # fmt: skip
    rows = []
    for r in g["rows"]:
        for name, err in r["errors"].items():
            ok = "FAILED" if name in r["failed"] else "ok"
            rows.append([r["mode"], r["T"], "y" if name == "y" else f"d{name}", fmt(err), r["tolerances"][name], ok])
    rows += [skipped_row(["all", ""], "no gradient measured (the test was skipped or cut)")] if not g["rows"] else []
    return lines + table(["mode", "T", "tensor", "max rel. error", "tolerance", "status"], rows)


def section(d: dict) -> list[str]:
    t = d.get("tests")
    if not t:
        return []
    number = "5. " if d["harness"] == "speed" else ""
    lines = ["", f"## {number}gpu-marked tests (chunked path first)", "", summary(t)]
    if t.get("failed_tests"):
        lines += ["", "Failed: " + ", ".join(f"`{n}`" for n in t["failed_tests"])]
    if t["errors"]:
        lines += ["", "```", *t["errors"], "```"]
    return lines + [""]
