"""Stage 2's learning-rate schedule, the one both engines use (DeepSpeed's and distributed.replicated's).

Optimizer step k (1-based) of a run of N = finetune.max_steps steps with W = finetune.warmup_steps uses

    lr * k / W                       for k <= W    (linear warmup: step 1 already trains)
    lr * (N + 1 - k) / (N + 1 - W)   for k > W     (linear decay, which would reach 0 at step N + 1: step N trains)

DeepSpeed's WarmupDecayLR, used before, raised W to at least 2 and started from warmup_min_lr, so the first two steps
of a run with W = 1 trained at lr 0. A torch LambdaLR over `lr_factor`, handed to deepspeed.initialize as its
lr_scheduler, replaces it; the engine advances it once per optimizer step, after the step.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, warmup: int, max_steps: int) -> float:
    """The fraction of finetune.lr that optimizer step `step` (1-based) uses."""
    if step <= warmup:
        return step / warmup
    return max(0.0, (max_steps + 1 - step) / (max_steps + 1 - warmup))


def _after(done: int, warmup: int, max_steps: int) -> float:
    # LambdaLR's argument is the number of steps taken so far: the next one is step done + 1
    return lr_factor(done + 1, warmup, max_steps)


def lr_schedule(optimizer: torch.optim.Optimizer, *, warmup: int, max_steps: int) -> LambdaLR:
    """The schedule of `optimizer` (its lr is finetune.lr): the optimizer's lr is step 1's from here on."""
    return LambdaLR(optimizer, partial(_after, warmup=warmup, max_steps=max_steps))


def schedule_for(f) -> partial:
    """What the engines take to build the schedule of the finetune section `f` over their optimizer."""
    return partial(lr_schedule, warmup=f.warmup_steps, max_steps=f.max_steps)


def resume_schedule(scheduler: LambdaLR, done: int) -> None:
    """The schedule as it stands after `done` optimizer steps, its rate put into the optimizer (a resume)."""
    scheduler.last_epoch = done
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(done)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
