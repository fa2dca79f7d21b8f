"""The signal flag every long stage reads at its step boundaries; the requeue request a stage makes on a save."""

import os
import re
import signal

from hybrid_scale import cli
from hybrid_scale.distributed.requeue import (
    EXIT_REQUEUE,
    REQUEUE_MARKER,
    Requeue,
    SignalFlag,
    clear_request,
    request,
)
from hybrid_scale.distributed.runtime import Runtime
from hybrid_scale.resources import data_dir


def test_usr1_and_term_set_the_one_flag_nested_flags_share_it_and_the_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        with SignalFlag() as outer:
            assert not outer.raised
            os.kill(os.getpid(), sig)  # e.g. between two pipeline stages
            with SignalFlag() as inner:  # the next stage's flag sees it
                assert inner.raised and outer.raised
            assert outer.raised  # the inner exit keeps the handlers: still the pipeline's
            assert signal.getsignal(sig) is not before[sig]
        assert {s: signal.getsignal(s) for s in before} == before
    with SignalFlag() as fresh:  # a new outermost flag starts clear
        assert not fresh.raised


def test_a_stage_saved_on_a_signal_leaves_the_marker_and_exits_with_the_code_the_batch_script_requeues_on(
    tmp_path, monkeypatch, capsys
):
    """The stage's half of the protocol (the batch script's half: test_sbatch.py): rank 0 writes the marker with the
    step before the ranks exit, and the CLI turns Requeue into the one exit code stage.sbatch requeues on."""
    run = tmp_path / "run"
    e = request(run, 5, run / "stage2" / "step_00000005", Runtime())
    assert isinstance(e, Requeue) and e.step == 5
    assert (run / REQUEUE_MARKER).read_text() == "5\n"
    assert str(e) == f"stopped by a signal after step 5; saved {run / 'stage2' / 'step_00000005'}; run again to resume"
    request(tmp_path / "other", 5, run, Runtime(rank=1, world=1))  # not rank 0: no marker of its own
    assert not (tmp_path / "other" / REQUEUE_MARKER).exists()
    clear_request(run)
    assert not (run / REQUEUE_MARKER).exists()

    script = (data_dir("slurm") / "stage.sbatch").read_text()
    assert re.findall(r'"\$code" -eq (\d+)', script) == [str(EXIT_REQUEUE)]
    assert f"exit {EXIT_REQUEUE}" in script  # max_restarts reached: the job ends with the stage's code

    def stopped(args):
        raise e

    monkeypatch.setattr(cli, "cmd_finetune", stopped)
    assert cli.main(["finetune", f"run_dir={run}"]) == EXIT_REQUEUE == 75  # EX_TEMPFAIL, what sites' scripts check
    assert "hybrid-scale finetune: stopped by a signal after step 5" in capsys.readouterr().err
