"""The gated delta-rule LA (attention/gated_delta/: naive.py, chunk.py, hybrid.py, recurrent.py, modules.py): the
chunked WY form against the spec loop and fla's own naive recurrence, the hybrid's paths against each other in
every mode, decode against the full forward, and the faults these checks must catch."""

import pytest
import torch
from conftest import perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale.attention.gated_delta.chunk import chunk_gated_delta
from hybrid_scale.attention.gated_delta.hybrid import COMBINES, delta_hybrid_attention
from hybrid_scale.attention.gated_delta.naive import DeltaGates, l2norm, recurrent_gated_delta
from hybrid_scale.attention.layer import HybridAttention, hybrid_layers

DT = torch.float64


def rule_inputs(B=2, H=4, Hkv=2, T=37, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    return dict(
        q=l2norm(r(B, H, T, D)),
        k=l2norm(r(B, Hkv, T, D)),
        v=r(B, Hkv, T, Dv),
        beta=torch.rand(B, Hkv, T, generator=g, dtype=DT),
        g=-0.3 * torch.rand(B, Hkv, T, generator=g, dtype=DT),
        initial_state=r(B, Hkv, D, Dv),
    )


def grads(fn, x: dict):
    leaves = {k: t.detach().clone().requires_grad_() for k, t in x.items()}
    o, S = fn(**leaves)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=o.dtype)
    gs = torch.autograd.grad((o * w).sum() + S.square().sum(), list(leaves.values()), allow_unused=True)
    gs = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves.values(), gs, strict=True)]
    return o, S, dict(zip(leaves, gs, strict=True))


def disagreement(fn, x: dict) -> float:
    """The largest difference between fn and the spec, in outputs, final state and every input's gradient."""
    o1, S1, g1 = grads(recurrent_gated_delta, x)
    o2, S2, g2 = grads(fn, x)
    return max([(o1 - o2).abs().max().item(), (S1 - S2).abs().max().item()]
               + [(g1[k] - g2[k]).abs().max().item() for k in g1])  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_chunked_wy_form_equals_the_spec_in_outputs_state_and_every_gradient(chunk):
    assert disagreement(lambda **x: chunk_gated_delta(**x, chunk_size=chunk), rule_inputs()) < 1e-10


def test_the_spec_equals_fla_naive_recurrence():
    fla = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    x = rule_inputs()
    o, S = recurrent_gated_delta(**x)
    G = x["q"].shape[1] // x["k"].shape[1]

    def heads(t):  # fla has one state per query head: each KV head's state repeated over its group
        return t.repeat_interleave(G, 1)

    bt = lambda t: t.transpose(1, 2)  # noqa: E731  [B, H, T, ...] -> fla's [B, T, H, ...]
    o_fla, S_fla = fla.naive_recurrent_gated_delta_rule(
        bt(x["q"]), bt(heads(x["k"])), bt(heads(x["v"])), bt(heads(x["beta"])), bt(heads(x["g"])),
        scale=1.0, initial_state=heads(x["initial_state"]), output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(bt(o_fla).to(DT), o, rtol=0, atol=1e-5)  # (fla computes in fp32)
    torch.testing.assert_close(S_fla.to(DT), heads(S), rtol=0, atol=1e-5)


def _additive(q, k, v, beta, g, *, initial_state=None):
    """Planted fault: the write term v - S k without its erase, S k (an additive, decayed linear attention)."""
    B, Hkv, T, _ = k.shape
    S, out = initial_state.clone(), []
    qg = q.view(B, Hkv, -1, T, q.shape[-1])
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None] + beta[:, :, t, None, None] * k[:, :, t, :, None] * v[:, :, t, None]
        out.append(torch.einsum("bhgk,bhkv->bhgv", qg[:, :, :, t], S))
    return torch.stack(out, 3).reshape(B, -1, T, v.shape[-1]), S


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(lambda **x: chunk_gated_delta(**{**x, "g": torch.zeros_like(x["g"])}), id="decay_ignored"),
        pytest.param(_additive, id="erase_term_dropped"),
        pytest.param(lambda **x: chunk_gated_delta(**{**x, "beta": torch.ones_like(x["beta"])}), id="beta_ignored"),
    ],
)
def test_planted_faults_are_caught_by_the_parity_check(fault):
    assert disagreement(fault, rule_inputs()) > 1e-2


