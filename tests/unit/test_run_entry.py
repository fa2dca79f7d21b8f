"""What every stage shares (hybrid_scale/run/): the one definition of the settings that change a result and of the
keys that differ (settings.py), the derived settings resolved once, the model a stage reads found by one probe that
reads its hybrid_config.json once (sources.py), and the stage entry (entry.py): preflight before anything is
written, then the runtime, the lock, the signal flag, the requeue marker cleared and the rank-0 log. The stages'
own tests (tests/integration) run every stage through it; test_pipeline counts the hybrid_config.json reads of a
whole run."""

import importlib.util
import json
import signal

import pytest
from conftest import tiny_model

import hybrid_scale as hs
from hybrid_scale import entry as entry_module
from hybrid_scale.config import load_config
from hybrid_scale.distributed.requeue import REQUEUE_MARKER, SignalFlag
from hybrid_scale.entry import stage_entry
from hybrid_scale.errors import ConfigError, InputError
from hybrid_scale.pipeline import STAGE_INPUTS
from hybrid_scale.run import lock, sources
from hybrid_scale.run.identity import differing
from hybrid_scale.run.layout import RunLayout
from hybrid_scale.run.resolved import Resolved
from hybrid_scale.run.settings import STAGE1_KEYS, derive, run_settings, stage1_settings, stage2_settings


def test_differing_lists_the_sorted_keys_that_differ_and_a_key_one_side_lacks():
    assert differing({"b": 1, "a": 2, "c": None}, {"b": 1, "a": 3, "d": 0}) == ["a", "c", "d"]
    assert differing({"x": [1, 2]}, {"x": [1, 2]}) == []


def test_derived_settings_follow_the_recipe_unless_set():
    cfg = load_config(overrides=["distill.recipe=lolcats", "data.seq_len=96"])
    d = derive(cfg)
    assert d.objectives == {"hybrid_output_mse": 1.0} and d.train_gamma  # gamma trains with a hybrid objective
    assert d.recipe.name == "lolcats" and not d.early_stopping and d.stage2_seq_len == 96
    d = derive(load_config(overrides=["distill.recipe=hedgecats", "finetune.recipe=ssd", "finetune.seq_len=32"]))
    assert d.objectives == {"weights_xent": 1.0} and not d.train_gamma
    assert d.recipe.name == "ssd" and not d.early_stopping and d.stage2_seq_len == 32
    d = derive(load_config(overrides=["distill.recipe=hedgecats", "finetune.early_stopping=false"]))
    assert d.recipe.name == "hedgecats" and not d.early_stopping
    assert derive(load_config(overrides=["distill.recipe=hedgecats"])).early_stopping


def test_one_definition_names_what_changes_each_stages_result():
    cfg = load_config(overrides=["distill.recipe=lolcats"])
    s1 = stage1_settings(cfg, derive(cfg))
    assert {k for k in s1 if not k.startswith("attention.")} == {k for k in STAGE1_KEYS if k != "attention"}
    assert "attention.window" in s1 and "attention.backend" not in s1  # the backend moves only rounding
    assert s1["distill.objectives"] == {"hybrid_output_mse": 1.0} and s1["distill.train_gamma"] is True  # resolved
    s2 = stage2_settings(cfg, derive(cfg))
    assert s2["recipe"] == "lolcats" and s2["seq_len"] == cfg.data.seq_len and "clip" in s2 and "progress" not in s2
    # stage 2 reads the training text and its held-out split too: another corpus is another result
    text = load_config(overrides=["distill.recipe=lolcats", "data.source=/x/corpus.txt", "data.heldout_fraction=0.1"])
    assert differing(s2, stage2_settings(text, derive(text))) == [
        "data.heldout_fraction",
        "data.source",
        "data.text_field",
    ]
    # the pipeline's record: both stages' settings; what moves only rounding or memory may change between reruns
    same = ["distill.query_block=32", "finetune.micro_batch=2", "attention.backend=torch", "eval.limit=3"]
    assert differing(run_settings(cfg), run_settings(load_config(overrides=["distill.recipe=lolcats", *same]))) == []
    other = load_config(overrides=["distill.recipe=lolcats", "finetune.clip=0.5", "distill.lr=0.1"])
    assert differing(run_settings(cfg), run_settings(other)) == ["distill.lr", "finetune.clip"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = root / "base"
    tiny_model("llama").save_pretrained(base)
    model = hs.convert_model(tiny_model("llama"), {"window": 4})
    hs.save_converted(model, root / "converted", base_path=base)
    return root


def test_each_stage_reads_the_model_its_rule_names(converted, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run}", f"model.path={converted / 'base'}"])
    layout = RunLayout.of(cfg)
    assert sources.stage_model(cfg, "distill", layout).path == converted / "base"
    assert not sources.stage_model(cfg, "finetune", layout).converted  # stage 1 has not run
    assert sources.stage_model(cfg, "evaluate", layout).path == converted / "base"  # no run model yet: model.path
    layout.stage1_output.parent.mkdir(parents=True)
    (converted / "converted").rename(layout.stage1_output)
    try:
        for stage in ("finetune", "evaluate", "export"):
            model = sources.stage_model(cfg, stage, layout)
            assert model.path.resolve() == layout.stage1_output.resolve() and model.converted
            assert model.base == converted / "base"
    finally:
        layout.stage1_output.rename(converted / "converted")
    cfg = load_config(overrides=[f"run_dir={run}", f"eval.model={converted / 'converted'}"])
    assert Resolved.of(cfg, "evaluate").model.path == converted / "converted"


def test_the_probe_reads_hybrid_config_once_and_names_a_damaged_one(converted, tmp_path, monkeypatch):
    calls = []
    real = sources.read_hybrid_config
    monkeypatch.setattr(sources, "read_hybrid_config", lambda p: calls.append(p) or real(p))
    model = sources.probe(converted / "converted", "eval.model")
    assert len(calls) == 1 and model.base == converted / "base" and model.hybrid_config["attention"]["window"] == 4
    model.base, model.describe(), model.converted  # answered from what was read
    assert len(calls) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "hybrid_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"hybrid_config.json is not valid JSON .*; restore"):
        sources.probe(broken, "eval.model")


def test_a_stage_entry_checks_before_it_writes_and_a_refusal_touches_nothing(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run}", "finetune.model=" + str(tmp_path / "missing")])
    with pytest.raises(InputError, match="config key 'finetune.model'.*is not a converted model"):
        with stage_entry(cfg, "finetune", STAGE_INPUTS["finetune"]):
            raise AssertionError("the body ran")
    assert not run.exists()  # no lock, no directory


def test_a_stage_entry_holds_the_lock_flag_and_log_and_clears_the_requeue_marker(converted, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / REQUEUE_MARKER).write_text("3\n")  # the stop before this job
    cfg = load_config(overrides=[f"run_dir={run}", f"model.path={converted / 'base'}"])
    seen = []
    monkeypatch.setattr(entry_module, "preflight", lambda cfg, stage, inputs, r: seen.append((stage, r)) or "checked")
    with stage_entry(cfg, "distill", STAGE_INPUTS["distill"]) as entry:
        assert seen == [("distill", entry.resolved)] and entry.plan == "checked"
        assert json.loads(lock.lock_path(run).read_text())["stage"] == "distill"
        assert not (run / REQUEUE_MARKER).exists()
        assert signal.getsignal(signal.SIGUSR1) == SignalFlag._on_signal and not entry.signal.raised
        entry.layout.stage1.mkdir()
        entry.log("a line")
        assert entry.rt.main and entry.derived == derive(cfg) and entry.model.path == entry.resolved.model.path
    assert not lock.lock_path(run).exists() and signal.getsignal(signal.SIGUSR1) != SignalFlag._on_signal
    assert (run / "stage1" / "log.txt").read_text().endswith(" a line\n")


@pytest.mark.parametrize("key, package", [("log.wandb=project", "wandb"), ("log.tensorboard=true", "tensorboard")])
def test_a_logger_without_its_package_is_refused_before_anything_is_written(
    converted, tmp_path, monkeypatch, key, package
):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    run = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run}", f"model.path={converted / 'base'}", key])
    with pytest.raises(ConfigError, match=rf"config key '{key.split('=')[0]}': .*needs the {package} package"):
        with stage_entry(cfg, "distill", STAGE_INPUTS["distill"]):
            raise AssertionError("the body ran")
    assert not run.exists()


