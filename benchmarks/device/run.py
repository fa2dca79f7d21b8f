"""The Run every part of the device benchmark writes into: its settings, its figures (Run.data, written as
device_speed.json and device_speed.md after every part), the deadline (DEADLINE, time.monotonic(), set by the driver)
and the budgets; `ratio` records a figure beside its target (settings.TARGETS) and prints it at once, so a run cut
short still has what it measured in its output."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from benchmarks.device.report import markdown
from benchmarks.device.settings import TARGETS
from benchmarks.gpu_check.common import DEADLINE, Log
from benchmarks.report_table import fmt


class Run:
    """The settings, the figures, the deadline; writes device_speed.md / .json after every part."""

    def __init__(self, cfg: dict, out: Path, dry: bool, command: str):
        self.cfg, self.out, self.dry, self.command = cfg, out, dry, command
        self.device, self.dtype = cfg["device"], getattr(torch, cfg["dtype"])
        self.cuda = torch.device(self.device).type == "cuda"
        self.data: dict = {"parts": {}, "ratios": {}, "settings": cfg, "dry_run": dry, "command": command}
        self.data["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.log = Log(out / "device_speed_children.log")

    def left(self) -> float:
        return DEADLINE[0] - time.monotonic()

    def part_deadline(self, name: str) -> float:
        """time.monotonic() after which part `name` starts nothing: its budget from now, or the run's deadline."""
        return min(DEADLINE[0], time.monotonic() + self.cfg["budgets"][name])

    def ratio(self, key: str, value: float | None, note: str = "") -> None:
        """A figure with its target (TARGETS: at most), printed at once."""
        target = TARGETS.get(key)
        met = None if value is None or target is None else bool(value <= target)
        self.data["ratios"][key] = dict(value=value, target=target, met=met, note=note)
        goal = "" if target is None else f" (target <= {target:.3g}: {'met' if met else 'MISSED'})"
        print(f"device_speed: RATIO {key}: {fmt(value)}{goal}{' ' + note if note else ''}", flush=True)

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def save(self) -> None:
        (self.out / "device_speed.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "device_speed.md").write_text(markdown(self.data))


def until(deadline: float, shares: int) -> float:
    """The time.monotonic() by which the next of `shares` equal slices of what is left before `deadline` ends (a
    length's share of a part's budget, so that one length cannot spend the next one's)."""
    now = time.monotonic()
    return now + max(0.0, deadline - now) / max(1, shares)


def out_of_time(limit: float, what: str, needs: float = 0.0) -> str | None:
    """Why a row is skipped when `limit` (time.monotonic()) has passed, or when less than `needs` seconds (what a
    like row took) are left before it, else None."""
    left = limit - time.monotonic()
    if left <= 0:
        return f"{what} spent ({-left:.0f} s past it)"
    if left < needs:
        return f"{what}: {left:.0f} s left, a like row took {needs:.0f} s"
    return None
