"""The committed cells of an evaluation (how its work is cut into cells: evaluate.py's docstring): how many an
evaluation has, the part of every cell's key that names the model (model_key, hashed with digest), and Cells, which
loads a committed cell whose key matches or else computes and commits it, and stops the ranks on a signal at every
cell boundary and between rounds of batches."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import NoReturn

import torch
import transformers
from omegaconf import OmegaConf

from .. import __version__
from ..config.schema import Config
from ..data import passkey
from ..distributed import requeue, runtime
from ..entry import Entry
from ..run.identity import differing
from ..run.metrics import Metrics, duration
from ..run.settings import data_settings
from ..run.sources import ModelSource
from ..storage.commits import atomic_write
from ..storage.faults import fault

TWINS = {  # the same keys on a hybrid that keeps its own sinks (with the cache as without it)
    "swa_only": "swa_sinks",
    "swa_sinks": "swa_only",
    "swa_only+cache": "swa_sinks+cache",
    "swa_sinks+cache": "swa_only+cache",
}


def own_modes(modes, keeps_sinks: bool) -> list[str]:
    """The modes that get cells of their own: on a hybrid with its own sinks, a mode whose twin (TWINS) comes
    before it reuses the twin's results."""
    modes = list(modes)
    return [m for i, m in enumerate(modes) if not (keeps_sinks and TWINS.get(m) in modes[:i])]


def count_cells(evaluation, keeps_sinks: bool = False) -> int:
    """The cells of an evaluation: (mode, task) pairs, then perplexity per mode and the LA share, then the passkey
    probe per mode and, with eval.recall_pairs, the recall probe per mode (a twin mode has none: `own_modes`)."""
    modes = own_modes(evaluation.modes, keeps_sinks)
    held_out = (len(modes) + (1 if evaluation.la_share_seq_len else 0)) if evaluation.ppl_sequences else 0
    probes = len(own_modes(passkey.probe_modes(evaluation), keeps_sinks)) * (2 if evaluation.recall_pairs else 1)
    return len(modes) * len(evaluation.tasks) + held_out + probes


def digest(obj) -> str:
    """sha256 of an object's JSON (for a cell's key)."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def model_key(cfg: Config, source: ModelSource, window: int, device: torch.device) -> dict:
    """The part of every cell's key that names the model: its path, the name, size and mtime of its files (and of its
    base's: stage 2 rewrites its output in place), the window, dtype, device type (and CPU threads: CPU kernels round
    differently with another number), the attention settings a plain model is converted with, and the versions of
    the code that computes the numbers."""
    path, converted = source.path, source.converted
    return {
        "model": str(path.resolve()),
        "converted": converted,
        "files": digest(source.files()),
        "attention": None if converted else OmegaConf.to_container(cfg.attention, resolve=True),
        "window": window,
        "dtype": cfg.model.dtype,
        "device": device.type,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "versions": {"hybrid_scale": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


def evaluation_window(cfg: Config, source: ModelSource) -> int:
    """The window the evaluation measures: eval.window, else the model's own (converted), else attention.window."""
    if cfg.eval.window is not None:
        return cfg.eval.window
    return (source.hybrid_config["attention"] if source.converted else cfg.attention)["window"]


NOT_RESULTS = ("progress", "out_dir", "model")  # eval.* keys that change no figure (the model is in its key)


def identity(cfg: Config, source: ModelSource, device: torch.device) -> dict:
    """What an evaluation's results.json describes (recorded in it): the model (model_key), every eval.* setting that
    changes a figure, the text it reads and the seed. The pipeline reruns an evaluation whose identity changed."""
    evaluation = {k: v for k, v in OmegaConf.to_container(cfg.eval, resolve=True).items() if k not in NOT_RESULTS}
    model = model_key(cfg, source, evaluation_window(cfg, source), device)
    return json.loads(json.dumps({"model": model, "eval": evaluation, "seed": cfg.seed, **data_settings(cfg)}))


def figures(result: dict) -> dict:
    """A cell's numbers for the metrics: its scalars, nested dicts of them kept, per-item lists left out."""
    out = {}
    for key, value in result.items():
        if isinstance(value, dict):
            if inner := figures(value):
                out[key] = inner
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
    return out


