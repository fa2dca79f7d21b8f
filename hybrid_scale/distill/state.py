"""Stage 1's state, Stage1: what its loop (stage.py), its buffers (buffers.py) and its training step
(step.py) read -- the teacher checkpoint and config, this rank's sequences and buffers, the run's identity
and the layer to start at. In a module of its own so that each of them can import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config.schema import AttentionConfig, Config
from ..distributed import runtime
from ..distributed.requeue import SignalFlag
from ..models import streaming
from ..run.layout import RunLayout
from ..run.log import StageLog
from ..run.metrics import Metrics
from ..run.settings import Derived


@dataclass
class Stage1:
    """What stage 1's loop reads: the teacher checkpoint, its config, this rank's sequences and buffers, the run's
    identity and the layer to start at."""

    cfg: Config  # the run's config (a structured DictConfig of config/schema.py's Config)
    rt: runtime.Runtime
    layout: RunLayout
    derived: Derived  # the objectives and whether gamma trains, resolved (run/settings.py)
    log: StageLog  # stage1/log.txt, rank 0
    signal: SignalFlag  # USR1/TERM: set by the stage's entry
    model_path: Path
    config: PretrainedConfig  # the teacher's
    ckpt: streaming.ShardedCheckpoint
    attention: AttentionConfig  # the resolved attention settings the layers are converted with
    identity: dict
    manifest: dict | None
    dtype: torch.dtype
    buf_dtype: torch.dtype
    owned: list[int]  # the sequences this rank holds: s = rank mod world
    first: int = 0
    bufs: dict = field(default_factory=dict)  # 'a' / 'b': this rank's memory-mapped hidden-state buffers
    rope: nn.Module | None = None  # the teacher's rotary embedding
    metrics: Metrics | None = None  # metrics.jsonl, TensorBoard, W&B (rank 0)
    step_s: float | None = None  # a training step's wall time, averaged (exponentially) over this run's steps

    @property
    def stage1(self) -> Path:
        return self.layout.stage1

    @property
    def buffer_dir(self) -> Path:
        return self.layout.buffers

    @property
    def weights(self) -> dict[str, float]:
        return self.derived.objectives

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def steps_per_layer(self) -> int:
        distill = self.cfg.distill
        return distill.epochs * -(-self.cfg.data.num_sequences // distill.batch_size)
