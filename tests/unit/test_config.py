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
        ("slurm.partion=gpu", "config key 'slurm.partion' is not known; allowed here: partition, account, time"),
        ("slurm.times={stage2: '1:00:00'}", "config key 'slurm.times': unknown stage(s) stage2; use distill,"),
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


def test_yaml_files_compose_through_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("attention: {window: 16, sinks: 4}\nseed: 1\n")
    (tmp_path / "mid.yaml").write_text("defaults: [base.yaml]\nattention: {window: 32}\n")
    (tmp_path / "run.yaml").write_text("defaults: [mid.yaml, recipes/ssd.yaml]\nseed: 2\n")  # a shipped preset too
    cfg = load_config(tmp_path / "run.yaml", ["attention.sinks=6"])
    assert (cfg.attention.window, cfg.attention.sinks, cfg.seed) == (32, 6, 2)  # later layers win, overrides last
    assert cfg.finetune.recipe == "ssd" and cfg.distill.recipe == "ssd"


def test_presets_load_by_name_and_carry_their_architecture():
    cfg = load_config("quickstart.yaml")
    assert cfg.finetune.recipe == "ssd" and cfg.model.arch["num_hidden_layers"] == 30 and cfg.data.seq_len == 256
    big = load_config("models/llama3-70b.yaml", ["launch.tensor_parallel=8"])
    assert big.model.arch["num_key_value_heads"] == 8 and big.launch.nodes * big.launch.procs_per_node == 32


@pytest.mark.parametrize(
    "files, message",
    [
        ({"run.yaml": "defaults: [nope.yaml]\n"}, "config file nope.yaml named in"),
        ({"run.yaml": "defaults: [b.yaml]\n", "b.yaml": "defaults: [run.yaml]\n"}, "config files include each other"),
        ({"run.yaml": "defaults: base.yaml\n"}, "'defaults' must be a list of YAML file names"),
        ({"run.yaml": "- 1\n- 2\n"}, "must hold a mapping of sections"),
        ({"run.yaml": "attention: {window: [\n"}, "is not valid YAML"),
        ({"run.yaml": "launch: {launcher: mpirun}\n"}, "'launch.launcher': 'mpirun' is not allowed"),
        ({"run.yaml": "launch: {procs_per_node: 8, tensor_parallel: 3}\n"}, "3 does not divide the 8 ranks"),
        ({"run.yaml": "slurm: {max_restarts: -1}\n"}, "'slurm.max_restarts': must be >= 0"),
    ],
)
def test_composition_errors(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "run.yaml")
    assert message in str(e.value)
