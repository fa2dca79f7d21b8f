"""run/tensorboard.py: a TensorBoard write that fails is one line on stderr, then TensorBoard is off; its close never
raises and gives back the thread hook (the real full disk: tests/integration/test_distill.py, test_finetune.py)."""

import errno
import os
import threading

import pytest

from hybrid_scale.run.tensorboard import TensorBoard

pytest.importorskip("tensorboard")


def test_a_failed_write_is_one_line_then_tensorboard_is_off(tmp_path, capsys):
    before = threading.excepthook
    tb = TensorBoard(tmp_path / "tb")
    assert threading.excepthook != before  # the writer thread's errors come here while it lives
    tb.add_scalars({"a": 1.0}, 1)

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "tb" / "events"))

    tb.writer.add_scalar = full
    tb.add_scalars({"a": 2.0}, 2)
    tb.add_scalars({"a": 3.0}, 3)  # off: not tried again, not said again
    tb.writer.close = full
    tb.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"hybrid-scale: TensorBoard stopped: writing under {tmp_path / 'tb'} failed: No space left on device "
        f"({tmp_path / 'tb' / 'events'}); the stage goes on without it"
    ]
    assert threading.excepthook == before


def test_the_writer_threads_error_is_one_line_and_other_threads_keep_their_hook(tmp_path, capsys):
    before = threading.excepthook
    tb = TensorBoard(tmp_path / "tb")
    seen = []
    tb._hook = seen.append  # (the hook before: for every thread but the writer's)
    writer_thread = type("_AsyncWriterThread", (threading.Thread,), {"__module__": "tensorboard.summary.writer"})()
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "events")
    threading.excepthook(threading.ExceptHookArgs((OSError, error, None, writer_thread)))
    other = threading.ExceptHookArgs((ValueError, ValueError("x"), None, threading.Thread()))
    threading.excepthook(other)
    tb.close()
    threading.excepthook = before  # (close gave back the stand-in above)
    assert seen == [other] and tb.failed
    assert capsys.readouterr().err.count("\n") == 1
