import pytest

from hybrid_scale.config import ConfigError, attention_settings, load_config


def test_defaults_yaml_and_overrides(tmp_path):
    cfg = load_config()
    assert cfg.attention.window == 64 and cfg.attention.feature_map == "hedgehog" and cfg.seed == 0
    for section in ("model", "attention", "data", "distill", "finetune", "eval", "export", "launch", "slurm"):
        assert section in cfg
    path = tmp_path / "c.yaml"
    path.write_text("attention:\n  window: 32\n  layers: [0, 2]\nmodel:\n  dtype: bfloat16\n")
    cfg = load_config(path, ["attention.mode=la_only", "seed=3"])
    assert (cfg.attention.window, list(cfg.attention.layers), cfg.model.dtype) == (32, [0, 2], "bfloat16")
    assert (cfg.attention.mode, cfg.seed) == ("la_only", 3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("attention.windw=3", "config key 'attention.windw' is not known; allowed here: window, feature_map,"),
        ("attention.window=abc", "config key 'attention.window': Value 'abc' of type 'str' could not be converted"),
        ("attention.window=0", "config key 'attention.window': must be >= 1, got 0"),
        ("attention.feature_map=cos", "'cos' is not allowed; choose one of: elu1, exp, hedgehog, relu, t2r"),
        ("attention.mode=both", "config key 'attention.mode': 'both' is not allowed; choose one of: hybrid, swa_only"),
        ("attention.gamma_init=1.5", "config key 'attention.gamma_init': must be in (0, 1), got 1.5"),
        ("model.dtype=int8", "config key 'model.dtype': 'int8' is not allowed; choose one of: float32, bfloat16"),
        ("distill.lrate=1", "config key 'distill.lrate' is not known; allowed here: recipe, objectives, train_feature"),
        ("slurm.partition=gpu", "config key 'slurm.partition' is not known; allowed here: (none yet)"),
        (
            "distill.recipe=lora",
            "config key 'distill.recipe': 'lora' is not allowed; choose one of: lolcats, hedgecats",
        ),
        (
            "distill.objectives={kl: 1.0}",
            "config key 'distill.objectives': 'kl' is not allowed; choose one of: weights",
        ),
        ("eval.buckets=[0,64,32]", "config key 'eval.buckets': must start at 0 and increase strictly, got [0, 64, 32]"),
        ("attention.window", "override 'attention.window' is not of the form key=value"),
    ],
)
def test_bad_values_give_one_clear_error(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_bad_yaml_key_and_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("atention:\n  window: 3\n")
    with pytest.raises(ConfigError, match="config key 'atention' is not known; allowed here: model, attention"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_attention_settings_from_dict():
    s = attention_settings({"window": 8, "mode": "swa_only"})
    assert (s.window, s.mode, s.sinks) == (8, "swa_only", 8)
    with pytest.raises(ConfigError, match="'attention.sinks': must be >= 1"):
        attention_settings({"sinks": 0})
