"""Process-group plumbing shared by the stages: one process, or N under torchrun (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .slurm import srun_environment


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init(device: str = "auto") -> Runtime:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK) or srun does (one task per rank),
    or run alone."""
    for key, value in srun_environment().items():
        os.environ.setdefault(key, value)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Runtime(rank, world, local, dev)


def gather_objects(rt: Runtime, obj):
    """List of every rank's obj (on every rank); [obj] when alone."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world
    dist.all_gather_object(out, obj)
    return out


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def join_group(rt: Runtime) -> None:
    """A process group even for one process (DeepSpeed wants one): a local rendezvous on a free port."""
    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("nccl" if rt.device.type == "cuda" else "gloo")
