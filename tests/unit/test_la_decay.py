"""The LA's decay (naive.py, attention.la_decay): alpha_h^(distance past the window) per KV head. The spec against
scalar loops over the formula; at rho = 0 the spec is the formula without it bit for bit and every fast path equal
within rounding; the chunked path and every decode split equal the spec in outputs and gradients (rho's included)
with padding and GQA; the sinks are never decayed; a converted model saves, loads, splits its heads and decodes with
it; the Triton kernels take it too (test_triton_kernels.py)."""

import json
import math

import pytest
import torch
from conftest import attention_inputs, perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale.attention.hedgehog import chunk as chunked
from hybrid_scale.attention.hedgehog import naive, recurrent
from hybrid_scale.attention.hedgehog.chunk import chunk_hybrid_attention
from hybrid_scale.attention.layer import Projections, hybrid_layers
from hybrid_scale.attention.shape import Shape
from hybrid_scale.errors import ConfigError
from hybrid_scale.models.convert import set_modes

W, S = 5, 3
RHO = torch.tensor([0.07, 0.3], dtype=torch.float64)  # per KV head
MODES = [("hybrid", False), ("hybrid", True), ("la_only", False)]  # the modes whose LA the decay changes


def loop_query(x, b, h, kh, n, real, mode, own_sinks, rho):
    """y for query n (real index) of row b, head h: scalar loops over docs/design.md §2's formula with the decay."""
    q, k, v, fq, fk, gamma = (x[name] for name in ("q", "k", "v", "fq", "fk", "gamma"))
    D, pn = q.shape[-1], real[n]
    score = lambda pj: sum(float(q[b, h, pn, d]) * float(k[b, kh, pj, d]) for d in range(D)) / math.sqrt(D)  # noqa: E731
    lin = lambda pj: sum(float(fq[b, h, pn, f]) * float(fk[b, kh, pj, f]) for f in range(fq.shape[-1]))  # noqa: E731
    alpha = math.exp(-float(rho[kh]))
    keys = list(enumerate(real[: n + 1]))
    soft, linear = [], []
    if mode == "hybrid":
        soft = [pj for j, pj in keys if n - W < j or (own_sinks and j < S)]
        linear = [(j, pj) for j, pj in keys if j <= n - W and not (own_sinks and j < S)]
    else:  # la_only: every key, those inside the window at weight 1
        linear = keys
    terms = []
    if soft:
        c = max(score(pj) for pj in soft)
        terms += [(float(gamma[h]) * math.exp(score(pj) - c), pj) for pj in soft]  # never decayed
    terms += [(alpha ** max(0, n - W - j) * lin(pj), pj) for j, pj in linear]
    den = sum(t for t, _ in terms)
    return [sum(t * float(v[b, kh, pj, d]) for t, pj in terms) / (den + naive.EPS) for d in range(D)]


def inputs(T=23, seed=0):
    x = attention_inputs(B=2, H=4, Hkv=2, T=T, D=4, F=3, seed=seed)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 9] = 0  # a hole
    return x, mask


