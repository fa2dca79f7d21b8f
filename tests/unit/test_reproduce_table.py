"""experiments/reproduce_table1/reproduce_table1.md is what experiments/reproduce_table1/run.py renders from the
committed row files (experiments/reproduce_table1/reproduce/<row>.json) for the current code: a row whose code hash
no longer matches shows as stale, and a table that mixes in stale rows silently does not pass. `make reproduce
ROW=...` itself runs in tests/integration/test_reproduce.py at a tiny budget."""

import importlib.util
from pathlib import Path

import pytest

from hybrid_scale.evaluate.results import EvalResults

ROOT = Path(__file__).resolve().parents[2]


def reproduce():
    spec = importlib.util.spec_from_file_location(
        "reproduce_table1", ROOT / "experiments" / "reproduce_table1" / "run.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("budget", ["default", "long"])
def test_the_committed_table_is_the_one_the_committed_rows_give_for_the_current_code(budget):
    mod = reproduce()
    rows = mod.load_rows(mod.rows_dir_of(budget))
    assert rows, f"no committed rows in {mod.rows_dir_of(budget).relative_to(ROOT)}"
    assert set(rows) <= set(mod.ROWS)
    expected = mod.table(rows, mod.BUDGETS[budget], mod.code_hash(), budget)
    assert mod.table_of(budget).read_text() == expected, (
        f"{mod.table_of(budget).relative_to(ROOT)} is not what the committed rows give for this code: run "
        f"`.venv/bin/python -m experiments.reproduce_table1.run --table --budget {budget}` (a stale row is then marked)"
    )
    for name, r in rows.items():
        line = next(x for x in expected.splitlines() if x.startswith(f"| {name} |"))
        assert r["commit"][:8] in line and r["row"] == name
    switched = mod.load_rows(mod.rows_dir_of(budget), switched=True)
    if switched:  # the exploration's rows (SWITCHES) and their table
        assert {k.split("@")[1] for k in switched} <= set(mod.SWITCHES)
        assert mod.explore_table_of(budget).read_text() == mod.explore_table(
            rows, switched, mod.BUDGETS[budget], mod.code_hash(), budget
        ), f"{mod.explore_table_of(budget).relative_to(ROOT)}: run --table --budget {budget}"


# an evaluation's results.json with nothing measured (the fake `evaluate` stage's)
EMPTY_RESULTS = EvalResults(
    model="m", converted=True, untrained_feature_maps=False, window=16, sinks=0, hybrid_sinks=False, la_decay=False,
    world_size=1, tensor_parallel=1, config={}, identity={}, heldout=None, tasks={}, modes={}, timings_s={},
    verdict="n/a",
).dumps()  # fmt: skip


def fake_stages(stage1: list):
    """A stand-in for the script's `hybrid_scale` call: each stage leaves what the next one reads, and stage 1's run
    directories are appended to `stage1`."""

    def fake(stage, *args):
        opts = dict(a.split("=", 1) for a in args)
        if stage == "distill":
            stage1.append(opts["run_dir"])
        if stage == "finetune":
            (Path(opts["run_dir"]) / "stage2").mkdir(parents=True, exist_ok=True)
            (Path(opts["run_dir"]) / "stage2" / "curves.json").write_text("{}")
        if stage == "evaluate":
            Path(opts["eval.out_dir"]).mkdir(parents=True, exist_ok=True)
            (Path(opts["eval.out_dir"]) / "results.json").write_text(EMPTY_RESULTS)

    return fake


def test_a_row_whose_code_hash_no_longer_matches_is_marked_stale(tmp_path):
    mod = reproduce()
    b = mod.BUDGETS["default"]
    results = {"modes": {"base": {"avg": 0.5}}, "verdict": "n/a"}
    row = {"row": "base", "commit": "0123456789ab", "code_hash": mod.code_hash(), "budget": b, "times_s": {"eval": 60}}
    row |= {"results": results, "curves": None}
    current = mod.table({"base": row}, b, mod.code_hash())
    line = next(x for x in current.splitlines() if x.startswith("| base |"))
    assert "| 01234567 |" in line and "stale" not in line
    old = mod.table({"base": row | {"code_hash": "0" * 64}}, b, mod.code_hash())
    line = next(x for x in old.splitlines() if x.startswith("| base |"))
    assert "01234567 **stale** (the attention or recipe code changed since)" in line
    other = mod.table({"base": row | {"budget": {**b, "steps": 1}}}, b, mod.code_hash())
    assert "**stale** (another budget)" in other
    assert "| lolcats | not run |" in current


def test_a_stale_row_runs_again_from_scratch_and_a_row_whose_code_changes_while_it_runs_is_refused(tmp_path):
    """The run directories are per budget and code hash: a finished stage of other code (its wall time and results,
    which the row would otherwise reuse) is never taken for the current code."""
    mod = reproduce()
    code = mod.code_hash()
    here = mod.measured_root(tmp_path, "default", code)
    assert here != mod.measured_root(tmp_path, "default", "0" * 64) != mod.measured_root(tmp_path, "tiny", "0" * 64)
    assert here.parent == tmp_path and here.name == f"default-{mod.same_numbers_as(code)[:12]}"
    results = tmp_path / "results.json"
    results.write_text(EMPTY_RESULTS)
    row = mod.record("base", mod.BUDGETS["default"], {}, {"eval": 1.0}, results, None, code)
    assert row["code_hash"] == code and row["results"]["schema"] == 1 and row["results"]["verdict"] == "n/a"
    try:
        mod.record("base", mod.BUDGETS["default"], {}, {"eval": 1.0}, results, None, "0" * 64)
    except SystemExit as e:
        assert "changed while it ran; its row file is not written" in str(e)
    else:
        raise AssertionError("a row measured on other code was recorded")


def test_rows_on_the_embedded_default_prepare_it_first_and_rows_on_a_given_model_do_not(tmp_path, monkeypatch):
    """On a fresh machine the embedded default is not converted yet: `make reproduce` prepares it (`hybrid-scale
    assets`, cached) before its first row instead of failing that row's stage 1 with "run `hybrid-scale assets`"."""
    mod = reproduce()
    calls = []
    monkeypatch.setattr(mod, "hybrid_scale", lambda *args: calls.append(args))
    row = {"row": "base", "commit": "0" * 12, "code_hash": mod.code_hash(), "times_s": {"eval": 1.0}}
    monkeypatch.setattr(mod, "run_row", lambda name, *rest: calls.append(("row", name)) or row)
    common = ["--run-root", str(tmp_path / "runs"), "--rows-dir", str(tmp_path / "rows")]
    assert mod.main(["--row", "base", *common]) == 0
    assert calls == [("assets",), ("row", "base")]
    calls.clear()
    assert mod.main(["--row", "base", "--model", str(tmp_path / "model"), *common]) == 0
    assert calls == [("row", "base")]
    calls.clear()
    empty = ["--run-root", str(tmp_path / "runs"), "--rows-dir", str(tmp_path / "none")]
    assert mod.main(["--table", "--out", str(tmp_path / "table.md"), *empty]) == 0
    assert calls == []


def test_each_variant_trains_and_evaluates_with_its_own_settings_and_stage_1(tmp_path, monkeypatch):
    """A recipe row's variant reaches all three of its stages (stage 1, stage 2 and the evaluation), and rows of one
    objective share a stage 1 only with the rows of the same variant: `+sinks+decay` is the main job's attention (its
    sinks and its decay), not `+sinks` or `+decay` alone."""
    mod = reproduce()
    stage1 = []
    monkeypatch.setattr(mod, "hybrid_scale", fake_stages(stage1))
    b, code = mod.BUDGETS["tiny"], mod.code_hash()
    sinks, decay = "attention.hybrid_sinks=true", "attention.la_decay=true"
    want = {"": (False, False), "+sinks": (True, False), "+decay": (False, True), "+sinks+decay": (True, True)}
    assert set(want) == set(mod.VARIANTS) == set(mod.OVERRIDES)
    for variant, (has_sinks, has_decay) in want.items():
        row = mod.run_row(f"ssd{variant}", b, tmp_path, [], code)
        assert row["row"] == f"ssd{variant}" and f"ssd{variant}" in mod.ROWS
        for stage in ("distill", "finetune", "evaluate"):
            opts = row["settings"][stage]
            assert (sinks in opts, decay in opts) == (has_sinks, has_decay), (variant, stage, opts)
    assert len(set(stage1)) == len(want), stage1  # one stage 1 per variant
    assert stage1[-1].endswith("stage1_weights_xent_sinks_decay")
    mod.run_row("la_only+sinks+decay", b, tmp_path, [], code)  # same objective and variant: that stage 1, finished
    assert len(stage1) == len(want)
    mod.run_row("lolcats+sinks+decay", b, tmp_path, [], code)  # another objective: its own
    assert stage1[-1].endswith("stage1_hybrid_output_mse_sinks_decay")


def test_another_budget_has_its_own_rows_and_table_and_says_how_it_was_made(tmp_path, monkeypatch):
    """`--budget long` writes its rows and table beside the default's, never into them (a row of another budget would
    show there as stale), and its table gives its own training length and the commands that make it."""
    mod = reproduce()
    assert mod.rows_dir_of("default") == mod.ROWS_DIR and mod.table_of("default") == mod.TABLE
    assert mod.rows_dir_of("long") == mod.ROWS_DIR.parent / "reproduce_long"
    assert mod.table_of("long") == mod.TABLE.parent / "reproduce_table1_long.md"
    long, default = mod.BUDGETS["long"], mod.BUDGETS["default"]
    tokens = {k: b["steps"] * b["global_batch"] * b["seq_len"] for k, b in (("long", long), ("default", default))}
    assert tokens["long"] == tokens["default"] and long["seq_len"] == long["ppl_seq_len"] == default["ppl_seq_len"]
    assert long["stage1_sequences"] * long["stage1_seq_len"] == default["stage1_sequences"] * default["stage1_seq_len"]
    text = mod.table({}, long, mod.code_hash(), "long")
    assert "(budget long)" in text and "(1x the training length)" in text
    assert 'make reproduce ROW=lolcats ARGS="--budget long"' in text and "--table --budget long" in text
    assert "(4x the training length)" in mod.table({}, default, mod.code_hash())
    monkeypatch.setattr(mod, "ROWS_DIR", tmp_path / "reproduce")
    monkeypatch.setattr(mod, "TABLE", tmp_path / "reproduce_table1.md")
    assert mod.main(["--table", "--budget", "long"]) == 0
    assert (tmp_path / "reproduce_table1_long.md").is_file() and not (tmp_path / "reproduce_table1.md").exists()


def test_a_switch_changes_every_stage_of_its_row_and_shares_stage_1_only_when_it_leaves_stage_1_alone(
    tmp_path, monkeypatch
):
    """`--row R --switch S` (the exploration of issue 52): S's overrides reach stage 1, stage 2 and the evaluation;
    a switch of stage 2's budget alone (steps128) reuses the unswitched row's finished stage 1; the switched row is
    current against the budget it changed, and its table puts it beside the row it changes with its command."""
    mod = reproduce()
    stage1 = []
    monkeypatch.setattr(mod, "hybrid_scale", fake_stages(stage1))
    b, code, row = mod.BUDGETS["tiny"], mod.code_hash(), "lolcats+sinks+decay"
    plain = mod.run_row(row, b, tmp_path, [], code)
    more = mod.run_switched(row, "steps128", b, tmp_path, [], code)
    assert len(stage1) == 1  # the unswitched row's stage 1, finished: not run again
    assert "finetune.max_steps=128" in more["settings"]["finetune"] and more["budget"]["steps"] == 128
    assert more["switch"] == "steps128" and mod.stale(more, b, code) == []
    assert mod.stale(more, {**b, "steps": 3}, code) == ["another budget"]
    small = mod.run_switched(row, "features32", b, tmp_path, [], code)
    assert len(stage1) == 2 and "@features32" in stage1[-1]  # its own stage 1
    for stage in ("distill", "finetune", "evaluate"):
        assert "attention.feature_dim=32" in small["settings"][stage], stage
        assert "attention.feature_dim=32" not in plain["settings"][stage]
    weak = mod.run_switched(row, "gamma3", b, tmp_path, [], code)
    for stage in ("distill", "finetune"):  # the switch comes after the variant's gamma_init=30.0: the last one wins
        keys = [x for x in weak["settings"][stage] if x.startswith("attention.gamma_init=")]
        assert keys[-1] == "attention.gamma_init=3.0", (stage, keys)
    text = mod.explore_table({row: plain}, {f"{row}@steps128": more, f"{row}@features32": small}, b, code, "tiny")
    lines = [x for x in text.splitlines() if x.startswith(f"| {row} |")]
    assert [x.split(" | ")[1] for x in lines] == ["-", "features32", "steps128"]
    assert f"-m experiments.reproduce_table1.run --row {row} --switch steps128 --budget tiny" in text
    other = "hedgecats+sinks+decay"  # every recipe with the main job's attention is a candidate, switched or not
    text = mod.explore_table({row: plain, other: plain, "hedgecats": plain}, {f"{row}@steps128": more}, b, code, "x")
    rows = [x.split(" | ")[0] for x in text.splitlines() if "+sinks+decay |" in x]
    assert rows == [f"| {other}", f"| {row}", f"| {row}"]  # (hedgecats, plain: not a candidate)
    assert f"-m experiments.reproduce_table1.run --row {other} --budget x" in text
    with pytest.raises(SystemExit):
        mod.main(["--switch", "steps128", "--table"])  # a switch needs the row it changes


def test_a_row_of_code_declared_to_compute_the_same_numbers_stays_current(tmp_path, monkeypatch):
    """SAME_NUMBERS: a row measured on the code before a declared refactor is current on the code after it (and its
    runs resume in the same directory); a row of any other code is stale."""
    mod = reproduce()
    before, after, other = "1" * 64, "2" * 64, "3" * 64
    monkeypatch.setattr(mod, "SAME_NUMBERS", {after: (before, "a" * 40, "b" * 40, "a refactor")})
    b = mod.BUDGETS["default"]
    row = {"row": "base", "commit": "0123456789ab", "code_hash": before, "budget": b}
    assert mod.stale(row, b, after) == [] and mod.stale(row, b, before) == []
    assert mod.stale(row, b, other) == ["the attention or recipe code changed since"]
    assert mod.stale(row | {"code_hash": after}, b, before) == []
    assert mod.measured_root(tmp_path, "default", after) == mod.measured_root(tmp_path, "default", before)
