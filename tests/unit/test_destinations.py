"""The rule for the whole code base: a stage only replaces or removes a directory the toolkit made for that purpose
(its COMMITTED marker, or the tag of a directory under construction); anything else is refused and left as it is."""

import hashlib
import json

import pytest

from hybrid_scale.storage.commits import (
    MARKER,
    PARTIAL_TAG,
    DestinationError,
    check_destination,
    commit,
    is_export,
    made_by_toolkit,
    remove_dir,
    replace_dir,
    start_partial,
)


def tree(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def foreign(path):
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work\n")
    return path


def build(dest, content="new"):
    tmp = start_partial(dest, "export.out_dir")
    (tmp / "payload.txt").write_text(content)
    commit(tmp)
    return tmp


def test_a_committed_directory_is_replaced_and_its_partial_tag_is_gone(tmp_path):
    dest = tmp_path / "out"
    replace_dir(build(dest, "first"), dest, "export.out_dir")
    assert (dest / "payload.txt").read_text() == "first" and (dest / MARKER).is_file()
    assert not (dest / PARTIAL_TAG).exists() and made_by_toolkit(dest)
    replace_dir(build(dest, "second"), dest, "export.out_dir")  # the toolkit's own: replaced
    assert (dest / "payload.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .partial, no .old left


@pytest.mark.parametrize("where", ["dest", "partial", "old"])
def test_a_foreign_directory_at_the_destination_or_its_siblings_is_refused_untouched(tmp_path, where):
    dest = tmp_path / "out"
    target = {"dest": dest, "partial": tmp_path / "out.partial", "old": tmp_path / "out.old"}[where]
    foreign(target)
    before = tree(tmp_path)
    with pytest.raises(DestinationError) as e:
        check_destination(dest, "export.out_dir")
    assert str(e.value) == (
        f"config key 'export.out_dir': {target} exists and is not a directory hybrid_scale wrote (no {MARKER} marker "
        "of its own); nothing was touched: choose a new directory or move that one away yourself"
    )
    with pytest.raises(DestinationError):
        start_partial(dest, "export.out_dir") if where == "partial" else replace_dir(tmp_path / "x", dest, "k")
    assert tree(tmp_path) == before


def test_a_file_or_a_link_at_the_destination_is_refused(tmp_path):
    (tmp_path / "out").write_text("a file\n")
    with pytest.raises(DestinationError, match="exists and is not a directory; nothing was touched"):
        check_destination(tmp_path / "out", "export.out_dir")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(DestinationError, match="link exists and is not a directory"):
        check_destination(tmp_path / "link", "export.out_dir")


def test_a_crashed_build_is_cleared_by_the_next_one(tmp_path):
    dest = tmp_path / "out"
    tmp = start_partial(dest, "export.out_dir")  # a run killed here leaves the tagged directory
    (tmp / "half.bin").write_bytes(b"\0" * 10)
    again = start_partial(dest, "export.out_dir")
    assert again == tmp and sorted(p.name for p in tmp.iterdir()) == [PARTIAL_TAG]


def test_remove_dir_leaves_what_the_toolkit_did_not_make(tmp_path):
    mine = build(tmp_path / "mine")
    theirs = foreign(tmp_path / "theirs")
    remove_dir(mine)
    remove_dir(theirs)
    assert not mine.exists() and (theirs / "thesis.tex").read_text() == "years of work\n"


def test_an_export_is_recognised_by_its_marker_and_its_model_type(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "hybrid_scale_llama"}))
    assert not is_export(export)  # no marker yet
    commit(export)
    assert is_export(export)
    (export / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_export(export)  # someone's model with a COMMITTED file is still not ours to replace


def test_assets_force_removes_only_what_assets_wrote(tmp_path):
    """HYBRID_SCALE_CACHE may point at a folder holding other things: `assets --force` refuses a model folder it did
    not write (no SOURCE.json) before removing anything, and leaves files it does not own alone."""
    from hybrid_scale.data import assets

    a = assets.paths(tmp_path)
    foreign(a.model)
    a.train_text.parent.mkdir(parents=True)
    a.train_text.write_text("text\n")
    (a.train_text.parent / "diary.txt").write_text("mine\n")
    before = tree(tmp_path)
    with pytest.raises(assets.AssetError) as e:
        assets.prepare(tmp_path, force=True)
    assert str(e.value) == (
        f"{a.model} exists and was not written by `hybrid-scale assets`; nothing was touched: move it away or point "
        "HYBRID_SCALE_CACHE at another folder"
    )
    assert tree(tmp_path) == before
    (a.model / "SOURCE.json").write_text("{}")  # now it is one of ours
    assets._remove_own(a.model)
    assert not a.model.exists() and (a.train_text.parent / "diary.txt").read_text() == "mine\n"


def _hold_prepare_lock(folder, seconds, events):
    import time

    from hybrid_scale.data import assets

    with assets._locked(folder):
        with open(events, "a") as f:
            f.write("in\n")
        time.sleep(seconds)  # (long enough for the other process to come in, were the lock not held)
        with open(events, "a") as f:
            f.write("out\n")


def test_two_processes_preparing_one_cache_take_turns_and_leave_no_lock_file(tmp_path):
    """Two jobs (or test workers) preparing the same cache at once: the second waits for the first's lock, which is a
    flock on the cache folder itself, so nothing is added to a folder that may hold other things."""
    import multiprocessing

    cache, events = tmp_path / "cache", tmp_path / "events.txt"
    cache.mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hold_prepare_lock, args=(cache, 0.6, events)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert events.read_text().split() == ["in", "out", "in", "out"]  # one after the other, never both inside
    assert list(cache.iterdir()) == []
