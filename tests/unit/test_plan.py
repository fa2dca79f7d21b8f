"""Presets on the meta device, their DeepSpeed configs, and the preflight plan."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hybrid_scale as hs
from hybrid_scale.cli import main
from hybrid_scale.config import load_config
from hybrid_scale.dist.deepspeed import train_config
from hybrid_scale.dist.slurm import first_host, render
from hybrid_scale.stages.plan import plan

PRESETS = ["smollm2-135m", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b"]
PARAMS_B = {"smollm2-135m": 0.135, "llama3-8b": 8.03, "llama3-70b": 70.6, "mistral-7b": 7.24, "qwen2.5-7b": 7.62}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_and_converts_on_the_meta_device(name):
    cfg = load_config(f"models/{name}.yaml", ["model.path=null"])
    arch = dict(cfg.model.arch)
    config = AutoConfig.for_model(**arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e9 == pytest.approx(PARAMS_B[name], rel=0.02)
    hs.convert_model(model, cfg.attention)
    layers = [m for m in model.modules() if isinstance(m, hs.HybridAttention)]
    assert len(layers) == arch["num_hidden_layers"] and layers[0].q_proj.weight.is_meta
    ranks = cfg.launch.nodes * cfg.launch.procs_per_node
    ds = train_config(cfg.finetune, getattr(torch, cfg.model.dtype), ranks)
    assert ds["train_batch_size"] == cfg.finetune.global_batch and ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"]["enabled"] == (cfg.model.dtype == "bfloat16")
    assert ("offload_param" in ds["zero_optimization"]) == cfg.finetune.offload
    script = render(cfg, "finetune", f"configs/models/{name}.yaml", ["run_dir=runs/x"])
    assert f"#SBATCH --nodes={cfg.launch.nodes}" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --signal=B:USR1@120" in script and "scontrol requeue" in script
    assert ("--gpus-per-node=8" in script) == (cfg.model.device == "cuda")


def test_plan_on_the_70b_preset(tmp_path):
    cfg = load_config("models/llama3-70b.yaml", [f"run_dir={tmp_path}"])
    p = plan(cfg)
    rows = {q: v for _, q, v in p.rows}
    assert rows["parameters"].startswith("70.55 B (141.11 GB in bfloat16)")
    assert rows["ranks"] == "4 node(s) x 8 = 32 (tensor parallel 1)"
    per_rank = float(rows["per-rank memory"].split("~")[1].split()[0])  # stage 2's row comes last
    assert 1 < per_rank < 80  # fits an 80 GB device with offload
    assert p.problems == [
        "model.path /path/to/Meta-Llama-3-70B is not a Hugging Face model directory (no config.json); set model.path"
    ]
    bad = plan(load_config("models/llama3-70b.yaml", ["launch.tensor_parallel=16", f"run_dir={tmp_path}"]))
    assert any(
        m.startswith("num_key_value_heads = 8 is not divisible by launch.tensor_parallel = 16") for m in bad.problems
    )
    no_offload = plan(
        load_config("models/llama3-70b.yaml", ["finetune.offload=false", "launch.nodes=1", "launch.procs_per_node=1"])
    )
    assert any(m.startswith("stage 2 needs ~") and "enable finetune.offload" in m for m in no_offload.problems)


def test_plan_command_exit_codes(smollm2, tmp_path, capsys):
    assert main(["plan", "models/smollm2-135m.yaml", f"run_dir={tmp_path}"]) == 0
    assert "plan: OK" in capsys.readouterr().out
    assert main(["plan", "models/qwen2.5-7b.yaml", "launch.tensor_parallel=8", f"run_dir={tmp_path}"]) == 1
    out = capsys.readouterr().out
    assert "BLOCKING: num_key_value_heads = 4 is not divisible by launch.tensor_parallel = 8" in out


def test_first_host_of_slurm_node_lists():
    assert first_host("localhost") == "localhost"
    assert first_host("gpu[003-005,9]") == "gpu003"
    assert first_host("node7,node9") == "node7"
