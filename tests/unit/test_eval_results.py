"""The evaluation's results record (hybrid_scale/evaluate/results.py): results.json round-trips through it exactly,
carries its schema version, an older file of today's shape is read, and one of another shape or version is refused
with one line naming the file and the fix. The report and the quickstart summary read it."""

import copy
import json

import pytest

from hybrid_scale.errors import InputError
from hybrid_scale.evaluate import report
from hybrid_scale.evaluate.results import SCHEMA, EvalResults
from hybrid_scale.quickstart import summary


def _task(metric: float, n: int = 2) -> dict:
    return {"metric": metric, "stderr": 0.1, "n": n, "acc": metric, "acc_norm": metric, "correct": [True, False],
            "loglik": [[-1.5, -2.25], [-0.5, -3.0]]}  # fmt: skip


def _interval(delta: float) -> dict:
    return {"delta": delta, "lo": delta - 0.1, "hi": delta + 0.1}


def _probe(extra: dict) -> dict:
    score = {"exact": 0.5, "loglik": -4.5, "trials": 2, "per_trial": [[-4.0, True], [-5.0, False]]}
    by_mode = {m: {"12": score, "40": score | {"exact": 0.0}} for m in ("base", "hybrid", "swa_sinks")}
    return {"distances": [12, 40], "trials": 2, "digits": 5, "chance": {"exact": 1e-05, "loglik": -11.5},
            "by_mode": by_mode, "sanity": []} | extra  # fmt: skip


def written() -> dict:
    """results.json as the evaluation writes it today, with every optional part measured."""
    modes = {m: {"piqa": _task(0.5 + i / 10), "winogrande": _task(0.5), "avg": 0.55 + i / 20, "rec": 100.0 - i}
             for i, m in enumerate(("base", "hybrid", "swa_only", "la_only", "none"))}  # fmt: skip
    blocks = {"delta": 0.02, "lo": 0.01, "hi": 0.03, "ratio": 0.98}
    ppl = {m: {"0-64": 20.0 + i, "64-96": 30.0 + i} for i, m in enumerate(("base", "hybrid", "swa_only", "swa_sinks"))}
    beyond = {"against": "swa_sinks", "window": 16, "tokens": 80, "margin": 0.01,
              "perplexity": {"hybrid": 30.0, "swa_only": 31.0, "swa_sinks": 31.0}, "swa_only": blocks,
              "verdict": "LA used"}  # fmt: skip
    share = {"0": {"0-64": [0.1, 0.2], "64-96": [0.3, 0.4]}, "1": {"0-64": [0.5, 0.6], "64-96": [0.7, 0.8]}}
    return {
        "schema": SCHEMA,
        "model": "/runs/x/stage2/output",
        "converted": True,
        "untrained_feature_maps": False,
        "window": 16,
        "sinks": 4,
        "hybrid_sinks": True,
        "la_decay": True,
        "world_size": 1,
        "tensor_parallel": 1,
        "config": {"eval": {"margin": 0.02}, "seed": 0},
        "identity": {"model": {"window": 16}, "eval": {"limit": 2}, "seed": 0},
        "heldout": {"selection": "selection half of ...", "report": "report half of ..."},
        "tasks": {
            "piqa": {"metric": "acc_norm", "n": 2, "beyond_window": {"16": 0.25, "64": 0.0}},
            "winogrande": {"metric": "acc", "n": 2, "beyond_window": {"16": 0.5, "64": 0.125}},
        },
        "modes": modes,
        "timings_s": {"base": 1.5, "hybrid": 2.0, "perplexity_and_la_share": 3.0, "passkey": 4.0, "recall": 5.0},
        "delta_swa": {"piqa": _interval(0.1), "winogrande": _interval(0.0), "avg": _interval(0.05)},
        "delta_la": {"piqa": _interval(0.2), "winogrande": _interval(0.1), "avg": _interval(0.15)},
        "verdict_tasks": "inconclusive",
        "perplexity": {"seq_len": 96, "sequences": 1, "by_mode": ppl},
        "beyond_window": blocks | beyond,
        "la_share": {"seq_len": 96, "sequences": 1, "share": share, "effect": share, "horizon": {"0": [None, 20.0]}},
        "passkey": _probe({}),
        "recall": _probe({"digits": 4, "pairs": 3}),
        "verdict": "LA used",
        "verdict_basis": "beyond_window",
    }


