"""Decoding a converted model with stock transformers `generate` under torch.compile (fullgraph): the same tokens as
eager decoding, one graph, no recompile over 64 tokens; with the torch decode step (recurrent.step) and with the
fused Triton step (its operator, run here by Triton's interpreter), which give the same tokens. On a GPU the same
cache takes CUDA graphs too (benchmarks/device/generate.py)."""

import pytest
import torch
from conftest import perturb_hybrid, tiny_model
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import hybrid_scale as hs
from hybrid_scale.attention.hf.cache import HybridCache
from hybrid_scale.attention.layer import hybrid_layers

try:
    import hybrid_scale_kernels  # noqa: F401

    KERNELS = True
except ImportError:
    KERNELS = False


ATTENTION = {"window": 8, "sinks": 2, "hybrid_sinks": True, "la_decay": True, "gamma_param": "exp", "gamma_init": 1.0}
NEW = 64


def _model(backend="torch"):
    model = perturb_hybrid(hs.convert_model(tiny_model(), {**ATTENTION, "backend": backend}))
    with torch.no_grad():  # a decay that every head applies
        for layer in hybrid_layers(model).values():
            layer.la_decay_rho.copy_(torch.linspace(0.02, 0.4, layer.la_decay_rho.numel()))
    return model


TRITON = pytest.param(
    "triton", marks=[pytest.mark.slow, pytest.mark.skipif(not KERNELS, reason="needs hybrid_scale_kernels (triton)")]
)  # (20 s in the interpreter)


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_compiled_generate_gives_the_eager_tokens_with_one_graph_and_no_recompile(backend):
    model = _model(backend)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    new = NEW if backend == "torch" else 16
    greedy = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    eager = model.generate(ids, **greedy, disable_compile=True)
    assert HybridCache(model).is_compileable

    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # (transformers compiles on accelerators only unless told)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # (no cache given: generate's own is a HybridCache)
        compiled = model.generate(ids, **greedy, compile_config=config)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the decode step was compiled, once
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled.shape == (2, 12 + new)
    assert torch.equal(compiled, eager), (compiled, eager)
    if backend == "triton":  # the fused step gives the torch step's tokens
        assert torch.equal(compiled, _model("torch").generate(ids, **greedy, disable_compile=True))


def test_generate_with_no_arguments_gets_a_compileable_cache_with_static_state():
    """`generate(ids)` makes a HybridCache before its prefill (so transformers compiles and graph-captures the decode
    step on a GPU, as for a static cache), and the state's tensors are marked as static inputs (their addresses do
    not change: a CUDA graph reads them in place). A partly converted model keeps transformers' DynamicCache."""
    model = _model()
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, HybridCache) and cache.is_compileable
    state = cache.layers[0].state
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in state.tensors())
    kwargs = {}
    model._prepare_cache_for_generation(model.generation_config, kwargs, None, 1, 20)
    assert isinstance(kwargs["cache"], HybridCache)
    partial = hs.convert_model(tiny_model(), {**ATTENTION, "layers": [1]})
    kwargs = {}
    partial._prepare_cache_for_generation(partial.generation_config, kwargs, None, 1, 20)
    assert type(kwargs["cache"]).__name__ == "DynamicCache"


def test_a_model_with_softmax_layers_left_generates_eagerly_with_its_cache():
    """A partly converted model keeps softmax layers whose DynamicLayer is not compileable: generate runs eagerly
    (no compile attempt), and its masks are sized by the softmax layer."""
    model = perturb_hybrid(hs.convert_model(tiny_model(), {**ATTENTION, "layers": [1]}))
    cache = HybridCache(model)
    assert not cache.is_compileable and cache.is_linear == [False, True]
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache=cache)
    ref = ids
    for _ in range(12):  # no cache: the whole sequence each time
        logits = model(ref, use_cache=False).logits[:, -1]
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_generate_keeps_rings_no_longer_than_its_own_length_and_still_compiles(backend):
    """A generate shorter than the window gets rings of its max_length (prompt + new tokens), not the window's: the
    same tokens as a cache of the whole window, a smaller cache, and the decode step still compiles to one graph.
    The evaluation's scoring bounds its rings the same way (to the batch's longest context)."""
    model = perturb_hybrid(hs.convert_model(tiny_model(), {**ATTENTION, "window": 64, "backend": backend}))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    whole = model.generate(ids, **greedy, cache=HybridCache(model), disable_compile=True)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        bounded = model.generate(ids, **greedy, compile_config=config)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert torch.equal(bounded.sequences, whole.sequences)
    layer = bounded.past_key_values.layers[0]
    assert layer.is_compileable and layer.state.ring == 32 and whole.past_key_values.layers[0].state.ring == 64
    assert bounded.past_key_values.nbytes < whole.past_key_values.nbytes


@pytest.mark.parametrize("la_kind", ["hedgehog", pytest.param("gated_delta", marks=pytest.mark.slow)])
def test_compiled_generate_with_the_cache_of_exact_keys_gives_the_eager_tokens_in_one_graph(la_kind):
    """attention.cache on (issue 66): the decode step with its cache slots, scores and fold compiles to one graph
    (fullgraph, no recompile over 40 tokens, past the window many times) and gives eager decoding's tokens, which are
    the teacher-forced forward's greedy ones (tests/unit/test_cache_decode.py; the gated delta rule's step compiles
    there too, with inductor)."""
    from hybrid_scale.models.convert import set_cache

    if la_kind == "hedgehog":
        model = _model()
        set_cache(model, 4, "attention")
    else:
        settings = {"window": 8, "sinks": 2, "hybrid_sinks": True, "la_kind": "gated_delta", "la_combine": "mix"}
        model = perturb_hybrid(hs.convert_model(tiny_model(), settings))
        set_cache(model, 4, "self_recall")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    new = 40
    greedy = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    eager = model.generate(ids, **greedy, disable_compile=True)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(ids, **greedy, compile_config=config, return_dict_in_generate=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(compiled.sequences, eager)
    assert compiled.past_key_values.layers[0].state.cache_k.shape[2] == 4