def hybrid_inputs(B=2, H=4, Hkv=2, T=53, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    gates = DeltaGates(
        torch.rand(B, Hkv, T, generator=g, dtype=DT),
        -0.2 * torch.rand(B, Hkv, T, generator=g, dtype=DT),
        torch.rand(B, H, T, generator=g, dtype=DT),
    )
    return [r(B, H, T, D), r(B, Hkv, T, D), r(B, Hkv, T, D), r(B, H, T, D), r(B, Hkv, T, D),
            0.5 + torch.rand(H, generator=g, dtype=DT), *gates]  # fmt: skip


def _run(inputs, **opts):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    y = delta_hybrid_attention(*xs[:6], DeltaGates(*xs[6:]), **opts)
    if not y.requires_grad:
        return y, []
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    gs = torch.autograd.grad((y * w).sum(), xs, allow_unused=True)
    return y, [torch.zeros_like(x) if g is None else g for x, g in zip(xs, gs, strict=True)]


MODES = ["hybrid", "la_only", "swa_only", "swa_sinks", "sinks_only", "none"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("own_sinks", [False, True])
def test_chunked_hybrid_equals_the_spec_with_padding_in_every_mode(mode, combine, own_sinks):
    mask = torch.ones(2, 53, dtype=torch.long)
    mask[1, :5], mask[1, -3:] = 0, 0
    opts = dict(window=7, mode=mode, sinks=3, hybrid_sinks=own_sinks, la_combine=combine, attention_mask=mask)
    x = hybrid_inputs()
    y1, g1 = _run(x, impl=recurrent_gated_delta, **opts)
    y2, g2 = _run(x, impl=chunk_gated_delta, chunk_size=8, **opts)
    torch.testing.assert_close(y2, y1, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_hybrid_is_exact_softmax_before_the_window_fills_and_padding_changes_nothing():
    x = hybrid_inputs()
    y = delta_hybrid_attention(*x[:6], DeltaGates(*x[6:]), window=7, mode="hybrid", sinks=3, impl=recurrent_gated_delta)
    soft = delta_hybrid_attention(
        *x[:6], DeltaGates(*x[6:]), window=7, mode="swa_only", sinks=3, impl=recurrent_gated_delta
    )
    torch.testing.assert_close(y[:, :, :7], soft[:, :, :7], rtol=0, atol=1e-10)  # n < w: nothing has left the window
    assert (y[:, :, 7:] - soft[:, :, 7:]).abs().max() > 1e-3  # past it the LA is in use
    # left-padded: the row alone
    pad = [t if t.dim() == 1 else torch.cat([torch.zeros_like(t[:1, :, :4]), t[:1]], 2) for t in x]  # time: dim 2
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 53, dtype=torch.long)], 1)
    y_pad = delta_hybrid_attention(*pad[:6], DeltaGates(*pad[6:]), window=7, sinks=3, attention_mask=mask,
                                   impl=chunk_gated_delta, chunk_size=8)  # fmt: skip
    torch.testing.assert_close(y_pad[:, :, 4:], y[:1], rtol=0, atol=1e-10)
    assert y_pad[:, :, :4].abs().max() == 0


def delta_model(**attention):
    settings = {"window": 6, "sinks": 3, "la_kind": "gated_delta", "chunk_size": 8, **attention}
    return perturb_hybrid(hs.convert_model(tiny_model("llama"), settings))