def _text(d: dict) -> str:
    return json.dumps(d, indent=1) + "\n"


def test_a_results_file_round_trips_exactly_and_carries_its_schema_version(tmp_path):
    text = _text(written())
    record = EvalResults.from_json(json.loads(text))
    assert record.dumps() == text  # every key, in order, as the stage writes it
    assert json.loads(record.dumps())["schema"] == SCHEMA == 1
    assert EvalResults.from_json(record.to_json()) == record
    (tmp_path / "results.json").write_text(text)
    loaded = EvalResults.load(tmp_path / "results.json")
    assert loaded == record and loaded.tasks["piqa"].beyond_window == {16: 0.25, 64: 0.0}  # keyed by the window
    assert loaded.modes["hybrid"].tasks["piqa"].metric == 0.6 and loaded.modes["none"].rec == 96.0
    assert loaded.beyond_window.swa_only.ratio == 0.98 and loaded.recall.pairs == 3 and loaded.passkey.pairs is None


def test_the_parts_not_measured_are_left_out_as_the_stage_leaves_them():
    """No task, no perplexity, no probe: the file holds the fixed keys (heldout null); perplexity measured without a
    comparison past the window writes beyond_window null."""
    d = {k: v for k, v in written().items() if k not in ("delta_swa", "delta_la", "verdict_tasks", "perplexity",
         "beyond_window", "la_share", "passkey", "recall", "verdict", "verdict_basis")}  # fmt: skip
    d |= {"heldout": None, "tasks": {}, "modes": {}}
    record = EvalResults.from_json(d)
    assert record.dumps() == _text(d) and record.perplexity is None and record.verdict is None
    with_ppl = d | {"perplexity": written()["perplexity"], "beyond_window": None}
    assert EvalResults.from_json(with_ppl).dumps() == _text(with_ppl)
    assert "Verdict on the linear attention: n/a" in summary(record)
    assert "Items per task: no tasks; window 16" in report.table(record)


def test_the_stage_writes_the_schema_version():
    """What evaluate() writes is EvalResults.dumps(): the version first."""
    import inspect

    from hybrid_scale.evaluate import stage

    assert '(out_dir / "results.json").write_text(results.dumps())' in inspect.getsource(stage._evaluate)
    record = EvalResults.from_json(written())
    assert next(iter(json.loads(record.dumps()))) == "schema"


def test_an_older_file_of_todays_shape_is_read(tmp_path):
    """Written before the version existed (the commit before it added only the version): read as this schema."""
    old = {k: v for k, v in written().items() if k != "schema"}
    (tmp_path / "results.json").write_text(_text(old))
    record = EvalResults.load(tmp_path / "results.json")
    assert record == EvalResults.from_json(written()) and record.dumps() == _text(written())


def test_an_older_file_of_another_shape_is_refused_with_one_line(tmp_path):
    old = {k: v for k, v in written().items() if k not in ("schema", "la_decay")}  # before the LA could decay
    path = tmp_path / "eval" / "results.json"
    path.parent.mkdir()
    path.write_text(_text(old))
    with pytest.raises(InputError) as err:
        EvalResults.load(path)
    assert str(err.value) == (
        f"{path} was written by an older hybrid_scale (no schema version; no 'la_decay' in EvalResults); rerun "
        "`hybrid-scale evaluate` to rewrite it"
    )
    nested = copy.deepcopy(old) | {"la_decay": False}
    del nested["modes"]["hybrid"]["piqa"]["acc_norm"]
    path.write_text(_text(nested))
    with pytest.raises(InputError, match="no 'acc_norm' in TaskScore"):
        EvalResults.load(path)


def test_a_newer_or_unknown_schema_is_refused_with_one_line(tmp_path):
    path = tmp_path / "results.json"
    for version in (SCHEMA + 1, "1.5"):
        path.write_text(_text(written() | {"schema": version}))
        with pytest.raises(InputError) as err:
            EvalResults.load(path)
        assert str(err.value) == (
            f"{path} has results schema {version!r}; this hybrid_scale reads schema {SCHEMA}: use the hybrid_scale "
            "that wrote it, or rerun `hybrid-scale evaluate` to rewrite it"
        )
        assert "\n" not in str(err.value)


