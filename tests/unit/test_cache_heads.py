"""attention.cache_heads=retrieval (issue 66): a layer's cache slots shared out over its KV heads by their retrieval.
The budgets sum to cache x Hkv with their floor and follow the mass; a per-head budget reaches the prefill (equal to
the spec, and head by head to the uniform cache of that head's size) and the decode state (equal to the prefill);
tensor parallelism keeps its heads' slice; the calibration's mass is the full causal softmax's from the answer to the
needle; the evaluation's cached cells run with the calibrated budgets."""

from __future__ import annotations

import pytest
import torch
from conftest import perturb_hybrid, tiny_model
from test_cache import KINDS, B, H, K, S, W, call, inputs, padded
from test_cache_decode import decode, decode_equals_forward, forward, padded_mask
from test_cache_decode import inputs as decode_inputs
from test_cache_decode import setup as decode_setup

import hybrid_scale as hs
from hybrid_scale.attention.cache import recurrent as cache_decode
from hybrid_scale.attention.layer import hybrid_layers
from hybrid_scale.attention.settings import CACHE_SELECTS
from hybrid_scale.data import passkey
from hybrid_scale.models import cache_heads
from hybrid_scale.models.convert import set_cache

G = H // K


# ------------------------------------------------------------------------------------------------ the budgets


@pytest.mark.parametrize("cache", [1, 4, 7, 32])
def test_budgets_sum_to_the_layers_slots_with_their_floor_and_follow_the_mass(cache):
    g = torch.Generator().manual_seed(cache)
    for heads in (1, 3, 5):
        mass = torch.rand(heads, generator=g, dtype=torch.float64) ** 3
        b = cache_heads.share(mass, cache)
        assert b.dtype == torch.long and int(b.sum()) == cache * heads
        assert int(b.min()) >= max(1, cache // 4)
        order = mass.argsort()
        assert bool((b[order].diff() >= 0).all()), (mass, b)  # more mass, no fewer slots
    b = cache_heads.share(torch.tensor([0.0, 0.0, 1.0, 0.0]), 32)  # one head retrieves: it takes all but the floors
    assert b.tolist() == [8, 8, 104, 8]
    assert cache_heads.share(torch.zeros(3), 5).tolist() in ([5, 5, 5],)  # no mass: uniform
    assert cache_heads.share(torch.ones(3), 0).tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------------------------ the prefill


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("select", CACHE_SELECTS)
def test_a_per_head_budget_prefill_is_the_spec_and_each_heads_uniform_cache(kind, select):
    """cache_budget (0, 8) (4 on average): the blocked prefill equals the spec (selection token by token with the
    [Hkv] budget) padded or not, and each KV head's query heads get what the uniform cache of that head's size gives
    them (a budget ignored, or the average used, fails)."""
    x, gates = inputs(kind)
    for mask in (None, padded()):
        kw = dict(cache=4, cache_budget=(0, 8), cache_select=select, attention_mask=mask)
        got = call(kind, x, gates, "chunk", **kw)
        torch.testing.assert_close(got, call(kind, x, gates, "naive", **kw), rtol=1e-9, atol=1e-11)
        none = call(kind, x, gates, "chunk", cache=0, cache_select=select, attention_mask=mask)
        eight = call(kind, x, gates, "chunk", cache=8, cache_select=select, attention_mask=mask)
        torch.testing.assert_close(got[:, :G], none[:, :G], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got[:, G:], eight[:, G:], rtol=1e-9, atol=1e-11)
        uniform = call(kind, x, gates, "chunk", cache=4, cache_select=select, attention_mask=mask)
        assert float((got - uniform).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------ the decode


@pytest.mark.parametrize("mode", ["hybrid", "cache_only"])
@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta"])
def test_decode_with_a_per_head_budget_equals_the_prefill(kind, select, mode):
    """A prompt then one token at a time with cache_budget (1, 5) equals the whole-sequence forward with it; the
    state holds 5 slots per KV head and fills 1 and 5."""
    from dataclasses import replace

    T = 40
    x, gamma, rho = decode_inputs(kind, T)
    part, side, o, _ = decode_setup(kind, mode, select)
    o = replace(o, cache_budget=(1, 5))
    state = _state(kind, o, (1, 5), select)
    mask = padded_mask(T)
    want = forward(part, x, gamma, o, mask, rho)
    got = decode(part, side, o, state, x, gamma, rho, mask, 17)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert state.cache_k.shape[2] == 5 and (state.cache_pos >= 0).sum(-1).tolist() == [[1, 5], [1, 5]]
    uniform = forward(part, x, gamma, replace(o, cache_budget=None), mask, rho)
    assert float((want - uniform).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="a live cache cannot change them"):  # another budget on this state
        cache_decode.step(state, _one(x), gamma, replace(o, cache_budget=(5, 1)), side=side)


def _state(kind, o, budget, select):
    """An empty decode state as test_cache_decode.setup builds it, with a cache of `budget` per KV head."""
    from test_cache_decode import DT, D

    from hybrid_scale.attention.shape import Shape
    from hybrid_scale.attention.window.recurrent import DecodeState

    hedgehog = kind == "hedgehog"
    shape = Shape(H, K, D, D, 6 if hedgehog else D, W, S, DT, o.hybrid_sinks, hedgehog,
                  "hedgehog" if hedgehog else "gated_delta", 0)  # fmt: skip
    return DecodeState.empty(shape, B, W, "cpu", cache=(budget, select))


def _one(x):
    from test_cache_decode import cut

    return cut(x, 0, 1)


def _model(kind="hedgehog", **extra):
    attention = {"window": 6, "sinks": 3, "hybrid_sinks": True, "chunk_size": 8, "backend": "torch"} | extra
    if kind == "gated_delta":
        attention |= {"la_kind": "gated_delta", "la_combine": "mix", "la_conv": 3}
    return perturb_hybrid(hs.convert_model(tiny_model(), attention))


@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta"])
def test_a_converted_model_with_budgets_decodes_its_forward(kind):
    """set_cache with {layer: budget}: the layers hold it, HybridCache allocates each layer's state with it, and a
    prompt then single tokens give the full forward's logits (a left-padded row included)."""
    model = _model(kind)
    budgets = {0: torch.tensor([1, 7]), 1: [6, 2]}
    set_cache(model, 4, "attention", budgets)
    layers = hybrid_layers(model)
    assert layers[0].cache_budget.tolist() == [1, 7] and layers[1].options().cache_budget == (6, 2)
    ids, mask, full, cache, _ = decode_equals_forward(model)
    set_cache(model, 4, "attention")
    with torch.no_grad():
        uniform = model(ids, attention_mask=mask, use_cache=False).logits
    assert [cache.layers[i].state.cache_sizes for i in (0, 1)] == [(1, 7), (6, 2)]
    assert float((full - uniform).abs().max()) > 1e-4  # (the budgets change the model)
    assert layers[0].cache_budget is None  # set_cache without budgets: uniform again
    with pytest.raises(ValueError, match="shares out keys x KV heads"):
        set_cache(model, 4, budgets={0: [1, 6]})  # 7 slots, not 8


def test_narrow_heads_keeps_its_heads_slice_of_the_budget():
    """Tensor parallelism: a layer narrowed to its second KV head keeps that head's budget, in its options too, and
    set_cache on a narrowed layer takes the whole layer's budget and keeps the slice."""
    model = _model()
    set_cache(model, 4, "attention", {0: [1, 7], 1: [3, 5]})
    layer = hybrid_layers(model)[0]
    layer.narrow_heads(G, 2 * G)
    assert layer.cache_budget.tolist() == [7] and layer.options().cache_budget == (7,)
    set_cache(model, 4, "attention", {0: [2, 6]})
    assert layer.cache_budget.tolist() == [6]
    other = hybrid_layers(model)[1]
    other.narrow_heads(0, G)
    set_cache(model, 4, "attention", {0: [2, 6], 1: [3, 5]})
    assert other.cache_budget.tolist() == [3] and layer.cache_budget.tolist() == [6]


# ------------------------------------------------------------------------------------------------ the calibration


def _retrieving():
    """The tiny Qwen2 (q/k biases) with a retrieval head planted in its last layer: the second KV head's keys are the
    hidden state's projection on the digits' mean embedding and its query heads' queries a constant, both on the
    slowest RoPE pair (RoPE hardly turns it over 130 tokens), so those heads attend to the digits: the needle's key
    (the filler has none) and the answer's digits so far."""
    model = tiny_model("qwen2")
    attn = model.model.layers[1].self_attn
    d = attn.head_dim
    slow = d // 2 - 1
    digits = torch.tensor([_Tok().encode(c)[0] for c in "0123456789"])
    with torch.no_grad():
        u = model.model.embed_tokens.weight[digits].mean(0)
        attn.q_proj.weight[G * d :] = 0
        attn.q_proj.bias[G * d :] = 0
        for h in range(G, 2 * G):
            attn.q_proj.bias[h * d + slow] = 30.0
        attn.k_proj.weight[d : 2 * d] = 0
        attn.k_proj.bias[d : 2 * d] = 0
        attn.k_proj.weight[d + slow] = 4.0 * u / u.norm()
    return model


class _Tok:
    """A tokenizer of the tiny model's vocabulary (128): one token per character."""

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) % 120) for c in text]


