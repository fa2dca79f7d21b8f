"""DeepSpeed starts without compiling its shared-memory all-reduce op (~70 s on 2 cores), which nothing here uses."""

import os
import subprocess
import sys

import procs
import pytest

SCRIPT = """
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from hybrid_scale.distributed.deepspeed import import_deepspeed
import_deepspeed().init_distributed(dist_backend="gloo")
import deepspeed.comm
print("shm op:", deepspeed.comm.comm.cdb.shm_comm_op)
"""


def test_deepspeed_starts_without_building_the_shared_memory_op(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PORT": str(procs.free_port()), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "shm op: None" in out.stdout and "built successfully" not in out.stdout + out.stderr
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))


def test_every_command_names_the_accelerator_before_it_runs(monkeypatch):
    """transformers reaches DeepSpeed's accelerator detection through accelerate while it loads a model (`make
    quickstart` fetching the default model printed DeepSpeed's '[WARNING] Setting accelerator to CPU'): the command
    line names the accelerator (DS_ACCELERATOR) before any command runs."""
    from hybrid_scale import cli
    from hybrid_scale.data import assets

    seen = []

    def prepare(force=False):
        seen.append(os.environ.get("DS_ACCELERATOR"))
        raise SystemExit(0)

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(assets, "prepare", prepare)
    with pytest.raises(SystemExit):
        cli.main(["assets"])
    assert seen == [None if any(os.path.exists(p) for p in cli.NVIDIA_DEVICES) else "cpu"]
