"""A stage's run resolved once, when it starts (entry.py): its paths, its derived settings, the model it reads.
The preflight, the lock and the stage body all take this one object."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from .layout import RunLayout
from .settings import Derived, derive
from .sources import ModelSource, stage_model


@dataclass(frozen=True)
class Resolved:
    """A stage's run, resolved once when it starts: its paths, its derived settings, the model it reads."""

    layout: RunLayout
    derived: Derived
    model: ModelSource | None

    @classmethod
    def of(cls, cfg: Config, stage: str | None = None) -> Resolved:
        layout = RunLayout.of(cfg)
        return cls(layout, derive(cfg), stage_model(cfg, stage, layout) if stage else None)
