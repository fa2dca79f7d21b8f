"""The cache of exact keys in constant-memory decode (attention/cache/recurrent.py): a prompt then one token at a time
equals the whole-sequence forward with the same cache (cache/attend.py, the chunked path) at every position, for both
LA kinds, every cache_select and the modes a cache changes; the prompt's state built at once equals the one the
token-by-token decode leaves; the step compiles to one graph; the state's bytes do not grow; a converted model's
decode and `generate` give the forward's logits and greedy tokens."""

import copy

import pytest
import torch
from conftest import perturb_hybrid, tiny_model
from torch._dynamo.utils import counters

import hybrid_scale as hs
from hybrid_scale.attention.cache import recurrent as cache_decode
from hybrid_scale.attention.gated_delta.cached import SIDE as delta_side
from hybrid_scale.attention.gated_delta.naive import DeltaGates
from hybrid_scale.attention.gated_delta.part import PART as DELTA
from hybrid_scale.attention.hedgehog.cached import SIDE as hedgehog_side
from hybrid_scale.attention.hedgehog.part import PART as HEDGEHOG
from hybrid_scale.attention.hf.cache import HybridCache
from hybrid_scale.attention.layer import hybrid_layers
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.part import Projections
from hybrid_scale.attention.settings import CACHE_SELECTS
from hybrid_scale.attention.shape import Shape
from hybrid_scale.attention.window.recurrent import DecodeState
from hybrid_scale.models.convert import set_cache

DT = torch.float64
B, H, K, D, W, S = 2, 4, 2, 8, 5, 3
# the hedgehog as configs/quickstart.yaml has it (its own sinks, an LA decay); the gated delta rule with each combine
KINDS = {
    "hedgehog": dict(hybrid_sinks=True),
    "gated_delta": dict(hybrid_sinks=True, la_combine="normaliser"),
    "gated_delta_mix": dict(hybrid_sinks=False, la_combine="mix"),
}


def decode_equals_forward(model):
    """A 20-token prompt then 20 single tokens through HybridCache (the second row left-padded by 5) give the full
    forward's logits. Returns (ids, mask, the full logits, the cache, the set of its byte counts after each step)."""
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :20], attention_mask=mask[:, :20], use_cache=True)
        cache, steps, sizes = out.cache, [out.logits], set()
        for t in range(20, 40):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True).logits)
            sizes.add(cache.nbytes)
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, 5:], full[1, 5:], rtol=1e-4, atol=1e-5)
    return ids, mask, full, cache, sizes


def inputs(kind: str, T: int, dtype=DT, seed=0, batch=B):
    """(Projections, gamma, la_decay or None) of random inputs for `kind`."""
    B = batch
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    if kind == "hedgehog":
        x = Projections(r(B, H, T, D), r(B, K, T, D), r(B, K, T, D), r(B, H, T, 6).abs(), r(B, K, T, 6).abs())
        return x, 0.5 + torch.rand(H, generator=g, dtype=dtype), torch.tensor([0.05, 0.3], dtype=dtype)
    u = lambda *s: torch.rand(*s, generator=g, dtype=dtype)  # noqa: E731
    gates = DeltaGates(u(B, K, T), -0.2 * u(B, K, T), u(B, H, T) if kind == "gated_delta_mix" else None)
    x = Projections(r(B, H, T, D), r(B, K, T, D), r(B, K, T, D), r(B, H, T, D), r(B, K, T, D), gates)
    return x, 0.5 + torch.rand(H, generator=g, dtype=dtype), None


def setup(kind, mode="hybrid", select="attention", cache=3, dtype=DT, batch=B):
    """(part, side, opts, an empty state) for `kind`."""
    o = AttentionOptions(window=W, mode=mode, sinks=S, cache=cache, cache_select=select, chunk_size=8,
                         **KINDS[kind])  # fmt: skip
    hedgehog = kind == "hedgehog"
    shape = Shape(H, K, D, D, 6 if hedgehog else D, W, S, dtype, o.hybrid_sinks, hedgehog,
                  "hedgehog" if hedgehog else "gated_delta", 0)  # fmt: skip
    state = DecodeState.empty(shape, batch, W, "cpu", cache=(cache, select))
    return (*((HEDGEHOG, hedgehog_side) if hedgehog else (DELTA, delta_side)), o, state)


def cut(x, a, b):
    gates = None if x.gates is None else DeltaGates(*(None if t is None else t[:, :, a:b] for t in x.gates))
    return Projections(*(t[:, :, a:b] for t in x[:5]), gates)


def forward(part, x, gamma, o, mask, rho):
    """The whole-sequence path with the cache (the chunked one)."""
    return part.attend(
        x, gamma, o, attention_mask=mask, backend="chunk", **({"la_decay": rho} if rho is not None else {})
    )


