"""The pipeline's work done by rank 0 alone on 2 gloo ranks: when the config record fails, every rank stops at once
with an error (rank 0 its own, the others one that points at it), none waits in a barrier; the export, the last
stage, is not waited for, so one longer than launch.timeout_min cannot time the other ranks out."""

from pathlib import Path

import procs

HERE = Path(__file__).parent


def test_rank_0s_failure_stops_every_rank_at_once():
    proc = procs.run(["record"], ranks=2, script=HERE / "rank0_work.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: ValueError: rank 0's own error" in proc.stdout
    assert "rank 1: PipelineError: recording the config failed on rank 0 (its error is in rank 0's output)" in (
        proc.stdout
    )


def test_an_export_longer_than_the_process_groups_timeout_is_not_waited_for():
    proc = procs.run(["export"], ranks=2, script=HERE / "rank0_work.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: done" in proc.stdout and "rank 1: done" in proc.stdout
