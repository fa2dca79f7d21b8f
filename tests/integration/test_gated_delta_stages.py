"""The stages train and measure the gated delta-rule LA (attention.la_kind=gated_delta): stage 1 on the LA's output
(its gates and convolution move), stage 2's LoRA with Scheduled Sliding-window Dropout, the evaluation with every
mode, the LA share, the passkey and the associative-recall probe, on the tiny pipeline model."""

import json
import subprocess
import sys

import torch
from conftest import tiny_run_overrides
from safetensors.torch import load_file

from hybrid_scale.evaluate.results import EvalResults


def test_stage1_stage2_with_ssd_and_the_evaluation_run_gated_delta(tiny_run_model, tmp_path):
    run = tmp_path / "run"
    overrides = tiny_run_overrides(
        tiny_run_model, run, "attention.la_kind=gated_delta", "attention.la_conv=3", "attention.hybrid_sinks=true",
        "attention.sinks=2", "distill.recipe=ssd", "distill.objectives={output_mse: 1.0}", "finetune.max_steps=4",
        "eval.modes=[base,hybrid,swa_only,la_only,none]", "eval.la_share_seq_len=64", "eval.recall_pairs=3",
        "eval.passkey_modes=[hybrid,swa_sinks,la_only]", "eval.passkey_distances=[10,24]",
    )  # fmt: skip
    for stage in ("distill", "finetune", "evaluate"):
        done = subprocess.run([sys.executable, "-m", "hybrid_scale", stage, *overrides], capture_output=True, text=True)
        assert done.returncode == 0, f"{stage}: {done.stderr[-3000:]}"
    config = json.loads((run / "stage1" / "converted" / "hybrid_config.json").read_text())["attention"]
    assert (config["la_kind"], config["la_conv"], config["la_combine"]) == ("gated_delta", 3, "mix")
    params = load_file(run / "stage1" / "converted" / "hybrid_params.safetensors")
    gates = params["model.layers.0.self_attn.la_gates.beta_weight"]
    conv = params["model.layers.0.self_attn.la_conv_q.weight"]
    assert gates.abs().max() > 0 and not torch.equal(
        conv[..., -1], torch.ones_like(conv[..., -1])
    )  # stage 1 moved them
    metrics = [json.loads(line) for line in (run / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert all("ssd_p" in m for m in metrics if m.get("kind") == "step")  # SSD ran (its rate is logged each step)
    r = EvalResults.load(run / "eval" / "results.json")
    assert set(r.perplexity.by_mode) >= {"hybrid", "swa_only", "la_only"}
    share = [h for layer in r.la_share.share.values() for b in layer.values() for h in b]
    assert share and all(0.0 <= h < 1.0 for h in share) and max(share) > 0  # the LA's weight in the output
    for probe in (r.passkey, r.recall):
        assert set(probe.by_mode) == {"hybrid", "swa_sinks", "la_only"}
        assert set(probe.by_mode["hybrid"]) == {"10", "24"}
    assert r.recall.pairs == 3 and r.recall.digits == 4
