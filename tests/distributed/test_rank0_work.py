"""The pipeline's work done by rank 0 alone (the config record, the export) on 2 gloo ranks: when it fails, every rank
stops at once with an error (rank 0 its own, the others one that points at it), none waits in a barrier."""

from pathlib import Path

import procs

HERE = Path(__file__).parent


def test_rank_0s_failure_stops_every_rank_at_once():
    proc = procs.run([], ranks=2, script=HERE / "rank0_work.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: ValueError: rank 0's own error" in proc.stdout
    assert "rank 1: PipelineError: the export failed on rank 0 (its error is in rank 0's output)" in proc.stdout
