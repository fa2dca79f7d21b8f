"""The eval modes with and without the cache of exact keys (issue 66): `hybrid+cache` is hybrid with eval.cache keys
per KV head, `hybrid` the same model with the cache off, cache_only always with it; each cell runs with its own
mode's cache (set at every `Models.get`), and the cells of the cached modes carry its size and selection in their key.

The cache's math is not what is tested here (attention/cache/): a forward hook stands in for it, halving a layer's
output while its `cache_keys` is > 0, so that a mode run with the cache computes another function than without."""

import json

import pytest
from conftest import one_thread

from hybrid_scale.config import load_config
from hybrid_scale.evaluate import models as eval_models
from hybrid_scale.evaluate.cells import count_cells
from hybrid_scale.evaluate.stage import evaluate
from hybrid_scale.models.convert import hybrid_layers
from hybrid_scale.quickstart import summary

KEYS = 4  # eval.cache


@pytest.fixture(scope="module")
def cached_eval(tiny_smollm_vocab, tmp_path_factory):
    """A tiny evaluation with the cached modes first (a plain mode after them must run without the cache): one task,
    perplexity and both probes; every hybrid forward's (layer mode, cache_keys, cache_select) recorded."""
    out = tmp_path_factory.mktemp("eval_cache")
    seen = []
    load = eval_models.Models._load_hybrid

    def load_with_fake_cache(self):
        model = load(self)
        for layer in hybrid_layers(model).values():
            layer.register_forward_pre_hook(lambda m, args: seen.append((m.mode, m.cache_keys, m.cache_select)))
            layer.register_forward_hook(lambda m, args, out: (out[0] * 0.5, *out[1:]) if m.cache_keys else None)
        return model

    overrides = [
        f"eval.model={tiny_smollm_vocab}",
        "eval.tasks=[piqa]",
        "eval.limit=4",
        "eval.batch_size=4",
        "eval.modes=[hybrid+cache,swa_sinks+cache,hybrid,swa_sinks]",
        "eval.passkey_modes=[hybrid+cache,cache_only,hybrid,base]",
        f"eval.cache={KEYS}",
        "attention.cache_select=recency",
        "attention.window=8",
        "eval.ppl_sequences=1",
        "eval.ppl_seq_len=96",
        "eval.la_share_seq_len=0",
        "eval.passkey_distances=[12,40]",
        "eval.passkey_trials=2",
        "eval.bootstrap=10",
        f"eval.out_dir={out}",
        "eval.progress=false",
    ]
    mp = pytest.MonkeyPatch()
    mp.setattr(eval_models.Models, "_load_hybrid", load_with_fake_cache)
    try:
        with one_thread():
            results = evaluate(load_config(overrides=overrides))
    finally:
        mp.undo()
    return out, results, seen


def test_a_cache_mode_runs_with_the_cache_and_a_plain_mode_without_it(cached_eval):
    out, r, seen = cached_eval
    assert set(seen) == {
        ("hybrid", KEYS, "recency"),
        ("swa_sinks", KEYS, "recency"),
        ("cache_only", KEYS, "recency"),
        ("hybrid", 0, "recency"),
        ("swa_sinks", 0, "recency"),
    }
    # the plain modes ran after the cached ones: with the cache off, so they differ from them everywhere measured
    for plain in ("hybrid", "swa_sinks"):
        assert r.modes[plain].tasks["piqa"].loglik != r.modes[plain + "+cache"].tasks["piqa"].loglik
        assert r.perplexity.by_mode[plain] != r.perplexity.by_mode[plain + "+cache"]
    for probe in (r.passkey, r.recall):
        assert list(probe.by_mode) == ["hybrid+cache", "cache_only", "hybrid", "base"]
        far = probe.by_mode["hybrid"]["40"].per_trial
        assert far != probe.by_mode["hybrid+cache"]["40"].per_trial != probe.by_mode["cache_only"]["40"].per_trial
    # the verdict compares the plain modes only: the hybrid and swa_sinks without the cache
    assert set(r.beyond_window.perplexity) == {"hybrid", "swa_sinks", "hybrid+cache", "swa_sinks+cache"}
    assert r.beyond_window.against == "swa_sinks"
    assert r.cached_modes() == ["hybrid+cache", "swa_sinks+cache", "cache_only"] and r.cache() == (KEYS, "recency")


def test_the_cells_of_a_cache_mode_carry_its_size_and_selection(cached_eval):
    out, _, _ = cached_eval
    cells = {p.stem: json.loads(p.read_text())["key"] for p in (out / "cells").glob("*.json")}
    assert {"hybrid+cache.piqa", "perplexity.swa_sinks+cache", "passkey.cache_only", "recall.hybrid+cache"} < set(cells)
    for name, key in cells.items():
        cached = "+cache" in name or "cache_only" in name
        assert (key.get("cache"), key.get("cache_select")) == ((KEYS, "recency") if cached else (None, None)), name