@pytest.mark.parametrize("mode,own", MODES)
def test_the_spec_equals_loops_over_the_formula(mode, own):
    x, mask = inputs()
    y = naive.naive_hybrid_attention(**x, window=W, mode=mode, sinks=S, hybrid_sinks=own, attention_mask=mask,
                                     la_decay=RHO)  # fmt: skip
    for b in range(2):
        real = [t for t in range(mask.shape[1]) if mask[b, t]]
        for h in range(4):
            for n, pn in enumerate(real):
                want = loop_query(x, b, h, h // 2, n, real, mode, own, RHO)
                torch.testing.assert_close(y[b, h, pn], torch.tensor(want, dtype=y.dtype), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode,own", [*MODES, ("swa_only", False), ("swa_sinks", False)])
def test_zero_terms_are_the_formula_without_them(mode, own):
    """rho = 0: the spec bit for bit, the chunked path and the decode within rounding."""
    x, mask = inputs(T=40)
    kw = dict(window=W, mode=mode, sinks=S, hybrid_sinks=own, attention_mask=mask)
    zero = {"la_decay": torch.zeros(2, dtype=torch.float64)}
    plain = naive.naive_hybrid_attention(**x, **kw)
    assert torch.equal(naive.naive_hybrid_attention(**x, **kw, **zero), plain)
    torch.testing.assert_close(chunk_hybrid_attention(**x, **kw, **zero, chunk_size=8), plain, rtol=1e-12, atol=1e-13)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=4, value_dim=4, features=3, window=W, sinks=S, dtype=torch.float64), 2, W, "cpu"
    )
    step = [recurrent.extend(state, *(x[n][:, :, t : t + 1] for n in ("q", "k", "v", "fq", "fk")), x["gamma"],
                             **{**kw, "attention_mask": mask[:, t : t + 1]}, **zero) for t in range(40)]  # fmt: skip
    torch.testing.assert_close(torch.cat(step, 2), plain, rtol=1e-12, atol=1e-13)


def test_the_decay_changes_the_output_only_past_the_window():
    x, _ = inputs(T=30)
    plain = naive.naive_hybrid_attention(**x, window=W, sinks=S)
    y = naive.naive_hybrid_attention(**x, window=W, sinks=S, la_decay=RHO)
    assert torch.equal(y[:, :, :W], plain[:, :, :W])  # no key has left a window yet
    assert torch.equal(y[:, :, W], plain[:, :, W])  # the first key past the window counts alpha^0 = 1
    assert (y[:, :, W + 2 :] - plain[:, :, W + 2 :]).abs().max() > 1e-3


def grads(fn, x, extra, **kw):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in {**x, **extra}.items()}
    y = fn(**{n: leaves[n] for n in x}, **{n: leaves[n] for n in extra}, **kw)
    y.square().sum().backward()
    return y, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("chunk,group", [(4, 16), (4, 3), (16, 16)])
@pytest.mark.parametrize("mode,own", MODES)
def test_chunked_equals_the_spec_in_outputs_and_gradients(mode, own, chunk, group, monkeypatch):
    """(group: chunks per group of the decayed state scan; 3 makes 37 tokens in chunks of 4 carry across groups)"""
    monkeypatch.setattr(chunked, "SCAN_GROUP", group)
    x, mask = inputs(T=37, seed=1)
    kw = dict(window=W, mode=mode, sinks=S, hybrid_sinks=own, attention_mask=mask)
    y0, g0 = grads(naive.naive_hybrid_attention, x, {"la_decay": RHO}, **kw)
    y1, g1 = grads(chunk_hybrid_attention, x, {"la_decay": RHO}, **kw, chunk_size=chunk)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-11, msg=name)
    assert g0["la_decay"].abs().min() > 0  # rho learns in every KV head


def test_an_initial_state_equals_the_keys_it_holds():
    """Rows a0.. with the keys before them folded into an initial state, each key weighted as query w-1 of the rows
    sees it: stage 1's units (objectives.unit_attention) and the decode's long extensions."""
    x, _ = inputs(T=40, seed=2)
    a0 = 17
    full = naive.naive_hybrid_attention(**x, window=W, sinks=S, la_decay=RHO)
    fk0, v0 = x["fk"][:, :, :a0], x["v"][:, :, :a0]
    fk0 = fk0 * naive.decay_weight(RHO.view(-1, 1), a0 + W - 1 - W - torch.arange(a0))[None, :, :, None]
    state = (fk0.transpose(-1, -2) @ v0, fk0.sum(2))
    rest = {n: (t if n == "gamma" else t[:, :, a0:]) for n, t in x.items()}
    for fn in (chunk_hybrid_attention, hs.attention.backends.get_backend("naive")):
        y = fn(**rest, window=W, mode="hybrid", sinks=S, initial_state=state, chunk_size=8, attention_mask=None,
               la_decay=RHO)  # fmt: skip
        torch.testing.assert_close(y[:, :, W - 1 :], full[:, :, a0 + W - 1 :], rtol=1e-10, atol=1e-12)


