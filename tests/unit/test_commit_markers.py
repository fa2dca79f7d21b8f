"""The rule under every resume: a directory or layer is trusted only through its commit marker, written last, whose
hashes match every file it names; stage 2 resumes from the newest committed step and rotation keeps the newest K."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hybrid_scale.distill.identity import committed
from hybrid_scale.finetune.checkpoints import committed_steps, rotate
from hybrid_scale.storage.commits import MARKER, PARTIAL_TAG, commit, is_committed, sha256, start_partial


def _step(stage2, n, commit_it=True):
    d = stage2 / f"step_{n:08d}"
    d.mkdir(parents=True)
    (d / "trainable.safetensors").write_bytes(b"weights %d" % n)
    (d / "state.json").write_text(json.dumps({"step": n}))
    if commit_it:
        commit(d)
    return d


def test_a_directory_is_committed_only_with_a_marker_whose_hashes_match(tmp_path):
    d = _step(tmp_path, 1, commit_it=False)
    assert not is_committed(d)  # no marker yet: a save that was killed
    commit(d)
    assert is_committed(d) and set(json.loads((d / MARKER).read_text())) == {"trainable.safetensors", "state.json"}
    (d / "state.json").write_text(json.dumps({"step": 2}))  # changed after the commit
    assert not is_committed(d)
    commit(d)
    (d / "trainable.safetensors").unlink()  # a file the marker names is gone
    assert not is_committed(d)
    (d / MARKER).write_text("{not json")
    assert not is_committed(d)


def test_commit_removes_the_partial_tag(tmp_path):
    d = tmp_path / "out"
    tmp = start_partial(d, "out")
    assert (tmp / PARTIAL_TAG).is_file()
    (tmp / "x.txt").write_text("x")
    commit(tmp)
    assert is_committed(tmp) and not (tmp / PARTIAL_TAG).exists()


def test_stage2_resumes_from_the_newest_committed_step_and_rotation_keeps_the_newest(tmp_path):
    for n in (2, 4, 6):
        _step(tmp_path, n)
    _step(tmp_path, 8, commit_it=False)  # killed while saving step 8
    assert [p.name for p in committed_steps(tmp_path)] == ["step_00000002", "step_00000004", "step_00000006"]
    rotate(tmp_path, keep=2)
    assert [p.name for p in committed_steps(tmp_path)] == ["step_00000004", "step_00000006"]
    assert (tmp_path / "step_00000008").is_dir()  # not committed, not removed by rotation: the next save replaces it


@pytest.mark.parametrize("damage", ["none", "no_marker", "other_hash", "bad_marker", "no_params"])
def test_a_stage1_layer_is_committed_only_when_its_marker_has_the_file_hash(tmp_path, damage):
    params = tmp_path / "layer_001.safetensors"
    save_file({"w": torch.ones(2)}, params)
    marker = tmp_path / "layer_001.done"
    marker.write_text(json.dumps({"sha256": sha256(params)}))
    if damage == "no_marker":
        marker.unlink()
    elif damage == "other_hash":
        save_file({"w": torch.zeros(2)}, params)
    elif damage == "bad_marker":
        marker.write_text("{}")
    elif damage == "no_params":
        params.unlink()
    assert committed(tmp_path, 1) is (damage == "none")