def test_allow_config_change_goes_on_only_for_a_training_stage_not_started_yet(tmp_path):
    from omegaconf import OmegaConf

    from hybrid_scale.pipeline import record_config

    run = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run}"])
    layout = RunLayout.of(cfg)
    record_config(cfg, layout)
    layout.stage1.mkdir(parents=True)
    (layout.stage1 / "layer_000.safetensors").write_bytes(b"")  # stage 1 has started, stage 2 has not
    lr = load_config(overrides=[f"run_dir={run}", "finetune.lr=0.5"])
    with pytest.raises(ConfigError, match=r"finetune.lr changed .*allow_config_change=true"):
        record_config(lr, layout)
    record_config(lr, layout, allow_change=True)  # stage 2 will run with the new rate, and the record says so
    assert OmegaConf.load(layout.config).finetune.lr == 0.5
    both = load_config(overrides=[f"run_dir={run}", "finetune.lr=0.5", "distill.lr=0.5"])
    with pytest.raises(ConfigError, match=rf"distill.lr changed, but stage 1 has started .*remove {layout.stage1} "):
        record_config(both, layout, allow_change=True)
    assert OmegaConf.load(layout.config).distill.lr != 0.5


def test_the_pipeline_trains_no_stage_1_when_stage_2_starts_from_a_given_model(tmp_path):
    from hybrid_scale.pipeline import is_done

    given = load_config(overrides=[f"run_dir={tmp_path / 'run'}", f"finetune.model={tmp_path / 'converted'}"])
    assert is_done(given, RunLayout.of(given), "distill")  # (its result would go unused)
    plain = load_config(overrides=[f"run_dir={tmp_path / 'run'}"])
    assert not is_done(plain, RunLayout.of(plain), "distill")


def test_the_cache_retrains_nothing_unless_the_stages_train_with_it():
    """attention.cache (and its selection) joins after training: the settings the stages record and a rerun compares
    do not change with it, so changing it retrains nothing; with attention.cache_train they do, stage 2's too (a
    resume with another cache is refused)."""
    from hybrid_scale.config import load_config
    from hybrid_scale.run.settings import derive, run_settings, stage2_settings

    def cfg(*extra):
        return load_config("quickstart.yaml", list(extra))

    plain, cached = cfg("attention.cache=16"), cfg("attention.cache=64", "attention.cache_select=self_recall")
    assert run_settings(plain) == run_settings(cached)
    trains = [cfg("attention.cache_train=true", f"attention.cache={c}") for c in (16, 64)]
    assert run_settings(trains[0]) != run_settings(trains[1])
    s2 = [stage2_settings(c, derive(c)) for c in trains]
    assert s2[0]["attention.cache"] == 16 and s2[1]["attention.cache"] == 64
