"""Converted tiny Llama / Mistral / Qwen2 models: parity with the base, padding, decoding, save/load, errors."""

import pytest
import torch
from conftest import ARCHS, perturb_hybrid, tiny_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hybrid_scale as hs
from hybrid_scale.attention.hf.cache import HybridCache
from hybrid_scale.attention.layer import HybridAttention


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_swa_only_with_large_window_equals_base_model(arch):
    base = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = logits(base, ids)
    hs.convert_model(base, {"window": 64, "mode": "swa_only", "chunk_size": 16})
    perturb_hybrid(base)  # phi and gamma must not matter in swa_only
    torch.testing.assert_close(logits(base, ids), ref, rtol=1e-4, atol=1e-4)
    # and the hybrid with a short window really is different (LA in use beyond the window)
    with hs.components(base, "hybrid"):
        for m in base.modules():
            if isinstance(m, HybridAttention):
                m.window = 8
        assert (logits(base, ids)[:, 8:] - ref[:, 8:]).abs().max() > 1e-3
        torch.testing.assert_close(logits(base, ids)[:, :8], ref[:, :8], rtol=1e-4, atol=1e-4)


def test_conversion_reuses_projections_and_partial_layers():
    model = tiny_model("qwen2", num_hidden_layers=3)
    q_proj = model.model.layers[1].self_attn.q_proj
    hs.convert_model(model, {"window": 4, "layers": [1]})
    attn = model.model.layers[1].self_attn
    assert isinstance(attn, HybridAttention) and attn.q_proj is q_proj and attn.q_proj.bias is not None
    assert not isinstance(model.model.layers[0].self_attn, HybridAttention)
    assert attn.feature_map_q.weight.shape == (4, 16, 16) and attn.feature_map_k.weight.shape == (2, 16, 16)
    torch.testing.assert_close(attn.gamma, torch.full((4,), 0.1))
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.1.self_attn.q_proj.weight" in names  # PEFT can target q_proj/k_proj/v_proj/o_proj by name
    ids = torch.randint(3, 128, (1, 30))
    full = logits(model, ids)
    with torch.no_grad():
        out = model(ids[:, :20], use_cache=True)
        assert isinstance(out.cache, HybridCache)
        assert type(out.cache.layers[0]).__name__ == "DynamicLayer"
        step = model(ids[:, 20:], cache=out.cache, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 20:], rtol=1e-4, atol=1e-5)


def test_left_padded_batch_equals_sequences_alone():
    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 6, "sinks": 3}))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 128, (1, 25), generator=g), torch.randint(3, 128, (1, 17), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0
    for mode in ("hybrid", "la_only", "sinks_only", "swa_only"):
        with hs.components(model, mode):
            out = logits(model, batch, attention_mask=mask)
            torch.testing.assert_close(out[0], logits(model, a)[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out[1, 8:], logits(model, b)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["hybrid", "la_only", "sinks_only"])
def test_prefill_chunks_and_decode_equal_full_forward(mode):
    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 5, "sinks": 3, "chunk_size": 8}))
    hs.set_modes(model, mode)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padded row
    full = logits(model, ids, attention_mask=mask)
    cache, outs = None, []
    cuts = [0, 15, 18, 21, 24] + list(range(25, 41))  # prefill 15 (> chunk: chunked path), 3 x 3 tokens, singles
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:], strict=False):
            out = model(ids[:, a:b], attention_mask=mask[:, :b], cache=cache, use_cache=True)
            cache = out.cache
            outs.append(out.logits)
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, 4:], full[1, 4:], rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 40


def test_copied_cache_scores_two_continuations():
    model = perturb_hybrid(hs.convert_model(tiny_model("mistral"), {"window": 4}))
    g = torch.Generator().manual_seed(3)
    ctx, c1, c2 = (torch.randint(3, 128, (1, n), generator=g) for n in (12, 6, 9))
    with torch.no_grad():
        cache = model(ctx, use_cache=True).cache
        other = cache.copy()
        y1 = model(c1, cache=cache, use_cache=True).logits
        y2 = model(c2, cache=other, use_cache=True).logits
    torch.testing.assert_close(y1, logits(model, torch.cat([ctx, c1], 1))[:, 12:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y2, logits(model, torch.cat([ctx, c2], 1))[:, 12:], rtol=1e-4, atol=1e-5)


def test_generate_without_cache_and_beam_search():
    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 4, "sinks": 2}))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = model.generate(ids, return_dict_in_generate=True, **kw)
    assert isinstance(out.cache, HybridCache)
    assert torch.equal(out.sequences, model.generate(ids, use_cache=False, **kw))
    beams = model.generate(ids, num_beams=3, **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=3, use_cache=False, **kw))


