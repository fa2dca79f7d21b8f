"""Stage 2's engine when tensor parallelism splits the frozen base (launch.tensor_parallel > 1).

ZeRO-3 does not compose with DTensor-split weights, and what trains is small (LoRA, phi/gamma: megabytes), so the
trainable state is *replicated* over the data-parallel ranks instead of sharded. `ReplicatedEngine` does what
DeepSpeed's engine does for stage 2, from the same generated DeepSpeed config, so that a run gives the same numbers at
any tensor-parallel size:
  - the forward and backward compute the cross-entropy on each rank's vocabulary columns of the logits
    (tensor_parallel.vocab_parallel_loss); backward scales the loss by 1 / gradient_accumulation_steps;
  - at the accumulation boundary the gradients are averaged over the data-parallel ranks (one fp32 all-reduce; the
    replicated LoRA factors' gradients, partial sums over the tensor-parallel ranks, in a second one over all ranks,
    which adds them up and averages them at once), the global norm is clipped to gradient_clipping (a split tensor
    counted once: its squares summed over the tensor-parallel group), then torch's AdamW steps and the learning-rate
    schedule that DeepSpeed's engine is given too (finetune.schedule) advances.
The trainable parameters are fp32 (their own masters); the frozen base computes in model.dtype.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import FinetuneError
from . import runtime, tensor_parallel
from .runtime import Runtime


class ReplicatedEngine:
    def __init__(self, module: nn.Module, ds_config: dict, rt: Runtime, schedule=None):
        self.module, self.rt = module, rt
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        heads = tensor_parallel.head_sharded(module)
        self.dims = {n: tensor_parallel.placement(p, heads) for n, p in self.named}
        o = ds_config["optimizer"]["params"]
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named],
            lr=o["lr"],
            betas=tuple(o["betas"]),
            eps=o["eps"],
            weight_decay=o["weight_decay"],
            foreach=False,  # DTensor and plain parameters side by side
        )
        # the learning-rate schedule DeepSpeed's engine is given too (finetune.schedule); none: a constant rate
        self.lr_scheduler = (
            schedule(self.optimizer)
            if schedule
            else torch.optim.lr_scheduler.ConstantLR(self.optimizer, factor=1.0, total_iters=0)
        )
        self.accumulation = ds_config["gradient_accumulation_steps"]
        self.clip = ds_config["gradient_clipping"]
        self.micro_steps = 0
        self.grad_norm: torch.Tensor | None = None  # of the last step, before clipping (DeepSpeed's figure too)

    def __call__(self, *args, **kwargs):
        with tensor_parallel.vocab_parallel_loss(self.module):
            out = self.module(*args, **kwargs)
        if isinstance(out.get("loss"), DTensor):  # (replicated: every rank's local value is the loss)
            out["loss"] = out["loss"].to_local()
        return out

    def backward(self, loss: torch.Tensor) -> None:
        with tensor_parallel.vocab_parallel_loss(self.module):
            (loss / self.accumulation).backward()

    def step(self) -> None:
        """Counts a micro-batch; at the accumulation boundary: average, clip, AdamW, the schedule."""
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        rt = self.rt
        grads, partial = [], []
        for _, p in self.named:
            if p.grad is None:  # e.g. gamma of a layer SSD runs in la_only: a zero gradient, as under ZeRO-3
                p.grad = torch.zeros_like(p)
            partial.append(isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements))
            if partial[-1]:  # a replicated factor's gradient: this rank's partial sum, laid out as the parameter
                p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements, run_check=False)
            grads.append(tensor_parallel.local(p.grad))
        squares = torch.zeros(2, dtype=torch.float32, device=rt.device)  # [split, whole] sums of squares
        for summed, group, size in ((False, tensor_parallel.dp_group(rt), rt.dp), (True, None, rt.world)):
            members = [g for g, s in zip(grads, partial, strict=True) if s == summed]
            if not members:
                continue
            flat = torch.cat([g.float().flatten() for g in members])
            runtime.all_reduce(rt, flat, group=group, size=size)  # (partial sums: over every rank, tp and dp at once)
            flat /= rt.dp
            offset = 0
            for g in members:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for (name, _), g in zip(self.named, grads, strict=True):
            squares[0 if self.dims[name] is not None else 1] += g.float().pow(2).sum()
        split = squares[:1].clone()
        runtime.all_reduce(rt, split, group=tensor_parallel.tp_group(rt), size=rt.tp)
        norm = (split[0] + squares[1]).sqrt()
        self.grad_norm = norm
        if self.clip:  # DeepSpeed's rule, without a host sync: scale by clip / (norm + 1e-6) when that is below 1
            scale = (self.clip / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if rt.rank == 1 and os.environ.get("HYBRID_SCALE_FAULT") == "drift":  # fault injection: rank 1's copy moves
            with torch.no_grad():
                next(tensor_parallel.local(p) for n, p in self.named if self.dims[n] is None).add_(1e-3)

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm (DeepSpeed's engine has the same method)."""
        return None if self.grad_norm is None else float(self.grad_norm)

    def get_lr(self) -> list[float]:
        """The learning rate of the next step (as DeepSpeed's engine reports it)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def check_replicas(self) -> None:
        """Every rank holds the same replicated trainable tensors (and the same parts of the split ones on the ranks
        of one data-parallel group): one all-reduce of a float64 checksum per tensor, max and -min together. A
        mismatch is one FinetuneError naming the first tensor that differs (on every rank)."""
        rt = self.rt
        if rt.world == 1:
            return
        sums = []
        for _, p in self.named:
            t = tensor_parallel.local(p.detach()).double().flatten()
            w = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device).remainder_(977).add_(1)
            sums.append((t * w).sum())
        local = torch.stack(sums)
        split = torch.tensor([d is not None for d in self.dims.values()], device=local.device)
        both = torch.cat([local, -local])
        runtime.all_reduce(rt, both, op="max")  # replicated: over every rank
        parts = torch.cat([local, -local])
        runtime.all_reduce(rt, parts, op="max", group=tensor_parallel.dp_group(rt), size=rt.dp)  # split: per part
        n = len(sums)
        for i, (name, _) in enumerate(self.named):
            hi, lo = (parts[i], -parts[n + i]) if split[i] else (both[i], -both[n + i])
            if hi != lo:
                raise FinetuneError(
                    f"{name} differs across ranks (checksums {lo.item():.17g} .. {hi.item():.17g}): the replicated "
                    "trainable state drifted apart; the run cannot continue correctly (please report it)"
                )

    # --- whole tensors in and out (checkpoints are independent of the tensor-parallel size) -------------------

    def trainable_state(self) -> tuple[dict, dict]:
        """(weights, AdamW moments) of the trainable parameters, each whole, on the CPU; collective."""
        weights, moments = {}, {}
        for name, p in self.named:
            dim = self.dims[name]
            weights[name] = tensor_parallel.whole(p, dim, self.rt).float().cpu().contiguous()
            state = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key] if key in state else torch.zeros_like(p)
                moments[f"{name}::{key}"] = tensor_parallel.whole(value, dim, self.rt).float().cpu().contiguous()
        return weights, moments

    def restore(self, weights: dict, moments: dict, step: int) -> None:
        """Put whole saved weights and moments back, cut to this rank's parts."""
        with torch.no_grad():
            for name, p in self.named:
                dim = self.dims[name]
                part = tensor_parallel.local_part(weights[name], dim, self.rt)
                tensor_parallel.local(p).copy_(part.to(p.dtype))
                state = {"step": torch.tensor(float(step))}
                for key in ("exp_avg", "exp_avg_sq"):
                    local = tensor_parallel.local_part(moments[f"{name}::{key}"], dim, self.rt).to(self.rt.device)
                    state[key] = _like(p, local.to(p.dtype))
                self.optimizer.state[p] = state


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` laid out as parameter `p` is (a DTensor with p's mesh and placements, or plain)."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local.contiguous(), p.device_mesh, p.placements, run_check=False)
    return local.clone()
