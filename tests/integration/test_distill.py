"""Stage 1 on a tiny 3-layer model with a sharded checkpoint: resume after SIGKILL anywhere, rebuild, 2 ranks."""

import json
import signal
from pathlib import Path

import procs
import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer

import hybrid_scale as hs
from hybrid_scale.config import ConfigError, load_config
from hybrid_scale.stages import distill as stage1


@pytest.fixture(scope="module")
def sharded_model(smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    model = tiny_model("llama", vocab_size=49152, num_hidden_layers=3, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(path, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) == 3
    return path


def overrides(model, run_dir, *extra):
    return [
        f"model.path={model}",
        f"run_dir={run_dir}",
        "data.seq_len=64",
        "data.num_sequences=16",
        "distill.batch_size=4",
        "distill.epochs=2",
        "attention.window=8",
        "distill.progress=false",
        "distill.lr=0.05",
        *extra,
    ]


def params(run_dir: Path) -> dict:
    return {k: v for i in range(3) for k, v in load_file(run_dir / "stage1" / f"layer_{i:03d}.safetensors").items()}


def run_cli(args, env_extra=None, torchrun=False):
    return procs.run(["distill", *args], env_extra, timeout=300, ranks=2 if torchrun else 0)


@pytest.fixture(scope="module")
def uninterrupted(sharded_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("full")
    out = stage1.distill(load_config(overrides=overrides(sharded_model, run)))
    return run, out


def test_result_is_a_converted_model_and_training_moved_the_maps(uninterrupted):
    run, out = uninterrupted
    model = hs.load_converted(out, dtype=torch.float32)
    assert sorted(m.layer_idx for m in model.modules() if isinstance(m, hs.HybridAttention)) == [0, 1, 2]
    p = params(run)
    eye = torch.eye(16).expand(4, 16, 16)
    assert not torch.equal(p["model.layers.1.self_attn.feature_map_q.weight"], eye)  # trained away from identity
    assert torch.equal(p["model.layers.1.self_attn.gamma_logit"], torch.full((4,), torch.logit(torch.tensor(0.1))))
    with safe_open(run / "stage1" / "layer_000.safetensors", "pt") as f:  # losses are recorded with each layer
        losses = json.loads(f.metadata()["losses"])
    assert len(losses) == 8 and losses[-1] < losses[0]


@pytest.mark.parametrize("fault, resume_at", [("train:1:5", 1), ("commit:1", 1), ("after:0", 1), ("after:1", 2)])
def test_sigkill_anywhere_then_resume_equals_uninterrupted(sharded_model, uninterrupted, tmp_path, fault, resume_at):
    """Killed mid-layer (training step 5 of layer 1), after writing a layer's parameters but before its commit,
    and between layers: the resumed run starts at the first uncommitted layer and ends bitwise equal."""
    proc = run_cli(overrides(sharded_model, tmp_path), {"HYBRID_SCALE_FAULT": fault})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    stage1.distill(load_config(overrides=overrides(sharded_model, tmp_path)))
    got, ref = params(tmp_path), params(uninterrupted[0])
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    log = (tmp_path / "stage1" / "log.txt").read_text()
    assert f"resuming at layer {resume_at} from buffer" in log and "replaying" not in log


def test_lost_buffer_and_corrupt_layer_file_are_rebuilt(sharded_model, uninterrupted, tmp_path):
    proc = run_cli(overrides(sharded_model, tmp_path), {"HYBRID_SCALE_FAULT": "after:1"})
    assert proc.returncode == -signal.SIGKILL
    for f in (tmp_path / "stage1" / "buffers").iterdir():  # the requeue landed on a node without the buffers
        f.unlink()
    stage1.distill(load_config(overrides=overrides(sharded_model, tmp_path)))
    log = (tmp_path / "stage1" / "log.txt").read_text()
    assert "replaying teacher layer 1 to rebuild layer 2's inputs" in log
    ref = params(uninterrupted[0])
    assert all(torch.equal(params(tmp_path)[k], ref[k]) for k in ref)
    # a damaged layer file is never trusted: layer 1 and what follows are redone
    f = tmp_path / "stage1" / "layer_001.safetensors"
    f.write_bytes(f.read_bytes()[:-7] + b"garbage")
    assert not stage1.committed(tmp_path / "stage1", 1) and stage1.committed(tmp_path / "stage1", 0)
    stage1.distill(load_config(overrides=overrides(sharded_model, tmp_path)))
    assert all(torch.equal(params(tmp_path)[k], ref[k]) for k in ref)


def test_two_ranks_equal_one_rank(sharded_model, uninterrupted, tmp_path):
    proc = run_cli(overrides(sharded_model, tmp_path), torchrun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "stage1" / "buffers").glob("hidden_*.bin")) == [
        "hidden_a.rank0.bin",
        "hidden_a.rank1.bin",
        "hidden_b.rank0.bin",
        "hidden_b.rank1.bin",
    ]
    got, ref = params(tmp_path), params(uninterrupted[0])
    # gradients summed in another order differ by fp rounding; Adam, normalising near-zero gradients, turns that
    # into parameter differences of ~1e-3 of one step (lr 0.05): far below what training moved them
    moved = max((ref[k] - got[k]).abs().max().item() for k in ref)
    assert moved < 1e-3
    trained = ref["model.layers.0.self_attn.feature_map_q.weight"] - torch.eye(16)
    assert trained.abs().max() > 100 * moved, (trained.abs().max(), moved)


def test_preflight_refuses_without_disk_room(sharded_model, tmp_path, monkeypatch):
    monkeypatch.setattr(stage1.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ConfigError, match=r"preflight \(distill\): .* has 0\.00 GB free but this node needs ~0\.00 GB"):
        stage1.distill(load_config(overrides=overrides(sharded_model, tmp_path)))  # the plan, before any work
    with pytest.raises(stage1.DistillError, match=r"stage 1 needs 0\.00 GiB .* only 0\.00 GiB are free: set distill"):
        stage1.preflight(tmp_path / "buffers", 16, 64, 64, torch.float32)  # and the stage's own exact check
