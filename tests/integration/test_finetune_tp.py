"""Stage 2 at launch.tensor_parallel 2 on the tiny converted model: the same run at any split (data x tensor meshes
of 2 and 4 ranks against ZeRO-3), bf16, stopping at one split and resuming at the other, replicated state that
drifts apart."""

import math
from pathlib import Path

import procs
import pytest
import torch
from conftest import assert_split
from finetune_common import assert_schedule, curves, finetune, make_setup, overrides
from safetensors.torch import load_file

from hybrid_scale.finetune.checkpoints import committed_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(smollm2, tmp_path_factory):
    return make_setup(smollm2, tmp_path_factory)


# --- tensor parallelism (launch.tensor_parallel): the same run at any split --------------------------------------


def tp_args(setup: Path, run: Path, ranks: int, tp: int, *extra) -> list[str]:
    return overrides(
        setup, run, "finetune.max_steps=5", f"launch.procs_per_node={ranks}", f"launch.tensor_parallel={tp}", *extra
    )


@pytest.fixture(scope="module")
def tp1(setup, tmp_path_factory):
    """5 steps on 2 ranks, tensor_parallel 1 (ZeRO-3 over 2 data-parallel ranks)."""
    run = tmp_path_factory.mktemp("tp1")
    proc = finetune(tp_args(setup, run, 2, 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def same_run(a: Path, b: Path, tol: float) -> None:
    """Equal loss curves (training and held-out) and equal saved adapters and phi/gamma, within tol."""
    ca, cb = curves(a), curves(b)
    for key in ("train", "hybrid", "la_only"):
        assert len(ca[key]) == len(cb[key]) > 0, key
        assert max(abs(x - y) for x, y in zip(ca[key], cb[key], strict=True)) <= tol, (key, ca[key], cb[key])
    for name in ("adapter/adapter_model.safetensors", "hybrid_params.safetensors"):
        x, y = (load_file(run / "stage2" / "final" / name) for run in (a, b))
        assert x.keys() == y.keys() and x
        worst = max((x[k].float() - y[k].float()).abs().max().item() for k in x)
        assert worst <= tol, (name, worst)


def test_tensor_parallel_2_trains_as_tensor_parallel_1(setup, tp1, tmp_path):
    """2 ranks splitting every layer's heads (data 1 x tensor 2) against ZeRO-3 on 2 data-parallel ranks: the same
    5-step loss curve and held-out losses within 1e-5, the same adapter and phi/gamma (whole tensors on disk)."""
    prefix = tmp_path / "collectives"
    proc = finetune(tp_args(setup, tmp_path, 2, 2), env=procs.checked(prefix))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "stage2" / "log.txt").read_text()
    assert "(data 1 x tensor 2)" in log
    report = next(line for line in log.splitlines() if "tensor parallel 2: each rank holds" in line)
    assert_split(report, 2, kinds=("q_proj", "o_proj", "q_proj.lora_B", "o_proj.lora_A"))  # LoRA split with its linear
    same_run(tp1, tmp_path, 1e-5)
    assert_schedule(tp1, 5)
    assert_schedule(tmp_path, 5)  # the replicated engine: the same schedule
    calls = procs.collective_calls(prefix, 2)  # every rank the same calls, each on its device
    ours = [c for c in calls if c["where"].startswith(("runtime.py", "replicated.py")) and c["dtype"]]  # (not objects)
    assert ours and all(c["dtype"][0] in ("torch.float32", "torch.float64", "torch.int32") for c in ours)


def test_bf16_at_tensor_parallel_2_stays_near_fp32(setup, tp1, tmp_path):
    """The presets' dtype on the split path: a bf16 frozen base split over 2 ranks, fp32 LoRA and phi/gamma in the
    replicated engine; the 5 training and the held-out losses within 1% of the fp32 run's."""
    proc = finetune(tp_args(setup, tmp_path, 2, 2, "model.dtype=bfloat16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = curves(tmp_path), curves(tp1)
    for key in ("train", "hybrid", "la_only"):
        assert len(got[key]) == len(ref[key]) and all(math.isfinite(x) for x in got[key])
        assert max(abs(a - b) / b for a, b in zip(got[key], ref[key], strict=True)) < 0.01, (key, got[key], ref[key])
    adapter = load_file(tmp_path / "stage2" / "final" / "adapter" / "adapter_model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.float32}  # trained and saved as fp32 masters


def test_data_2_x_tensor_2_trains_as_data_2(setup, tp1, tmp_path):
    """4 ranks: a 2 x 2 mesh (the replicated engine over 2 data-parallel groups, each splitting every layer over 2
    ranks) against ZeRO-3 over 2 data-parallel ranks (tp1), 5 steps: the same data split, the same curve and adapter."""
    proc = finetune(tp_args(setup, tmp_path, 4, 2), ranks=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(data 2 x tensor 2)" in (tmp_path / "stage2" / "log.txt").read_text()
    same_run(tp1, tmp_path, 1e-5)


def test_a_run_stopped_at_tensor_parallel_2_resumes_at_tensor_parallel_1(setup, tp1, tmp_path):
    """Killed after saving step 3 at tensor_parallel 2; resumed on 2 ranks at tensor_parallel 1 (ZeRO-3), from the
    whole tensors of the checkpoint: the curve and the adapter of the uninterrupted run."""
    proc = finetune(tp_args(setup, tmp_path, 2, 2), env={"HYBRID_SCALE_FAULT": "saved:3"})
    assert proc.returncode != 0
    stage2 = tmp_path / "stage2"
    assert [p.name for p in committed_steps(stage2)] == ["step_00000003"]
    weights = load_file(stage2 / "step_00000003" / "trainable.safetensors")
    reference = load_file(tp1 / "stage2" / "step_00000003" / "trainable.safetensors")
    assert weights.keys() == reference.keys()
    assert all(weights[k].shape == reference[k].shape for k in weights)  # whole tensors, not a rank's part
    proc = finetune(tp_args(setup, tmp_path, 2, 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step_00000003" in (stage2 / "log.txt").read_text()
    same_run(tp1, tmp_path, 1e-5)
    assert_schedule(tmp_path, 5)  # steps 1-3 replicated, 4-5 DeepSpeed's


def test_a_run_stopped_at_tensor_parallel_1_resumes_at_tensor_parallel_2(setup, tp1, tmp_path):
    """The other way: killed after saving step 3 under ZeRO-3 (tensor_parallel 1, 2 ranks); resumed on 2 ranks at
    tensor_parallel 2, each cutting its parts from the whole saved tensors: the uninterrupted run's curve and
    adapter."""
    proc = finetune(tp_args(setup, tmp_path, 2, 1), env={"HYBRID_SCALE_FAULT": "saved:3"})
    assert proc.returncode != 0
    stage2 = tmp_path / "stage2"
    assert [p.name for p in committed_steps(stage2)] == ["step_00000003"]
    proc = finetune(tp_args(setup, tmp_path, 2, 2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step_00000003 (step 3, saved by 2 ranks, now 2)" in (stage2 / "log.txt").read_text()
    same_run(tp1, tmp_path, 1e-5)
    assert_schedule(tmp_path, 5)  # steps 1-3 DeepSpeed's, 4-5 replicated


def test_replicated_state_that_drifts_apart_across_ranks_stops_the_run_naming_the_tensor(setup, tmp_path):
    """At tensor_parallel 2 the trainable state not split is replicated: a checksum all-reduce at each held-out
    evaluation finds a copy that moved on one rank (fault injection: rank 1 adds 1e-3 after each step) and stops the
    run with one line naming the tensor, before a wrong checkpoint is written."""
    proc = finetune(tp_args(setup, tmp_path, 2, 2), env={"HYBRID_SCALE_FAULT": "drift"})
    assert proc.returncode == 1, proc.stderr[-3000:]  # (each rank exits 2; torchrun reports 1)
    line = next(x for x in proc.stderr.splitlines() if "differs across ranks" in x)
    assert line.startswith("hybrid-scale finetune: error: base_model.model.") and "lora_A" in line, line
    assert not committed_steps(tmp_path / "stage2") or committed_steps(tmp_path / "stage2")[-1].name < "step_00000005"
