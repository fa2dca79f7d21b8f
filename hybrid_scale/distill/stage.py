"""Stage 1: attention transfer, streamed layer by layer, sharded over ranks, resumable, on model.device.

For layer l, with the teacher's hidden states entering l in a memory-mapped buffer on disk (sequence g on rank
g mod world; with tensor parallelism, on data-parallel group g mod dp):
  1. read only layer l's tensors from the safetensors shards and build that one decoder layer on the device;
  2. train its feature maps (and gamma, fp32 masters) so that linear attention mimics the layer's softmax attention:
     each step's batch is staged to the device (the next one read from disk meanwhile) and broadcast from the ranks
     holding it; its query blocks are split over the ranks (batches.split_units: every rank works every step),
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
This module is the loop (distill, start, transfer, advance, commit_layer, write_output); the run's identity and commit
markers are in identity.py, the buffers and the teacher pass in buffers.py, the training step and its
step checkpoints in step.py, and the state all of them read (Stage1) in state.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from ..attention.layer import HybridAttention
from ..config.schema import Config
from ..distributed import requeue, runtime, tensor_parallel
from ..entry import Entry, stage_entry
from ..errors import DistillError
from ..measure import peak_memory
from ..models import streaming
from ..models.converted import write_converted
from ..run.metrics import Metrics, duration
from ..run.settings import stage1_settings
from ..storage.commits import atomic_write, save_tensors, sha256
from ..storage.faults import fault
from .buffers import buffer_slot, buffer_writer, inputs_of_first_layer, mark_written, preflight_buffers, run_teacher
from .identity import committed, identity_changes
from .inputs import INPUTS
from .state import Stage1
from .step import StepCheckpoint, layer_head_dim, saved_steps, train_layer


def distill(cfg: Config) -> Path:
    """Run (or resume) stage 1; returns the converted model directory {run_dir}/stage1/converted. Per layer: train
    its feature maps on the teacher's inputs to it, run the teacher layer to make the next layer's inputs, commit."""
    # preflight, runtime, lock, signal flag (entry.py); USR1/TERM: a step checkpoint at the next step, or a stop
    # after a commit
    with stage_entry(cfg, "distill", INPUTS) as entry, start(entry) as stage:
        for warning in entry.plan.warnings:  # e.g. ranks left idle by too few query blocks per step
            stage.log(f"warning: {warning}")
        current = inputs_of_first_layer(stage)
        t0, times = time.perf_counter(), []
        # each layer's heads and MLP columns split over the tensor-parallel group, each rank reading only its part
        for i, layer in streaming.layers(
            stage.config, stage.ckpt, stage.dtype, first=stage.first, device=stage.rt.device, rt=stage.rt
        ):
            if i == stage.first and stage.rt.tp > 1:
                stage.log(f"layer {i}: {tensor_parallel.split_report(layer, stage.rt)}")
            other = "b" if current == "a" else "a"
            if buffer_writer(stage.rt):
                (stage.buffer_dir / f"written_{other}.rank{buffer_slot(stage.rt)}").unlink(missing_ok=True)
            params, losses = transfer(stage, i, layer, current)
            if i + 1 < stage.n_layers:
                advance(stage, i, layer, current, other)
            times.append(time.perf_counter() - t0)
            layer_metrics(stage, i, losses, times)  # before the commit: a kill between the two drops it with the layer
            commit_layer(stage, i, params, losses, other)
            current = other
            t0 = time.perf_counter()
            if i + 1 < stage.n_layers and runtime.any_rank(stage.rt, entry.signal.raised):
                stage.log(f"signal: layer {i} is committed, exiting for a requeue")
                raise requeue.request(
                    stage.layout.run_dir,
                    f"layer {i}",
                    stage.stage1,
                    stage.rt,
                    what=f"stage 1 stopped by a signal after committing layer {i} of {stage.n_layers}",
                )
        return write_output(stage)


def layer_metrics(stage: Stage1, i: int, losses: list[float], times: list[float]) -> None:
    """Layer i's record (its time, first and last loss, the ETA of the layers left) and a progress line."""
    left = stage.n_layers - i - 1
    eta = sum(times) / len(times) * left
    values = {"layer": i, "layer_s": times[-1], "eta_s": eta, "layers_left": left}
    values |= {"first_loss": losses[0], "last_loss": losses[-1]} if losses else {}
    values |= peak_memory(stage.rt.device)
    stage.metrics.log((i + 1) * stage.steps_per_layer, values, kind="layer")
    tokens = stage.steps_per_layer * stage.cfg.distill.batch_size * stage.cfg.data.seq_len / times[-1]
    stage.metrics.progress(
        f"layer {i + 1}/{stage.n_layers} in {duration(times[-1])} ({tokens:.0f} tokens/s), "
        f"{values['host_peak_gb']:.1f} GB host peak, ETA {duration(eta)}",
        force=left == 0,
    )


