"""Each attention setting is declared once (hybrid_scale/attention/settings.py: name, type, default, check, doc line),
and the config schema, the validator, the layer, the options of one call and hybrid_config.json read that record: a
new setting is one record and reaches all of them; an older hybrid_config.json without a key means what the record
says it means there."""

import json
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch
from conftest import perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.settings import SETTINGS, by_name
from hybrid_scale.config import AttentionConfig, ConfigError, attention_settings

TESTS = Path(__file__).resolve().parents[1]


def test_the_schema_the_options_and_the_layer_take_the_records_names_and_defaults():
    assert [(f.name, f.default) for f in fields(AttentionConfig)] == [(s.name, s.default) for s in SETTINGS]
    call = {f.name: f.default for f in fields(AttentionOptions) if f.name in by_name()}
    assert call.pop("window") is MISSING  # (every op is given its window)
    assert call == {s.name: s.default for s in SETTINGS if s.call and s.name != "window"}
    model = tiny_model()
    base = model.model.layers[0].self_attn
    with pytest.raises(TypeError, match=r"unknown settings \['windw'\]"):
        hs.HybridAttention(base, layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, windw=3)
    layer = hs.HybridAttention(base, layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)
    assert {s.name: layer.setting(s.name) for s in SETTINGS if s.layer and s.name != "feature_dim"} == {
        s.name: s.default for s in SETTINGS if s.layer and s.name != "feature_dim"
    }


def test_one_check_per_setting_in_the_config_the_layer_and_the_options():
    """gamma_init's bound depends on gamma_param: one check, the same words in the config and the layer."""
    with pytest.raises(ConfigError, match=r"^config key 'attention.gamma_init': must be in \(0, 1\) with attention"):
        attention_settings({"gamma_init": 1.5})
    assert attention_settings({"gamma_init": 1.5, "gamma_param": "exp"}).gamma_init == 1.5
    base = tiny_model().model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"^attention.gamma_init: must be in \(0, 1\) with attention"):
        hs.HybridAttention(base, layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, gamma_init=1.5)
    with pytest.raises(
        ValueError, match=r"^attention la_combine: 'sum' is not allowed; choose one of: normaliser, mix"
    ):
        AttentionOptions(window=4, la_combine="sum")
    with pytest.raises(ConfigError, match="'attention.la_conv': applies to attention.la_kind=gated_delta only"):
        attention_settings({"la_conv": 4})
    with pytest.raises(ConfigError, match="'attention.backend': 'triton' is not an implementation of the gated_delta"):
        attention_settings({"la_kind": "gated_delta", "backend": "triton"})


NEW_SETTING = """
import sys, json
sys.path.insert(0, {tests!r})
from hybrid_scale.attention import settings
settings.SETTINGS += (settings.Setting("dummy_taps", int, 3, "a key declared by a test", settings.at_least(1),
                                       live="dummy_taps"),)
import hybrid_scale as hs
from hybrid_scale.config import ConfigError, attention_settings, load_config
from hybrid_scale.config_reference import render
from conftest import tiny_model
cfg = attention_settings({{"dummy_taps": 5}})
try:
    attention_settings({{"dummy_taps": 0}})
except ConfigError as e:
    refused = str(e)
model = hs.convert_model(tiny_model(), {{"dummy_taps": 5, "window": 4}})
layer = hs.hybrid_layers(model)[0]
layer.dummy_taps = 6  # (a live setting: what is written is its current value)
hs.save_converted(model, {out!r})
written = json.load(open({out!r} + "/hybrid_config.json"))["attention"]
row = [line for line in render().splitlines() if "attention.dummy_taps" in line]
print(json.dumps([cfg.dummy_taps, refused, layer.settings["dummy_taps"], written["dummy_taps"], row]))
"""


def test_a_setting_declared_in_the_record_reaches_the_schema_the_validator_the_layer_and_hybrid_config(tmp_path):
    """A test's own setting, one Setting appended to the record before anything reads it (a process of its own): the
    config takes it (and its check refuses 0), the reference page lists it, the layer holds it, hybrid_config.json
    records its live value."""
    code = NEW_SETTING.format(tests=str(TESTS), out=str(tmp_path / "converted"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    taps, refused, held, written, row = json.loads(out.stdout.strip().splitlines()[-1])
    assert (taps, held, written) == (5, 5, 6)
    assert refused == "config key 'attention.dummy_taps': must be >= 1, got 0"
    assert row == ["| `attention.dummy_taps` | `int` | `3` | a key declared by a test |"]


@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta"])
def test_an_older_hybrid_config_json_means_what_the_record_says_of_its_missing_keys(kind, tmp_path):
    """A converted model whose hybrid_config.json predates the keys the record declares an older meaning for (written
    by hand here: those keys removed) loads with those meanings, and computes what it computed."""
    older = {s.name: s.older for s in SETTINGS if s.why}
    attention = {"window": 4, "sinks": 2, "la_kind": kind, "la_combine": "normaliser"}
    model = hs.convert_model(tiny_model(), attention)
    perturb_hybrid(model)
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    out = hs.save_converted(model, tmp_path / "c", base_path=None)
    meta = json.loads((out / "hybrid_config.json").read_text())
    dropped = [k for k in older if meta["attention"].get(k) == older[k]]  # (where the model has the older value)
    for k in dropped:
        del meta["attention"][k]
    (out / "hybrid_config.json").write_text(json.dumps(meta))
    assert {"la_combine", "hybrid_sinks", "la_decay"} <= set(dropped) and (kind != "hedgehog" or "la_kind" in dropped)
    again = hs.load_converted(out)
    layer = hs.hybrid_layers(again)[0]
    assert {k: layer.setting(k) if by_name()[k].live else None for k in dropped} == {
        k: older[k] if by_name()[k].live else None for k in dropped
    }
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