def decode(part, side, o, state, x, gamma, rho, mask, t0, *, parallel=True):
    """A prompt of t0 tokens (built at once, or token by token), then one step a token; the outputs [B,H,T,Dv]."""
    whole = (lambda y, m: forward(part, y, gamma, o, m, rho)) if parallel else None
    outs = [cache_decode.extend(state, cut(x, 0, t0), gamma, o, side=side, attention_mask=mask[:, :t0], la_decay=rho,
                                forward=whole, part=part)]  # fmt: skip
    for t in range(t0, x.q.shape[2]):
        outs.append(cache_decode.step(state, cut(x, t, t + 1), gamma, o, side=side, attention_mask=mask[:, t : t + 1],
                                      la_decay=rho))  # fmt: skip
    return torch.cat(outs, 2)


def padded_mask(T):
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row
    mask[1, 29] = 0  # and a padded step in the decode
    return mask


@pytest.mark.parametrize("mode", ["hybrid", "swa_sinks", "cache_only"])
@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_then_steps_equal_the_whole_sequence_forward(kind, select, mode):
    """Past the window, the cache full and keys leaving it into the LA at many steps: every position of both rows
    (one left-padded, with a padded decode step) equals the forward with the same cache."""
    T = 40
    x, gamma, rho = inputs(kind, T)
    part, side, o, state = setup(kind, mode, select)
    mask = padded_mask(T)
    want = forward(part, x, gamma, o, mask, rho)
    got = decode(part, side, o, state, x, gamma, rho, mask, 17)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert state.count.tolist() == mask.sum(1).tolist() and int(state.seen) == T
    assert bool((state.cache_pos >= 0).all())  # (the cache is full: its keys compete)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_only_without_a_cache_decodes_the_forward_and_adds_no_byte(kind):
    """cache_only with a cache of 0 (nothing to attend: zeros) through the same path, and a state without a cache
    holds nothing the cache would (its bytes are those of a state built before the cache)."""
    T = 34
    x, gamma, rho = inputs(kind, T)
    part, side, o, state = setup(kind, "cache_only", cache=0)
    mask = padded_mask(T)
    got = decode(part, side, o, state, x, gamma, rho, mask, 9)
    torch.testing.assert_close(got, forward(part, x, gamma, o, mask, rho), rtol=0, atol=0)
    extra = ("cache_k", "cache_v", "cache_fk", "cache_gates", "cache_score", "cache_pos", "cache_budget", "ring_score",
             "shadow_kv", "shadow_ksum", "la_has")  # fmt: skip
    assert all(getattr(state, name).numel() == 0 for name in extra) and state.cache_select == ""


def canonical(state: DecodeState) -> dict:
    """The state's tensors, the cache's slots in position order (where each key sits in the cache is free)."""
    order = state.cache_pos.argsort(-1)
    out = {}
    for name, t in vars(state).items():
        if not isinstance(t, torch.Tensor):
            continue
        if name.startswith("cache_") and name != "cache_budget":
            t = t.gather(2, order if t.dim() == 3 else order[..., None].expand_as(t))
        out[name] = t
    return out


