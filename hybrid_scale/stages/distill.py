"""Stage 1: attention transfer, streamed layer by layer, sharded over ranks, resumable, on model.device.

For layer l, with the teacher's hidden states entering l in a memory-mapped buffer on disk (sequence g on rank
g mod world; with tensor parallelism, on data-parallel group g mod dp):
  1. read only layer l's tensors from the safetensors shards and build that one decoder layer on the device;
  2. train its feature maps (and gamma, fp32 masters) so that linear attention mimics the layer's softmax attention:
     each step's batch is staged to the device (the next one read from disk meanwhile) and broadcast from the ranks
     holding it; its query blocks are split over the ranks (objectives.split_units: every rank works every step),
     and gradients, loss and the signal flag are summed in one fp32 all-reduce;
  3. run the *teacher* layer (exact softmax, SDPA) on the inputs and write layer l+1's inputs to the other buffer;
  4. commit: layer l's parameters (safetensors, written then renamed), then the manifest naming the buffer that holds
     layer l+1's inputs, then a marker with the parameter file's sha256 -- written last.
A run killed at any point resumes at the first layer without a valid marker; when the buffer named by the manifest
is missing (another node) or does not hold that layer's inputs, they are rebuilt by replaying the teacher layers.
USR1/TERM: the ranks agree at the next step boundary, save a step checkpoint of the layer in training (resumed
from there, bitwise) or, between layers, just stop; then Requeue (exit 75).
Tensor parallelism (launch.tensor_parallel): each layer's heads and MLP columns are split over the ranks of a group
(the teacher forward too); the group holds one copy of its sequences' buffers (on its node) and trains its heads.
Memory: one layer (/ tensor_parallel) and a batch; disk: 2 x (sequences of this group) x seq_len x hidden.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from ..attention.hybrid import HybridAttention
from ..config import attention_settings
from ..data import assets, corpus
from ..data.staging import Stager
from ..distributed import requeue, runtime, tensor_parallel
from ..distributed.checkpoint import atomic_write, fault, sha256
from ..distributed.requeue import SignalFlag
from ..errors import ConfigError, DistillError
from ..models import streaming
from ..models.converted import write_converted
from ..recipes import RECIPES
from . import objectives, rundir
from .plan import preflight

# --- buffers, manifest, commits ----------------------------------------------------------------------------------


def _buffer(path: Path, n: int, seq_len: int, hidden: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    numel = n * seq_len * hidden
    size = numel * torch.empty((), dtype=dtype).element_size()
    if create and (not path.exists() or path.stat().st_size != size):
        with open(path, "wb") as f:
            f.truncate(size)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(n, seq_len, hidden)


def committed(stage1: Path, i: int) -> bool:
    marker, params = stage1 / f"layer_{i:03d}.done", stage1 / f"layer_{i:03d}.safetensors"
    if not (marker.is_file() and params.is_file()):
        return False
    try:
        return json.loads(marker.read_text())["sha256"] == sha256(params)
    except (ValueError, KeyError):
        return False


def preflight_buffers(buffer_dir: Path, n_local: int, seq_len: int, hidden: int, dtype: torch.dtype) -> int:
    need = 2 * n_local * seq_len * hidden * torch.empty((), dtype=dtype).element_size()
    buffer_dir.mkdir(parents=True, exist_ok=True)
    have = sum(p.stat().st_size for p in buffer_dir.glob("*.bin"))  # reused in place
    free = shutil.disk_usage(buffer_dir).free
    if need - have > free * 0.95:
        raise DistillError(
            f"stage 1 needs {need / 2**30:.2f} GiB for its hidden-state buffers in {buffer_dir} but only "
            f"{free / 2**30:.2f} GiB are free: set distill.buffer_dir to a larger disk, or lower data.num_sequences, "
            "data.seq_len or distill.buffer_dtype"
        )
    return need


# --- the stage -----------------------------------------------------------------------------------------------------


def objective_weights(cfg) -> dict[str, float]:
    d = cfg.distill
    if d.objectives:
        return {k: float(v) for k, v in d.objectives.items() if v}
    return {RECIPES[d.recipe].objective: 1.0}


def train_gamma(cfg, weights) -> bool:
    """distill.train_gamma as resolved: unset = only when a hybrid objective is used."""
    if cfg.distill.train_gamma is None:
        return bool(weights.get("hybrid_output_mse"))
    return bool(cfg.distill.train_gamma)


def _trainable(m: HybridAttention, cfg, weights) -> list[torch.nn.Parameter]:
    params = []
    if cfg.distill.train_feature_maps:
        params += list(m.feature_map_q.parameters()) + list(m.feature_map_k.parameters())
    if train_gamma(cfg, weights):
        params.append(m.gamma_logit)
    if not params:
        raise ConfigError("config: stage 1 has nothing to train (distill.train_feature_maps=false, no gamma)")
    return params


@dataclass
class StepCheckpoint:
    """Layer i's training stopped by a signal at a step boundary: phi/gamma (fp32 masters), AdamW's state, the
    steps done and their losses. `layer_{i}.step.safetensors`, written by rank 0, removed when the layer commits."""

    tensors: dict
    done: int
    losses: list[float]

    @staticmethod
    def path(stage1: Path, i: int) -> Path:
        return stage1 / f"layer_{i:03d}.step.safetensors"


def _save_step(s: Stage1, i: int, named: list, opt, done: int, losses: list[float]) -> Path:
    path = StepCheckpoint.path(s.stage1, i)
    tensors, dim = {}, _head_dim(s)  # whole tensors (gathered over the tensor-parallel group): any split resumes
    for name, p in named:
        st = opt.state.get(p, {})
        tensors[f"param.{name}"] = tensor_parallel.whole(p, dim, s.rt).cpu()
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if k in st:
                value = st[k] if k == "step" else tensor_parallel.whole(st[k], dim, s.rt)
                tensors[f"{k}.{name}"] = value.detach().cpu().reshape(value.shape)
    if s.rt.main:
        meta = {"identity": json.dumps(s.identity, sort_keys=True), "done": str(done), "losses": json.dumps(losses)}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    runtime.barrier(s.rt)
    return path


def _load_step(s: Stage1, i: int) -> StepCheckpoint | None:
    """Layer i's step checkpoint, when there is one made with this run's settings (else None, and it goes)."""
    path = StepCheckpoint.path(s.stage1, i)
    if not path.is_file():
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
        ok = meta.get("identity") == json.dumps(s.identity, sort_keys=True)
    except (SafetensorError, OSError, ValueError):
        ok = False
    if not runtime.all_ranks(s.rt, ok):
        s.log(f"layer {i}: its step checkpoint is unreadable or from other settings; the layer starts over")
        runtime.barrier(s.rt)
        if s.rt.main:
            path.unlink(missing_ok=True)
        return None
    return StepCheckpoint(tensors, int(meta["done"]), json.loads(meta["losses"]))


def _restore(s: Stage1, named: list, opt, ckpt: StepCheckpoint) -> None:
    """The whole saved tensors, cut to this rank's heads."""
    dim = _head_dim(s)

    def mine(key: str) -> torch.Tensor:
        return tensor_parallel.local_part(ckpt.tensors[key], dim, s.rt)

    with torch.no_grad():
        for name, p in named:
            p.copy_(mine(f"param.{name}"))
            if f"step.{name}" in ckpt.tensors:
                opt.state[p] = {k: mine(f"{k}.{name}").to(p.device) for k in ("exp_avg", "exp_avg_sq")}
                opt.state[p]["step"] = ckpt.tensors[f"step.{name}"].cpu()  # AdamW keeps its step count on the host