@pytest.mark.parametrize(
    "attention",
    [
        {"la_combine": "normaliser"},
        {"la_combine": "mix", "hybrid_sinks": True},
        {"la_conv": 4, "hybrid_sinks": True, "mode": "la_only", "la_qk_map": True},
        {"la_conv": 3, "mode": "swa_only", "hybrid_sinks": True},
        {"la_combine": "mix", "mode": "sinks_only"},
    ],
    ids=["hybrid", "mix+sinks", "conv+la_only", "conv+swa_sinks", "sinks_only"],
)
def test_decode_prefill_extend_and_steps_equal_the_full_forward(attention):
    model = delta_model(**attention)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :20], use_cache=True)  # a prompt longer than the chunk: the chunked forward
        ext = model(ids[:, 20:25], cache=out.cache, use_cache=True).logits  # a short extension: ring + state
        steps = [model(ids[:, t : t + 1], cache=out.cache, use_cache=True).logits for t in range(25, 40)]
    torch.testing.assert_close(ext, full[:, 20:25], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 25:], rtol=1e-4, atol=1e-5)
    # the LA state is one head_dim x head_dim matrix per KV head (constant in the length: the next test counts bytes)
    assert out.cache.layers[0].state.kv.shape == (2, 2, 16, 16)


def test_decode_state_is_constant_in_the_length():
    model = delta_model(la_conv=4)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids[:, :10], use_cache=True)
        sizes = []
        for t in range(10, 90):
            model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            sizes.append(out.cache.nbytes)
    assert len(set(sizes)) == 1


def test_left_padded_batch_equals_sequences_alone_with_the_convolution():
    model = delta_model(la_conv=4, hybrid_sinks=True)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 128, (1, 25), generator=g), torch.randint(3, 128, (1, 17), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 25, dtype=torch.long), torch.cat([torch.zeros(1, 8), torch.ones(1, 17)], 1).long()])
    with torch.no_grad():
        both = model(batch, attention_mask=mask, use_cache=False).logits
        alone = model(b, use_cache=False).logits
    torch.testing.assert_close(both[1:, 8:], alone, rtol=1e-4, atol=1e-5)


