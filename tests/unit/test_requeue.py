"""The signal flag every long stage reads at its step boundaries."""

import os
import signal

from hybrid_scale.distributed.requeue import SignalFlag


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