def test_a_file_of_this_schema_with_an_unknown_key_or_no_json_is_refused(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(_text(written() | {"surprise": 1}))
    with pytest.raises(InputError) as err:
        EvalResults.load(path)
    assert str(err.value) == (
        f"{path} is not a schema-1 results.json (unknown key 'surprise' in EvalResults); rerun `hybrid-scale "
        "evaluate` to rewrite it"
    )
    path.write_text("{")
    with pytest.raises(InputError, match=r"not readable as an evaluation's results.json"):
        EvalResults.load(path)


def test_the_report_and_the_quickstart_summary_read_the_record(tmp_path):
    record = EvalResults.from_json(written())
    table = report.table(record)
    assert "| hybrid | 60.0 ± 10.0 | 50.0 ± 10.0 | 60.0 | 99.0 |" in table
    assert "| LA = la_only - none | +20.0 [+10.0, +30.0] | +10.0 [+0.0, +20.0] | +15.0 [+5.0, +25.0] |" in table
    assert "**Verdict: LA used** (on the held-out text beyond the window)" in table
    assert "`swa_only`, its own window + 4 sinks: is the LA used? 0.98x its perplexity" in table
    assert "| 0 | inf | 20 |" in table and "Associative recall (2 seeded prompts per distance, a line of 3" in table
    lines = summary(record).splitlines()
    assert lines[0] == "Verdict on the linear attention: LA used"
    assert "  passkey exact match at distances [40] (beyond the window): base 0%, hybrid 0%, swa_sinks 0%" in lines
    report.plots(record, tmp_path)
    assert (tmp_path / "ablation.png").is_file() and (tmp_path / "long_context.png").is_file()


def test_the_summary_puts_each_modes_retrieval_without_and_with_the_cache_side_by_side():
    """Issue 66: when the probes ran `+cache` modes, one line per mode: its exact match beyond the window without
    and with the cache (hybrid+cache on hybrid's line), for the passkey and the recall probe; cache_only has nothing
    without it, and a mode run one way only gets one value."""
    d = written()
    d["config"] = {"eval": {"margin": 0.02, "cache": None}, "attention": {"cache": 32, "cache_select": "self_recall"}}
    exact = {"base": 0.9, "hybrid": 0.0, "hybrid+cache": 0.8, "swa_sinks+cache": 0.5, "cache_only": 0.25}
    for probe, scale in (("passkey", 1.0), ("recall", 0.5)):
        score = d[probe]["by_mode"]["base"]["40"]
        by_mode = {m: {"12": score, "40": score | {"exact": e * scale}} for m, e in exact.items()}
        d[probe]["by_mode"] = by_mode
    record = EvalResults.from_json(d)
    assert record.cached_modes() == ["hybrid+cache", "swa_sinks+cache", "cache_only"]
    assert record.cache() == (32, "self_recall")
    lines = summary(record).splitlines()
    start = lines.index(
        "  passkey and recall exact match at distances [40] (beyond the window), without / with the cache (32 keys "
        "per KV head, chosen by self_recall):"
    )
    assert lines[start + 1 :] == [
        "    base: passkey 90%, recall 45%",
        "    hybrid: passkey 0% / 80%, recall 0% / 40%",
        "    swa_sinks: passkey - / 50%, recall - / 25%",
        "    cache_only: passkey - / 25%, recall - / 12%",
    ]
    assert "exact match at distances [40] (beyond the window): base" not in summary(record)
    table = report.table(record)
    assert "With the cache (hybrid+cache, swa_sinks+cache, cache_only): 32 exact keys per KV head" in table
    d["recall"] = None  # the passkey alone; eval.cache overrides attention.cache
    d["config"]["eval"]["cache"] = 8
    lines = summary(EvalResults.from_json(d)).splitlines()
    head = "  passkey exact match at distances [40] (beyond the window), without / with the cache (8 keys per KV head, "
    assert head + "chosen by self_recall):" in lines and "    hybrid: passkey 0% / 80%" in lines