def test_compiled_one_token_step_equals_extend():
    from hybrid_scale.attention.gated_delta import recurrent as delta_decode
    from hybrid_scale.attention.shape import Shape
    from hybrid_scale.attention.window.recurrent import DecodeState

    x = [t.float() for t in hybrid_inputs(T=30)]
    shape = Shape(4, 2, 8, 8, 8, 7, 3, torch.float32, True, False, "gated_delta", 0)
    opts = dict(window=7, sinks=3, hybrid_sinks=True, mode="hybrid", la_combine="mix")
    eager, compiled = DecodeState.empty(shape, 2, 7, "cpu"), DecodeState.empty(shape, 2, 7, "cpu")
    step = torch.compile(delta_decode.step, fullgraph=True, dynamic=False)
    for t in range(30):
        token = [u if u.dim() == 1 else u[:, :, t : t + 1] for u in x]
        gates = DeltaGates(*token[6:])
        want = delta_decode.extend(eager, *token[:5], gates, x[5], **opts)
        got = step(compiled, *token[:5], gates, x[5], **opts)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_heads_compute_their_slice_of_the_layer():
    model = delta_model(la_conv=4, la_combine="mix", hybrid_sinks=True, la_qk_map=True)
    m = hybrid_layers(model)[0]
    hidden = torch.randn(1, 30, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    rope = model.model.rotary_emb(hidden, torch.arange(30)[None])
    with torch.no_grad():
        x = m.project(hidden, rope)
        whole = m.attend(*x[:5], gates=x.gates)
        g = m.num_key_value_groups
        part = HybridAttention.from_softmax(m, model.config, 0, model.hybrid_settings)
        part.load_state_dict(m.state_dict())
        part.narrow_heads(g, 2 * g)  # the second KV head's group
        part.q_proj = torch.nn.Linear(1, 1)  # (the projections are split by their own plan: slice by hand here)
        x = m.project(hidden, rope)
        kv = slice(1, 2)
        gates = part.la_gates(hidden)
        fq = part.la_map_q(part.la_conv_q(m.q_proj(hidden).view(1, 30, -1, 16).transpose(1, 2)[:, g : 2 * g]))
        fk = part.la_map_k(part.la_conv_k(m.k_proj(hidden).view(1, 30, -1, 16).transpose(1, 2)[:, kv]))
        y = part.attend(x.q[:, g : 2 * g], x.k[:, kv], x.v[:, kv], fq, fk, gates=gates)
    torch.testing.assert_close(y, whole[:, g : 2 * g], rtol=1e-5, atol=1e-6)


def test_config_refuses_what_gated_delta_cannot_do():
    from hybrid_scale.config import load_config
    from hybrid_scale.distill.inputs import check_la_objectives
    from hybrid_scale.errors import ConfigError
    from hybrid_scale.run.settings import derive

    ssd = load_config(None, ["attention.la_kind=gated_delta", "distill.recipe=ssd"])  # (a finetune-only config loads)
    with pytest.raises(ConfigError, match="weights_xent .recipe ssd's stage-1 objective. transfers attention weights"):
        check_la_objectives(ssd, derive(ssd).objectives)  # stage 1's preflight refuses it
    with pytest.raises(ConfigError, match="attention.la_kind=gated_delta has its own forget gate"):
        load_config(None, ["attention.la_kind=gated_delta", "attention.la_decay=true"])
    with pytest.raises(ConfigError, match="'attention.la_conv': applies to attention.la_kind=gated_delta only"):
        load_config(None, ["attention.la_conv=4"])
    with pytest.raises(ConfigError, match="'attention.la_qk_map': applies to attention.la_kind=gated_delta only"):
        load_config(None, ["attention.la_qk_map=true"])
    cfg = load_config(
        None, ["attention.la_kind=gated_delta", "distill.recipe=ssd", "distill.objectives={output_mse: 1}"]
    )
    check_la_objectives(cfg, derive(cfg).objectives)  # the LA's output objective: taken


def test_the_hybrid_reads_the_state_of_the_keys_that_left_the_window():
    """Query n's LA read-out is S_(n-w)^T q_n, S_(n-w) the recurrence over keys 0..n-w alone (planted: lag 0 fails)."""
    x = hybrid_inputs(B=1, T=30)
    gates = DeltaGates(*x[6:])
    w = 7
    la = delta_hybrid_attention(*x[:6], gates, window=w, mode="hybrid", la_combine="mix", impl=recurrent_gated_delta)
    soft = delta_hybrid_attention(*x[:6], gates, window=w, mode="swa_only", impl=recurrent_gated_delta)
    mix = DeltaGates(*x[6:]).mix
    for n in (w, w + 3, 29):
        S = recurrent_gated_delta(
            l2norm(x[3][:, :, : n - w + 1]), l2norm(x[4][:, :, : n - w + 1]), x[2][:, :, : n - w + 1],
            x[6][:, :, : n - w + 1], x[7][:, :, : n - w + 1],
        )[1]  # fmt: skip
        read = torch.einsum("bhgk,bhkv->bhgv", l2norm(x[3][:, :, n]).view(1, 2, 2, -1), S).reshape(1, 4, -1)
        lam = mix[:, :, n, None]
        want = (1 - lam) * soft[:, :, n] + lam * read
        torch.testing.assert_close(la[:, :, n], want, rtol=0, atol=1e-10)


def test_fla_kernel_is_registered_by_the_kernels_and_refused_with_a_reason_where_it_cannot_run():
    """hybrid_scale_kernels registers fla-core's kernel as the gated delta rule's "fla" (attention never imports fla);
    on this CPU it cannot launch: the registry's self-check says why, and auto resolves to the chunked torch form. A
    backend the kind does not have is an error naming what it has, not a silent substitute."""
    pytest.importorskip("triton")
    from hybrid_scale.attention import backends
    from hybrid_scale.attention.shape import Shape

    fla = backends.get_backend("fla", "gated_delta")
    assert fla.__module__ == "hybrid_scale_kernels.gated_delta"
    shape = Shape(la_kind="gated_delta", head_dim=64, value_dim=64, features=64, dtype=torch.float32)
    assert backends.self_check("fla", "cpu", shape=shape) is not None
    assert backends.resolve("auto", "cpu", shape) == "chunk" and backends.resolve("torch", "cpu", shape) == "chunk"
    assert backends.get_backend("naive", "gated_delta") is recurrent_gated_delta
    with pytest.raises(ValueError, match="'triton' is not an implementation of the gated_delta LA; it has naive, "):
        backends.resolve("triton", "cpu", shape)


@pytest.mark.gpu
def test_fla_kernel_equals_the_spec_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hybrid_scale.attention import backends
    from hybrid_scale.attention.shape import Shape

    x = {k: t.float().cuda() for k, t in rule_inputs(T=150, D=64, Dv=64).items()}
    shape = Shape(la_kind="gated_delta", head_dim=64, value_dim=64, features=64, dtype=torch.float32)
    assert backends.self_check("fla", "cuda", shape=shape) is None
    assert backends.resolve("auto", "cuda", shape) == "fla"
    fla = backends.get_backend("fla", "gated_delta")
    o, S = fla(**x)
    o_ref, S_ref = recurrent_gated_delta(**x)
    torch.testing.assert_close(o, o_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(S, S_ref, rtol=1e-3, atol=1e-3)


def test_gamma_fit_scales_the_delta_rules_mass_and_refuses_the_mix():
    """Inference-time hybridisation's closed form (export/gamma.py) with gated_delta: gamma scales the LA's part."""
    from hybrid_scale.export import gamma as export

    model = delta_model(hybrid_sinks=True, la_combine="normaliser")
    m = hybrid_layers(model)[0]
    hidden = torch.randn(2, 30, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    rope = model.model.rotary_emb(hidden, torch.arange(30)[None])
    with torch.no_grad():
        x = m.project(hidden, rope)
        parts = export.gamma_parts(m, x)
        for g in (torch.full((4,), 0.3), torch.full((4,), 2.5)):
            want = m.attend(*x[:5], gates=x.gates, gamma=g)
            torch.testing.assert_close(export.hybrid_at(g, parts), want, rtol=1e-5, atol=1e-6)
    mix = hybrid_layers(delta_model(la_combine="mix"))[0]
    with pytest.raises(ValueError, match="la_combine=mix does not use"):
        export.gamma_parts(mix, x)


@pytest.mark.parametrize(
    "attention",
    [
        {"feature_map": "hedgehog"},
        {"feature_map": "hedgehog", "feature_dim": 4},
        {"feature_map": "exp", "feature_dim": 8},
        {"feature_map": "t2r"},
        {"feature_map": "t2r", "feature_dim": 12},
        {"feature_map": "relu"},
        {"feature_map": "elu1"},
        {"la_kind": "gated_delta", "la_combine": "normaliser"},
        {"la_kind": "gated_delta", "la_combine": "mix", "la_conv": 4, "la_qk_map": True},
    ],
    ids=["hedgehog", "hedgehog4", "exp8", "t2r", "t2r12", "relu", "elu1", "delta", "delta_mix_conv_map"],
)
def test_plan_counts_the_la_parameters_the_model_has(attention):
    """preflight's count of what trains as a layer's feature maps equals the converted layer's own."""
    from hybrid_scale.config import load_config
    from hybrid_scale.preflight.shape import la_params

    model = tiny_model("llama")
    hs.convert_model(model, {"window": 6, **attention})
    m = hybrid_layers(model)[0]
    cfg = load_config(None, [f"attention.{k}={str(v).lower()}" for k, v in attention.items()]
                      + ["distill.objectives={output_mse: 1.0}"])  # fmt: skip
    c = {"H": m.num_heads, "K": m.num_key_value_heads, "hd": m.head_dim, "D": model.config.hidden_size}
    assert la_params(cfg, c) == sum(p.numel() for p in m.la_parameters())
