"""The attention benchmarks' registry and runner (benchmarks/registry.py, benchmarks/run.py): the shapes are the model
presets', `--verify` passes on the real backends and stops, naming the backend, on one that differs from the spec
(planted here: a prefill and a decode step off by a little), the scaling suite runs end to end at a toy length, and
the committed roofline page is what the runner writes for the current kernels' tiles (the cost model's own tests:
test_cost_model.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import registry, run
from tools.kernel_compile import preset_shapes

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_shapes_are_the_presets():
    presets = {s.preset: dict(H=s.heads, Hkv=s.kv_heads, D=s.head_dim, F=s.features) for s in preset_shapes()}
    assert registry.SHAPES and all(registry.SHAPES[name] == presets[name] for name in registry.SHAPES)
    assert registry.WINDOW == next(s.window for s in preset_shapes() if s.preset == "llama3-8b")
    with pytest.raises(SystemExit, match="unknown shape llama-3-8b; the registry has smollm2-135m, llama3-8b"):
        registry.shapes_named("llama-3-8b")


@pytest.mark.slow  # the benchmarks' runner (13 s): make test, not the inner loop
def test_verify_passes_on_the_real_backends():
    assert run.verify(registry.SMALL_SHAPES, window=16) == []
    assert run.verify({"smollm2-135m": registry.SHAPES["smollm2-135m"]}) == []


def test_verify_stops_on_a_prefill_or_a_decode_step_that_differs_from_the_spec(monkeypatch):
    real_prefill, real_step = registry.prefill, registry.decode_step

    def wrong_prefill(window, device="cpu"):
        out = real_prefill(window, device)
        torch_path = out["torch"]
        return out | {"torch": lambda x: torch_path(x) * 1.001}

    monkeypatch.setattr(registry, "prefill", wrong_prefill)
    with pytest.raises(SystemExit, match=r"differs from the spec; nothing timed:\n  prefill `torch` at tiny"):
        run.check(registry.SMALL_SHAPES, "cpu", torch.float32, 16)
    monkeypatch.setattr(registry, "prefill", real_prefill)
    monkeypatch.setattr(registry, "decode_step", lambda *a: real_step(*a) + 1e-3)
    problems = run.verify(registry.SMALL_SHAPES, window=16)
    assert problems and all(p.startswith("decode `") for p in problems), problems  # each decode step (torch, triton)
    assert any(p.startswith("decode `torch` at tiny") for p in problems), problems


@pytest.mark.slow  # the scaling suite (19 s): make test, not the inner loop
def test_the_scaling_suite_runs_verified_at_a_toy_length(tmp_path):
    out = tmp_path / "scaling.json"
    args = ["--max-len", "1024", "--naive-max", "1024", "--repeats", "1", "--decode-steps", "2", "--contexts", "32,64"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "scaling", "--verify", *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--verify: every fast backend agrees with the spec on smollm2-135m" in proc.stdout
    assert '"T": 1024' in out.read_text() and "64 / 32: decode step time" in proc.stdout


def test_the_committed_roofline_page_is_what_the_runner_writes(tmp_path):
    assert run.main(["roofline", "--out", str(tmp_path / "page.md")]) == 0
    page = ROOT / "docs" / "results" / "kernel_roofline.md"
    assert (tmp_path / "page.md").read_text() == page.read_text(), "run `make kernel-roofline`"


def test_the_cache_prefill_benchmark_runs_and_prints_every_selection(capsys):
    """benchmarks/cache_prefill.py at a toy length: one row per kind and variant, each with its ratio."""
    from benchmarks import cache_prefill

    assert cache_prefill.main(["--tokens", "64", "--cache", "4", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith("x")]
    assert len(rows) == 8 and all("by" in r or "none" in r for r in rows)