def _head_dim(s: Stage1) -> int | None:
    """The dimension of phi/gamma (and their AdamW moments) that tensor parallelism splits: their heads."""
    return 0 if s.rt.tp > 1 else None


def _plan_steps(s: Stage1, i: int) -> list[list[int]]:
    """Every step's batch of global sequence indices, in order (the same on every rank): epoch e's permutation comes
    from (seed, layer, epoch), cut into distill.batch_size sequences."""
    d, n = s.cfg.distill, s.cfg.data.num_sequences
    out = []
    for epoch in range(d.epochs):
        g = torch.Generator().manual_seed(s.cfg.seed * 1_000_003 + i * 1009 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        out += [perm[a : a + d.batch_size] for a in range(0, n, d.batch_size)]
    return out


def _step_loss(s: Stage1, m, layer, hidden: torch.Tensor, units: list) -> torch.Tensor:
    """This rank's units of a step: each sequence it touches projected once (rows up to its last unit's end), the
    units' terms summed (fp32). hidden [B, T, D] on the device, the whole step's batch."""
    T = s.cfg.data.seq_len
    loss = torch.zeros((), dtype=torch.float32, device=s.rt.device)
    for seq in sorted({u[0] for u in units}):
        mine = [u for u in units if u[0] == seq]
        end = max(b for _, _, b in mine)
        rope = tuple(t[:, :end] for t in s.rope)
        q, k, v, fq, fk = m.project(layer.input_layernorm(hidden[seq : seq + 1, :end].to(s.dtype)), rope)
        q, k, v = q.detach(), k.detach(), v.detach()
        for _, a, b in mine:
            loss = loss + objectives.unit_loss(m, q, k, v, fq, fk, a, b, T, s.weights)
    return loss


def _gather_batch(s: Stage1, staged: torch.Tensor | None, batch: list[int], mine: list[int]) -> torch.Tensor:
    """The step's whole batch [B, T, D] on every rank's device: each sequence from a rank whose buffer holds it
    (sequence g lives on the ranks of data-parallel group g mod dp; the first of them sends it), in the buffer
    dtype."""
    T, D = s.cfg.data.seq_len, s.config.hidden_size
    if s.rt.dp == 1:  # every rank holds every sequence
        return staged
    out = torch.empty(len(batch), T, D, dtype=s.buf_dtype, device=s.rt.device)
    own = {g: j for j, g in enumerate(mine)}
    for pos, g in enumerate(batch):
        if g in own:
            out[pos] = staged[own[g]]
        runtime.broadcast(s.rt, out[pos], (g % s.rt.dp) * s.rt.tp)
    return out


def train_layer(s: Stage1, m, layer, buf_in, i: int) -> list[float]:
    """Train layer i's feature maps (and gamma) on the teacher's inputs to it; returns the per-step global losses.
    Every step: the batch is staged to the device, this rank computes its share of the step's query blocks
    (objectives.split_units, one share per data-parallel group) for its heads (tensor parallelism), and gradients,
    loss and the signal flag are summed over the ranks in one fp32 all-reduce (each rank's gradients at its heads'
    place in whole-layer buffers, so that they are summed over the data-parallel ranks only). On a signal the ranks
    save a step checkpoint at the next step boundary and raise Requeue."""
    d, rt = s.cfg.distill, s.rt
    trained = {id(p) for p in _trainable(m, s.cfg, s.weights)}
    named = [(n, p) for n, p in m.hybrid_parameters() if id(p) in trained]
    params = [p for _, p in named]
    for p in m.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    for p in params:
        p.grad = torch.zeros_like(p)  # a rank without units this step still sends its (zero) share
    opt = torch.optim.AdamW(params, lr=d.lr, weight_decay=d.weight_decay)
    steps = _plan_steps(s, i)
    per_epoch = len(steps) // d.epochs
    resumed = _load_step(s, i)
    done, losses = (resumed.done, list(resumed.losses)) if resumed else (0, [])
    if resumed:
        _restore(s, named, opt, resumed)
        s.log(f"layer {i}: resuming at step {done + 1} of {len(steps)} from its step checkpoint")
    local_of = {g: j for j, g in enumerate(s.owned)}
    mine = [[g for g in batch if g in local_of] for batch in steps[done:]]
    bar = tqdm(
        total=len(steps), initial=done, desc=f"layer {i:>3}", disable=not (d.progress and rt.main), dynamic_ncols=True
    )
    staged = Stager(buf_in, rt.device).steps([[local_of[g] for g in rows] for rows in mine])
    with SignalFlag() as signal:
        for step, (batch, rows, x) in enumerate(zip(steps[done:], mine, staged, strict=True), start=done):
            opt.zero_grad(set_to_none=False)
            units = objectives.split_units(len(batch), s.cfg.data.seq_len, d.query_block, rt.dp)[rt.dp_rank]
            hidden = _gather_batch(s, x, batch, rows)
            loss = _step_loss(s, m, layer, hidden, units) / len(batch)
            if units:
                loss.backward()
            flag = torch.tensor([float(signal.raised)], device=rt.device)
            flat = torch.cat([_spread(p.grad, rt) for p in params] + [loss.detach().reshape(1), flag])
            runtime.all_reduce(rt, flat)
            value, stop = flat[-2].item(), flat[-1].item() > 0
            offset = 0
            for p in params:
                whole = flat[offset : offset + p.numel() * rt.tp].view(p.shape[0] * rt.tp, *p.shape[1:])
                p.grad.copy_(whole[rt.tp_rank * p.shape[0] : (rt.tp_rank + 1) * p.shape[0]])
                offset += p.numel() * rt.tp
            if not math.isfinite(value):  # summed over the ranks: every rank sees it and stops here
                bar.close()
                msg = _nonfinite_loss(value, s.cfg, i, step // per_epoch, step + 1, len(steps))
                s.log(msg)
                raise DistillError(msg)
            opt.step()
            losses.append(value)
            bar.update()
            bar.set_postfix(loss=f"{value:.4f}")
            fault(f"train:{i}:{step}", rt.rank)
            if stop and step + 1 < len(steps):
                t0 = time.perf_counter()
                path = _save_step(s, i, named, opt, step + 1, losses)
                bar.close()
                took = time.perf_counter() - t0
                s.log(f"signal: saved layer {i}'s step {step + 1} in {took:.2f} s, exiting for a requeue")
                raise requeue.request(
                    s.cfg.run_dir,
                    f"layer {i} step {step + 1}",
                    path,
                    rt,
                    what=f"stage 1 stopped by a signal at layer {i}, step {step + 1} of {len(steps)}; saved {path}",
                )
    bar.close()
    s.log(f"layer {i}: loss {losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)} steps)")
    return losses


def _spread(grad: torch.Tensor, rt) -> torch.Tensor:
    """A gradient of this rank's heads at their place in a whole layer's buffer (zeros at the other ranks' heads),
    fp32, flattened: summed over every rank, each head's entry sums its data-parallel ranks' shares."""
    if rt.tp == 1:
        return grad.float().flatten()
    n = grad.shape[0]
    whole = grad.new_zeros((n * rt.tp, *grad.shape[1:]), dtype=torch.float32)
    whole[rt.tp_rank * n : (rt.tp_rank + 1) * n] = grad
    return whole.flatten()


def _nonfinite_loss(loss: float, cfg, i: int, epoch: int, step: int, steps: int) -> str:
    """The one-line refusal for a nan/inf loss at layer i, step `step` (1-based) of `steps`: where, what is kept and
    the fix (layers commit in order, so every layer before i is committed)."""
    d = cfg.distill
    kept = {0: "no layer is committed yet", 1: "layer 0 stays committed"}.get(i, f"layers 0-{i - 1} stay committed")
    layers = "layer 0" if i == 0 else f"layers 0-{i}"  # layer i's own weights, or inputs its teachers computed
    if step == 1:  # before any update: the weights or the inputs, not the learning rate
        fix = (
            f"it is not finite before any update, so layer {i}'s weights or its inputs hold nan/inf: check the "
            f"weights of {layers} in model.path for nan/inf"
        )
    else:
        fix = (
            f"lower distill.lr (now {d.lr}), or check the weights of {layers} in model.path for nan/inf (a batch's "
            "inputs may hold them)"
        )
    if d.buffer_dtype == "float16":
        fix += ", or set distill.buffer_dtype=bfloat16 (hidden states can overflow float16)"
    return (
        f"stage 1: the loss is {loss} at layer {i}, step {step} of {steps} (epoch {epoch + 1} of {d.epochs}); "
        f"nothing of layer {i} is committed, {kept} and a rerun resumes at layer {i}; {fix}"
    )


@torch.no_grad()
def run_teacher(s: Stage1, layer, buf_in, buf_out) -> bool:
    """The teacher layer over every sequence of this rank, on the device, batch by batch (the next batch staged
    while one computes); False when an output is not finite (nan/inf)."""
    batch, n = s.cfg.distill.batch_size, buf_in.shape[0]
    starts = list(range(0, n, batch))
    staged = Stager(buf_in, s.rt.device).steps([list(range(a, min(n, a + batch))) for a in starts])
    finite = torch.ones((), dtype=torch.bool, device=s.rt.device)
    for a, x in zip(starts, staged, strict=True):
        out = streaming.teacher(layer, x.to(s.dtype), s.rope).to(buf_out.dtype)
        finite &= torch.isfinite(out).all()
        if _writer(s.rt):  # the ranks of a tensor-parallel group share one buffer (the same outputs)
            buf_out[a : a + batch] = out.cpu()
    if s.rt.tp > 1:  # the group's other ranks read buf_out next: not before it is whole
        runtime.barrier(s.rt)
    return bool(finite)


def _slot(rt) -> int:
    """The rank whose buffer files this rank uses: its own, or with tensor parallelism the first rank of its group
    (a group's ranks hold the same sequences and sit on one node: they share one copy, written by that rank)."""
    return rt.dp_rank * rt.tp


def _writer(rt) -> bool:
    return rt.tp_rank == 0


# --- the run's identity ----------------------------------------------------------------------------------------------

# identities written before the keys were dotted config keys; their "world" is dropped (a resume may change it)
_LEGACY_KEYS = {
    "model": "model.path",
    "seq_len": "data.seq_len",
    "num_sequences": "data.num_sequences",
    "seed": "seed",
    "data": "data.source",
    "buffer_dtype": "distill.buffer_dtype",
    "weights": "distill.objectives",
    "epochs": "distill.epochs",
    "batch_size": "distill.batch_size",
    "lr": "distill.lr",
}


def run_identity(cfg, model_path: Path, attention, weights: dict[str, float]) -> dict:
    """Every setting that changes stage 1's result, under the dotted key a user writes, as it takes effect (JSON
    values). Left out, as they do not change what is computed: the number of ranks (the buffers are per sequence; a
    resume on another world rebuilds them), model.device and model.arch (the device moves only rounding; arch is for
    `plan`), distill.progress, distill.buffer_dir (where the buffers live, not what they hold), distill.recipe
    (only through distill.objectives, recorded as resolved), distill.query_block (the same loss summed in other
    row blocks: memory only, like the number of ranks it moves only floating-point rounding) and attention.backend
    (the same attention computed by another implementation: rounding only)."""
    d, data = cfg.distill, cfg.data
    user_source = data.source is not None  # the embedded default ignores text_field and heldout_fraction
    identity = {
        "model.path": str(Path(model_path).resolve()),
        "model.dtype": cfg.model.dtype,
        "seed": cfg.seed,
        "data.source": str(Path(data.source).resolve()) if user_source else None,
        "data.text_field": data.text_field if user_source else None,
        "data.heldout_fraction": data.heldout_fraction if user_source else 0.0,
        "data.seq_len": data.seq_len,
        "data.num_sequences": data.num_sequences,
        "distill.objectives": weights,  # resolved: distill.objectives, else distill.recipe's objective
        "distill.train_feature_maps": d.train_feature_maps,
        "distill.train_gamma": train_gamma(cfg, weights),  # resolved
        "distill.lr": d.lr,
        "distill.weight_decay": d.weight_decay,
        "distill.epochs": d.epochs,
        "distill.batch_size": d.batch_size,
        "distill.buffer_dtype": d.buffer_dtype,
    }
    container = OmegaConf.to_container(attention, resolve=True) if OmegaConf.is_config(attention) else dict(attention)
    identity.update({f"attention.{k}": v for k, v in container.items() if k != "backend"})  # window, layers, ...
    return json.loads(json.dumps(identity))


def identity_changes(recorded: dict, identity: dict) -> list[str]:
    """'key old -> new' for each key of `identity` whose recorded value differs (sorted by key). A key the
    recorded identity lacks (written by an older version) counts as changed: nothing says it was the same."""
    if "seq_len" in recorded:  # the older, undotted form
        old = {new: recorded[k] for k, new in _LEGACY_KEYS.items() if k in recorded}
        old.update({f"attention.{k}": v for k, v in (recorded.get("attention") or {}).items()})
        recorded = old

    def show(d: dict, key: str) -> str:
        if key not in d:
            return "(not recorded)"
        return d[key] if isinstance(d[key], str) else json.dumps(d[key])

    missing = object()
    return [
        f"{k} {show(recorded, k)} -> {show(identity, k)}"
        for k in sorted(identity)
        if recorded.get(k, missing) != identity[k]
    ]


@dataclass
class Stage1:
    """What stage 1's loop reads: the teacher checkpoint, its config, this rank's sequences and buffers, the run's
    identity and the layer to start at."""

    cfg: object
    rt: runtime.Runtime
    model_path: Path
    config: object
    ckpt: streaming.ShardedCheckpoint
    attention: object
    weights: dict
    identity: dict
    manifest: dict | None
    dtype: torch.dtype
    buf_dtype: torch.dtype
    owned: list[int]  # the sequences this rank holds: s = rank mod world
    first: int = 0
    bufs: dict = field(default_factory=dict)  # 'a' / 'b': this rank's memory-mapped hidden-state buffers
    rope: object = None

    @property
    def stage1(self) -> Path:
        return rundir.stage1_dir(self.cfg)

    @property
    def buffer_dir(self) -> Path:
        return rundir.buffer_dir(self.cfg)

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def log(self, msg: str) -> None:
        if self.rt.main:
            with open(self.stage1 / "log.txt", "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {msg}\n")


def distill(cfg) -> Path:
    """Run (or resume) stage 1; returns the converted model directory {run_dir}/stage1/converted. Per layer: train
    its feature maps on the teacher's inputs to it, run the teacher layer to make the next layer's inputs, commit."""
    checked = preflight(cfg, "distill")  # inputs, architecture, tensor-parallel shape, memory, disk: before any write
    with SignalFlag() as signal:  # USR1/TERM: a step checkpoint at the next step, or a stop after a commit
        s = start(cfg)
        for warning in checked.warnings:  # e.g. ranks left idle by too few query blocks per step
            s.log(f"warning: {warning}")
        current = inputs_of_first_layer(s)
        for i, layer in streaming.layers(s.config, s.ckpt, s.dtype, first=s.first, device=s.rt.device):
            tensor_parallel.split_layer(layer, s.rt)  # its heads and MLP columns over the tensor-parallel group
            other = "b" if current == "a" else "a"
            if _writer(s.rt):
                (s.buffer_dir / f"written_{other}.rank{_slot(s.rt)}").unlink(missing_ok=True)
            params, losses = transfer(s, i, layer, current)
            if i + 1 < s.n_layers:
                advance(s, i, layer, current, other)
            commit_layer(s, i, params, losses, other)
            current = other
            if i + 1 < s.n_layers and runtime.any_rank(s.rt, signal.raised):
                s.log(f"signal: layer {i} is committed, exiting for a requeue")
                raise requeue.request(
                    cfg.run_dir,
                    f"layer {i}",
                    s.stage1,
                    s.rt,
                    what=f"stage 1 stopped by a signal after committing layer {i} of {s.n_layers}",
                )
        return write_output(s)


def start(cfg) -> Stage1:
    """The teacher's config and checkpoint, the run's identity (a rerun with other settings is refused before any
    write), the first uncommitted layer."""
    rt = runtime.init(cfg.model.device, cfg.launch.tensor_parallel)
    if rt.main:
        requeue.clear_request(cfg.run_dir)
    model_path = Path(cfg.model.path) if cfg.model.path else assets.require().model
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    config._attn_implementation = "sdpa"
    weights = objective_weights(cfg)
    attention = attention_settings(cfg.attention)
    N = cfg.data.num_sequences
    s = Stage1(
        cfg,
        rt,
        model_path,
        config,
        streaming.ShardedCheckpoint(model_path),
        attention,
        weights,
        run_identity(cfg, model_path, attention, weights),
        None,
        getattr(torch, cfg.model.dtype),
        getattr(torch, cfg.distill.buffer_dtype),
        list(range(rt.dp_rank, N, rt.dp)),  # the ranks of a tensor-parallel group hold the same sequences
    )
    manifest_path = s.stage1 / "manifest.json"
    s.manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    changes = identity_changes(s.manifest["identity"], s.identity) if s.manifest else []
    if changes:
        raise DistillError(
            f"{s.stage1} holds a stage 1 run made with other settings: {', '.join(changes)}; use another run_dir, "
            f"restore them, or delete {s.stage1}"
        )
    s.stage1.mkdir(parents=True, exist_ok=True)
    preflight_buffers(s.buffer_dir, len(s.owned), cfg.data.seq_len, config.hidden_size, s.buf_dtype)
    s.first = next((i for i in range(s.n_layers) if not committed(s.stage1, i)), s.n_layers)
    s.log(
        f"start at layer {s.first} of {s.n_layers}: {rt.world} ranks (data {rt.dp} x tensor {rt.tp}), "
        f"{len(s.owned)} of {N} sequences on rank 0"
    )
    return s


def inputs_of_first_layer(s: Stage1) -> str:
    """The buffer ('a' or 'b') holding the first layer's inputs: the one the manifest names when this rank's copy
    of it is complete and laid out for this number of ranks (every rank must agree), else rebuilt from the
    embeddings by replaying the committed teacher layers."""
    rt, manifest, T, D = s.rt, s.manifest, s.cfg.data.seq_len, s.config.hidden_size
    paths = {k: s.buffer_dir / f"hidden_{k}.rank{_slot(rt)}.bin" for k in ("a", "b")}
    size = len(s.owned) * T * D * torch.empty((), dtype=s.buf_dtype).element_size()
    layout = (rt.world, rt.tp)
    ready = (
        manifest is not None
        and manifest["next_layer"] == s.first
        and _layout(manifest) == layout
        and _written_by(s.buffer_dir / f"written_{manifest['inputs']}.rank{_slot(rt)}") == layout
        and paths[manifest["inputs"]].is_file()
        and paths[manifest["inputs"]].stat().st_size == size
    )
    ready = runtime.all_ranks(rt, ready)
    if not ready:  # what this rank's buffers hold is trusted no more: their markers go before a buffer is resized
        for name in paths:
            if _writer(rt):
                (s.buffer_dir / f"written_{name}.rank{_slot(rt)}").unlink(missing_ok=True)
        if rt.main and manifest is not None and manifest.get("world") != rt.world:
            _drop_absent_ranks(s.buffer_dir, rt.world)
        runtime.barrier(rt)
    if _writer(rt):
        s.bufs = {k: _buffer(p, len(s.owned), T, D, s.buf_dtype, create=True) for k, p in paths.items()}
    if rt.tp > 1:  # the other ranks of the group map the files their first rank made
        runtime.barrier(rt)
        s.bufs = {k: _buffer(p, len(s.owned), T, D, s.buf_dtype, create=False) for k, p in paths.items()}
    s.rope = streaming.rotary(s.config, T, s.dtype, rt.device)
    if ready:
        s.log(f"resuming at layer {s.first} from buffer {manifest['inputs']}")
        return manifest["inputs"]
    if s.first >= s.n_layers:
        return "a"
    if manifest is not None:
        if _layout(manifest) != layout:
            (world, tp) = _layout(manifest)
            were, now = f"{world} ranks", f"{rt.world}"
            if (tp, rt.tp) != (1, 1):
                were, now = f"{were} at tensor_parallel {tp}", f"{now} at {rt.tp}"
            why = f"its buffers were written by {were}, now {now}"
        elif manifest["next_layer"] != s.first:
            why = f"the manifest names layer {manifest['next_layer']}'s inputs"
        else:
            why = "a rank's buffer of them is missing, incomplete or laid out for another number of ranks"
        s.log(f"resuming at layer {s.first}: rebuilding its inputs by replaying the teacher ({why})")
    return _rebuild_inputs(s)


def _rebuild_inputs(s: Stage1) -> str:
    cfg, batch = s.cfg, s.cfg.distill.batch_size
    tokenizer = AutoTokenizer.from_pretrained(s.model_path, local_files_only=True)
    docs, _ = corpus.split_documents(
        corpus.read_documents(cfg.data.source, cfg.data.text_field),
        cfg.data.heldout_fraction if cfg.data.source else 0.0,
    )
    ids = corpus.pack(tokenizer, docs, cfg.data.seq_len, cfg.data.num_sequences, cfg.seed)[s.owned]
    if _writer(s.rt):
        emb = streaming.embedding(s.ckpt, s.dtype)
        for a in range(0, len(s.owned), batch):
            s.bufs["a"][a : a + batch] = emb[ids[a : a + batch]].to(s.buf_dtype)
        del emb
    if s.rt.tp > 1:
        runtime.barrier(s.rt)
    current = "a"
    for j, layer in itertools.islice(streaming.layers(s.config, s.ckpt, s.dtype, device=s.rt.device), s.first):
        tensor_parallel.split_layer(layer, s.rt)
        s.log(f"replaying teacher layer {j} to rebuild layer {s.first}'s inputs")
        other = "b" if current == "a" else "a"
        run_teacher(s, layer, s.bufs[current], s.bufs[other])
        current = other
    _mark_written(s.buffer_dir, current, s.rt)
    return current


def transfer(s: Stage1, i: int, layer, current: str) -> tuple[dict, list[float]]:
    """Layer i's trained phi/gamma (nothing for a layer left unconverted) and its loss curve."""
    layers = s.attention.layers
    if layers is not None and i not in layers:
        return {}, []
    torch.manual_seed(s.cfg.seed * 7919 + i)
    m = HybridAttention.from_softmax(layer.self_attn, s.config, i, s.attention, param_dtype=torch.float32)
    tensor_parallel.narrow(m, s.rt)  # this rank's heads (its q/k/v projections are split already)
    losses = train_layer(s, m, layer, s.bufs[current], i)
    params = {
        f"model.layers.{i}.self_attn.{n}": tensor_parallel.whole(p, _head_dim(s), s.rt).clone()
        for n, p in m.hybrid_parameters()
    }
    if not all(bool(torch.isfinite(t).all()) for t in params.values()):  # the same on every rank
        raise DistillError(
            f"stage 1: layer {i}'s trained feature maps hold nan/inf after its last step (its loss stayed "
            f"finite); nothing of layer {i} is committed and a rerun resumes there: lower distill.lr (now "
            f"{s.cfg.distill.lr}) in another run_dir"
        )
    return params, losses


def advance(s: Stage1, i: int, layer, current: str, other: str) -> None:
    """The teacher layer i on its inputs: layer i+1's inputs, in the other buffer (refused when not finite)."""
    finite = run_teacher(s, layer, s.bufs[current], s.bufs[other])
    if not runtime.all_ranks(s.rt, finite):
        raise DistillError(
            f"stage 1: teacher layer {i} gives nan/inf outputs (layer {i + 1}'s inputs); nothing of layer {i} "
            f"is committed: check layer {i}'s weights in model.path for nan/inf, or use a wider "
            "distill.buffer_dtype (float16 overflows where bfloat16 and float32 do not)"
        )
    _mark_written(s.buffer_dir, other, s.rt)


def commit_layer(s: Stage1, i: int, params: dict, losses: list[float], other: str) -> None:
    """Layer i's parameters (written then renamed), the manifest naming the buffer with layer i+1's inputs, then
    the marker with the parameter file's sha256, written last."""
    stage1 = s.stage1
    if s.rt.main:
        tmp = stage1 / f"layer_{i:03d}.safetensors.tmp"
        save_file(params, tmp, metadata={"losses": json.dumps(losses if params else [])})
        os.replace(tmp, stage1 / f"layer_{i:03d}.safetensors")
        fault(f"commit:{i}")
        manifest = {"identity": s.identity, "next_layer": i + 1, "inputs": other, "world": s.rt.world}
        manifest["tensor_parallel"] = s.rt.tp
        atomic_write(stage1 / "manifest.json", json.dumps(manifest))
        atomic_write(
            stage1 / f"layer_{i:03d}.done", json.dumps({"sha256": sha256(stage1 / f"layer_{i:03d}.safetensors")})
        )
        StepCheckpoint.path(stage1, i).unlink(missing_ok=True)  # committed: its step checkpoint is spent
    runtime.barrier(s.rt)
    fault(f"after:{i}", s.rt.rank)


def write_output(s: Stage1) -> Path:
    """The converted model: every trained layer's phi/gamma, the attention settings, the base referenced."""
    out = rundir.stage1_output(s.cfg)
    config = s.config
    trained = sorted(range(s.n_layers) if s.attention.layers is None else s.attention.layers)
    if s.rt.main:
        params = {}
        for i in trained:
            params.update(load_file(s.stage1 / f"layer_{i:03d}.safetensors"))
        settings = dict(s.attention)
        settings["layers"] = trained
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        settings["feature_dim"] = s.attention.feature_dim or head_dim
        write_converted(out, config.architectures[0], str(s.model_path.resolve()), settings, params)
        s.log(f"converted model written to {out}")
    runtime.barrier(s.rt)
    return out


def _drop_absent_ranks(buffer_dir: Path, world: int) -> None:
    """Remove the buffers and markers of ranks >= world, left by a run on more ranks: no rank of this run owns them
    (and, gone, they can neither be trusted by mistake nor hold disk)."""
    for p in [*buffer_dir.glob("hidden_*.rank*.bin"), *buffer_dir.glob("written_*.rank*")]:
        rank = p.name.split(".rank", 1)[1].removesuffix(".bin")
        if rank.isdigit() and int(rank) >= world:
            p.unlink(missing_ok=True)


def _mark_written(buffer_dir: Path, name: str, rt) -> None:
    """This rank's buffer `name` now holds complete inputs, laid out for this number of ranks (checked on resume
    before the buffer is trusted); written by the rank that writes the buffer."""
    if not _writer(rt):
        return
    with open(buffer_dir / f"hidden_{name}.rank{_slot(rt)}.bin", "rb+") as f:
        os.fsync(f.fileno())
    layout = json.dumps({"world": rt.world, "tensor_parallel": rt.tp})
    atomic_write(buffer_dir / f"written_{name}.rank{_slot(rt)}", layout)


def _layout(record: dict) -> tuple[int, int]:
    """(ranks, tensor_parallel) of a manifest or marker: which sequences each rank's buffers hold."""
    return record.get("world"), record.get("tensor_parallel", 1)


def _written_by(marker: Path) -> tuple[int, int] | None:
    """The layout (ranks, tensor_parallel) a buffer's marker vouches for; None without a marker (or an older one)."""
    try:
        record = json.loads(marker.read_text())
        return int(record["world"]), int(record.get("tensor_parallel", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return None
