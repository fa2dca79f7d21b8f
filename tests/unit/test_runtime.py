"""The runtime's collectives: the only place the stages call torch.distributed's collectives, on device tensors."""

import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hybrid_scale.distributed import runtime
from hybrid_scale.errors import ConfigError

PACKAGE = Path(runtime.__file__).parents[1]
COLLECTIVE = re.compile(r"\bdist\.(all_reduce|broadcast|all_gather\w*|reduce\w*|gather|scatter|send|recv)\(")


def test_only_the_runtime_calls_collectives_directly():
    """Every stage goes through runtime.all_reduce / broadcast / all_ranks / any_rank, which check the device."""
    callers = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "import torch.distributed" in p.read_text() and COLLECTIVE.search(p.read_text())
    )  # (loglik's `dist` is a distribution over the vocabulary)
    assert callers == ["distributed/runtime.py"]


def test_a_tensor_off_the_ranks_device_is_refused_before_any_collective():
    """What NCCL would refuse on a GPU rank (a CPU tensor), the runtime refuses on every backend, at the call."""
    rt = runtime.Runtime(rank=0, world=2, device=torch.device("meta"))  # a rank computing elsewhere than the CPU
    with pytest.raises(RuntimeError, match="collective on a cpu tensor; this rank computes on meta"):
        runtime.all_reduce(rt, torch.zeros(2))
    with pytest.raises(RuntimeError, match="collective on a cpu tensor"):
        runtime.broadcast(rt, torch.zeros(2), 0)


def test_alone_the_helpers_need_no_process_group():
    rt = runtime.Runtime()
    assert runtime.all_ranks(rt, True) and not runtime.any_rank(rt, False)
    t = torch.ones(3)
    assert runtime.all_reduce(rt, t) is t


def test_device_resolution():
    assert runtime.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert runtime.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="model.device' is cuda but this process sees no GPU"):
            runtime.resolve_device("cuda")
    assert runtime.backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert runtime.backend(torch.device("cpu")) == "gloo"


def test_launch_timeout_min_is_the_process_groups_timeout(monkeypatch):
    """launch.timeout_min reaches init_process_group: how long a collective waits for a rank still reading."""
    seen = {}
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rt = runtime.init("cpu", tp=2, timeout_min=90)
    assert seen == {"backend": "gloo", "timeout": timedelta(minutes=90)} and rt.timeout_min == 90


def test_a_step_checkpoint_keeps_the_gpus_random_state_too(monkeypatch):
    """LoRA dropout draws on the GPU: a resume at the same world size restores its generator, not only the CPU's (a
    checkpoint saved on CPU has no GPU state, and the GPU's stays seeded)."""
    from hybrid_scale.finetune import checkpoints

    gpu = {"state": torch.tensor([7, 7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: gpu.update(state=state))
    cuda = torch.device("cuda", 0)
    saved = checkpoints.rng_state(cuda)
    assert set(saved) == {"rng", "cuda_rng"} and set(checkpoints.rng_state(torch.device("cpu"))) == {"rng"}
    gpu["state"] = torch.tensor([1, 2], dtype=torch.uint8)
    checkpoints.set_rng_state(saved, cuda)
    assert gpu["state"].tolist() == [7, 7]
    checkpoints.set_rng_state({"rng": saved["rng"]}, cuda)  # saved on CPU: the GPU's generator is left as it is
    assert gpu["state"].tolist() == [7, 7]