@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_built_at_once_leaves_the_state_of_the_token_by_token_decode(kind, select):
    """The parallel prefill (drop times: the cache, the LA in fold order, the shadow, the ring's partial sums) leaves
    the state that `step` token by token leaves, on a padded batch; the outputs agree, and so do the next steps."""
    T, t0 = 40, 26
    x, gamma, rho = inputs(kind, T, seed=1)
    part, side, o, at_once = setup(kind, select=select)
    by_step = copy.deepcopy(at_once)
    mask = padded_mask(T)
    mask[0, 20] = 0  # a padded token inside the prompt too
    a = decode(part, side, o, at_once, x, gamma, rho, mask, t0, parallel=True)
    b = decode(part, side, o, by_step, x, gamma, rho, mask, t0, parallel=False)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    one, two = canonical(at_once), canonical(by_step)
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-10, atol=1e-12, msg=name)
    at_once_prompt, by_step_prompt = setup(kind, select=select)[3], setup(kind, select=select)[3]
    decode(part, side, o, at_once_prompt, cut(x, 0, t0), gamma, rho, mask[:, :t0], t0, parallel=True)
    decode(part, side, o, by_step_prompt, cut(x, 0, t0), gamma, rho, mask[:, :t0], t0, parallel=False)
    one, two = canonical(at_once_prompt), canonical(by_step_prompt)
    for name in one:  # right after the prompt: the same state
        torch.testing.assert_close(one[name], two[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta_mix"])
def test_the_step_traces_to_one_graph_and_equals_eager(kind, select):
    """torch.compile(fullgraph=True) of the step: one graph for every token (no recompile, no graph break), in place,
    equal to eager (dynamo's graph run eagerly here; the slow test below runs inductor)."""
    _compiled_equals_eager(kind, select, backend="eager")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta_mix"])
def test_the_inductor_compiled_step_equals_eager(kind):
    _compiled_equals_eager(kind, "self_recall" if kind == "hedgehog" else "attention", backend="inductor")


def _compiled_equals_eager(kind, select, backend):
    T, t0 = 30, 9
    x, gamma, rho = inputs(kind, T, dtype=torch.float32, seed=2)
    part, side, o, eager = setup(kind, select=select, dtype=torch.float32)
    mask = padded_mask(T)
    cache_decode.extend(eager, cut(x, 0, t0), gamma, o, side=side, attention_mask=mask[:, :t0], la_decay=rho)
    compiled = copy.deepcopy(eager)
    storage = [t.data_ptr() for t in compiled.tensors()]
    step = torch.compile(cache_decode.step, fullgraph=True, dynamic=False, backend=backend)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(t0, T):
            kw = dict(side=side, attention_mask=mask[:, t : t + 1], la_decay=rho)
            want = cache_decode.step(eager, cut(x, t, t + 1), gamma, o, **kw)
            got = step(compiled, cut(x, t, t + 1), gamma, o, **kw)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [t.data_ptr() for t in compiled.tensors()] == storage


@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta"])
def test_the_state_bytes_after_8k_tokens_are_those_after_512(kind):
    """At a tiny shape: the state after 512 tokens and after 8192 (each a prompt built at once; its outputs are not
    asked for) has the same bytes, and 64 more steps neither grow it nor move a tensor."""
    sizes = {}
    for T in (512, 8192):
        x, gamma, rho = inputs(kind, T, dtype=torch.float32, seed=3, batch=1)
        part, side, o, state = setup(kind, select="self_recall" if kind == "hedgehog" else "attention",
                                     dtype=torch.float32, batch=1)  # fmt: skip
        cache_decode.extend(state, x, gamma, o, side=side, la_decay=rho, part=part, forward=lambda y, m: None)
        sizes[T] = state.nbytes
        assert int(state.count) == T and bool((state.cache_pos >= 0).all())
    assert sizes[512] == sizes[8192]
    storage = [t.data_ptr() for t in state.tensors()]
    for t in range(64):
        cache_decode.step(state, cut(x, t, t + 1), gamma, o, side=side, la_decay=rho)
    assert state.nbytes == sizes[512] and [t.data_ptr() for t in state.tensors()] == storage
    assert state.cache_k.shape[2] == 3 and state.ring == W


def _model(kind):
    attention = {"window": 6, "sinks": 3, "hybrid_sinks": True, "chunk_size": 8, "backend": "torch"}
    if kind == "hedgehog":  # as configs/quickstart.yaml: its own sinks, an LA decay
        attention |= {"la_decay": True, "gamma_param": "exp", "gamma_init": 1.0}
    else:
        attention |= {"la_kind": "gated_delta", "la_combine": "mix", "la_conv": 3}
    model = perturb_hybrid(hs.convert_model(tiny_model(), attention))
    if kind == "hedgehog":
        with torch.no_grad():  # a decay that every head applies
            for layer in hybrid_layers(model).values():
                layer.la_decay_rho.copy_(torch.linspace(0.02, 0.4, layer.la_decay_rho.numel()))
    return model


@pytest.mark.parametrize("select", CACHE_SELECTS)
@pytest.mark.parametrize("kind", ["hedgehog", "gated_delta"])
def test_a_converted_model_decodes_and_generates_what_its_forward_gives(kind, select):
    """cache_keys 4 on a converted model: a prompt then single tokens through HybridCache give the full forward's
    logits (a left-padded row included), its bytes do not grow, and `generate`'s greedy tokens are the teacher-forced
    forward's."""
    model = _model(kind)
    set_cache(model, 4, select)
    ids, mask, _, cache, sizes = decode_equals_forward(model)
    assert len(sizes) == 1 and cache.layers[0].state.cache_k.shape[2] == 4
    new = 24
    gen = model.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, disable_compile=True)  # fmt: skip
    with torch.no_grad():
        whole = torch.cat([mask[:, :16], torch.ones(2, new, dtype=torch.long)], 1)
        logits = model(gen, attention_mask=whole, use_cache=False).logits[:, 15:-1]
    logits[..., model.config.eos_token_id] = -torch.inf  # (min_new_tokens keeps generate off it)
    assert torch.equal(logits.argmax(-1), gen[:, 16:])


def test_a_live_decode_cache_refuses_another_cache():
    model = _model("hedgehog")
    set_cache(model, 4, "attention")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        set_cache(model, 8)
        with pytest.raises(ValueError, match="make a new HybridCache after changing them"):
            model(ids[:, :1], cache=cache, use_cache=True)
        set_cache(model, 4, "recency")
        with pytest.raises(ValueError, match="make a new HybridCache after changing them"):
            model(ids[:, :1], cache=cache, use_cache=True)
        set_cache(model, 4, "attention")
        model(ids[:, :1], cache=cache, use_cache=True)
    assert isinstance(cache, HybridCache)
