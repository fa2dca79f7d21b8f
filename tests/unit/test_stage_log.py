"""run/log.py: a stage's log is the `logging` logger hybrid_scale.<stage> with a rank-0 file handler (and a stderr
handler for a stage that echoes); other ranks write nothing; a failed write is one line, once."""

import logging
import re

from hybrid_scale.run.log import StageLog


def test_rank_0_lines_go_to_the_file_through_logging_and_other_ranks_write_nothing(tmp_path, capsys):
    path = tmp_path / "log.txt"
    log = StageLog(path, main=True, echo="evaluate", name="evaluate")
    assert path.exists() is False  # opened at its first line
    log("one")
    log("two")
    handlers = logging.getLogger("hybrid_scale.evaluate").handlers
    assert [type(h).__name__ for h in handlers] == ["_File", "StreamHandler"]
    log.close()
    assert [re.sub(r"^\d\d:\d\d:\d\d ", "", x) for x in path.read_text().splitlines()] == ["one", "two"]
    assert capsys.readouterr().err.splitlines() == ["evaluate: one", "evaluate: two"]
    assert logging.getLogger("hybrid_scale.evaluate").handlers == []
    other = tmp_path / "rank1.txt"
    quiet = StageLog(other, main=False, name="evaluate")
    quiet("three")
    quiet.close()
    assert not other.exists() and capsys.readouterr().err == ""


def test_a_line_that_cannot_be_written_is_said_once_in_one_line(tmp_path, capsys):
    log = StageLog(tmp_path / "missing" / "log.txt", name="distill")  # (its directory is not there: open fails)
    log("one")
    log("two")
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybrid-scale: the stage log {tmp_path / 'missing' / 'log.txt'}")