def test_the_calibration_measures_the_softmax_mass_from_the_answer_to_the_needle():
    """Only the last layer converted: its inputs are the base model's, so the mass retrieval_mass measures per KV head
    is the base model's own attention probabilities (eager, output_attentions) from the answer rows to the needle,
    averaged over the group's query heads and the rows, summed over the prompts; and the budgets give more slots to
    the head with more mass."""
    base = _retrieving()
    base.config._attn_implementation = "eager"
    tok = _Tok()
    filler = tok.encode("the quick brown fox jumps over the lazy dog; " * 20)
    lead, distances, trials, seed = 32, [40, 60], 3, 7
    items = passkey.probes(tok, filler, distances, trials, seed + cache_heads.SEED_OFFSET, lead)
    spans = cache_heads.needle_spans(tok, items, lead)
    want = torch.zeros(K, dtype=torch.float64)
    with torch.no_grad():
        for p, (s0, s1, r0, r1) in zip(items, spans, strict=True):
            att = base(torch.tensor([p.ids]), output_attentions=True).attentions[1][0].double()  # [H, T, T]
            want += att[:, r0:r1, s0:s1].sum(-1).mean(-1).view(K, G).mean(-1)
    assert float(want[1]) > 2 * float(want[0]), want  # (the planted head retrieves)
    model = hs.convert_model(_retrieving(), {"window": 6, "sinks": 3, "layers": [1], "backend": "torch"})
    prompts = cache_heads.Prompts(distances, trials, lead, seed)
    mass = cache_heads.retrieval_mass(model, tok, filler, prompts)
    assert list(mass) == [1]
    torch.testing.assert_close(mass[1], want, rtol=1e-4, atol=1e-6)
    budgets = cache_heads.retrieval_budgets(model, tok, filler, 16, prompts)
    b = budgets[1]
    assert int(b.sum()) == 16 * K and int(b[1]) > int(b[0]) >= 4
    layer = hybrid_layers(model)[1]
    assert layer.cache_keys == 0 and layer.cache_budget is None and layer.mode == "hybrid"  # (left as it was)
