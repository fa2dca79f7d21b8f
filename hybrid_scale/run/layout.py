"""Where a run reads and writes, from its config alone (the disk is not touched):

  {run_dir}/config.yaml            the resolved config (pipeline)
  {run_dir}/.lock                  the one-writer lock (run/lock.py)
  {run_dir}/stage1/                stage 1: per-layer parameters and markers, log.txt, buffers/ (distill.buffer_dir),
                                   converted/ (its output)
  {run_dir}/stage2/                stage 2: step_XXXXXXXX/, best/, final/, output -> best or final, log.txt
  {run_dir}/eval/                  evaluation (eval.out_dir): cells/, results.json, log.txt
  {run_dir}/export/                export (export.out_dir)

`RunLayout.of(cfg)` is the one place these rules are written; `run/sources.py` adds the rules that need the disk
(which model is the run's model, whether a directory is an export this toolkit wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "hybrid_config.json"  # a converted model's own config, beside the base model's config.json
RUN_CONFIG = "config.yaml"  # the resolved config a run records in its run dir


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path
    config: Path  # the recorded config
    lock: Path
    stage1: Path
    buffers: Path
    stage1_output: Path  # stage 1's converted model
    stage2: Path
    stage2_output: Path  # a link to best/ or final/
    eval: Path
    export: Path

    @classmethod
    def of(cls, cfg) -> RunLayout:
        run = Path(cfg.run_dir)
        stage1 = run / "stage1"
        return cls(
            run_dir=run,
            config=run / RUN_CONFIG,
            lock=run / ".lock",
            stage1=stage1,
            buffers=Path(cfg.distill.buffer_dir) if cfg.distill.buffer_dir else stage1 / "buffers",
            stage1_output=stage1 / "converted",
            stage2=run / "stage2",
            stage2_output=run / "stage2" / "output",
            eval=Path(cfg.eval.out_dir) if cfg.eval.out_dir else run / "eval",
            export=Path(cfg.export.out_dir) if cfg.export.out_dir else run / "export",
        )

    @property
    def logs(self) -> tuple[Path, ...]:
        """The stages' rank-0 logs, in pipeline order."""
        return self.stage1 / "log.txt", self.stage2 / "log.txt", self.eval / "log.txt"
