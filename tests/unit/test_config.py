import json

import pytest
from omegaconf import OmegaConf

from hybrid_scale.config import ConfigError, attention_settings, load_config
from hybrid_scale.config.schema import eval_cache, eval_mode


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
        (
            "attention.gamma_init=1.5",
            "config key 'attention.gamma_init': must be in (0, 1) with attention.gamma_param=s",
        ),
        ("attention.gamma_param=tanh", "config key 'attention.gamma_param': 'tanh' is not allowed; choose one of: sig"),
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


def test_eval_modes_with_and_without_the_cache():
    """`+cache` runs a windowed mode with the cache of exact keys (eval.cache, else attention.cache), cache_only always
    with it; the plain names with it off. A cached mode with a cache of 0 keys is refused, naming the fix."""
    cached = ["eval.modes=[hybrid,hybrid+cache,swa_only+cache,swa_sinks+cache,cache_only]"]
    cfg = load_config(overrides=[*cached, "eval.cache=16", "eval.passkey_modes=[base,swa_sinks+cache]"])
    assert cfg.eval.modes[-1] == "cache_only" and eval_cache(cfg) == 16
    assert eval_cache(load_config(overrides=[*cached, "attention.cache=8"])) == 8  # eval.cache null: attention.cache
    assert eval_cache(load_config(overrides=[*cached, "attention.cache=8", "eval.cache=2"])) == 2
    assert [eval_mode(m) for m in cfg.eval.modes] == [
        ("hybrid", False), ("hybrid", True), ("swa_only", True), ("swa_sinks", True), ("cache_only", True)
    ]  # fmt: skip
    assert "cache_only" not in load_config().eval.modes  # the default runs no cached mode (attention.cache 0)
    fix = "set eval.cache (or attention.cache) to the keys per KV head it keeps, e.g. eval.cache=32, or leave"
    for overrides, message in (
        (["eval.modes=[hybrid,hybrid+cache]"], "config key 'eval.modes': hybrid+cache runs with the cache of exact "
         "keys, whose size is 0 (eval.cache unset, attention.cache = 0); " + fix + " hybrid+cache out"),
        (["eval.modes=[cache_only]", "attention.cache=8", "eval.cache=0"], "config key 'eval.modes': cache_only runs "
         "with the cache of exact keys, whose size is 0 (eval.cache = 0); " + fix + " cache_only out"),
        (["eval.modes=[base]", "eval.passkey_modes=[base,swa_sinks+cache]"], "config key 'eval.passkey_modes': "
         "swa_sinks+cache runs with the cache"),
        (["eval.modes=[la_only+cache]", "eval.cache=8"], "config key 'eval.modes': 'la_only+cache' is not allowed; "
         "choose one of: base, hybrid, swa_only, swa_sinks, la_only, sinks_only, none, hybrid+cache, swa_only+cache, "
         "swa_sinks+cache, cache_only"),
        (["eval.passkey_modes=[base+cache]", "eval.cache=8"], "config key 'eval.passkey_modes': 'base+cache' is not"),
        (["eval.cache=-1"], "config key 'eval.cache': must be >= 0, got -1"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(overrides=overrides)
        assert message in str(e.value), overrides


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
    with pytest.raises(ConfigError, match="'attention.sinks': must be >= 0"):
        attention_settings({"sinks": -1})
    assert attention_settings({"sinks": 0}).sinks == 0  # (the hybrid's own sinks then are LoLCATs' hybrid)


def test_yaml_files_compose_through_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("attention: {window: 16, sinks: 4}\nseed: 1\n")
    (tmp_path / "mid.yaml").write_text("defaults: [base.yaml]\nattention: {window: 32}\n")
    (tmp_path / "run.yaml").write_text("defaults: [mid.yaml, recipes/ssd.yaml]\nseed: 2\n")  # a shipped preset too
    cfg = load_config(tmp_path / "run.yaml", ["attention.sinks=6"])
    assert (cfg.attention.window, cfg.attention.sinks, cfg.seed) == (32, 6, 2)  # later layers win, overrides last
    assert cfg.finetune.recipe == "ssd" and cfg.distill.recipe == "ssd"


def test_presets_load_by_name_and_carry_their_architecture():
    cfg = load_config("quickstart.yaml")
    assert cfg.finetune.recipe == "lolcats" and cfg.model.arch["num_hidden_layers"] == 30 and cfg.data.seq_len == 1024
    assert cfg.attention.la_decay and cfg.finetune.seq_len is None  # stage 2 reads what stage 1 read
    assert cfg.attention.window == 16 and "swa_sinks" in cfg.eval.modes
    assert cfg.eval.passkey_distances == [8, 64, 128, 256]
    big = load_config(
        "models/llama3-70b.yaml", ["launch.tensor_parallel=8", "eval.shard_weights=false", "finetune.offload=false"]
    )
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
        (
            {"run.yaml": "launch: {procs_per_node: 8, tensor_parallel: 3}\n"},
            "3 does not divide launch.procs_per_node",
        ),
        (
            {"run.yaml": "launch: {procs_per_node: 2, tensor_parallel: 2}\neval: {shard_weights: true}\n"},
            "ZeRO-3 partitioning and the tensor-parallel split (2) do not combine",
        ),
        (
            {"run.yaml": "launch: {procs_per_node: 2, tensor_parallel: 2}\nfinetune: {offload: true}\n"},
            "CPU offload is ZeRO-3's; with the tensor-parallel split (2)",
        ),
        (
            {"run.yaml": "model: {dtype: float16}\nlaunch: {procs_per_node: 2, tensor_parallel: 2}\n"},
            "float16 needs DeepSpeed's loss scaling",
        ),
        ({"run.yaml": "slurm: {max_restarts: -1}\n"}, "'slurm.max_restarts': must be >= 0"),
    ],
)
def test_composition_errors(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "run.yaml")
    assert message in str(e.value)


