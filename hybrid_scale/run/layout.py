"""Where a run reads and writes, from its config alone (the disk is not touched):

  {run_dir}/config.yaml            the resolved config (pipeline)
  {run_dir}/timings.json           the pipeline's stage times
  {run_dir}/.lock                  the one-writer lock (run/lock.py)
  {run_dir}/requeue_requested      a stage saved on a signal and asks to be started again (distributed/requeue.py)
  {run_dir}/stage1/                stage 1: per-layer parameters and markers, log.txt, buffers/ (distill.buffer_dir),
                                   converted/ (its output)
  {run_dir}/stage2/                stage 2: step_XXXXXXXX/, best/, final/, output -> best or final, log.txt
  {run_dir}/eval/                  evaluation (eval.out_dir): cells/, results.json, log.txt
  {run_dir}/export/                export (export.out_dir), built in export.partial/ (export_log.txt there)
  {run_dir}/converted/             `hybrid-scale convert`'s output (untrained feature maps)
  {run_dir}/slurm/                 the sbatch scripts and job logs (launch/slurm.py)

`RunLayout.of(cfg)` is the one place these rules are written; `run/sources.py` adds the one rule that needs the disk
(which model a stage reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "hybrid_config.json"  # a converted model's own config, beside the base model's config.json
RUN_CONFIG = "config.yaml"  # the resolved config a run records in its run dir
LOCK_NAME = ".lock"
LOG_NAME = "log.txt"


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path
    config: Path  # the recorded config
    timings: Path
    lock: Path
    stage1: Path
    buffers: Path
    stage1_output: Path  # stage 1's converted model
    stage2: Path
    stage2_output: Path  # a link to best/ or final/
    eval: Path
    export: Path
    slurm: Path
    converted: Path  # `hybrid-scale convert`

    @classmethod
    def of(cls, cfg) -> RunLayout:
        run_dir = Path(cfg.run_dir)
        stage1 = run_dir / "stage1"
        return cls(
            run_dir=run_dir,
            config=run_dir / RUN_CONFIG,
            timings=run_dir / "timings.json",
            lock=run_dir / LOCK_NAME,
            stage1=stage1,
            buffers=Path(cfg.distill.buffer_dir) if cfg.distill.buffer_dir else stage1 / "buffers",
            stage1_output=stage1 / "converted",
            stage2=run_dir / "stage2",
            stage2_output=run_dir / "stage2" / "output",
            eval=Path(cfg.eval.out_dir) if cfg.eval.out_dir else run_dir / "eval",
            export=Path(cfg.export.out_dir) if cfg.export.out_dir else run_dir / "export",
            slurm=run_dir / "slurm",
            converted=run_dir / "converted",
        )

    def log(self, stage: str) -> Path | None:
        """The stage's rank-0 log.txt (the export logs into the directory it builds; the pipeline to stdout)."""
        folder = {"distill": self.stage1, "finetune": self.stage2, "evaluate": self.eval}.get(stage)
        return folder / LOG_NAME if folder is not None else None

    @property
    def logs(self) -> tuple[Path, ...]:
        """The stages' rank-0 logs, in pipeline order."""
        return self.stage1 / LOG_NAME, self.stage2 / LOG_NAME, self.eval / LOG_NAME

    @property
    def cells(self) -> Path:
        return self.eval / "cells"
