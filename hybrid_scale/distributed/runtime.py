"""Process-group plumbing shared by the stages: one process, or N under torchrun / srun.

Every hand-written collective of the stages goes through the helpers below. They take (or make) tensors on the
runtime's device, so that the same code runs under gloo (CPU) and NCCL (GPU, which takes CUDA tensors only), and
every rank passes the same dtype and shape (gloo aborts the process on a mismatch; NCCL hangs or corrupts). On GPUs
the group has both backends ("cpu:gloo,cuda:nccl"): all_gather_object and barrier work too."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .environment import srun_environment


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp: int = 1  # launch.tensor_parallel: consecutive ranks form a tensor-parallel group (inside a node)
    timeout_min: float = 60.0  # launch.timeout_min: how long a collective waits for the slowest rank

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of tensor-parallel groups, each working on its own share of the data."""
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def timeout(self) -> timedelta:
        return timedelta(minutes=self.timeout_min)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """model.device as a torch device for this process: auto = cuda:<local rank> when a GPU is visible, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                "config key 'model.device' is cuda but this process sees no GPU (torch.cuda.is_available() is "
                "False): run on a GPU node, or set model.device=cpu (or auto)"
            )
        if torch.cuda.device_count() <= local_rank:
            raise ConfigError(
                f"config key 'model.device': local rank {local_rank} has no GPU ({torch.cuda.device_count()} "
                "visible): start at most one process per GPU (launch.procs_per_node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init(device: str = "auto", tp: int = 1, timeout_min: float = 60.0) -> Runtime:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK) or srun does (one task per rank),
    or run alone. The device is model.device (auto: the local rank's GPU when there is one); `tp` is
    launch.tensor_parallel, which must divide the number of ranks started; `timeout_min` (launch.timeout_min) is the
    process group's timeout: how long any collective waits for the slowest rank (e.g. one still reading shards)."""
    for key, value in srun_environment().items():
        os.environ.setdefault(key, value)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if tp < 1 or world % tp:
        raise ConfigError(
            f"config key 'launch.tensor_parallel': {tp} does not divide the {world} ranks this job started; start a "
            f"multiple of {tp} ranks (launch.procs_per_node) or set launch.tensor_parallel to a divisor of {world}"
        )
    dev = resolve_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rt = Runtime(rank, world, local, dev, tp, timeout_min)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend(dev), timeout=rt.timeout)
    return rt


def _on_device(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    if t.device != rt.device:  # a programming error: NCCL would refuse it, or (dual backend) it would go slowly
        raise RuntimeError(f"collective on a {t.device} tensor; this rank computes on {rt.device}")
    return t


def all_reduce(rt: Runtime, t: torch.Tensor, op: str = "sum", group=None, size: int | None = None) -> torch.Tensor:
    """In place over the ranks (sum / min / max), or over a subgroup (`group` of `size` ranks, e.g. the
    data-parallel ranks of tensor_parallel.groups); a no-op alone."""
    if (rt.world if size is None else size) > 1:
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(_on_device(rt, t), op=ops.get(op, op), group=group)
    return t


def broadcast(rt: Runtime, t: torch.Tensor, src: int) -> torch.Tensor:
    """In place from rank `src`; a no-op alone."""
    if rt.distributed:
        dist.broadcast(_on_device(rt, t), src)
    return t


def all_ranks(rt: Runtime, ok: bool) -> bool:
    """True when `ok` holds on every rank (the same answer everywhere)."""
    if not rt.distributed:
        return bool(ok)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def any_rank(rt: Runtime, flag: bool) -> bool:
    """True when `flag` holds on some rank (e.g. a signal that reached one of them)."""
    return not all_ranks(rt, not flag)


def gather_objects(rt: Runtime, obj):
    """List of every rank's obj (on every rank); [obj] when alone."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world
    dist.all_gather_object(out, obj)
    return out


def barrier(rt: Runtime) -> None:
    if rt.distributed and rt.device.type == "cuda":
        dist.barrier(device_ids=[rt.device.index])
    elif rt.distributed:
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
    dist.init_process_group(backend(rt.device), timeout=rt.timeout)
