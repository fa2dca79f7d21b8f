"""The hybrid's balance options on a converted model: gamma's parametrisation (attention.gamma_param: exp lets the
window outweigh a weak LA) and the hybrid with its own sinks (attention.hybrid_sinks, docs/design.md §2): its no-LA
ablation is its window plus the same sinks, it differs from LoLCATs' hybrid only past the window, cached generation
equals the full forward, the setting survives save / load (an older hybrid_config.json without it loads as LoLCATs'),
and the evaluation report says which sinks each mode has. The attention math of every path is tested against the
spec with the HYBRID_SINKS mode of test_naive / test_chunked / test_recurrent / test_triton_kernels."""

import json

import pytest
import torch
from conftest import perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale.attention.layer import hybrid_layers
from hybrid_scale.evaluate import report
from hybrid_scale.evaluate.results import BeyondWindow
from hybrid_scale.models.convert import set_modes

W, S = 4, 3


def converted(hybrid_sinks: bool, **attention):
    model = tiny_model("llama")
    settings = {"window": W, "sinks": S, "hybrid_sinks": hybrid_sinks, **attention}
    return perturb_hybrid(hs.convert_model(model, settings))


def ids(T=20):
    return torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model, mode, x=None):
    set_modes(model, mode)
    return model(ids() if x is None else x).logits


def test_the_no_la_ablation_of_a_hybrid_with_sinks_is_its_window_plus_the_same_sinks():
    own = converted(True)
    assert torch.equal(logits(own, "swa_only"), logits(own, "swa_sinks"))
    lolcats = converted(False)  # LoLCATs' hybrid: its ablation is the window alone
    assert (logits(lolcats, "swa_only") - logits(lolcats, "swa_sinks")).abs().max() > 1e-3
    assert "hybrid_sinks=True" in repr(own) and "hybrid_sinks" not in repr(lolcats)


def test_the_sinks_change_the_hybrid_only_where_a_sink_has_left_the_window():
    lolcats, own = converted(False), converted(True)  # the same weights, phi and gamma
    a, b = logits(lolcats, "hybrid"), logits(own, "hybrid")
    torch.testing.assert_close(a[:, :W], b[:, :W], rtol=0, atol=1e-6)  # no key has left any window yet
    assert (a[:, W + 2 :] - b[:, W + 2 :]).abs().max() > 1e-3
    for mode in ("la_only", "sinks_only", "swa_sinks", "none"):  # the option is the hybrid's own
        assert torch.equal(logits(lolcats, mode), logits(own, mode)), mode


def test_cached_generation_with_sinks_equals_the_full_forward():
    model = converted(True)
    set_modes(model, "hybrid")
    x = ids(10)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding: the sinks are the first real tokens
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)  # fmt: skip
        full = model(out.sequences, attention_mask=torch.cat([mask, torch.ones(2, 12, dtype=mask.dtype)], 1)).logits
    for i, step in enumerate(out.logits):  # prefill, then 11 decode steps past the window and the sinks
        torch.testing.assert_close(step, full[:, x.shape[1] + i - 1], rtol=1e-4, atol=1e-5)


def test_gamma_exp_is_unbounded_and_sigmoid_is_lolcats():
    model = tiny_model("llama")
    hs.convert_model(model, {"window": W, "gamma_param": "exp", "gamma_init": 2.0})
    m = hybrid_layers(model)[0]
    torch.testing.assert_close(m.gamma, torch.full_like(m.gamma, 2.0))  # a window weight above 1 from the start
    torch.testing.assert_close(m.gamma, torch.exp(m.gamma_logit))
    with pytest.raises(
        ValueError, match=r"gamma_init': must be in \(0, 1\) with attention.gamma_param=sigmoid, got 2.0"
    ):
        hs.convert_model(tiny_model("llama"), {"window": W, "gamma_init": 2.0})
    lolcats = hybrid_layers(hs.convert_model(tiny_model("llama"), {"window": W, "gamma_init": 0.3}))[0]
    torch.testing.assert_close(lolcats.gamma, torch.sigmoid(lolcats.gamma_logit))
    torch.testing.assert_close(lolcats.gamma, torch.full_like(lolcats.gamma, 0.3))


def test_the_settings_are_saved_and_an_older_config_loads_as_lolcats(tmp_path):
    model = converted(True, gamma_param="exp", gamma_init=3.0)
    hs.save_converted(model, tmp_path / "own")
    loaded = hs.load_converted(tmp_path / "own")
    assert all(m.hybrid_sinks and m.gamma_param == "exp" for m in hybrid_layers(loaded).values())
    torch.testing.assert_close(logits(loaded, "hybrid"), logits(model, "hybrid"))
    path = tmp_path / "own" / "hybrid_config.json"
    config = json.loads(path.read_text())
    assert config["attention"]["hybrid_sinks"] is True and config["attention"]["gamma_param"] == "exp"
    for key in ("hybrid_sinks", "gamma_param"):  # as written before the options existed
        del config["attention"][key]
    config["attention"]["gamma_init"] = 0.1
    path.write_text(json.dumps(config))
    old = hybrid_layers(hs.load_converted(tmp_path / "own")).values()
    assert not any(m.hybrid_sinks for m in old) and {m.gamma_param for m in old} == {"sigmoid"}


@pytest.mark.parametrize("own", [True, False])
def test_the_report_says_which_sinks_each_mode_has(own):
    line = report.modes_line(16, 8, own, la_decay=False)
    if own:
        assert "hybrid: window 16 + the first 8 tokens" in line
        assert "swa_only (the hybrid without its LA): window 16 + the same 8 sinks (= swa_sinks)" in line
    else:
        assert "hybrid: window 16 (gamma-weighted), LA beyond it, no sinks" in line
        assert "swa_only (the hybrid without its LA): window 16 alone" in line
    b = {"tokens": 100, "window": 16, "perplexity": {"hybrid": 20.0, "swa_only": 30.0}, "margin": 0.01,
         "against": "swa_only", "swa_only": {"ratio": 0.67, "delta": 0.4, "lo": 0.3, "hi": 0.5}}  # fmt: skip
    b = BeyondWindow.from_json(b | b["swa_only"] | {"verdict": "LA used"})  # (as balance.beyond_window gives it)
    row = report.beyond_window_lines(b, 8 if own else None)[-1]
    assert row.startswith("- `swa_only`, its own window + 8 sinks: is the LA used?" if own else
                          "- `swa_only`, its own window alone: is the LA used?")  # fmt: skip