@contextmanager
def start(entry: Entry) -> Iterator[Stage1]:
    """The teacher's config and checkpoint, the run's identity (a rerun with other settings is refused before any
    write), the first uncommitted layer."""
    cfg, rt, model_path = entry.cfg, entry.rt, entry.model.path
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    config._attn_implementation = "sdpa"
    N = cfg.data.num_sequences
    stage = Stage1(
        cfg,
        rt,
        entry.layout,
        entry.derived,
        entry.log,
        entry.signal,
        model_path,
        config,
        streaming.ShardedCheckpoint(model_path),
        cfg.attention,
        stage1_settings(cfg, entry.derived, model_path),
        None,
        getattr(torch, cfg.model.dtype),
        getattr(torch, cfg.distill.buffer_dtype),
        list(range(rt.dp_rank, N, rt.dp)),  # the ranks of a tensor-parallel group hold the same sequences
    )
    manifest_path = stage.stage1 / "manifest.json"
    stage.manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    changes = identity_changes(stage.manifest["identity"], stage.identity) if stage.manifest else []
    if changes:
        raise DistillError(
            f"{stage.stage1} holds a stage 1 run made with other settings: {', '.join(changes)}; use another run_dir, "
            f"restore them, or delete {stage.stage1}"
        )
    stage.stage1.mkdir(parents=True, exist_ok=True)
    preflight_buffers(stage.buffer_dir, len(stage.owned), cfg.data.seq_len, config.hidden_size, stage.buf_dtype)
    stage.first = next((i for i in range(stage.n_layers) if not committed(stage.stage1, i)), stage.n_layers)
    stage.log(
        f"start at layer {stage.first} of {stage.n_layers}: {rt.world} ranks (data {rt.dp} x tensor {rt.tp}), "
        f"{len(stage.owned)} of {N} sequences on rank 0"
    )
    # the records up to the committed layers (and a matching step checkpoint's steps) stay
    resumed = stage.first * stage.steps_per_layer + (
        saved_steps(stage, stage.first) if stage.first < stage.n_layers else 0
    )
    with Metrics(cfg, "distill", stage.stage1, rt.main, resumed=resumed, log=stage.log) as stage.metrics:
        yield stage


def transfer(stage: Stage1, i: int, layer, current: str) -> tuple[dict, list[float]]:
    """Layer i's trained phi/gamma (nothing for a layer left unconverted) and its loss curve."""
    layers = stage.attention.layers
    if layers is not None and i not in layers:
        return {}, []
    torch.manual_seed(stage.cfg.seed * 7919 + i)
    m = HybridAttention.from_softmax(layer.self_attn, stage.config, i, stage.attention, param_dtype=torch.float32)
    tensor_parallel.narrow(m, stage.rt)  # this rank's heads (its q/k/v projections are split already)
    if not stage.cfg.attention.cache_train:  # the cache of exact keys joins after training (attention.cache_train)
        m.cache_keys = 0
    losses = train_layer(stage, m, layer, stage.bufs[current], i)
    params = {
        f"model.layers.{i}.self_attn.{n}": tensor_parallel.whole(p, layer_head_dim(stage), stage.rt).clone()
        for n, p in m.hybrid_parameters()
    }
    if not all(bool(torch.isfinite(t).all()) for t in params.values()):  # the same on every rank
        raise DistillError(
            f"stage 1: layer {i}'s trained feature maps hold nan/inf after its last step (its loss stayed "
            f"finite); nothing of layer {i} is committed and a rerun resumes there: lower distill.lr (now "
            f"{stage.cfg.distill.lr}) in another run_dir"
        )
    return params, losses


def advance(stage: Stage1, i: int, layer, current: str, other: str) -> None:
    """The teacher layer i on its inputs: layer i+1's inputs, in the other buffer (refused when not finite)."""
    finite = run_teacher(stage, layer, stage.bufs[current], stage.bufs[other])
    if not runtime.all_ranks(stage.rt, finite):
        raise DistillError(
            f"stage 1: teacher layer {i} gives nan/inf outputs (layer {i + 1}'s inputs); nothing of layer {i} "
            f"is committed: check layer {i}'s weights in model.path for nan/inf, or use a wider "
            "distill.buffer_dtype (float16 overflows where bfloat16 and float32 do not)"
        )
    mark_written(stage.buffer_dir, other, stage.rt)


def commit_layer(stage: Stage1, i: int, params: dict, losses: list[float], other: str) -> None:
    """Layer i's parameters (written then renamed), the manifest naming the buffer with layer i+1's inputs, then
    the marker with the parameter file's sha256, written last."""
    stage1 = stage.stage1
    if stage.rt.main:
        tmp = stage1 / f"layer_{i:03d}.safetensors.tmp"
        save_tensors(params, tmp, metadata={"losses": json.dumps(losses if params else [])})
        os.replace(tmp, stage1 / f"layer_{i:03d}.safetensors")
        fault(f"commit:{i}")
        manifest = {"identity": stage.identity, "next_layer": i + 1, "inputs": other, "world": stage.rt.world}
        manifest["tensor_parallel"] = stage.rt.tp
        atomic_write(stage1 / "manifest.json", json.dumps(manifest))
        atomic_write(
            stage1 / f"layer_{i:03d}.done", json.dumps({"sha256": sha256(stage1 / f"layer_{i:03d}.safetensors")})
        )
        StepCheckpoint.path(stage1, i).unlink(missing_ok=True)  # committed: its step checkpoint is spent
    runtime.barrier(stage.rt)
    fault(f"after:{i}", stage.rt.rank)


def write_output(stage: Stage1) -> Path:
    """The converted model: every trained layer's phi/gamma, the attention settings, the base referenced."""
    out = stage.layout.stage1_output
    config = stage.config
    trained = sorted(range(stage.n_layers) if stage.attention.layers is None else stage.attention.layers)
    if stage.rt.main:
        params = {}
        for i in trained:
            params.update(load_file(stage.stage1 / f"layer_{i:03d}.safetensors"))
        settings = dict(stage.attention)
        settings["layers"] = trained
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        settings["feature_dim"] = stage.attention.feature_dim or head_dim
        write_converted(out, config.architectures[0], str(stage.model_path.resolve()), settings, params)
        stage.log(f"converted model written to {out}")
    runtime.barrier(stage.rt)
    return out
