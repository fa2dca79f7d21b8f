"""Stage 1's training step: what is trained (trainable; the objectives and gamma as the recipe resolves them),
every step's batch (_plan_steps), a step's loss over this rank's query blocks and the one fp32 all-reduce of
gradients, loss and signal flag (train_layer), the refusal of a non-finite loss, and the step checkpoint a signal
saves at a step boundary (StepCheckpoint: resumed bitwise when made with this run's identity)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from ..attention.layer import HybridAttention
from ..config import OBJECTIVES
from ..config.schema import Config
from ..data import batches
from ..data.staging import Stager
from ..distributed import requeue, runtime, tensor_parallel
from ..errors import ConfigError, DistillError
from ..run.settings import Derived
from ..storage.commits import save_tensors
from ..storage.faults import fault, throttle
from . import objectives
from .state import Stage1


def trainable(m: HybridAttention, cfg: Config, derived: Derived) -> list[torch.nn.Parameter]:
    """What stage 1 trains of a layer: its feature maps (gated_delta: its gates and convolutions), gamma (as resolved),
    the LA decay under an objective that runs the LA through it."""
    params, weights = [], derived.objectives
    if cfg.distill.train_feature_maps:
        params += m.la_parameters()
    if derived.train_gamma:
        params.append(m.gamma_logit)
    if m.la_decay is not None and (weights.get("hybrid_output_mse") or weights.get("output_mse")):
        params.append(m.la_decay_rho)  # (the objectives that run the LA through its decay; weights_xent does not)
    if not params:
        raise ConfigError("config: stage 1 has nothing to train (distill.train_feature_maps=false, no gamma)")
    return params


@dataclass
class Trained:
    """Layer i under training: its hybrid attention `m` (what stage 1 trains), the decoder layer around it (its
    input norm feeds `m`) and the parameters trained (trainable's, in order)."""

    i: int
    m: HybridAttention
    layer: torch.nn.Module
    params: list[torch.nn.Parameter]


@dataclass
class StepCheckpoint:
    """Layer i's training stopped by a signal at a step boundary: phi/gamma (fp32 masters), AdamW's state, the
    steps done and their losses. `layer_{i}.step.safetensors`, written by rank 0, removed when the layer commits."""

    tensors: dict
    steps_done: int
    losses: list[float]

    @staticmethod
    def path(stage1: Path, i: int) -> Path:
        return stage1 / f"layer_{i:03d}.step.safetensors"


def _save_step(stage: Stage1, i: int, named: list, opt, steps_done: int, losses: list[float]) -> Path:
    path = StepCheckpoint.path(stage.stage1, i)
    tensors, dim = (
        {},
        layer_head_dim(stage),
    )  # whole tensors (gathered over the tensor-parallel group): any split resumes
    for name, p in named:
        st = opt.state.get(p, {})
        tensors[f"param.{name}"] = tensor_parallel.whole(p, dim, stage.rt).cpu()
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if k in st:
                value = st[k] if k == "step" else tensor_parallel.whole(st[k], dim, stage.rt)
                tensors[f"{k}.{name}"] = value.detach().cpu().reshape(value.shape)
    if stage.rt.main:
        meta = {"identity": json.dumps(stage.identity, sort_keys=True), "losses": json.dumps(losses)}
        meta["done"] = str(steps_done)  # (the file's key for the steps done)
        tmp = path.with_name(path.name + ".tmp")
        save_tensors(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    runtime.barrier(stage.rt)
    return path


def _load_step(stage: Stage1, i: int) -> StepCheckpoint | None:
    """Layer i's step checkpoint, when there is one made with this run's settings (else None, and it goes)."""
    path = StepCheckpoint.path(stage.stage1, i)
    if not path.is_file():
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
        ok = meta.get("identity") == json.dumps(stage.identity, sort_keys=True)
    except (SafetensorError, OSError, ValueError):
        ok = False
    if not runtime.all_ranks(stage.rt, ok):
        stage.log(f"layer {i}: its step checkpoint is unreadable or from other settings; the layer starts over")
        runtime.barrier(stage.rt)
        if stage.rt.main:
            path.unlink(missing_ok=True)
        return None
    return StepCheckpoint(tensors, int(meta["done"]), json.loads(meta["losses"]))


def saved_steps(stage: Stage1, i: int) -> int:
    """The steps layer i's step checkpoint holds when it was made with this run's settings (0 otherwise): read from
    its header alone, to keep those steps' metrics on a resume."""
    path = StepCheckpoint.path(stage.stage1, i)
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError):
        return 0
    return int(meta["done"]) if meta.get("identity") == json.dumps(stage.identity, sort_keys=True) else 0


def _restore(stage: Stage1, named: list, opt, ckpt: StepCheckpoint) -> None:
    """The whole saved tensors, cut to this rank's heads."""
    dim = layer_head_dim(stage)

    def mine(key: str) -> torch.Tensor:
        return tensor_parallel.local_part(ckpt.tensors[key], dim, stage.rt)

    with torch.no_grad():
        for name, p in named:
            p.copy_(mine(f"param.{name}"))
            if f"step.{name}" in ckpt.tensors:
                opt.state[p] = {k: mine(f"{k}.{name}").to(p.device) for k in ("exp_avg", "exp_avg_sq")}
                opt.state[p]["step"] = ckpt.tensors[f"step.{name}"].cpu()  # AdamW keeps its step count on the host


def layer_head_dim(stage: Stage1) -> int | None:
    """The dimension of phi/gamma (and their AdamW moments) that tensor parallelism splits: their heads."""
    return 0 if stage.rt.tp > 1 else None


def _plan_steps(stage: Stage1, i: int) -> list[list[int]]:
    """Every step's batch of global sequence indices, in order (the same on every rank): epoch e's permutation comes
    from (seed, layer, epoch), cut into distill.batch_size sequences."""
    distill, n = stage.cfg.distill, stage.cfg.data.num_sequences
    out = []
    for epoch in range(distill.epochs):
        g = torch.Generator().manual_seed(stage.cfg.seed * 1_000_003 + i * 1009 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        out += [perm[a : a + distill.batch_size] for a in range(0, n, distill.batch_size)]
    return out


def _step_loss(stage: Stage1, m, layer, hidden: torch.Tensor, units: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's units of a step: each sequence it touches projected once (rows up to its last unit's end), the
    units' terms summed (fp32); and, with more than one objective, each objective's share of it (OBJECTIVES order;
    their sum is the loss, term by term as unit_loss adds them). hidden [B, T, D] on the device, the whole step's
    batch."""
    T = stage.cfg.data.seq_len
    names = [n for n in OBJECTIVES if stage.weights.get(n)]
    loss = torch.zeros((), dtype=torch.float32, device=stage.rt.device)
    parts = torch.zeros(len(names), dtype=torch.float32, device=stage.rt.device) if len(names) > 1 else None
    for seq in sorted({u[0] for u in units}):
        mine = [u for u in units if u[0] == seq]
        end = max(b for _, _, b in mine)
        rope = tuple(t[:, :end] for t in stage.rope)
        x = m.project(layer.input_layernorm(hidden[seq : seq + 1, :end].to(stage.dtype)), rope)
        x = x._replace(q=x.q.detach(), k=x.k.detach(), v=x.v.detach())  # (stage 1 trains phi and gamma only)
        for _, a, b in mine:
            if parts is None:
                loss = loss + objectives.unit_loss(m, x, a, b, T, stage.weights)
                continue
            terms = [objectives.unit_loss(m, x, a, b, T, {n: stage.weights[n]}) for n in names]
            loss = loss + sum(terms[1:], terms[0])
            parts = parts + torch.stack([t.detach() for t in terms])
    return loss, parts


def _gather_batch(stage: Stage1, staged: torch.Tensor | None, batch: list[int], mine: list[int]) -> torch.Tensor:
    """The step's whole batch [B, T, D] on every rank's device: each sequence from a rank whose buffer holds it
    (sequence g lives on the ranks of data-parallel group g mod dp; the first of them sends it), in the buffer
    dtype."""
    T, D = stage.cfg.data.seq_len, stage.config.hidden_size
    if stage.rt.dp == 1:  # every rank holds every sequence
        return staged
    out = torch.empty(len(batch), T, D, dtype=stage.buf_dtype, device=stage.rt.device)
    own = {g: j for j, g in enumerate(mine)}
    for pos, g in enumerate(batch):
        if g in own:
            out[pos] = staged[own[g]]
        runtime.broadcast(stage.rt, out[pos], (g % stage.rt.dp) * stage.rt.tp)
    return out


def train_layer(stage: Stage1, m, layer, buf_in, i: int) -> list[float]:
    """Train layer i's feature maps (and gamma) on the teacher's inputs to it; returns the per-step global losses.
    Every step: the batch is staged to the device, this rank computes its share of the step's query blocks
    (batches.split_units, one share per data-parallel group) for its heads (tensor parallelism), and gradients,
    loss and the signal flag are summed over the ranks in one fp32 all-reduce (each rank's gradients at its heads'
    place in whole-layer buffers, so that they are summed over the data-parallel ranks only). On a signal the ranks
    save a step checkpoint at the next step boundary and raise Requeue."""
    distill, rt = stage.cfg.distill, stage.rt
    trained = {id(p) for p in trainable(m, stage.cfg, stage.derived)}
    named = [(n, p) for n, p in m.hybrid_parameters() if id(p) in trained]
    params = [p for _, p in named]
    for p in m.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    for p in params:
        p.grad = torch.zeros_like(p)  # a rank without units this step still sends its (zero) share
    trained_layer = Trained(i, m, layer, params)
    opt = torch.optim.AdamW(params, lr=distill.lr, weight_decay=distill.weight_decay)
    steps = _plan_steps(stage, i)
    per_epoch = len(steps) // distill.epochs
    resumed = _load_step(stage, i)
    steps_done, losses = (resumed.steps_done, list(resumed.losses)) if resumed else (0, [])
    if resumed:
        _restore(stage, named, opt, resumed)
        stage.log(f"layer {i}: resuming at step {steps_done + 1} of {len(steps)} from its step checkpoint")
    local_of = {g: j for j, g in enumerate(stage.owned)}
    mine = [[g for g in batch if g in local_of] for batch in steps[steps_done:]]
    bar = tqdm(
        total=len(steps),
        initial=steps_done,
        desc=f"layer {i:>3}",
        disable=not (distill.progress and rt.main),
        dynamic_ncols=True,
    )
    staged = Stager(buf_in, rt.device).steps([[local_of[g] for g in rows] for rows in mine])
    t0 = time.perf_counter()
    for step, (batch, rows, x) in enumerate(zip(steps[steps_done:], mine, staged, strict=True), start=steps_done):
        opt.zero_grad(set_to_none=False)
        summed = gradients(stage, trained_layer, x, batch, rows, stage.signal.raised).tolist()
        value, stop = summed[-2], summed[-1] > 0
        if not math.isfinite(value):  # summed over the ranks: every rank sees it and stops here
            bar.close()
            msg = _nonfinite_loss(value, stage.cfg, i, step // per_epoch, step + 1, len(steps))
            stage.log(msg)
            raise DistillError(msg)
        opt.step()
        losses.append(value)
        t1 = time.perf_counter()
        step_metrics(stage, i, i * len(steps) + step + 1, summed, len(batch), t1 - t0)
        t0 = t1
        bar.update()
        bar.set_postfix(loss=f"{value:.4f}")
        fault(f"train:{i}:{step}", rt.rank)
        throttle()
        if stop and step + 1 < len(steps):
            t0 = time.perf_counter()
            path = _save_step(stage, i, named, opt, step + 1, losses)
            bar.close()
            took = time.perf_counter() - t0
            stage.log(f"signal: saved layer {i}'s step {step + 1} in {took:.2f} s, exiting for a requeue")
            raise requeue.request(
                stage.layout.run_dir,
                f"layer {i} step {step + 1}",
                path,
                rt,
                what=f"stage 1 stopped by a signal at layer {i}, step {step + 1} of {len(steps)}; saved {path}",
            )
    bar.close()
    stage.log(f"layer {i}: loss {losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)} steps)")
    return losses


def step_metrics(stage: Stage1, i: int, step: int, summed: list[float], sequences: int, step_s: float):
    """Stage 1's record of one step (global step `step` over the layers) from what `gradients` summed: the loss, each
    objective's term (with more than one), the layer, tokens/s and the step time; rank 0 writes (run/metrics.py)."""
    loss, terms = summed[-2], summed[:-2]
    total = stage.n_layers * stage.steps_per_layer
    stage.step_s = step_s if stage.step_s is None else 0.9 * stage.step_s + 0.1 * step_s
    values = {"layer": i, "loss": loss, "step_s": step_s, "tokens_per_s": sequences * stage.cfg.data.seq_len / step_s}
    values |= {"steps_total": total, "eta_s": stage.step_s * (total - step)}  # (training steps only: a rough ETA)
    if terms:
        values["objectives"] = dict(zip([n for n in OBJECTIVES if stage.weights.get(n)], terms, strict=True))
    stage.metrics.log(step, values)


def gradients(stage: Stage1, t: Trained, staged, batch: list[int], rows: list[int], signalled: bool):
    """One step's gradients of `t` on this rank: the batch gathered (`_gather_batch`), the loss of this rank's units
    of query blocks for its heads, its backward, then the gradients, the objectives' terms (with more than one), the
    loss and the signal flag summed over the ranks in one fp32 all-reduce, each rank keeping its heads' part.
    Returns [each objective's term (OBJECTIVES order, only with more than one)..., global loss, signal count] (a
    tensor: no host sync here; the dry run calls it on the meta device)."""
    distill, rt = stage.cfg.distill, stage.rt
    units = batches.split_units(len(batch), stage.cfg.data.seq_len, distill.query_block, rt.dp)[rt.dp_rank]
    hidden = _gather_batch(stage, staged, batch, rows)
    loss, parts = _step_loss(stage, t.m, t.layer, hidden, units)
    loss = loss / len(batch)
    if units:
        loss.backward()
    flag = torch.tensor([float(signalled)], device=rt.device)
    terms = [parts.detach() / len(batch)] if parts is not None else []
    flat = torch.cat([_spread(p.grad, rt) for p in t.params] + terms + [loss.detach().reshape(1), flag])
    runtime.all_reduce(rt, flat)
    offset = 0
    for p in t.params:
        whole = flat[offset : offset + p.numel() * rt.tp].view(p.shape[0] * rt.tp, *p.shape[1:])
        p.grad.copy_(whole[rt.tp_rank * p.shape[0] : (rt.tp_rank + 1) * p.shape[0]])
        offset += p.numel() * rt.tp
    return flat[-2 - (len(parts) if parts is not None else 0) :]


def _spread(grad: torch.Tensor, rt) -> torch.Tensor:
    """A gradient of this rank's heads at their place in a whole layer's buffer (zeros at the other ranks' heads),
    fp32, flattened: summed over every rank, each head's entry sums its data-parallel ranks' shares."""
    if rt.tp == 1:
        return grad.float().flatten()
    n = grad.shape[0]
    whole = grad.new_zeros((n * rt.tp, *grad.shape[1:]), dtype=torch.float32)
    whole[rt.tp_rank * n : (rt.tp_rank + 1) * n] = grad
    return whole.flatten()


def _nonfinite_loss(loss: float, cfg: Config, i: int, epoch: int, step: int, steps: int) -> str:
    """The one-line refusal for a nan/inf loss at layer i, step `step` (1-based) of `steps`: where, what is kept and
    the fix (layers commit in order, so every layer before i is committed)."""
    distill = cfg.distill
    kept = {0: "no layer is committed yet", 1: "layer 0 stays committed"}.get(i, f"layers 0-{i - 1} stay committed")
    layers = "layer 0" if i == 0 else f"layers 0-{i}"  # layer i's own weights, or inputs its teachers computed
    if step == 1:  # before any update: the weights or the inputs, not the learning rate
        fix = (
            f"it is not finite before any update, so layer {i}'s weights or its inputs hold nan/inf: check the "
            f"weights of {layers} in model.path for nan/inf"
        )
    else:
        fix = (
            f"lower distill.lr (now {distill.lr}), or check the weights of {layers} in model.path for nan/inf (a "
            "batch's inputs may hold them)"
        )
    if distill.buffer_dtype == "float16":
        fix += ", or set distill.buffer_dtype=bfloat16 (hidden states can overflow float16)"
    return (
        f"stage 1: the loss is {loss} at layer {i}, step {step} of {steps} (epoch {epoch + 1} of {distill.epochs}); "
        f"nothing of layer {i} is committed, {kept} and a rerun resumes at layer {i}; {fix}"
    )
