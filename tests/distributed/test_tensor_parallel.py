"""Tensor parallelism (distributed/tensor_parallel.py) on 2 gloo ranks: the split model against the whole one."""

import json
from pathlib import Path

import procs
import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def split_models():
    proc = procs.run(["llama", "qwen2"], ranks=2, script=HERE / "tp_model.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["arch"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_tensor_parallel_ranks_compute_what_one_whole_model_does(split_models, arch):
    out = split_models[arch]
    assert set(out["logits"]) == {"hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none"}
    assert max(out["logits"].values()) <= 1e-5, out["logits"]  # every component mode
    assert out["partial"] <= 1e-5  # a softmax layer left unconverted is split the same way
    assert out["decode_equal"] and out["decode_tokens"] == 20  # prefill (left-padded) + 20 greedy tokens
    assert out["loss"] <= 1e-6
    assert out["trainable"] == 34 and out["grads"] <= 1e-6  # LoRA's every factor, phi and gamma, whole vs split
    assert 0.49 < out["bytes_ratio"] < 0.51  # the parameters held per rank halve (norms stay whole)


def test_the_memory_benchmark_measures_half_the_frozen_base_per_rank(tmp_path):
    """benchmarks/tensor_parallel_memory.py at a tiny shape: the frozen base's bytes per rank halve at tp 2 (norms
    stay whole: a little over half), the decode state halves, the trainable LoRA state shrinks less (lora_A of
    q/k/v and lora_B of o are replicated)."""
    script = HERE.parents[1] / "benchmarks" / "tensor_parallel_memory.py"
    out = tmp_path / "memory.json"
    args = ["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "512", "--out", str(out)]
    proc = procs.run(args, ranks=2, script=script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frozen_base" in proc.stdout and "ratio" in proc.stdout
    per_rank = json.loads(out.read_text())["per_rank"]
    one, halves = per_rank[0]["1"], [r["2"] for r in per_rank]
    for half in halves:
        assert 0.5 <= half["frozen_base"] / one["frozen_base"] < 0.51
        assert 0.5 <= half["decode_state"] / one["decode_state"] < 0.501  # (a few position counters stay whole)
        assert 0.5 < half["trainable_state"] / one["trainable_state"] < 1
