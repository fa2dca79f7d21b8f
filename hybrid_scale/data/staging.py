"""Rows of a memory-mapped buffer, staged to the compute device one step ahead: a background thread reads the next
step's rows from disk (into pinned memory when the device is a GPU) while the current step computes; the copy to
the device does not block the host."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch


class Stager:
    def __init__(self, buffer: torch.Tensor, device: torch.device):
        self.buffer, self.device = buffer, device
        self.pin = device.type == "cuda"

    def _read(self, rows: list[int]) -> torch.Tensor | None:
        if not rows:
            return None
        t = self.buffer[torch.tensor(rows)]
        return t.pin_memory() if self.pin else t

    def steps(self, plan: list[list[int]]) -> Iterator[torch.Tensor | None]:
        """For each step's row list: those rows on the device (None for an empty list), in order; step k+1's rows
        are read while the caller computes on step k's."""
        if not plan:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-rows") as pool:
            pending = pool.submit(self._read, plan[0])
            for k in range(len(plan)):
                rows = pending.result()
                if k + 1 < len(plan):
                    pending = pool.submit(self._read, plan[k + 1])
                yield None if rows is None else rows.to(self.device, non_blocking=True)
