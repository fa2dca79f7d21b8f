"""The launch wrappers (launch/torchrun.sh, launch/deepspeed.sh) for real: two "nodes" on localhost whose
rendezvous comes from a Slurm environment, and the DeepSpeed launcher on one node with two processes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import procs
import pytest
from conftest import tiny_run_overrides
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def wrapper(name: str, args: list[str], env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not the outer job's, if any
    env.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env_extra})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen(
        [str(ROOT / "launch" / name), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} timed out: {out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    return out


def params(run: Path) -> dict:
    return load_file(run / "stage1" / "converted" / "hybrid_params.safetensors")


def test_two_nodes_rendezvous_from_the_slurm_environment_and_the_deepspeed_launcher(tiny_run_model, tmp_path):
    """About 60 s (two torchrun "nodes" and the DeepSpeed launcher, each a stage 1): the wrappers are shell scripts
    that derive the rendezvous from Slurm's environment; only starting them for real shows that the ranks meet."""
    port = procs.free_port()
    two_nodes = tmp_path / "two_nodes"
    args = ["distill", *tiny_run_overrides(tiny_run_model, two_nodes, "distill.epochs=2")]
    slurm = {"SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7000"}  # port = launch.master_port + 7000 % 1000
    nodes = [
        wrapper(
            "torchrun.sh",
            [*args, "launch.nodes=2", "launch.procs_per_node=1", f"launch.master_port={port}"],
            {**slurm, "SLURM_NODEID": str(n)},
        )
        for n in (0, 1)
    ]
    outs = [finish(p) for p in nodes]
    for n, out in enumerate(outs):
        assert f"torch.distributed.run --nnodes=2 --nproc-per-node=1 --node-rank={n} --master-addr=localhost" in out
        assert f"--master-port={port} --shutdown-timeout=105" in out  # slurm.signal_lead_s 120 - 15: the save's time
    assert "start at layer 0 of 2: 2 ranks" in (two_nodes / "stage1" / "log.txt").read_text()

    one_node = tmp_path / "one_node"  # the same two ranks, started by the DeepSpeed launcher on one node
    out = finish(
        wrapper(
            "deepspeed.sh",
            [
                "distill",
                *tiny_run_overrides(tiny_run_model, one_node, "distill.epochs=2"),
                "launch.procs_per_node=2",
                f"launch.master_port={procs.free_port()}",
            ],
            {},
        )
    )
    assert "deepspeed.launcher.runner --num_nodes=1 --num_gpus=2 --node_rank=0 --master_addr=localhost" in out
    assert "dist_world_size=2" in out
    assert "start at layer 0 of 2: 2 ranks" in (one_node / "stage1" / "log.txt").read_text()
    a, b = params(two_nodes), params(one_node)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # same world, same sharding: bitwise
    assert min(a[k].abs().max() for k in a if k.endswith("feature_map_q.bias")) > 1e-3  # trained away from init (0)

    # stage 2 under the DeepSpeed launcher: ZeRO-3 over its two processes (they get --local_rank from it)
    out = finish(
        wrapper(
            "deepspeed.sh",
            [
                "finetune",
                *tiny_run_overrides(tiny_run_model, one_node, "finetune.max_steps=4", "finetune.eval_every=0"),
                "launch.procs_per_node=2",
                f"launch.master_port={procs.free_port()}",
            ],
            {},
        )
    )
    log = (one_node / "stage2" / "log.txt").read_text()
    assert "2 ranks" in log and "done at step 4" in log, out[-3000:]


def test_wrapper_usage_and_export_on_one_process_only(tiny_run_model, tmp_path):
    usage = "launch/torchrun.sh STAGE [CONFIG] [key=value ...]"
    proc = subprocess.run([str(ROOT / "launch" / "deepspeed.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and usage in proc.stderr
    proc = subprocess.run([str(ROOT / "launch" / "torchrun.sh"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and usage in proc.stdout
    # export is rank 0's work: node 0 runs it without a launcher, node 1 has nothing to do
    args = ["export", f"run_dir={tmp_path}", "launch.nodes=2", "launch.procs_per_node=4"]
    out = finish(wrapper("torchrun.sh", args, {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "localhost"}))
    assert "export: node 0 runs it; nothing to do on this node" in out
    proc = wrapper("torchrun.sh", args, {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and f"+ {sys.executable} -m hybrid_scale.cli export" in out
    assert f"config key 'export.model': {tmp_path} has no stage-2 or stage-1 model yet" in out
