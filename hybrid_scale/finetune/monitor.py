"""What stage 2 measures as it trains: each step's metrics (loss, learning rate, tokens, gamma and the LA decay, peak
memory), the held-out loss per mode (hybrid, and la_only / swa_only where early stopping or the report asks) and the
best step it keeps, and the stop on a loss that is not finite. finetune/stage.py's loop calls them.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from ..distributed import runtime, tensor_parallel
from ..distributed.deepspeed import import_deepspeed, is_partitioned
from ..distributed.replicated import ReplicatedEngine
from ..errors import FinetuneError
from ..measure import peak_memory
from ..models.convert import set_modes
from ..run.metrics import duration
from .checkpoints import committed_steps, write_model
from .state import Stage2


def step_metrics(stage: Stage2, step_s: float) -> None:
    """The step's record (loss, lr, gradient norm, SSD, gamma and rho per layer, tokens/s, TFLOP/s and MFU, peak
    memory, step time) and, every log.every_s seconds, a progress line with the ETA. Collective (gamma and rho are
    gathered on every rank); rank 0 writes."""
    finetune_cfg, rt = stage.cfg.finetune, stage.rt
    tokens = finetune_cfg.global_batch * len(stage.train_ids[0])
    stage.step_s = step_s if stage.step_s is None else 0.9 * stage.step_s + 0.1 * step_s
    norm = stage.engine.get_global_grad_norm()
    values = {
        "loss": stage.curves["train"][-1],
        "lr": stage.lr,
        "grad_norm": None if norm is None else float(norm),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops": stage.flops_per_step / step_s / 1e12,
        "steps_total": finetune_cfg.max_steps,
        "eta_s": stage.step_s * (finetune_cfg.max_steps - stage.step),
    }
    if (
        rt.device.type == "cuda" and stage.cfg.launch.gpu_tflops
    ):  # against launch.gpu_tflops per rank, as `plan` assumes
        values["mfu"] = stage.flops_per_step / step_s / (rt.world * stage.cfg.launch.gpu_tflops * 1e12)
    values |= peak_memory(rt.device)
    if stage.ssd:
        values |= {"ssd_p": stage.ssd_p, "ssd_dropped": stage.dropped}
    values |= hybrid_values(stage)
    stage.metrics.log(stage.step, values)
    memory = f", {values['device_peak_gb']:.1f} GB device peak" if "device_peak_gb" in values else ""
    stage.metrics.progress(
        f"step {stage.step}/{finetune_cfg.max_steps}: loss {values['loss']:.4f}, "
        f"{values['tokens_per_s']:.0f} tokens/s, {values['host_peak_gb']:.1f} GB host peak{memory}, "
        f"ETA {duration(values['eta_s'])}",
        force=stage.step == finetune_cfg.max_steps,
    )


def hybrid_values(stage: Stage2) -> dict[str, list[float]]:
    """gamma (and rho, with a decaying LA) of every hybrid layer, averaged over its heads: gathered under ZeRO-3, the
    tensor-parallel group's heads averaged. Collective."""
    layers = [m for _, m in sorted(stage.layers.items())]
    own = [p for m in layers for n, p in m.hybrid_parameters() if n in ("gamma_logit", "la_decay_rho")]
    partitioned = [p for p in own if is_partitioned(p)]
    whole = import_deepspeed().zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()
    with whole, torch.no_grad():
        gamma = [tensor_parallel.local(m.gamma).float().mean() for m in layers]
        rho = [tensor_parallel.local(m.la_decay).float().mean() for m in layers if m.la_decay is not None]
        values = torch.stack(gamma + rho).to(stage.rt.device)
    if stage.rt.tp > 1:  # each rank holds as many heads: the mean of the ranks' means
        runtime.all_reduce(stage.rt, values, group=tensor_parallel.tp_group(stage.rt), size=stage.rt.tp)
        values /= stage.rt.tp
    values = values.tolist()
    return {"gamma": values[: len(gamma)], **({"rho": values[len(gamma) :]} if rho else {})}


