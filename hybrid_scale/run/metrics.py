"""What a stage logs while it runs, rank 0 only, to three places with the same records:

  {stage dir}/metrics.jsonl   always: one JSON record per step and kind ({"step", "time", "kind", values...}; the
                              kinds: "step", and "layer" (stage 1), "heldout" (stage 2), "cell" (evaluation)),
                              append-only;
  {stage dir}/tensorboard/    TensorBoard event files (log.tensorboard; on when the tensorboard package is there),
                              written by torch's SummaryWriter (run/tensorboard.py: a failed write is one line);
  Weights & Biases            log.wandb: PROJECT, one W&B run per stage (its id kept in {stage dir}/wandb.json),
                              written by wandb's own run (WANDB_MODE=offline works without a network).

A stage that resumes at its last committed step `resumed` opens Metrics with it: metrics.jsonl keeps the records up
to that step and drops the rest (a kill after them loses them with the work they describe), the SummaryWriter purges
the events after it (purge_step), and the W&B run is resumed under the same id. W&B's writer (a separate process)
keeps what it has not flushed, and a SIGKILL loses it, so the records W&B is not known to hold are sent again from
metrics.jsonl when the run resumes: known are the steps of a run that ended cleanly (wandb.json) and, online, the
steps the server holds (the run's starting step; the server takes no step twice). So each step is recorded exactly
once, up to the last committed step, then the resumed ones. One exception, W&B's: a stage that stopped on an error
(not a kill) closed its W&B run holding the steps after its last checkpoint, which the resumed stage does again;
W&B keeps their first values (it takes no step twice), metrics.jsonl and TensorBoard the values of the rerun.

`progress(line)` puts a line with the rates and the ETA in the stage's log.txt and on stderr, at most every
log.every_s seconds. `last(path)` reads a metrics.jsonl's last record without torch (`hybrid-scale status`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path

from ..config.schema import Config
from ..errors import ConfigError
from .tensorboard import TensorBoard

FILE = "metrics.jsonl"
RECORD_KEYS = ("step", "time", "kind")  # a record's own keys; the rest are its values
TB_DIR = "tensorboard"
WANDB_FILE = "wandb.json"


def tensorboard_on(cfg: Config) -> bool:
    """log.tensorboard as resolved: unset = on when the tensorboard package is installed."""
    t = cfg.log.tensorboard
    return importlib.util.find_spec("tensorboard") is not None if t is None else bool(t)


def check_packages(cfg: Config) -> None:
    """The preflight's refusal of a logger whose package is missing (one line naming it)."""
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "config key 'log.tensorboard': true needs the tensorboard package, which is not installed: pip install "
            "tensorboard (or pip install 'hybrid_scale[monitor]'), or set log.tensorboard=false"
        )
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"config key 'log.wandb': {cfg.log.wandb} needs the wandb package, which is not installed: pip install "
            "wandb (or pip install 'hybrid_scale[monitor]'), or leave log.wandb unset"
        )


