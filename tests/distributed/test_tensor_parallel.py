"""Tensor parallelism (distributed/tensor_parallel.py) on 2 gloo ranks: the split model against the whole one."""

import json
from pathlib import Path

import procs
import pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_tensor_parallel_ranks_compute_what_one_whole_model_does(arch):
    proc = procs.run([arch], ranks=2, script=HERE / "tp_model.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["logits"]) == {"hybrid", "swa_only", "la_only", "sinks_only", "none"}
    assert max(out["logits"].values()) <= 1e-5, out["logits"]  # every component mode
    assert out["partial"] <= 1e-5  # a softmax layer left unconverted is split the same way
    assert out["decode_equal"] and out["decode_tokens"] == 20  # prefill (left-padded) + 20 greedy tokens
    assert out["loss"] <= 1e-6
    assert out["trainable"] == 34 and out["grads"] <= 1e-6  # LoRA's every factor, phi and gamma, whole vs split
    assert 0.49 < out["bytes_ratio"] < 0.51  # the parameters held per rank halve (norms stay whole)
