"""`hybrid-scale plan --dry-run` (dry_run.py) at the presets' real shapes: stage 1, stage 2 and evaluation set
up and stepped as rank 0 of the real mesh, on the meta device under torch's fake process group, against plan's
figures."""

import procs
import pytest

from hybrid_scale import dry_run

SPLIT_70B = ["launch.tensor_parallel=8", "finetune.offload=false", "eval.shard_weights=false"]


def _plan(args):
    """The dry run's output. The presets' model.path is a placeholder, so plan blocks (on that, and on a disk here
    too small for the export) and
    `plan --dry-run` exits 1 after its dry run (a script's `plan --dry-run && sbatch` submits nothing)."""
    proc = procs.run(["plan", *args, "--dry-run"], timeout=600)
    assert "dry run of stage 1" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    blocked = [line for line in proc.stdout.splitlines() if line.startswith("BLOCKING")]
    assert any("is not a Hugging Face model directory" in line for line in blocked), blocked
    assert all("model.path" in line or "GB free" in line for line in blocked), blocked  # (and this machine's disk)
    assert proc.returncode == 1
    assert f"plan --dry-run: exit 1: {len(blocked)} blocking problem(s) listed above" in proc.stderr
    return proc, proc.stdout[proc.stdout.index("dry run of stage 1") :]


def _rows(out: str, stage: str) -> dict:
    """{figure: [unit, dry run, plan, plan/dry]} of one stage's table."""
    part = out[out.index(f"dry run of {stage} (") :].split("\n\n")[0].splitlines()
    return {line[:32].strip(): line[32:].split() for line in part[2:] if not line.startswith("collectives in")}


def test_the_70b_preset_at_tensor_parallel_8_on_32_ranks_agrees_with_plan():
    """Llama-3-70B, 4 nodes x 8, tp 8: every per-rank figure within 10 % of plan's. Stage 1: a layer / 8, the step's
    8 sequences broadcast from their groups and one gradient all-reduce. Stage 2's collectives exactly as Megatron
    counts them: per micro-batch forward 2 per block (160) + the embedding's + the loss-parallel
    cross-entropy's 3; backward 2 per block + the recomputed attention output's (activation checkpointing) + 1; per
    optimizer step the data-parallel gradients', LoRA's replicated factors' and the clipping norm's; 16 micro-batches
    (64 sequences over 4 data-parallel groups). Evaluation: 161 all-reduces and the logits' one gather."""
    proc, out = _plan(["models/llama3-70b.yaml", *SPLIT_70B])
    assert proc.returncode == 1, out + proc.stderr[-3000:]  # blocked by the placeholder model.path alone (_plan)
    assert "split over 8 tensor-parallel ranks; trainable state fp32, replicated over 4; 16 micro-batch(es)" in out
    one = _rows(out, "stage 1")
    assert one["layer weights per rank"] == ["GB", "0.214", "0.214", "1.000"]  # 1.7 GB / 8
    assert one["collectives per optimizer step"] == ["9", "9", "1.000"]
    assert "collectives in the step: all_reduce x1, broadcast x8" in out  # the batch from 4 groups; the gradients
    rows = _rows(out, "stage 2")
    assert rows["weights per rank"] == ["GB", "17.665", "17.638", "0.999"]  # 141 GB / 8, norms whole
    assert rows["trainable parameters per rank"] == ["M", "22.45", "22.45", "1.000"]  # of 32.8 M: B of q/k/v, A of o
    assert rows["collectives per optimizer step"] == ["6,483", "6,483", "1.000"]
    assert "collectives in the forward: funcol.all_reduce x164" in out
    assert "collectives in the backward: funcol.all_reduce x241" in out
    assert "collectives in the step: all_reduce x3" in out
    assert "collectives in the forward: funcol.all_gather_single x1, funcol.all_reduce x161" in out
    assert "DIFFERS" not in out and out.rstrip().endswith("dry run: plan agrees within 10%")


def test_the_8b_preset_under_zero3_on_8_ranks_agrees_with_plan():
    """Llama-3-8B as its preset runs it (1 node x 8, tp 1, ZeRO-3): the model with LoRA goes through a forward and
    backward at its real shape; the bytes follow ZeRO-3's partitioning rule (its engine is not started)."""
    proc, out = _plan(["models/llama3-8b.yaml"])
    assert proc.returncode == 1, out + proc.stderr[-3000:]  # blocked by the placeholder model.path alone (_plan)
    assert "ZeRO-3 partitions over 8 ranks (DeepSpeed's rule; its engine is not started)" in out
    assert _rows(out, "stage 2")["weights per rank"][:2] == ["GB", "2.013"]  # 16 GB of bf16 / 8
    assert _rows(out, "stage 1")["layer weights per rank"][:2] == ["GB", "0.436"]  # one whole layer per rank
    assert "DIFFERS" not in out and out.rstrip().endswith("dry run: plan agrees within 10%")


@pytest.mark.fast
def test_a_figure_off_by_more_than_the_tolerance_is_flagged():
    rows = dry_run.compare({"weights_bytes": 100, "collectives_per_step": 100}, {"weights_bytes": 109})
    assert [(r["key"], r["ok"]) for r in rows] == [("weights_bytes", True), ("collectives_per_step", False)]
    rows = dry_run.compare({"collectives_per_step": 6480}, {"collectives_per_step": 5187})  # plan without recompute
    assert not rows[0]["ok"] and rows[0]["ratio"] == pytest.approx(0.8, abs=0.001)