def cache_formula(batch, layers, kv_heads, head_dim, feature_out, window, sinks, elem=4):
    """Its bytes: `window` the ring's slots (the window, or the generate's max_length below it)."""
    ring = kv_heads * window * (2 * head_dim + feature_out) * elem  # k, v and phi_k in the model's dtype
    sink = kv_heads * sinks * (2 * head_dim + feature_out) * elem  # k, v and phi_k of the first S keys
    state = kv_heads * (feature_out * head_dim + feature_out) * 4  # fp32 LA state
    # + one int64 count per row, one int64 position count, and int32 step counts per (row, KV head) and per row
    return layers * (batch * (ring + sink + state + 8) + 8 + batch * (kv_heads + 1) * 4)


def test_decode_cache_bytes_do_not_grow():
    model = hs.convert_model(tiny_model("llama"), {"window": 16, "sinks": 4})
    ids = torch.randint(3, 128, (2, 5))
    for new in (10, 200):  # (a generate shorter than the window keeps rings of its own length: 15 slots, then 16)
        expect = cache_formula(batch=2, layers=2, kv_heads=2, head_dim=16, feature_out=32, window=min(16, 5 + new),
                               sinks=4)  # fmt: skip
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 5 + new
        assert out.cache.nbytes == expect


def test_save_and_load_converted_gives_identical_logits(tmp_path):
    model = perturb_hybrid(hs.convert_model(tiny_model("qwen2"), {"window": 6, "feature_map": "exp", "layers": [0]}))
    hs.set_modes(model, {0: "la_only"})
    hs.save_converted(model, tmp_path / "conv")
    assert sorted(p.name for p in (tmp_path / "conv").iterdir()) == [
        "config.json",
        "generation_config.json",
        "hybrid_config.json",
        "hybrid_params.safetensors",
        "model.safetensors",
    ]
    loaded = hs.load_converted(tmp_path / "conv", dtype=torch.float32)
    assert hs.get_modes(loaded) == {0: "la_only"}
    ids = torch.randint(3, 128, (2, 30))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    # a converted model that points at its base directory instead of copying it
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    conv = perturb_hybrid(
        hs.convert_model(
            AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
            {"window": 3},
        )
    )
    hs.save_converted(conv, tmp_path / "conv2")
    assert not (tmp_path / "conv2" / "model.safetensors").exists()
    assert torch.equal(logits(hs.load_converted(tmp_path / "conv2"), ids), logits(conv, ids))


def test_clear_errors(tmp_path):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(hs.UnsupportedArchitectureError) as e:
        hs.convert_model(gpt2, {})
    assert str(e.value) == (
        "hybrid_scale cannot convert GPT2LMHeadModel: supported architectures are "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GraniteForCausalLM"
    )
    with pytest.raises(hs.ConfigError, match="config key 'attention.feature_map': 'cos' is not allowed"):
        hs.convert_model(tiny_model(), {"feature_map": "cos"})
    with pytest.raises(ValueError, match="names layer 5 but the model has 2"):
        hs.convert_model(tiny_model(), {"layers": [5]})
    with pytest.raises(ValueError, match="is not a converted model: hybrid_config.json is missing"):
        hs.load_converted(tmp_path)
    model = hs.convert_model(tiny_model(), {})
    with pytest.raises(ValueError, match="already converted"):
        hs.convert_model(model, {})
    with pytest.raises(ValueError, match="unknown attention mode 'both'"):
        hs.set_modes(model, "both")
    with pytest.raises(TypeError, match="needs a hybrid_scale HybridCache"):
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
        model(torch.ones(1, 2, dtype=torch.long), cache=cache)


def test_components_restores_modes():
    model = hs.convert_model(tiny_model(), {"mode": "hybrid"})
    hs.set_modes(model, ["la_only", "hybrid"])
    ids = torch.tensor([[5, 9, 17, 33]])
    with hs.components(model, "none"):
        assert hs.get_modes(model) == {0: "none", 1: "none"}
        alone = torch.cat([logits(model, ids[:, n : n + 1]) for n in range(4)], 1)
        torch.testing.assert_close(logits(model, ids), alone, rtol=0, atol=1e-6)  # no attention: no context
    assert hs.get_modes(model) == {0: "la_only", 1: "hybrid"}
    assert (logits(model, ids)[:, 1:] - alone[:, 1:]).abs().amax(-1).min() > 1e-3  # attention back: context matters


def test_training_builds_no_cache_and_gradient_checkpointing_matches():
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(6))
    grads = []
    for checkpointing in (False, True):
        model = perturb_hybrid(
            hs.convert_model(tiny_model("llama"), hs.load_config(overrides=["attention.window=5"]).attention)
        )
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = model(ids, labels=ids)
        assert out.cache is None
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "feature_map" in n or "q_proj" in n})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 10  # 2 layers x (q_proj, phi_q w/b, phi_k w/b)
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)