CUTS = [[0, 40], [0, 3, 30, 31, 32, 40], [0, 12, *range(13, 41)], [0, 9, 35, 40]]


@pytest.mark.parametrize("cuts", range(len(CUTS)))
@pytest.mark.parametrize("mode,own", MODES)
def test_prefill_extend_and_decode_equal_the_spec(mode, own, cuts):
    x, mask = inputs(T=40, seed=3)
    kw = dict(window=W, mode=mode, sinks=S, hybrid_sinks=own, la_decay=RHO)
    ref = naive.naive_hybrid_attention(**x, **kw, attention_mask=mask)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=4, value_dim=4, features=3, window=W, sinks=S, dtype=torch.float64), 2, W, "cpu"
    )
    c = CUTS[cuts]
    outs = []
    for a, b in zip(c, c[1:], strict=False):
        new = (x[n][:, :, a:b] for n in ("q", "k", "v", "fq", "fk"))
        outs.append(recurrent.extend(state, *new, x["gamma"], **kw, attention_mask=mask[:, a:b], chunk_size=4))
    y = torch.where(mask[:, None, :, None].bool(), torch.cat(outs, 2), 0.0)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    assert state.kv.shape == (2, 2, 3, 4)  # one state per KV head whatever the length: the decay is one multiply


def converted(**attention):
    model = tiny_model("llama")
    return perturb_hybrid(hs.convert_model(model, {"window": W, "sinks": S, "hybrid_sinks": True, **attention}))


def test_a_converted_model_has_rho_per_kv_head_kept_non_negative():
    model = converted(la_decay=True)
    m = hybrid_layers(model)[0]
    assert m.la_decay_rho.shape == (2,) and "la_decay=True" in repr(m)
    with torch.no_grad():
        m.la_decay_rho.copy_(torch.tensor([-1.0, 0.2]))
    assert m.la_decay.tolist() == pytest.approx([0.0, 0.2])
    rho = m.la_decay_rho  # straight through: a parameter past its bound still gets the gradient
    (m.la_decay * torch.tensor([1.0, 2.0])).sum().backward()
    assert rho.grad.tolist() == [1.0, 2.0]
    plain = hybrid_layers(converted())[0]
    assert not hasattr(plain, "la_decay_rho") and plain.la_decay is None


def test_at_initialisation_a_converted_model_is_todays_hybrid():
    x = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    plain = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "hybrid_sinks": True})
    decay = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "hybrid_sinks": True, "la_decay": True})
    with torch.no_grad():
        torch.testing.assert_close(decay(x).logits, plain(x).logits, rtol=1e-6, atol=1e-6)


def test_a_horizon_starts_every_kv_head_at_rho_one_over_it_and_needs_the_decay():
    x = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    model = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "la_decay": True, "la_decay_horizon": 8})
    assert all(m.la_decay.tolist() == pytest.approx([1 / 8, 1 / 8]) for m in hybrid_layers(model).values())
    assert model.hybrid_settings["la_decay_horizon"] == 8
    plain = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "la_decay": True})
    with torch.no_grad():  # the decay acts from the start: past the window the output is not the undecayed one
        assert not torch.allclose(model(x).logits[:, W + 2 :], plain(x).logits[:, W + 2 :], atol=1e-4)
    with pytest.raises(ConfigError, match="attention.la_decay_horizon.*la_decay is false"):
        hs.convert_model(tiny_model("llama"), {"window": W, "la_decay_horizon": 8})
    with pytest.raises(ConfigError, match="attention.la_decay_horizon': must be >= 0"):
        hs.convert_model(tiny_model("llama"), {"window": W, "la_decay": True, "la_decay_horizon": -1})


