"""Tensor parallelism (distributed/tensor_parallel.py) on 2 gloo ranks: the split model against the whole one."""

import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import procs
import pytest

from hybrid_scale.attention.settings import MODES

HERE = Path(__file__).parent
SCRIPT = "benchmarks/memory/tensor_parallel.py"


@pytest.fixture(scope="module")
def split_models():
    proc = procs.run(["llama", "qwen2", "granite"], ranks=2, script=HERE / "tp_model.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["arch"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "granite"])
def test_two_tensor_parallel_ranks_compute_what_one_whole_model_does(split_models, arch):
    out = split_models[arch]
    assert set(out["logits"]) == {*MODES, "hybrid+sinks", "hybrid+decay"}
    assert max(out["logits"].values()) <= 1e-5, out["logits"]  # every component mode
    assert out["partial"] <= 1e-5  # a softmax layer left unconverted is split the same way
    assert out["decode_equal"] and out["decode_tokens"] == 20  # prefill (left-padded) + 20 greedy tokens (with sinks)
    assert out["loss"] <= 1e-6  # the loss-parallel cross-entropy of training against the whole model's
    assert out["train_logits"] == ["DTensor", [2, 16, 64]]  # no rank holds the whole logits
    assert out["trainable"] == 36 and out["grads"] <= 1e-6  # LoRA's every factor, phi, gamma and rho, whole vs split
    assert 0.49 < out["bytes_ratio"] < 0.51  # the parameters held per rank halve (norms stay whole)
    delta = out["delta"]  # the gated delta-rule LA (gates, convolutions, mix gate, own sinks) split over its heads
    assert max(delta["logits"].values()) <= 1e-5 and set(delta["logits"]) == set(MODES), delta["logits"]
    assert delta["decode_equal"]
    for cache in (out["cache"], delta["cache"]):  # each selection's cache, whole vs split: 3 modes x 3 selections
        assert len(cache["logits"]) == 9 and max(cache["logits"].values()) <= 1e-5, cache["logits"]
        assert cache["decode_equal"]
    assert delta["trainable"] > 24 and delta["grads"] <= 1e-6, delta


def test_the_memory_benchmark_loads_a_converted_model_split_at_tp_1_and_2(tmp_path):
    """benchmarks/memory/tensor_parallel.py at a tiny shape, its workers started as the benchmark starts them (one
    job per tp, here through the warm test server): a converted model with a LoRA adapter read at tp 1 and split at
    tp 2 gives the same logits; each rank holds half the parameters (norms stay whole: a little over half) and half
    the decode state, and reports its peak resident memory; the table has a row per tp."""
    spec = importlib.util.spec_from_file_location("tensor_parallel_memory", HERE.parents[1] / SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parser().parse_args(["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2"])
    args.vocab, args.tp = 512, [1, 2]
    path = bench.make_model(args, tmp_path)
    for tp in args.tp:
        proc = procs.run(bench.worker_args(args, path, tp), ranks=tp, script=HERE.parents[1] / SCRIPT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted((tmp_path / "base").glob("*.safetensors"))
    lines, per_tp = bench.report(args, {tp: bench.read_results(path, tp) for tp in args.tp}, shards)
    assert "rank peak RSS MiB" in lines[1] and [line.split()[0] for line in lines[2:]] == ["1", "2"]
    one = per_tp["1"]["ranks"][0]
    assert per_tp["2"]["max_dlogit"] < 1e-4 and len(per_tp["2"]["ranks"]) == 2
    for half in per_tp["2"]["ranks"]:
        assert 0.5 <= half["parameters"] / one["parameters"] < 0.51
        assert 0.5 <= half["decode_state"] / one["decode_state"] < 0.501  # (a few position counters stay whole)
        assert half["peak_rss"] > 0 and half["load_s"] > 0


def _per_phase(prefix: Path, world: int) -> dict:
    """{(phase, layers, lora): Counter of (op, bytes)} from rank 0's record (collective_calls: the ranks' equal)."""
    out, phase = {}, None
    for c in procs.collective_calls(prefix, world):
        if c["op"] == "marker":
            words = c["where"].split()
            phase = (words[0], *(w.split("=")[1] for w in words[1:])) if words[0] != "end" else None
            out.setdefault(phase, Counter())
        elif phase is not None:
            size = 4 if c["dtype"] and c["dtype"][0] == "torch.float32" else 2
            out[phase][(c["op"], sum(math.prod(s) for s in c["shape"]) * size)] += 1
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_the_recorder_sees_the_split_layers_collectives_per_block(tp, tmp_path):
    """The collective checker records DTensor's functional collectives too (funcol.*), from one training step through
    stage 2's engine at tp > 1 (tp_collectives.py). Per decoder block (3 layers minus 2, every rank the same calls):
    Megatron's 2 all-reduces of one activation each ([1, 16, 64] fp32, 4 KiB) in the forward (the attention's and the
    MLP's outputs) and 2 in the backward (their inputs' gradients: q/k/v and gate/up share one each). LoRA on q/k/v/o
    (at tp 2; its counts do not depend on tp) adds none per block: its replicated factors' gradients are partial sums,
    added up in one all-reduce per optimizer step. Around the blocks: the embedding's one all-reduce, and the
    loss-parallel cross-entropy's 3 of [16] fp32 (no rank gathers the [1, 16, 128] logits: no all_gather at all)."""
    prefix = tmp_path / "collectives"
    args = ["--lora"] if tp == 2 else []
    proc = procs.run(args, procs.checked(prefix), ranks=tp, script=HERE / "tp_collectives.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = _per_phase(prefix, tp)
    act, loss = ("funcol.all_reduce", 1 * 16 * 64 * 4), ("funcol.all_reduce", 16 * 4)
    norm = ("all_reduce", 4)  # the clipping norm's sum of squares over the tensor-parallel ranks
    for lora in ("False", "True") if tp == 2 else ("False",):
        for phase, block in (("forward", {act: 2}), ("backward", {act: 2})):
            got = phases[(phase, "3", lora)] - phases[(phase, "2", lora)]
            assert dict(got) == block, (phase, lora, dict(got))
        assert dict(phases[("forward", "2", lora)]) == {act: 2 * 2 + 1, loss: 3}, dict(phases[("forward", "2", lora)])
        assert dict(phases[("backward", "2", lora)]) == {act: 2 * 2}, dict(phases[("backward", "2", lora)])
        factors = 4 * 256 * 4  # per layer: q/k/v's lora_A [4, 64] and o's lora_B [64, 4], fp32
        for layers in (2, 3):
            step = {norm: 1, **({("all_reduce", layers * factors): 1} if lora == "True" else {})}
            assert dict(phases[("step", str(layers), lora)]) == step, dict(phases[("step", str(layers), lora)])
