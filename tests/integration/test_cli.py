import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_model

import hybrid_scale as hs
from hybrid_scale.cli import main


def test_config_prints_resolved_values_and_rejects_bad_keys(capsys):
    assert main(["config", "attention.window=32"]) == 0
    assert "window: 32" in capsys.readouterr().out
    assert main(["config", "attention.windo=32"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "hybrid-scale config: error: config key 'attention.windo' is not known; allowed here: "
        "window, feature_map, feature_dim, gamma_init, gamma_param, sinks, hybrid_sinks, la_decay, la_decay_horizon, "
        "la_decay_max_horizon, la_kind, la_combine, la_conv, la_delta_horizon, la_qk_map, mode, cache, cache_select, "
        "cache_heads, cache_train, layers, chunk_size, backend"
    )


def test_convert_writes_a_loadable_converted_model(tmp_path, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "base")
    code = main(["convert", f"model.path={tmp_path / 'base'}", f"run_dir={tmp_path / 'run'}", "attention.window=4"])
    assert code == 0, capsys.readouterr().err
    model = hs.load_converted(tmp_path / "run" / "converted", dtype=torch.float32)
    assert [m.window for m in model.modules() if isinstance(m, hs.HybridAttention)] == [4, 4]
    assert main(["convert", f"run_dir={tmp_path}"]) == 2
    assert "config key 'model.path' is not set" in capsys.readouterr().err


def test_console_script_entry_point():
    script = Path(sys.executable).parent / "hybrid-scale"  # installed by `pip install -e .` (make install)
    out = subprocess.run([str(script), "config", "seed=7"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "seed: 7" in out.stdout


def test_deepspeed_launcher_local_rank_argument_is_accepted(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "unset")  # recorded, so that teardown removes what main() sets
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["config", "--local_rank=1", "seed=3"]) == 0
    assert "seed: 3" in capsys.readouterr().out
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["config", "seed=4", "--local-rank", "0"]) == 0 and os.environ["LOCAL_RANK"] == "0"


def test_stage_help_lists_the_config_keys_it_reads():
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_scale", "distill", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    assert "distill: recipe, objectives, train_feature_maps" in out.stdout and "data: source, text_field" in out.stdout