def test_the_table_and_the_summary_name_the_cache(cached_eval):
    out, r, _ = cached_eval
    table = (out / "table.md").read_text()
    assert "With the cache (hybrid+cache, swa_sinks+cache, cache_only): 4 exact keys per KV head" in table
    assert "| hybrid+cache |" in table and "| cache_only |" in table
    lines = summary(r).splitlines()
    head = next(i for i, x in enumerate(lines) if "without / with the cache" in x)
    assert lines[head] == (
        "  passkey and recall exact match at distances [12, 40] (beyond the window), without / with the cache "
        "(4 keys per KV head, chosen by recency):"
    )
    assert [x.split(":")[0].strip() for x in lines[head + 1 : head + 4]] == ["hybrid", "cache_only", "base"]
    assert (out / "long_context.png").is_file()


def test_twins_and_cells_count_the_cache_modes():
    """On a hybrid that keeps its own sinks swa_only is swa_sinks, with the cache as without it: one cell each."""
    e = load_config(
        overrides=[
            "eval.modes=[swa_only+cache,swa_sinks+cache,swa_sinks]",
            "eval.tasks=[piqa]",
            "eval.cache=8",
            "eval.recall_pairs=0",
        ]
    ).eval
    assert count_cells(e) == 3 + 3 + 1 + 3
    assert count_cells(e, keeps_sinks=True) == 2 + 2 + 1 + 2


@pytest.fixture(scope="module")
def retrieval_eval(tiny_smollm_vocab, tmp_path_factory):
    """A tiny evaluation with attention.cache_heads=retrieval: every hybrid forward's (mode, cache_keys, budget)
    recorded, and each calibration's budgets."""
    out = tmp_path_factory.mktemp("eval_cache_heads")
    seen, calibrated, calibrating = [], [], []
    load = eval_models.Models._load_hybrid
    budgets = eval_models.Models.cache_budgets

    def record(m, args):
        if not calibrating:  # (the calibration's own forwards are not the cells')
            seen.append((m.layer_idx, m.mode, m.cache_keys, m.options().cache_budget))

    def load_recording(self):
        model = load(self)
        for layer in hybrid_layers(model).values():
            layer.register_forward_pre_hook(record)
        return model

    def budgets_recording(self, keys):
        calibrating.append(True)
        try:
            got = budgets(self, keys)
        finally:
            calibrating.clear()
        calibrated.append((keys, {i: tuple(b.tolist()) for i, b in got.items()}))
        return got

    overrides = [
        f"eval.model={tiny_smollm_vocab}",
        "eval.tasks=[piqa]",
        "eval.limit=2",
        "eval.batch_size=2",
        "eval.modes=[hybrid+cache,hybrid]",
        "eval.passkey_modes=[cache_only]",
        f"eval.cache={KEYS}",
        "attention.cache_heads=retrieval",
        "attention.window=8",
        "eval.ppl_sequences=0",
        "eval.la_share_seq_len=0",
        "eval.recall_pairs=0",
        "eval.passkey_distances=[12]",
        "eval.passkey_trials=1",
        "eval.bootstrap=10",
        f"eval.out_dir={out}",
        "eval.progress=false",
    ]
    mp = pytest.MonkeyPatch()
    mp.setattr(eval_models.Models, "_load_hybrid", load_recording)
    mp.setattr(eval_models.Models, "cache_budgets", budgets_recording)
    try:
        with one_thread():
            evaluate(load_config(overrides=overrides))
    finally:
        mp.undo()
    return out, seen, calibrated


def test_retrieval_budgets_run_the_cached_cells(retrieval_eval):
    """cache_heads=retrieval: the budgets are calibrated once for the eval's cache and every forward of a cached mode
    (hybrid+cache, cache_only) runs with them, each layer's summing to KEYS x its KV heads; the plain hybrid runs
    without a cache; the cached cells' keys name the selection of heads."""
    out, seen, calibrated = retrieval_eval
    assert calibrated and {k for k, _ in calibrated} == {KEYS}
    budgets = calibrated[0][1]
    assert all(b == calibrated[0][1] for _, b in calibrated)  # (calibrated once: the same budgets every call)
    assert set(budgets) == {0, 1} and all(sum(b) == KEYS * len(b) for b in budgets.values())
    cached = {(mode, keys, budget) for i, mode, keys, budget in seen if keys}
    assert {mode for mode, _, _ in cached} >= {"hybrid", "cache_only"}
    for i, mode, keys, budget in seen:
        if keys:
            assert budget == budgets[i], (i, mode, budget)
        else:
            assert (mode, budget) == ("hybrid", None)
    cells = {p.stem: json.loads(p.read_text())["key"] for p in (out / "cells").glob("*.json")}
    assert cells["hybrid+cache.piqa"]["cache_heads"] == "retrieval" and "cache_heads" not in cells["hybrid.piqa"]
