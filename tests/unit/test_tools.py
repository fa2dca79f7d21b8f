"""The small tools and generators of tools/ and benchmarks/ run as their make targets and docs run them (`python -m`
from the repository root), at toy sizes: tools.compare_runs on two run directories, tools.test_time on pytest's
durations, benchmarks.device.make_text regenerating the pipeline check's committed text byte for byte."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def fake_run(root: Path, weight: float) -> Path:
    (root / "eval").mkdir(parents=True)
    (root / "eval" / "results.json").write_text(json.dumps({"modes": {"hybrid": {"avg": 0.5}}, "verdict": "n/a"}))
    (root / "stage2").mkdir()
    (root / "stage2" / "curves.json").write_text(json.dumps({"hybrid": [3.0]}))
    (root / "stage1").mkdir()
    save_file({"w": torch.full((2, 2), weight)}, str(root / "stage1" / "layer_0.safetensors"))
    return root


def test_compare_runs_says_equal_runs_are_equal_and_finds_a_tensor_that_differs(tmp_path):
    a, b, c = (fake_run(tmp_path / n, w) for n, w in (("a", 1.0), ("b", 1.0), ("c", 1.0 + 1e-7)))
    same = run("tools.compare_runs", str(a), str(b))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "stage1/layer_*.safetensors: 1 tensors, bitwise equal" in same.stdout
    other = run("tools.compare_runs", str(a), str(c))
    assert other.returncode == 1 and "stage1/layer_*.safetensors: 1 tensors, DIFFERENT" in other.stdout


def test_test_time_tables_a_durations_log_and_two_side_by_side(tmp_path):
    before, after = tmp_path / "before.log", tmp_path / "after.log"
    before.write_text("12.00s call     tests/unit/test_a.py::test_x\n1.00s setup    tests/unit/test_b.py::test_y\n"
                      "==== 2 passed in 14.50s ====\n")  # fmt: skip
    after.write_text("6.00s call     tests/unit/test_a.py::test_x\n0.50s teardown tests/unit/test_a.py::test_x\n"
                     "1.00s setup    tests/unit/test_b.py::test_y\n==== 2 passed in 8.00s ====\n")  # fmt: skip
    one = run("tools.test_time", str(after))
    assert one.returncode == 0, one.stderr
    assert "| `tests/unit/test_a.py` | 6 |" in one.stdout and "| pytest wall | 8 s (0.1 min) |" in one.stdout
    two = run("tools.test_time", str(before), str(after))
    assert "| `tests/unit/test_a.py` | 12 | 6 | 0.54 |" in two.stdout
    three = run("tools.test_time", str(before), str(after), str(after))
    assert three.returncode == 2 and "one log, or two" in three.stderr


def test_make_text_regenerates_the_committed_text(tmp_path, monkeypatch):
    from benchmarks.device import make_text

    monkeypatch.setattr(make_text, "OUT", tmp_path / "text.jsonl")
    make_text.main()
    assert (tmp_path / "text.jsonl").read_bytes() == (ROOT / "benchmarks" / "device" / "text.jsonl").read_bytes()


def test_the_longest_files_named_for_the_workers_exist():
    """conftest's LONGEST_FIRST orders the files `make test` hands out: a renamed file would silently drop to the
    end of the queue and make the run's tail (one worker on a long file while the others wait) long again."""
    from tests.conftest import LONGEST_FIRST

    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [f for f in LONGEST_FIRST if not (ROOT / f).is_file()] == []