def last(path: Path, kind: str = "step") -> dict | None:
    """The last complete record of `kind` in a metrics.jsonl (None: no file or no such record yet)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if record.get("kind", "step") == kind:
            return record
    return None


class Metrics:
    """One stage's metrics; a no-op on every rank but rank 0 (`main`). `log(step, values)` writes a record;
    `close()` flushes and ends the writers."""

    def __init__(self, cfg: Config, stage: str, directory: Path, main: bool, resumed: int | None = None, log=None):
        self.main, self.stage, self.dir = main, stage, Path(directory)
        self.tb = self.wandb = None
        self.wandb_at: tuple[int, list[str]] = (-1, [])  # the last step W&B holds, and the kinds it holds there
        self.every_s, self.stage_log, self.last_line = cfg.log.every_s, log, 0.0
        if not main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / FILE
        self.logged = self._keep(resumed)
        if tensorboard_on(cfg):
            self.tb = TensorBoard(self.dir / TB_DIR, purge_step=None if resumed is None else resumed + 1)
        if cfg.log.wandb:
            self._start_wandb(cfg)

    def _keep(self, resumed: int | None) -> dict[str, int]:
        """Drop the records after step `resumed` (None: keep all); returns the last step kept per kind."""
        if not self.path.is_file():
            return {}
        kept, last_step = [], {}
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if resumed is not None and record["step"] > resumed:
                continue
            kept.append(line)
            kind = record.get("kind", "step")
            last_step[kind] = max(last_step.get(kind, -1), record["step"])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.path)
        return last_step

    def _start_wandb(self, cfg: Config) -> None:
        import wandb
        from omegaconf import OmegaConf

        record = self.dir / WANDB_FILE
        state = json.loads(record.read_text()) if record.is_file() else {}
        run_id = state.get("id") or uuid.uuid4().hex[:8]  # (a W&B run id: 8 lowercase letters and digits)
        self.wandb = wandb.init(
            project=cfg.log.wandb,
            id=run_id,
            resume="allow",
            dir=str(self.dir),
            name=f"{Path(cfg.run_dir).name}/{self.stage}",
            group=Path(cfg.run_dir).name,
            job_type=self.stage,
            config=OmegaConf.to_container(cfg, resolve=True),
        )
        record.write_text(json.dumps({"id": run_id, "step": state.get("step", -1), "kinds": state.get("kinds", [])}))
        held = -1 if self.wandb.offline else int(getattr(self.wandb, "starting_step", 0)) - 1
        at = max(int(state.get("step", -1)), held)
        self.wandb_at = (at, list(state.get("kinds", [])) if at == state.get("step") else [])
        for line in self.path.read_text().splitlines() if self.path.is_file() else ():
            r = json.loads(line)  # (the file was rewritten whole by _keep: no cut line)
            self._send_wandb(r["step"], r.get("kind", "step"), {k: v for k, v in r.items() if k not in RECORD_KEYS})

    def log(self, step: int, values: dict, kind: str = "step") -> None:
        """One record of `kind` at `step`: numbers go to TensorBoard and W&B as scalars under STAGE/KIND/NAME (lists:
        one scalar per index, e.g. per layer), everything to metrics.jsonl. A step of a kind logged already (a
        resumed evaluation's cells) is skipped."""
        if not self.main or step <= self.logged.get(kind, -1):
            return
        self.logged[kind] = step
        record = {"step": step, "time": round(time.time(), 3), "kind": kind, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {f"{self.stage}/{kind}/{k}": v for k, v in _scalars(values)}
        if self.tb is not None:
            self.tb.add_scalars(scalars, step)
        self._send_wandb(step, kind, values)

    def _send_wandb(self, step: int, kind: str, values: dict) -> None:
        at, kinds = self.wandb_at
        if self.wandb is not None and (step > at or (step == at and kind not in kinds)):
            # (W&B takes a step it is at again, never an earlier one)
            self.wandb.log({f"{self.stage}/{kind}/{k}": v for k, v in _scalars(values)}, step=step)
            self.wandb_at = (step, [*kinds, kind] if step == at else [kind])

    def progress(self, line: str, force: bool = False) -> None:
        """A progress line in the stage's log and on stderr, at most every log.every_s seconds (unless `force`)."""
        now = time.monotonic()
        if not self.main or (not force and now - self.last_line < self.every_s):
            return
        self.last_line = now
        if self.stage_log is not None:
            self.stage_log(line)
        if not getattr(self.stage_log, "echo", None):  # (a log that echoes puts it on stderr itself)
            print(f"{self.stage}: {line}", file=sys.stderr, flush=True)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()  # flushed: the steps sent so far are held
            state = {"id": self.wandb.id, "step": self.wandb_at[0], "kinds": self.wandb_at[1]}
            (self.dir / WANDB_FILE).write_text(json.dumps(state))
            self.wandb = None


def duration(seconds: float | None) -> str:
    """A time left or taken, for a progress line: '40 s', '12 min', '3.5 h' ('?' when not known yet)."""
    if seconds is None or seconds != seconds:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _scalars(values: dict, prefix: str = ""):
    """(name, float) of every number in `values`; a list or dict becomes name/index or name/key."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)):
            yield name, float(value)
        elif isinstance(value, dict):
            yield from _scalars(value, f"{name}/")
        elif isinstance(value, (list, tuple)):
            yield from _scalars({str(i): v for i, v in enumerate(value)}, f"{name}/")