EVIL = "x\nrm -rf ~"  # a line break: the rest would become a shell command in the sbatch script
ONE_LINE = "contains a line break or NUL, which would end its line of the sbatch script and run the rest as a command"
TIME_FIX = (
    "is not a Slurm time limit; use minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes "
    "or days-hours:minutes:seconds (e.g. 90, 24:00:00, 2-00:00:00), or UNLIMITED"
)
MEM_FIX = (
    "is not a Slurm memory size; use an integer with an optional unit K, M, G or T (e.g. 200G; mebibytes without a "
    "unit; 0 = all of a node's memory)"
)
NAME_FIX = "without whitespace, quotes or any of # $ ` ; & | < > \\"
LISTS = " (a comma-separated list for several, e.g. gpu,gpu-long)"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("slurm.job_name", EVIL, f"config key 'slurm.job_name': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.partition", EVIL, f"config key 'slurm.partition': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.account", EVIL, f"config key 'slurm.account': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.time", EVIL, f"config key 'slurm.time': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.mem", EVIL, f"config key 'slurm.mem': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.times.export", EVIL, f"config key 'slurm.times.export': {EVIL!r} {ONE_LINE}; remove it"),
        (
            "slurm.extra",
            [f"--qos={EVIL}"],
            f"config key 'slurm.extra[0]': {'--qos=' + EVIL!r} {ONE_LINE}; give each sbatch option as its own item",
        ),
        (
            "slurm.setup",
            ["module load cuda", EVIL],
            f"config key 'slurm.setup[1]': {EVIL!r} {ONE_LINE}; give each shell line as its own item",
        ),
        ("slurm.template_dir", EVIL, f"config key 'slurm.template_dir': {EVIL!r} {ONE_LINE}; remove it"),
        ("run_dir", EVIL, f"config key 'run_dir': {EVIL!r} {ONE_LINE}; remove it"),
        ("slurm.time", "1 day", f"config key 'slurm.time': '1 day' {TIME_FIX}"),
        ("slurm.time", "25:61:61:00", f"config key 'slurm.time': '25:61:61:00' {TIME_FIX}"),
        ("slurm.time", "2-", f"config key 'slurm.time': '2-' {TIME_FIX}"),
        ("slurm.times.export", "soon", f"config key 'slurm.times.export': 'soon' {TIME_FIX}"),
        ("slurm.mem", "lots", f"config key 'slurm.mem': 'lots' {MEM_FIX}"),
        ("slurm.mem", "8 G", f"config key 'slurm.mem': '8 G' {MEM_FIX}"),
        ("slurm.mem", "-1", f"config key 'slurm.mem': '-1' {MEM_FIX}"),
        (
            "slurm.job_name",
            "my job",
            f"config key 'slurm.job_name': 'my job' contains ' '; use a plain name {NAME_FIX}",
        ),
        (
            "slurm.partition",
            "gpu;reboot",
            f"config key 'slurm.partition': 'gpu;reboot' contains ';'; use a plain name{LISTS} {NAME_FIX}",
        ),
        (
            "slurm.account",
            "$(id)",
            f"config key 'slurm.account': '$(id)' contains '$'; use a plain name{LISTS} {NAME_FIX}",
        ),
        (
            "slurm.extra",
            ["qos=high"],
            "config key 'slurm.extra[0]': 'qos=high' is not an sbatch option; give one option per item, starting "
            "with - (e.g. --qos=high)",
        ),
    ],
)
def test_hostile_slurm_values_give_one_clear_error(key, value, message):
    """Values that end up in the sbatch scripts (#SBATCH lines, the shell body): each refused with its own message.
    Overrides are parsed as YAML, so each value goes in through a YAML literal that keeps it a string."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"{key}={json.dumps(value)}"])
    assert str(e.value) == message


@pytest.mark.parametrize(
    "override, key, want",
    [
        ("slurm.time=2-00:00:00", "slurm.time", "2-00:00:00"),
        ("slurm.time=90", "slurm.time", "90"),  # minutes
        ("slurm.time=UNLIMITED", "slurm.time", "UNLIMITED"),
        ("slurm.time='1-12'", "slurm.time", "1-12"),  # days-hours
        ("slurm.time='05:30'", "slurm.time", "05:30"),  # minutes:seconds
        ("slurm.mem=0", "slurm.mem", "0"),  # the YAML int 0, stored as the string '0': the whole node
        ("slurm.mem=200G", "slurm.mem", "200G"),
        ("slurm.mem=512", "slurm.mem", "512"),
        ("slurm.times={export: '02:00:00'}", "slurm.times", {"export": "02:00:00"}),
        ("slurm.partition=gpu,gpu-long", "slurm.partition", "gpu,gpu-long"),
        ("slurm.extra=[--qos=high, --exclusive]", "slurm.extra", ["--qos=high", "--exclusive"]),
        ("slurm.setup=['module load cuda/12.4', 'cd $HOME']", "slurm.setup", ["module load cuda/12.4", "cd $HOME"]),
        ("run_dir='/scratch/my runs/$(x)'", "run_dir", "/scratch/my runs/$(x)"),  # quoted where it is used
    ],
)
def test_valid_slurm_values_load(override, key, want):
    got = OmegaConf.select(load_config(overrides=[override]), key)
    assert (got if isinstance(got, str) else OmegaConf.to_container(got)) == want


def test_slurm_times_stay_as_written_not_yaml_base_60(tmp_path):
    """YAML 1.1 reads 24:00:00 as 86400, which Slurm would take as 60 days of minutes."""
    cfg = load_config(overrides=["slurm.time=24:00:00", "slurm.times={export: 2:00:00, distill: 90}"])
    assert cfg.slurm.time == "24:00:00" and dict(cfg.slurm.times) == {"export": "2:00:00", "distill": "90"}
    (tmp_path / "c.yaml").write_text("slurm:\n  time: 24:00:00\n  times: {export: 1:30:00}\n")
    cfg = load_config(tmp_path / "c.yaml", ["slurm.times.evaluate=0:45:00"])
    assert cfg.slurm.time == "24:00:00" and dict(cfg.slurm.times) == {"export": "1:30:00", "evaluate": "0:45:00"}


@pytest.mark.parametrize(
    "override,message",
    [
        ("slurm.cpus_per_task=0", "config key 'slurm.cpus_per_task': must be >= 1, got 0"),
        ("slurm.job_name=''", "config key 'slurm.job_name': must not be empty (the jobs are named <job_name>-<stage>)"),
    ],
)
def test_slurm_counts_and_names(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert str(e.value) == message
