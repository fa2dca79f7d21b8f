"""The attention entry point (hybrid.attend, HybridAttention.attend) and its backend registry: naive and chunk are
registered and agree through the entry point (outputs, denominators and gradients, fp64, every mode); an unknown
backend is a clear error; a backend registered from outside is the one used when asked for."""

import pytest
import torch
from conftest import attention_inputs
from torch import nn

from hybrid_scale.attention import backends
from hybrid_scale.attention.hedgehog import chunk as chunked
from hybrid_scale.attention.hedgehog import naive
from hybrid_scale.attention.layer import HybridAttention, attend
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.settings import MODES

NAMES = ("q", "k", "v", "fq", "fk", "gamma")


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry, so that what a test registers is gone after it."""
    backends.load_plugins()  # the installed kernels register "triton" first, as they would in a run
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    monkeypatch.setattr(backends, "_DECODERS", dict(backends._DECODERS))
    return backends


def padding_mask(T):
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    mask[1, T // 2] = 0  # a hole
    return mask


def tensors(x):
    return [x[n] for n in NAMES[:5]]


def run(x, **kw):
    y = attend(*tensors(x), gamma=x["gamma"], **kw)
    if not y.requires_grad:  # mode none: zeros, no graph
        return y, {n: torch.zeros_like(x[n]) for n in NAMES}
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype)
    grads = torch.autograd.grad((y * grad_out).sum(), [x[n] for n in NAMES], allow_unused=True)
    return y, {n: (torch.zeros_like(x[n]) if g is None else g) for n, g in zip(NAMES, grads, strict=True)}


def test_the_registry_holds_naive_and_chunk():
    assert {"naive", "chunk"} <= set(backends.available())
    assert backends.available() == tuple(sorted(backends.available()))
    assert backends.get_backend("chunk") is chunked.chunk_hybrid_attention
    with pytest.raises(ValueError, match="attention backend 'naive' is built in and cannot be replaced"):
        backends.register_backend("naive", chunked.chunk_hybrid_attention)


@pytest.mark.parametrize("mode", MODES)
def test_naive_and_chunk_agree_through_the_entry_point(mode):
    x = attention_inputs(B=2, H=4, Hkv=2, T=37, D=8, F=6, requires_grad=True, seed=7)
    for window, mask in ((5, padding_mask(37)), (64, None)):
        kw = dict(window=window, mode=mode, sinks=3, scale=0.3, attention_mask=mask, chunk_size=8)
        kw |= {"cache": 4} if mode == "cache_only" else {}  # (the cache's own paths: test_cache.py)
        y_ref, g_ref = run(x, backend="naive", **kw)
        y, g = run(x, backend="chunk", **kw)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-11)
        for n in NAMES:
            torch.testing.assert_close(g[n], g_ref[n], rtol=1e-8, atol=1e-10, msg=f"grad of {n}")
        if mode != "none" and window < 37:  # (a 64-token window over 37 tokens leaves the cache empty)
            assert y_ref.abs().max() > 0
    if mode == "cache_only":  # (its spec is cache/naive.py)
        return
    # the direct call of the spec is what the "naive" backend computes
    torch.testing.assert_close(
        naive.naive_hybrid_attention(*tensors(x), x["gamma"], window=5, mode=mode, sinks=3, scale=0.3),
        attend(*tensors(x), gamma=x["gamma"], window=5, mode=mode, sinks=3, scale=0.3, backend="naive"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only", "none"])
def test_denominators_agree(mode):
    x = attention_inputs(B=1, H=4, Hkv=2, T=30, D=8, F=6, seed=3)
    kw = dict(gamma=x["gamma"], window=5, mode=mode, chunk_size=8, return_denominators=True)
    ref = attend(*tensors(x), backend="naive", **kw)
    got = attend(*tensors(x), backend="chunk", **kw)
    assert len(ref) == len(got) == 3
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    if mode == "hybrid":
        assert (ref[2][..., 5:] > 0).all() and torch.equal(ref[2][..., :5], torch.zeros_like(ref[2][..., :5]))


def test_unknown_backend_is_a_clear_error(registry):
    x = attention_inputs(T=4)
    registry.register_backend("zzz", lambda *a, **k: None)
    with pytest.raises(
        ValueError,
        match=r"^attention backend 'flash' is not an implementation of the hedgehog LA; it has naive, chunk, triton "
        r"\(or auto, torch\)$",
    ):
        attend(*tensors(x), gamma=x["gamma"], window=2, backend="flash")
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash' of the hedgehog LA; available: chunk, "):
        registry.get_backend("flash")
    assert attend(*tensors(x), gamma=x["gamma"], window=2, backend="zzz") is None  # (registered: it has it now)
    with pytest.raises(ValueError, match="^attention mode: 'mixed' is not allowed; choose one of: hybrid, "):
        attend(*tensors(x), gamma=x["gamma"], window=2, mode="mixed")
    with pytest.raises(TypeError):
        attend(*tensors(x), x["gamma"], 2)  # the settings are one AttentionOptions (or keywords)


def test_a_backend_registered_from_outside_is_used_when_asked(registry):
    calls = []

    def spy(q, k, v, fq, fk, gamma, opts, *, attention_mask, initial_state, la_decay):
        assert isinstance(opts, AttentionOptions) and initial_state is None and la_decay is None
        calls.append(dict(window=opts.window, mode=opts.mode, sinks=opts.sinks, scale=opts.scale,
                          chunk_size=opts.chunk_size))  # fmt: skip
        return 2 * naive.naive_hybrid_attention(q, k, v, fq, fk, gamma, opts, attention_mask=attention_mask)

    assert registry.register_backend("spy", spy) is spy
    assert "spy" in registry.available()
    x = attention_inputs(T=10)
    y = attend(*tensors(x), gamma=x["gamma"], window=3, mode="la_only", sinks=2, scale=0.7, chunk_size=4, backend="spy")
    ref = attend(*tensors(x), gamma=x["gamma"], window=3, mode="la_only", sinks=2, scale=0.7, backend="chunk")
    torch.testing.assert_close(y, 2 * ref)
    assert calls == [dict(window=3, mode="la_only", sinks=2, scale=0.7, chunk_size=4)]
    attend(*tensors(x), gamma=x["gamma"], window=3)  # the default backend is not the spy
    assert len(calls) == 1

    m = layer()
    m.backend = "spy"
    hidden, rope = inputs()
    calls.clear()
    m(hidden, rope)
    assert calls == [dict(window=3, mode="hybrid", sinks=2, scale=0.5, chunk_size=4)]


def layer(**kw) -> HybridAttention:
    torch.manual_seed(0)
    base = nn.Module()
    for name, (i, o) in {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16)}.items():
        setattr(base, name, nn.Linear(i, o, bias=False, dtype=torch.float64))
    settings = dict(window=3, sinks=2, chunk_size=4, feature_map="hedgehog", gamma_init=0.3) | kw
    return HybridAttention(base, layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=4, scaling=0.5, **settings)


def inputs(T=13):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, T, 16, generator=g, dtype=torch.float64)
    angle = torch.randn(2, T, 4, generator=g, dtype=torch.float64)
    return hidden, (angle.cos(), angle.sin())


@pytest.mark.parametrize("mode", MODES)
def test_the_layer_method_uses_its_own_settings_and_backend(mode):
    m = layer(mode=mode)
    hidden, rope = inputs()
    q, k, v, fq, fk = m.project(hidden, rope)[:5]
    expect = attend(q, k, v, fq, fk, gamma=m.gamma, window=3, mode=mode, sinks=2, scale=0.5, chunk_size=4)
    torch.testing.assert_close(m.attend(q, k, v, fq, fk), expect, rtol=0, atol=0)
    # a keyword replaces the layer's setting for that call only
    other = attend(q, k, v, fq, fk, gamma=m.gamma, window=5, mode="la_only", sinks=2, scale=0.5, chunk_size=4)
    torch.testing.assert_close(m.attend(q, k, v, fq, fk, window=5, mode="la_only"), other, rtol=0, atol=0)
    assert (m.window, m.mode, m.backend) == (3, mode, "auto")

    # the forward through either backend: same outputs and same gradients of everything trained
    out = {}
    for backend in ("naive", "chunk"):
        m.backend = backend
        m.zero_grad()
        y = m(hidden, rope)[0]
        y.pow(2).sum().backward()
        out[backend] = (
            y,
            {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in m.named_parameters()},
        )
    torch.testing.assert_close(out["chunk"][0], out["naive"][0], rtol=1e-9, atol=1e-11)
    for n, g in out["naive"][1].items():
        torch.testing.assert_close(out["chunk"][1][n], g, rtol=1e-8, atol=1e-10, msg=f"grad of {n}")
    if mode in ("hybrid", "la_only"):  # the linear part is in the graph
        assert out["naive"][1]["feature_map_k.weight"].abs().max() > 0
    if mode in ("hybrid", "swa_only"):
        assert out["naive"][1]["gamma_logit"].abs().max() > 0


def test_a_self_check_inside_an_activation_checkpointed_layer_passes_and_leaves_the_layers_backward_intact(monkeypatch):
    """On CUDA, attention.backend=auto self-checks a backend at the first attention call, which in stage 2 is inside a
    decoder layer under non-reentrant activation checkpointing (seen on an H200: the check's gradients went through
    the checkpoint's saved-tensor hooks, so 'triton' failed its check, and the layer's backward then raised
    CheckpointError, 94 tensors saved in the forward and 78 in the recomputation). Here the same on CPU, the check
    run through the registry's cache as resolve() runs it."""
    monkeypatch.setattr(backends, "_CHECKED", {})
    shape = backends.Shape(dtype=torch.float32)
    seen = []

    def layer(x):
        seen.append(backends._check("naive", torch.device("cpu"), shape))  # the first call checks, then the cache
        return (x * 2).sin() * x

    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    y.sum().backward()
    assert seen == [None, None]  # passed, in the forward and (from the cache) in the recomputation
    want = (2 * x).sin() + 2 * x * (2 * x).cos()
    torch.testing.assert_close(x.grad, want.detach())


@pytest.mark.parametrize(
    "around",
    [
        lambda: torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"),  # (torch.func, AOTAutograd)
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: torch.inference_mode(),
    ],
    ids=["hooks disabled", "autocast", "inference mode"],
)
def test_the_self_check_is_not_swayed_by_the_callers_autograd_state(around, monkeypatch):
    """What a check finds is cached for the process: a check that failed because of where it was called from would
    blame the backend for good (auto would warn and fall back, attention.backend=<name> would refuse to run)."""
    monkeypatch.setattr(backends, "_CHECKED", {})
    with around():
        assert backends._check("naive", torch.device("cpu"), backends.Shape(dtype=torch.float32)) is None