class Cells:
    """The committed cells ({out_dir}/cells/<name>.json: the cell's `result` and the `key` it was computed from),
    read once by rank 0 and given to every rank, so that every rank makes the same choice to load or compute;
    `committed` counts the cells committed (loaded or computed) in this run, `resumed` names the loaded ones. At
    every cell boundary, and between rounds of batches (between_rounds), the ranks agree on the signal flag; on a
    signal `stop` writes the requeue marker and raises Requeue."""

    def __init__(self, entry: Entry, total: int):
        self.rt, self.flag, self.log, self.total = entry.rt, entry.signal, entry.log, total
        self.run_dir, self.dir = entry.layout.run_dir, entry.layout.cells
        rt = self.rt
        if rt.main:
            self.dir.mkdir(parents=True, exist_ok=True)
        stored = {p.stem: json.loads(p.read_text()) for p in sorted(self.dir.glob("*.json"))} if rt.main else None
        self.stored = runtime.gather_objects(rt, stored)[0]
        self.committed, self.resumed = 0, []
        # one record per cell at its place in this run's order, every run writing them all again (resumed=0: the
        # earlier run's records and events go), so that a recomputed cell's record is its new result
        self.metrics = Metrics(entry.cfg, "evaluate", entry.layout.eval, rt.main, resumed=0, log=entry.log)
        self.computed_s: list[float] = []  # the cells computed in this run: their times, for the ETA

    def result(self, name: str, key: dict, compute: Callable[[], dict | None], here: bool = True) -> dict | None:
        """The cell's result (as its file holds it): the committed one when its key matches, else compute() committed
        by rank 0 -- a cell computed by rank 0 alone (`here` False on the others) is None there. Then the boundary:
        the ranks stop on a signal. compute() returns None when a signal stopped it: the cell is dropped."""
        key = json.loads(json.dumps(key))  # as the file holds it
        stored = self.stored.get(name)
        if stored is not None and stored["key"] == key:
            self.committed += 1
            self.resumed.append(name)
            self.record(name, stored["result"])
            return stored["result"] if here else None
        result, t0 = None, time.perf_counter()
        if here:
            if stored is not None:
                changed = differing(stored["key"], key)
                self.log(f"cell {name} was committed with another {', '.join(changed)}: recomputing it")
            result = compute()
            if result is None:
                self.stop(dropped=name)
            result = json.loads(json.dumps(result))
            if self.rt.main:
                atomic_write(self.dir / f"{name}.json", json.dumps({"key": key, "result": result}, indent=1) + "\n")
            fault(f"eval:{name}", self.rt.rank)
        self.committed += 1
        self.computed_s.append(time.perf_counter() - t0)
        self.record(name, result)
        if runtime.any_rank(self.rt, self.flag.raised):
            self.stop()
        return result

    def record(self, name: str, result: dict | None) -> None:
        """The cell's record (cells done of total, the ETA, its figures without per-item lists) and a progress line."""
        left = self.total - self.committed
        eta = sum(self.computed_s) / len(self.computed_s) * left if self.computed_s else None
        values = {"cell": name, "cells_done": self.committed, "cells_total": self.total, "eta_s": eta}
        self.metrics.log(self.committed, values | {"figures": figures(result or {})}, kind="cell")
        self.metrics.progress(f"{self.committed}/{self.total} cells ({name} done), ETA {duration(eta)}", left == 0)

    def between_rounds(self, name: str) -> Callable[[int], bool]:
        """loglik.score's `stop` for cell `name`: whether the ranks agree to stop, after `done` rounds of batches."""

        def stop(rounds: int) -> bool:
            fault(f"eval_batch:{name}:{rounds}", self.rt.rank)
            return runtime.any_rank(self.rt, self.flag.raised)

        return stop

    def stop(self, dropped: str | None = None) -> NoReturn:
        """After a signal, on every rank: the requeue marker (rank 0), then Requeue. Every finished cell is already
        committed; `dropped` names the cell in progress, if any."""
        t0 = time.perf_counter()
        n, total = self.committed, self.total
        what = f"evaluation stopped by a signal after {n} of {total} cells; committed cells are in {self.dir}"
        exc = requeue.request(self.run_dir, self.committed, self.dir, self.rt, what=what)
        self.metrics.close()
        resumed = f" ({len(self.resumed)} resumed)" if self.resumed else ""
        dropped = f"; dropped the cell in progress, {dropped}" if dropped else ""
        self.log(
            f"signal: {self.committed} of {self.total} cells committed{resumed}{dropped}; requeue marker written in "
            f"{time.perf_counter() - t0:.2f} s, exiting for a requeue"
        )
        raise exc

    def finish(self) -> None:
        """Logs which cells were resumed (after a requeue); the metrics' writers end."""
        self.metrics.close()
        if self.resumed:
            self.log(f"resumed {len(self.resumed)} of {self.total} cells from {self.dir}: {', '.join(self.resumed)}")
