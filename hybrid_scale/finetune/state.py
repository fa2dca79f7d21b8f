"""Stage 2's state (Stage2): everything its training loop (stage.py) reads and advances, and what a step checkpoint
saves of it (checkpoints.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from ..config.schema import Config
from ..distributed import runtime
from ..distributed.replicated import ReplicatedEngine
from ..recipes.early_stopping import EarlyStopping
from ..recipes.ssd import SSD
from ..run.layout import RunLayout
from ..run.log import StageLog
from ..run.metrics import Metrics
from ..run.sources import ModelSource

if TYPE_CHECKING:  # (DeepSpeed and PEFT are imported where the stage builds them)
    from deepspeed import DeepSpeedEngine
    from peft import PeftModel
    from transformers.integrations import HfDeepSpeedConfig

    Engine = DeepSpeedEngine | ReplicatedEngine


@dataclass
class Stage2:
    """Everything the training loop reads and advances."""

    cfg: Config  # the run's config (a structured DictConfig of config/schema.py's Config)
    rt: runtime.Runtime
    log: StageLog  # stage2/log.txt, rank 0
    layout: RunLayout
    source: ModelSource  # the converted model it fine-tunes, its hybrid_config.json read once
    mode: str
    early: bool
    settings: dict
    train_ids: torch.Tensor
    held_ids: torch.Tensor
    accumulation: int
    model: PreTrainedModel | None = None  # the converted model
    peft_model: PeftModel | None = None  # the same with LoRA (PEFT)
    engine: Engine | None = None  # DeepSpeed's ZeRO-3 engine, or the replicated one under tensor parallelism
    named: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)
    ssd: SSD | None = None
    step: int = 0
    dropped: list[int] = field(default_factory=list)  # the layers SSD ran in la_only in the last step
    ssd_p: float | None = None  # SSD's drop probability in the last step
    lr: float | None = None  # the learning rate of the last step
    metrics: Metrics | None = None  # metrics.jsonl, TensorBoard, W&B (rank 0)
    flops_per_step: float = 0.0  # measure.training_flops of one optimizer step
    step_s: float | None = None  # a step's wall time, averaged (exponentially) over the steps of this run
    hf_ds: HfDeepSpeedConfig | None = None  # from_pretrained loads under ZeRO-3 init while it lives
    curves: dict = field(default_factory=lambda: dict(train=[], eval_steps=[], hybrid=[], la_only=[], window=[]))
    stopping: EarlyStopping = field(default_factory=EarlyStopping)

    @property
    def stage2(self) -> Path:
        return self.layout.stage2

    def state_dict(self) -> dict:
        return {
            "settings": self.settings,
            "step": self.step,
            "curves": self.curves,
            "stopping": asdict(self.stopping),
            "ssd": self.ssd.state_dict() if self.ssd else None,
            "window": next(iter(self.layers.values())).window,
        }