def test_a_max_horizon_keeps_every_kv_heads_decay_at_least_its_inverse_and_needs_the_decay(tmp_path):
    """attention.la_decay_max_horizon: the forward's rho is at least 1/H (a head trained towards no decay keeps one),
    with the identity's gradient (the parameter below the floor still learns); recorded, saved and loaded with the
    model; without it, the same model is today's (rho >= 0)."""
    x = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    settings = {"window": W, "sinks": S, "la_decay": True}
    model = hs.convert_model(tiny_model("llama"), {**settings, "la_decay_max_horizon": 8})
    plain = hs.convert_model(tiny_model("llama"), settings)
    m = hybrid_layers(model)[0]
    with torch.no_grad():
        m.la_decay_rho.copy_(torch.tensor([0.0, 0.5]))
        hybrid_layers(plain)[0].la_decay_rho.copy_(torch.tensor([0.0, 0.5]))
    assert m.la_decay.tolist() == pytest.approx([1 / 8, 0.5])  # the floor, and a faster decay as it is
    assert hybrid_layers(plain)[0].la_decay.tolist() == pytest.approx([0.0, 0.5])
    (grad,) = torch.autograd.grad(m.la_decay.sum(), m.la_decay_rho)
    assert grad.tolist() == [1.0, 1.0]  # straight through: the head at the floor still learns
    with torch.no_grad():
        assert not torch.allclose(model(x).logits[:, W + 2 :], plain(x).logits[:, W + 2 :], atol=1e-4)
    assert model.hybrid_settings["la_decay_max_horizon"] == 8 and "la_decay_floor=0.125" in repr(m)
    hs.save_converted(model, tmp_path / "m")
    again = hs.load_converted(tmp_path / "m", dtype=torch.float32)
    assert hybrid_layers(again)[0].la_decay.tolist() == pytest.approx([1 / 8, 0.5])
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, model(x).logits)
    with pytest.raises(ConfigError, match="attention.la_decay_max_horizon.*la_decay is false"):
        hs.convert_model(tiny_model("llama"), {"window": W, "la_decay_max_horizon": 8})
    with pytest.raises(ConfigError, match="attention.la_decay_max_horizon': must be >= 0"):
        hs.convert_model(tiny_model("llama"), {**settings, "la_decay_max_horizon": -1})