def stop_non_finite(stage: Stage2, loss: float) -> None:
    finetune_cfg = stage.cfg.finetune
    kept = committed_steps(stage.stage2)
    newest = f"stage2/{kept[-1].name}" if kept else "none yet"
    check = f"check the weights of {stage.source.path} (and of its base model) for nan/inf"
    if stage.step == 0:  # before any update: the model, not the learning rate
        fix = f"it is not finite before any update: {check}"
    else:
        fix = f"lower finetune.lr (now {finetune_cfg.lr}) in another run_dir (a changed lr does not resume), or {check}"
    if stage.cfg.model.dtype == "float16":
        fix += ", or set model.dtype=bfloat16 (float16 overflows)"
    msg = (
        f"stage 2: the training loss is {loss} at step {stage.step + 1} of {finetune_cfg.max_steps}; nothing of that "
        f"step is saved, the newest committed checkpoint is {newest} (kept); {fix}"
    )
    stage.log(msg)
    raise FinetuneError(msg)


def evaluate_heldout(stage: Stage2) -> None:
    """Held-out losses in hybrid and la_only; with early stopping, best/ on a better hybrid loss and the verdict."""
    finetune_cfg, step = stage.cfg.finetune, stage.step
    if isinstance(stage.engine, ReplicatedEngine):  # its copies on every rank must not have drifted apart
        stage.engine.check_replicas()
    h = heldout_loss(stage.engine, stage.model, stage.held_ids, "hybrid", finetune_cfg.micro_batch, stage.rt)
    la = heldout_loss(stage.engine, stage.model, stage.held_ids, "la_only", finetune_cfg.micro_batch, stage.rt)
    stage.curves["eval_steps"].append(step)
    stage.curves["hybrid"].append(h)
    stage.curves["la_only"].append(la)
    stage.log(f"step {step}: held-out loss hybrid {h:.4f}, la_only {la:.4f}")
    improved = stage.stopping.update(step, h, la)
    if improved and stage.early:  # best/ is early stopping's choice; without it the output is final/
        write_model(stage, stage.stage2 / "best", step)
    if stage.early and stage.stopping.reason is None:
        stage.stopping.reason = stage.stopping.verdict(finetune_cfg.patience, finetune_cfg.la_margin)
        if stage.stopping.reason:
            stage.log(f"early stop at step {step}: {stage.stopping.reason}")
    stopping = {k: v for k, v in asdict(stage.stopping).items() if v is not None}
    stage.metrics.log(step, {"hybrid": h, "la_only": la, "improved": improved, **stopping}, kind="heldout")


@torch.no_grad()
def heldout_loss(engine, model, held: torch.Tensor, mode: str, micro: int, rt) -> float:
    """Mean next-token loss over the held-out sequences with every hybrid layer in `mode`. Every rank runs the same
    number of forwards (ZeRO-3 gathers weights collectively); a rank short of sequences repeats one at weight 0.
    The ranks of a tensor-parallel group score the same sequences (their sums count tp times, in both totals)."""
    set_modes(model, mode)
    engine.module.eval()
    mine = list(range(rt.dp_rank, len(held), rt.dp))
    rounds = math.ceil(math.ceil(len(held) / rt.dp) / micro)
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # [loss x tokens, tokens], summed over the ranks
    for r in range(rounds):
        idx = mine[r * micro : (r + 1) * micro]
        weight = 1.0 if idx else 0.0
        ids = held[idx or [0]].to(rt.device)
        out = engine(input_ids=ids, labels=ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total[0] += out.loss.detach().double() * n * weight
        total[1] += n * weight
    loss, tokens = runtime.all_reduce(rt, total).tolist()
    engine.module.train()
    return loss / tokens


def best_step(best: Path) -> int | None:
    """The step best/ was written at (its hybrid_config.json's origin), None without one. best/ is the run's output
    only when it is the early-stopping state's best step: one left by an attempt this run did not resume from (a
    run stopped before its first checkpoint, or the redone steps of a resume) is not."""
    try:
        return json.loads((best / "hybrid_config.json").read_text())["origin"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
