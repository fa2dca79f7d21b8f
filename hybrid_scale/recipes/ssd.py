"""Scheduled Sliding-window Dropout: during hybrid fine-tuning, a layer's SWA is dropped (the layer runs `la_only`
for that forward) with probability p(t), a step function of training progress (default 0.9 -> 0.75 -> 0.5 at equal
thirds); optionally the window follows its own step schedule.

Every decision is a pure function of (seed, step): identical on every rank without communication, and the same after
a resume. Only the tallies of realised drops (for the log) are carried in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def at(schedule: list[list[float]], progress: float) -> float:
    """Value of a [[fraction, value], ...] step schedule at progress in [0, 1]."""
    value = schedule[0][1]
    for fraction, v in schedule:
        if progress >= fraction:
            value = v
    return value


def phase(schedule: list[list[float]], progress: float) -> int:
    return sum(1 for fraction, _ in schedule if progress >= fraction) - 1


@dataclass
class SSD:
    schedule: list[list[float]]
    granularity: str  # "step" | "layer"
    layers: list[int]
    seed: int
    windows: list[list[float]] | None = None
    dropped: list[int] = field(default_factory=list)  # per phase: layer-forwards that ran la_only
    total: list[int] = field(default_factory=list)  # per phase: layer-forwards

    def __post_init__(self):
        n = len(self.schedule)
        self.dropped = list(self.dropped) or [0] * n
        self.total = list(self.total) or [0] * n

    def drops(self, step: int, max_steps: int) -> dict[int, bool]:
        """Which layers drop their SWA at optimizer step `step` (0-based), and tally them."""
        progress = step / max_steps
        p = at(self.schedule, progress)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.granularity == "step":
            draws = torch.rand(1, generator=g, dtype=torch.float64).expand(len(self.layers))
        else:
            draws = torch.rand(len(self.layers), generator=g, dtype=torch.float64)
        out = {i: bool(d < p) for i, d in zip(self.layers, draws.tolist(), strict=True)}
        k = phase(self.schedule, progress)
        self.dropped[k] += sum(out.values())
        self.total[k] += len(out)
        return out

    def window(self, step: int, max_steps: int) -> int | None:
        return None if self.windows is None else int(at(self.windows, step / max_steps))

    def realised(self) -> list[dict]:
        return [
            {"from": f, "p": p, "realised": (d / t if t else None), "layer_forwards": t}
            for (f, p), d, t in zip(self.schedule, self.dropped, self.total, strict=True)
        ]

    def state_dict(self) -> dict:
        return {"dropped": self.dropped, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.dropped, self.total = list(state["dropped"]), list(state["total"])
