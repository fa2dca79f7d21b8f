"""Stage 1's hidden-state buffers: two memory-mapped files per rank, 'a' and 'b' (one holds a layer's inputs, the
teacher layer writes the next layer's into the other; with tensor parallelism one copy per group, written by its
first rank), the disk check before any write, the teacher pass from one buffer into the other (run_teacher), the
markers that vouch for a buffer being complete and laid out for this number of ranks, and the first layer's inputs
on a resume: the buffer the manifest names when every rank can trust it, else rebuilt by replaying the teacher."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import torch

from ..data.staging import Stager
from ..distributed import runtime
from ..errors import DistillError
from ..models import streaming
from ..models.converted import load_tokenizer
from ..storage.commits import atomic_write
from .inputs import training_sequences
from .state import Stage1


def _buffer(path: Path, n: int, seq_len: int, hidden: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    numel = n * seq_len * hidden
    size = numel * torch.empty((), dtype=dtype).element_size()
    if create and (not path.exists() or path.stat().st_size != size):
        with open(path, "wb") as f:
            f.truncate(size)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(n, seq_len, hidden)


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


def inputs_of_first_layer(stage: Stage1) -> str:
    """The buffer ('a' or 'b') holding the first layer's inputs: the one the manifest names when this rank's copy
    of it is complete and laid out for this number of ranks (every rank must agree), else rebuilt from the
    embeddings by replaying the committed teacher layers."""
    rt, manifest, T, D = stage.rt, stage.manifest, stage.cfg.data.seq_len, stage.config.hidden_size
    paths = {k: stage.buffer_dir / f"hidden_{k}.rank{buffer_slot(rt)}.bin" for k in ("a", "b")}
    size = len(stage.owned) * T * D * torch.empty((), dtype=stage.buf_dtype).element_size()
    layout = (rt.world, rt.tp)
    ready = (
        manifest is not None
        and manifest["next_layer"] == stage.first
        and _layout(manifest) == layout
        and _written_by(stage.buffer_dir / f"written_{manifest['inputs']}.rank{buffer_slot(rt)}") == layout
        and paths[manifest["inputs"]].is_file()
        and paths[manifest["inputs"]].stat().st_size == size
    )
    ready = runtime.all_ranks(rt, ready)
    if not ready:  # what this rank's buffers hold is trusted no more: their markers go before a buffer is resized
        for name in paths:
            if buffer_writer(rt):
                (stage.buffer_dir / f"written_{name}.rank{buffer_slot(rt)}").unlink(missing_ok=True)
        if rt.main and manifest is not None and manifest.get("world") != rt.world:
            _drop_absent_ranks(stage.buffer_dir, rt.world)
        runtime.barrier(rt)
    if buffer_writer(rt):
        stage.bufs = {k: _buffer(p, len(stage.owned), T, D, stage.buf_dtype, create=True) for k, p in paths.items()}
    if rt.tp > 1:  # the other ranks of the group map the files their first rank made
        runtime.barrier(rt)
        stage.bufs = {k: _buffer(p, len(stage.owned), T, D, stage.buf_dtype, create=False) for k, p in paths.items()}
    stage.rope = streaming.rotary(stage.config, T, stage.dtype, rt.device)
    if ready:
        stage.log(f"resuming at layer {stage.first} from buffer {manifest['inputs']}")
        return manifest["inputs"]
    if stage.first >= stage.n_layers:
        return "a"
    if manifest is not None:
        if _layout(manifest) != layout:
            (world, tp) = _layout(manifest)
            were, now = f"{world} ranks", f"{rt.world}"
            if (tp, rt.tp) != (1, 1):
                were, now = f"{were} at tensor_parallel {tp}", f"{now} at {rt.tp}"
            why = f"its buffers were written by {were}, now {now}"
        elif manifest["next_layer"] != stage.first:
            why = f"the manifest names layer {manifest['next_layer']}'s inputs"
        else:
            why = "a rank's buffer of them is missing, incomplete or laid out for another number of ranks"
        stage.log(f"resuming at layer {stage.first}: rebuilding its inputs by replaying the teacher ({why})")
    return _rebuild_inputs(stage)


def _rebuild_inputs(stage: Stage1) -> str:
    cfg, batch = stage.cfg, stage.cfg.distill.batch_size
    ids = training_sequences(cfg, load_tokenizer(stage.model_path))[stage.owned]  # (preflight's, tokenized once)
    if buffer_writer(stage.rt):
        emb = streaming.embedding(stage.ckpt, stage.dtype)
        for a in range(0, len(stage.owned), batch):
            stage.bufs["a"][a : a + batch] = emb[ids[a : a + batch]].to(stage.buf_dtype)
        del emb
    if stage.rt.tp > 1:
        runtime.barrier(stage.rt)
    current = "a"
    for j, layer in itertools.islice(
        streaming.layers(stage.config, stage.ckpt, stage.dtype, device=stage.rt.device, rt=stage.rt), stage.first
    ):
        stage.log(f"replaying teacher layer {j} to rebuild layer {stage.first}'s inputs")
        other = "b" if current == "a" else "a"
        run_teacher(stage, layer, stage.bufs[current], stage.bufs[other])
        current = other
    mark_written(stage.buffer_dir, current, stage.rt)
    return current


@torch.no_grad()
def run_teacher(stage: Stage1, layer, buf_in, buf_out) -> bool:
    """The teacher layer over every sequence of this rank, on the device, batch by batch (the next batch staged
    while one computes); False when an output is not finite (nan/inf)."""
    batch, n = stage.cfg.distill.batch_size, buf_in.shape[0]
    starts = list(range(0, n, batch))
    staged = Stager(buf_in, stage.rt.device).steps([list(range(a, min(n, a + batch))) for a in starts])
    finite = torch.ones((), dtype=torch.bool, device=stage.rt.device)
    for a, x in zip(starts, staged, strict=True):
        out = streaming.teacher(layer, x.to(stage.dtype), stage.rope).to(buf_out.dtype)
        finite &= torch.isfinite(out).all()
        if buffer_writer(stage.rt):  # the ranks of a tensor-parallel group share one buffer (the same outputs)
            buf_out[a : a + batch] = out.cpu()
    if stage.rt.tp > 1:  # the group's other ranks read buf_out next: not before it is whole
        runtime.barrier(stage.rt)
    return bool(finite)


def buffer_slot(rt) -> int:
    """The rank whose buffer files this rank uses: its own, or with tensor parallelism the first rank of its group
    (a group's ranks hold the same sequences and sit on one node: they share one copy, written by that rank)."""
    return rt.dp_rank * rt.tp


def buffer_writer(rt) -> bool:
    return rt.tp_rank == 0


def _drop_absent_ranks(buffer_dir: Path, world: int) -> None:
    """Remove the buffers and markers of ranks >= world, left by a run on more ranks: no rank of this run owns them
    (and, gone, they can neither be trusted by mistake nor hold disk)."""
    for p in [*buffer_dir.glob("hidden_*.rank*.bin"), *buffer_dir.glob("written_*.rank*")]:
        rank = p.name.split(".rank", 1)[1].removesuffix(".bin")
        if rank.isdigit() and int(rank) >= world:
            p.unlink(missing_ok=True)


def mark_written(buffer_dir: Path, name: str, rt) -> None:
    """This rank's buffer `name` now holds complete inputs, laid out for this number of ranks (checked on resume
    before the buffer is trusted); written by the rank that writes the buffer."""
    if not buffer_writer(rt):
        return
    with open(buffer_dir / f"hidden_{name}.rank{buffer_slot(rt)}.bin", "rb+") as f:
        os.fsync(f.fileno())
    layout = json.dumps({"world": rt.world, "tensor_parallel": rt.tp})
    atomic_write(buffer_dir / f"written_{name}.rank{buffer_slot(rt)}", layout)


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
