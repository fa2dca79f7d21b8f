"""What a run shows while it runs (hybrid_scale/run/metrics.py) on the tiny model: stage 1 and stage 2 (2 ranks) write
their per-step records to metrics.jsonl, TensorBoard (read back with tensorboard's EventAccumulator) and an offline
W&B run (read back from its .wandb file with wandb's own protobuf records); rank 0 alone writes; a stage 1 killed
mid-layer and a stage 2 killed after a step, each resumed from its last commit, hold every step exactly once
everywhere; an evaluation stopped after a cell and rerun holds every cell once; `status` shows the stopped stage's
last metrics. (A missing logger package: tests/unit/test_run_entry.py.)"""

import json
import struct

import procs
import pytest
from conftest import tiny_run_overrides

pytestmark = pytest.mark.slow

WANDB = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def records(path, kind="step"):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def tensorboard(directory, tag):
    """(step, value) of a scalar in a TensorBoard log directory, by tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_history(directory):
    """Every history row of the offline W&B runs under `directory` (run id, step, {key: value}), from their .wandb
    files: wandb's record log (a ':W&B' header, then 32 KiB blocks of checksummed, length-prefixed chunks) holding
    wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        data, out, pos = path.read_bytes(), b"", 7  # header: ':W&B', magic 0xBEE1, version
        while pos + 7 <= len(data):
            block_left = 32768 - pos % 32768
            if block_left < 7:  # a block's tail too short for a chunk header is padding
                pos += block_left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            out += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                record = wandb_internal_pb2.Record()
                record.ParseFromString(out)
                out = b""
                if record.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    rows.append((path.stem.removeprefix("run-"), record.history.step.num, items))
    return rows


def test_stage_metrics_reach_every_sink_once_per_step_through_a_kill_and_resume(tiny_run_model, tmp_path):
    """About 90 s (five CLI runs, two of them 2-rank torchruns): the only test where a real SIGKILL lands between a
    logged step and its commit, for each stage, with all three sinks on; the resumed run must purge what the killed
    one logged past the commit (TensorBoard and W&B included), which no in-process test of the sinks can show."""
    run = tmp_path / "run"
    args = [*tiny_run_overrides(tiny_run_model, run), "log.tensorboard=true", "log.wandb=hybrid-scale-test"]
    # stage 1, SIGKILLed after its step 3 (layer 1's first, logged but not committed), then resumed at layer 1
    killed1 = procs.run(["distill", *args], {**WANDB, "HYBRID_SCALE_FAULT": "train:1:0"})
    assert killed1.returncode != 0
    assert [r["step"] for r in records(run / "stage1" / "metrics.jsonl")] == [1, 2, 3]
    s1 = procs.run(["distill", *args], WANDB)
    assert s1.returncode == 0, s1.stderr[-3000:]
    assert "start at layer 1 of 2" in (run / "stage1" / "log.txt").read_text()
    steps1 = records(run / "stage1" / "metrics.jsonl")
    assert [r["step"] for r in steps1] == [1, 2, 3, 4]  # 2 layers x (8 sequences / batch 4) x 1 epoch
    assert [r["layer"] for r in steps1] == [0, 0, 1, 1] and all(r["tokens_per_s"] > 0 for r in steps1)
    layers = records(run / "stage1" / "metrics.jsonl", "layer")
    assert [(r["step"], r["layers_left"]) for r in layers] == [(2, 1), (4, 0)] and layers[-1]["eta_s"] == 0
    assert [s for s, _ in tensorboard(run / "stage1" / "tensorboard", "distill/step/loss")] == [1, 2, 3, 4]
    history1 = sorted((step, items["distill/step/loss"]) for _, step, items in wandb_history(run / "stage1")
                      if "distill/step/loss" in items)  # fmt: skip
    assert history1 == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps1]

    # stage 2 on 2 ranks, SIGKILLed after step 3 (checkpoints every 2 steps), then resumed from step 2
    killed = procs.run(["finetune", *args], {**WANDB, "HYBRID_SCALE_FAULT": "step:3"}, ranks=2)
    assert killed.returncode != 0
    metrics = run / "stage2" / "metrics.jsonl"
    assert [r["step"] for r in records(metrics)] == [1, 2, 3]  # rank 0 alone: each step once
    status = procs.run(["status", str(run)])
    assert "stage 2: running or stopped" in status.stdout and "step 3/6, loss " in status.stdout, status.stdout
    again = procs.run(["finetune", *args], WANDB, ranks=2)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = records(metrics)
    curves = json.loads((run / "stage2" / "curves.json").read_text())
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # step 3 of the killed run went with its work
    assert [r["loss"] for r in steps] == curves["train"]
    assert all(len(r["gamma"]) == 2 and r["lr"] >= 0 and r["grad_norm"] > 0 and "ssd_p" in r for r in steps)
    held = records(metrics, "heldout")
    assert [(r["step"], r["hybrid"], r["la_only"]) for r in held] == list(
        zip(curves["eval_steps"], curves["hybrid"], curves["la_only"], strict=True)
    )
    tb = tensorboard(run / "stage2" / "tensorboard", "finetune/step/loss")
    assert [s for s, _ in tb] == [1, 2, 3, 4, 5, 6]  # the killed run's step 3 purged, written once again
    assert [v for _, v in tb] == pytest.approx(curves["train"], rel=1e-6)
    history = wandb_history(run / "stage2")
    assert len({run_id for run_id, _, _ in history}) == 1  # one W&B run, resumed under its id
    logged = sorted((step, items["finetune/step/loss"]) for _, step, items in history if "finetune/step/loss" in items)
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in logged] == pytest.approx(curves["train"], rel=1e-6)

    # one record per cell, cells done of total, the ETA; the same in TensorBoard
    # the evaluation, stopped by USR1 after its first cell (exit 75, the requeue), then rerun
    stopped = procs.run(["evaluate", *args, "log.wandb=null"], {**WANDB, "HYBRID_SCALE_FAULT": "eval:base.piqa@USR1"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert [r["cells_done"] for r in records(run / "eval" / "metrics.jsonl", "cell")] == [1]
    ev = procs.run(["evaluate", *args, "log.wandb=null"], WANDB)
    assert ev.returncode == 0, ev.stderr[-3000:]
    cells = records(run / "eval" / "metrics.jsonl", "cell")
    total = cells[0]["cells_total"]
    assert [r["cells_done"] for r in cells] == list(range(1, total + 1)) and cells[-1]["eta_s"] == 0
    assert cells[0]["cell"] == "base.piqa" and "metric" in cells[0]["figures"]
    cells_tb = tensorboard(run / "eval" / "tensorboard", "evaluate/cell/cells_done")
    assert [int(v) for _, v in cells_tb] == list(range(1, total + 1))