def test_save_load_generate_and_split_heads(tmp_path):
    model = converted(la_decay=True)
    set_modes(model, "hybrid")
    x = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    with torch.no_grad():
        for m in hybrid_layers(model).values():
            m.la_decay_rho.zero_()
        undecayed = model(x, attention_mask=mask).logits
        for m in hybrid_layers(model).values():
            m.la_decay_rho.copy_(torch.tensor([0.1, 0.4]))
        full = model(x, attention_mask=mask).logits
    assert torch.equal(full[0, : W + 1], undecayed[0, : W + 1])  # the decay acts only past the window
    assert (full[0, W + 2 :] - undecayed[0, W + 2 :]).abs().max() > 1e-4
    with torch.no_grad():  # without a cache (training, stage 1, the LA-share diagnostic): the same function
        torch.testing.assert_close(model(x, attention_mask=mask, use_cache=False).logits, full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        out = model(x[:, :10], attention_mask=mask[:, :10], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(10, 24):
            out = model(x[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-4, atol=1e-4)
    hs.save_converted(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "hybrid_config.json").read_text())["attention"]["la_decay"] is True
    loaded = hs.load_converted(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, attention_mask=mask).logits, full, rtol=1e-5, atol=1e-5)
    m = hybrid_layers(model)[1]
    rho = m.la_decay_rho.detach().clone()
    m.narrow_heads(2, 4)  # the second KV head and its two query heads
    assert torch.equal(m.la_decay_rho, rho[1:])


def test_the_fused_kernels_pass_their_self_check_with_a_decay():
    """The self-check runs the decayed shape (forward, backward incl. rho's gradient, 20 decode steps) against the
    torch path: the kernels pass it (in Triton's interpreter on CPU, as in the tests), so attention.backend=auto
    takes them on CUDA for a decayed model."""
    pytest.importorskip("hybrid_scale_kernels")
    from hybrid_scale.attention import backends

    shape = backends.Shape(dtype=torch.float32, la_decay=True)
    assert backends.self_check("triton", "cpu", dtype=torch.float32, shape=shape) is None
    assert "LA decay" in str(shape)


@pytest.mark.parametrize("own", [False, True])
def test_stage_1_units_with_a_decay_equal_the_whole_rows(own):
    """objectives.unit_attention: rows a..b-1 of a decayed layer, attended from a0 = a - w + 1 with the keys before
    a0 folded into a decayed initial state (or, with the hybrid's sinks, from row 0), equal those rows of the whole
    sequence; and rho's gradient through the units equals the whole's."""
    from hybrid_scale.distill.objectives import unit_attention

    model = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "hybrid_sinks": own, "la_decay": True})
    m = hybrid_layers(model)[0]
    with torch.no_grad():
        m.la_decay_rho.copy_(torch.tensor([0.05, 0.3]))
    x = attention_inputs(B=2, H=4, Hkv=2, T=40, D=16, F=32, dtype=torch.float32, seed=4)
    q, k, v, fq, fk = (x[n] for n in ("q", "k", "v", "fq", "fk"))
    whole = m.attend(q, k, v, fq, fk, mode="hybrid")
    (g_whole,) = torch.autograd.grad(whole[:, :, 17:33].square().sum(), m.la_decay_rho)
    units = [unit_attention(m, Projections(q, k, v, fq, fk), a, b, "hybrid") for a, b in ((17, 25), (25, 33))]
    torch.testing.assert_close(torch.cat(units, 2), whole[:, :, 17:33], rtol=1e-5, atol=1e-6)
    (g_units,) = torch.autograd.grad(sum(u.square().sum() for u in units), m.la_decay_rho)
    torch.testing.assert_close(g_units, g_whole, rtol=1e-4, atol=1e-6)


def test_the_balance_report_shows_the_learned_horizon_per_layer_and_kv_head():
    from hybrid_scale.evaluate import balance, report
    from hybrid_scale.evaluate.results import LaShare

    model = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S, "hybrid_sinks": True, "la_decay": True})
    with torch.no_grad():
        hybrid_layers(model)[0].la_decay_rho.copy_(torch.tensor([0.0, 0.05]))
        hybrid_layers(model)[1].la_decay_rho.copy_(torch.tensor([0.5, -0.2]))  # (clamped: no decay)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    share = balance.la_share(model, ids, [0, 8, 40])
    assert share["horizon"] == {0: [None, pytest.approx(20.0)], 1: [pytest.approx(2.0), None]}
    lines = report.horizon_lines(LaShare.from_json(share))
    assert "LA horizon 1/rho per layer and KV head (tokens past the window; inf = no decay):" in lines
    assert "| 0 | inf | 20 |" in lines and "| 1 | 2 | inf |" in lines
    assert "The LA decays: in hybrid and la_only" in report.modes_line(W, S, True, la_decay=True)
    assert "decays" not in report.modes_line(W, S, True, la_decay=False)


def test_a_converted_model_saved_before_the_decay_loads_without_one(tmp_path):
    """hybrid_config.json written before attention.la_decay existed (no such key) loads as a hybrid without decay."""
    model = hs.convert_model(tiny_model("llama"), {"window": W, "sinks": S})
    hs.save_converted(model, tmp_path / "old")
    path = tmp_path / "old" / "hybrid_config.json"
    config = json.loads(path.read_text())
    del config["attention"]["la_decay"]
    path.write_text(json.dumps(config))
    loaded = hs.load_converted(tmp_path / "old")
    assert all(m.la_decay is None for m in hybrid_layers(loaded).values())
