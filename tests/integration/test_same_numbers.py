"""SAME_NUMBERS (experiments/reproduce_table1/run.py): a change of the code the reproduce rows measure, declared to
compute the same numbers, keeps their rows current. For every entry: both commits' code hash is the declared one,
and stage 1, stage 2 and the evaluation of both commits, each run from its own checkout as a user runs them, on a
tiny model with the window-64 rows' attention (the hybrid's own sinks, exp gamma from 30, the LA decay from a
horizon) and SSD, give every tensor and every figure equal to the bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_run_overrides
from safetensors.torch import load_file

from experiments.reproduce_table1 import run as reproduce

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROWS_ATTENTION = [
    "attention.hybrid_sinks=true",
    "attention.gamma_param=exp",
    "attention.gamma_init=30.0",
    "attention.la_decay=true",
    "attention.la_decay_horizon=16",
    "eval.la_share_seq_len=64",
]
# the gated delta-rule LA's run: its conv, q/k maps, own sinks and mix gate, stage 1 on the LA's output
ROWS_GATED_DELTA = [
    "attention.la_kind=gated_delta",
    "attention.la_conv=3",
    "attention.la_qk_map=true",
    "attention.hybrid_sinks=true",
    "attention.sinks=2",
    "attention.la_combine=mix",
    "distill.objectives={output_mse: 1.0}",
    "eval.la_share_seq_len=64",
]
KINDS = {"hedgehog": ROWS_ATTENTION, "gated_delta": ROWS_GATED_DELTA}  # each entry's stages run on both LA kinds
NOT_NUMBERS = ("timings_s", "config", "identity", "model", "schema")  # (run paths, wall times, the file's format)
# figures a later commit adds beside the rows' numbers (a new probe): compared only where both commits have them
ADDED = {"recall"}
ADDED_INSIDE = {"la_share": {"memories"}}  # (issue 66: each memory's share beside the LA's)


def checkout(commit: str, where: Path) -> Path:
    """The commit's tracked files in `where` (git archive: no work tree of this clone is touched)."""
    where.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def run_stages(tree: Path, model: Path, run: Path, kind: str = "hedgehog") -> tuple[dict, dict]:
    """Stage 1, stage 2 and the evaluation with `tree`'s code (its own package first on the path) and the LA `kind`'s
    attention; returns ({file: {tensor name: tensor}} of both stages' outputs, the evaluation's figures)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    overrides = tiny_run_overrides(model, run, *KINDS[kind])
    for stage in ("distill", "finetune", "evaluate"):
        done = subprocess.run(
            [sys.executable, "-m", "hybrid_scale.cli", stage, *overrides],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"{tree.name}: {stage} failed: {done.stderr[-3000:]}"
    tensors = {
        str(f.relative_to(run)): load_file(f)
        for top in ("stage1/converted", "stage2/output")
        for f in sorted((run / top).resolve().rglob("*.safetensors"))
    }
    results = json.loads((run / "eval" / "results.json").read_text())
    return tensors, {k: v for k, v in results.items() if k not in NOT_NUMBERS}


# The newest entries (the ledger is newest first) run both commits' stages in every `make test`: an entry is added
# with the change it declares, so its own landing runs it. An older entry compares two fixed commits under the same
# pinned packages, and ran when it landed; `make test-ledger` (SAME_NUMBERS_ALL=1) runs every entry again (about 85 s
# each), and every `make test` still checks every entry's commits against its hashes.
RUN_NEWEST = 1  # (each entry ran at its landing; the two before issue 65's also ran on both kinds in its session)
CHECKED = list(reproduce.SAME_NUMBERS) if os.environ.get("SAME_NUMBERS_ALL") == "1" else [
    *reproduce.SAME_NUMBERS][:RUN_NEWEST]  # fmt: skip
# (entry, LA kind) pairs run: the newest entries on both kinds; make test-ledger runs every entry on both
RUNS = [(after, kind) for after in CHECKED for kind in KINDS]


def test_every_declared_refactor_is_checked(tmp_path):
    """Every entry names its commits, each commit's code hash is the one declared, and the chain ends in a hash no
    entry maps (no cycle)."""
    for i, (after, (before, old, new, why)) in enumerate(reproduce.SAME_NUMBERS.items()):
        assert after != before and len(old) == len(new) == 40 and why
        assert reproduce.same_numbers_as(after) not in reproduce.SAME_NUMBERS
        for name, commit, code in (("before", old, before), ("after", new, after)):
            tree = checkout(commit, tmp_path / f"{i}_{name}")
            assert reproduce.code_hash(tree) == code, f"{commit}: its code hash is not the declared {code[:12]}"


@pytest.mark.parametrize(("after", "kind"), RUNS)
def test_a_declared_refactor_computes_the_same_numbers(after, kind, tiny_run_model, tmp_path):
    """About 80 s an entry and LA kind (three stages of two checkouts, each run as a user runs it): a change declared
    to keep the reproduce rows current must give every tensor and figure equal to the bit, with either kind of linear
    part, which only running both commits' code shows."""
    before, old, new, _ = reproduce.SAME_NUMBERS[after]
    outputs = []
    for name, commit, code in (("before", old, before), ("after", new, after)):
        tree = checkout(commit, tmp_path / name)
        assert reproduce.code_hash(tree) == code, f"{commit}: its code hash is not the declared {code[:12]}"
        outputs.append(run_stages(tree, tiny_run_model, tmp_path / f"run_{name}", kind))
    (t0, r0), (t1, r1) = outputs
    assert sorted(t0) == sorted(t1) and t0, "the two commits wrote different files"
    for f in t0:
        assert sorted(t0[f]) == sorted(t1[f]), f
        for n in t0[f]:
            assert t0[f][n].dtype == t1[f][n].dtype and t0[f][n].equal(t1[f][n]), f"{f}: {n} differs"
    assert set(r1) - set(r0) <= ADDED, set(r1) - set(r0)
    for key, inside in ADDED_INSIDE.items():
        if isinstance(r1.get(key), dict) and isinstance(r0.get(key), dict):
            assert set(r1[key]) - set(r0[key]) <= inside, set(r1[key]) - set(r0[key])
            r1[key] = {k: v for k, v in r1[key].items() if k in r0[key]}
    assert r0 == {k: v for k, v in r1.items() if k in r0}
