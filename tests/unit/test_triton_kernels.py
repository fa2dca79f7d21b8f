"""The Triton kernels (kernels/hybrid_scale_kernels: the chunked forward and backward, the fused decode step) through
the backend's entry, against the naive spec.

On CPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 before triton loads) in fp32 with the
64-token chunks they have on a GPU, over lengths of two to four chunks: every mode, windows 1 / 16 / 64 / 100 (two
chunks back), lengths that are not a multiple of the chunk, GQA 3:1 and 5:1, a left-padded row beside an unpadded
one, padding with holes; outputs and the gradients of q, k, v, phi_q, phi_k and gamma; an initial LA state (stage
1's units); the fused decode step against the full forward and against recurrent.extend; the LA's decay
(attention.la_decay) in all of these, rho's gradient included; a converted model with a decay on the "triton"
backend (forward, gradients, generate()); the backend switch. The compiled bf16 tests (marked `gpu`) and the
gradient's precision contract are in test_triton_kernels_bf16.py.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import HYBRID_SINKS, variant
from kernel_inputs import MODES, NAMES, left_padded, make, run, with_keywords

import hybrid_scale as hs
from hybrid_scale.attention import backends
from hybrid_scale.attention.hedgehog import chunk as chunked
from hybrid_scale.attention.hedgehog import naive
from hybrid_scale.attention.hedgehog.recurrent import extend
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.shape import Shape
from hybrid_scale.attention.window.recurrent import DecodeState
from hybrid_scale.config import ConfigError, load_config

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
triton_attention = with_keywords(kernels.triton_hybrid_attention)
triton_decode = with_keywords(kernels.triton_decode_step, ("state", *NAMES))


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the backend registry (what a test registers is gone after it)."""
    backends.load_plugins()
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    monkeypatch.setattr(backends, "_DECODERS", dict(backends._DECODERS))
    return backends


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def check(x, mask, atol=2e-5, **options):
    y, grads = run(triton_attention, x, mask, **options)
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    y_ref, grads_ref = run(naive.naive_hybrid_attention, ref, mask, **options)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=atol)
    for n in NAMES:
        torch.testing.assert_close(grads[n].double(), grads_ref[n], rtol=1e-4, atol=atol * 5, msg=f"grad of {n}")
    return y_ref, grads_ref


@pytest.mark.parametrize(
    ("mode", "window"), [(m, w) for m in MODES for w in (1, 16, 64, 100)] + [(HYBRID_SINKS, w) for w in (1, 16, 64)]
)  # (the hybrid with its sinks at 3 windows: the interpreter's time at 100, which adds no other case)
def test_outputs_and_gradients_equal_the_naive_spec(mode, window):
    """Every mode at windows of one chunk (1, 16, 64) and of two (100: each query chunk streams two chunks back, and
    the backward sums dq over three key blocks), over three or four 64-token chunks (the LA reaches past the window
    through the states), a length that is not a multiple of the chunk, and a left-padded row."""
    T = window + 130
    _, grads = check(make(T, seed=window), left_padded(T), window=window, **variant(mode), sinks=3)
    used = {"hybrid": NAMES, HYBRID_SINKS: NAMES, "swa_only": NAMES[:3], "swa_sinks": NAMES[:3], "la_only": NAMES[2:5]}
    used = used.get(mode, NAMES[:3])
    if window == 1 and mode in ("hybrid", "swa_only"):  # one window key: exp(a - c) = 1 whatever q and k are
        used = tuple(n for n in used if n not in ("q", "k"))
    for n in used:  # the test sees every input the mode uses
        assert grads[n].abs().max() > 0, n


def test_gqa_at_a_group_of_five():
    """G = 5 query heads per KV head (3 is the default above, 1 below): the query heads' programs find their KV head,
    and the backward's per-KV-head kernels (dk, dv, dphi_k, the reverse state scan) sum over all five. Both ends
    padded, across three chunks."""
    x = make(150, H=10, Hkv=2, seed=5)
    mask = left_padded(150, pad=4)
    mask[0, -3:] = 0
    check(x, mask, window=5, mode="hybrid", sinks=2)


@pytest.mark.parametrize("mode", ["hybrid", "swa_sinks", "la_only", HYBRID_SINKS])
def test_padding_anywhere_is_packed_and_restored(mode):
    T = 150
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, -5:] = 0  # right padding: one span, handled in place
    mask[1, :3] = 0
    mask[1, 80:84] = 0  # a hole: packed, computed, put back
    y, _ = check(make(T, seed=3), mask, window=16, **variant(mode), sinks=3)
    assert torch.equal(y[1, :, 80:84], torch.zeros_like(y[1, :, 80:84]))


@pytest.mark.parametrize("mode", ["hybrid", "la_only"])
def test_feature_dims_wider_than_one_chunk(mode):
    """phi's F = 80 in chunks of 64 (the interpreter's), the last one partial: every kernel tiles the feature dim (no
    [tile, F] tile stays live, so F = 256 compiles without spills), with padding and GQA 3:1."""
    check(make(100, F=80, seed=7), left_padded(100), window=16, mode=mode)


@pytest.mark.parametrize("mode", ["hybrid", "la_only"])
def test_an_initial_state_counts_as_keys_before_the_sequence(mode):
    """Stage 1 attends a block of rows with the keys before it folded into an initial LA state: the rows equal the
    whole sequence's, and the gradients reach the folded keys through the state."""
    x = make(70, seed=11)
    T0 = 23  # keys 0..22 folded away; rows 23..69 attended
    fk0, v0 = x["fk"][:, :, :T0], x["v"][:, :, :T0]
    state = (fk0.transpose(-1, -2) @ v0, fk0.sum(2))
    part = {n: t[:, :, T0:] if n != "gamma" else t for n, t in x.items()}
    y = triton_attention(*(part[n] for n in NAMES), window=16, mode=mode, initial_state=state)
    full = naive.naive_hybrid_attention(*(x[n] for n in NAMES), window=16, mode=mode)
    # rows T0.. see keys T0-15.. in their window: the test folds only keys that every row has left (T0 <= n - 16)
    torch.testing.assert_close(y[:, :, 16:], full[:, :, T0 + 16 :], rtol=1e-5, atol=2e-6)
    dy = torch.randn(y[:, :, 16:].shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(y[:, :, 16:], [x[n] for n in NAMES], dy, allow_unused=True)
    ref = torch.autograd.grad(full[:, :, T0 + 16 :], [x[n] for n in NAMES], dy, allow_unused=True)
    for n, a, b in zip(NAMES, got, ref, strict=True):
        a, b = (torch.zeros_like(x[n]) if g is None else g for g in (a, b))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"grad of {n}")


@pytest.mark.parametrize(
    ("backend", "own_sinks"),
    [("torch", False), ("torch", True), pytest.param("triton", False, marks=pytest.mark.slow)],  # 24 s interpreted
)
def test_stage_1_output_objectives_run_on_the_backend_and_sum_to_the_whole_sequence(backend, own_sinks):
    """Stage 1's output objectives per unit of rows (objectives.unit_loss, as split over ranks) through the layer's
    backend: their sum equals the whole-sequence objective computed with the spec, and so do the gradients; also
    for a hybrid with its own sinks (whose units attend from row 0: their rows need the sinks)."""
    from types import SimpleNamespace

    from hybrid_scale.attention.layer import Projections, attend
    from hybrid_scale.data.batches import split_units
    from hybrid_scale.distill.objectives import teacher_rows, unit_loss

    x = make(53, seed=4)
    T, H, D, w = 53, 3, 16, 8
    scale = D**-0.5

    def layer_attend(q, k, v, fq, fk, mode, initial_state=None):
        return attend(q, k, v, fq, fk, gamma=x["gamma"], window=w, mode=mode, scale=scale, chunk_size=8,
                      backend=backend, initial_state=initial_state, sinks=3, hybrid_sinks=own_sinks)  # fmt: skip

    m = SimpleNamespace(scaling=scale, all_heads=H, gamma=x["gamma"], window=w, sinks=3, attend=layer_attend,
                        hybrid_sinks=own_sinks, la_decay=None)  # fmt: skip
    weights = {"output_mse": 0.5, "hybrid_output_mse": 1.0}
    target = teacher_rows(x["q"].detach(), x["k"].detach(), x["v"].detach(), 0, scale)
    spec = {
        mode: naive.naive_hybrid_attention(*(x[n] for n in NAMES), window=w, mode=mode, sinks=3, hybrid_sinks=own_sinks)
        for mode in ("la_only", "hybrid")
    }
    expect = (0.5 * (spec["la_only"] - target).pow(2).sum() + (spec["hybrid"] - target).pow(2).sum()) / (H * T * D)
    tensors = [x[n] for n in NAMES[:5]]
    units = [u for rank in split_units(1, T, 16, 3) for u in rank]  # rows 0-15, 16-31, 32-47, 48-52 (window 8)
    got = sum(unit_loss(m, Projections(*tensors), a, b, T, weights) for _, a, b in units)  # each over 2 sequences
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-7)
    for n, g_got, g_ref in zip(NAMES, torch.autograd.grad(got, list(x.values())), torch.autograd.grad(
            expect, list(x.values())), strict=True):  # fmt: skip
        torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-6, msg=f"grad of {n}")


DECAYED = [("hybrid", 16), ("la_only", 16), (HYBRID_SINKS, 16), ("hybrid", 1), ("la_only", 1), ("la_only", 64)]
DECAYED += [("hybrid", 100), ("la_only", 100)]  # (two chunks back: the states and their lags move with the window)


def with_decay(T, seed, Hkv=2, F=16):
    """Inputs with 2 KV heads (GQA 3:1) and a decay rate per KV head, one slow and one fast: rho is an input."""
    x = make(T, H=3 * Hkv, Hkv=Hkv, F=F, seed=seed)
    x["rho"] = torch.linspace(0.03, 0.4, Hkv).requires_grad_()
    return x


def check_decay(fn, x, mask, ref_fn=naive.naive_hybrid_attention, atol=2e-5, initial_state=None, **options):
    """fn against ref_fn (the spec unless given) with x's rho as la_decay: outputs and every gradient, rho's and
    the initial state's included. chunk_size goes to ref_fn only."""
    names = (*NAMES, "rho")
    results = []
    for f, dtype, drop in ((fn, None, ("chunk_size",)), (ref_fn, torch.float64, ())):
        xs = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in x.items()}
        opts = {n: o for n, o in options.items() if n not in drop}
        init = None
        if initial_state is not None:
            init = tuple(t.detach().to(dtype or t.dtype).requires_grad_() for t in initial_state)
            opts["initial_state"] = init
        y = f(*(xs[n] for n in NAMES), attention_mask=mask, la_decay=xs["rho"], **opts)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
        inputs = [xs[n] for n in names] + list(init or ())
        grads = torch.autograd.grad(y, inputs, dy, allow_unused=True)
        results.append((y, [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads, strict=True)]))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y.double(), y_ref.double(), rtol=1e-5, atol=atol)
    what = (*names, "initial kv", "initial k")
    for n, a, b in zip(what, grads, grads_ref, strict=False):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=atol * 5, msg=f"grad of {n}")
    return grads_ref


@pytest.mark.parametrize(("mode", "window"), DECAYED)
def test_a_decay_equals_the_spec(mode, window):
    """The LA's decay: each key past the window weighted alpha^(distance past it) per KV head, la_only's keys inside
    it 1, the sinks never. Outputs and gradients (rho's too) against the spec, across several tiles and states, a
    left-padded row, GQA with a slow and a fast head."""
    T = window + 130
    grads = check_decay(triton_attention, with_decay(T, seed=window), left_padded(T), window=window,
                        **variant(mode), sinks=3)  # fmt: skip
    assert grads[-1].abs().min() > 0  # rho's gradient reaches both heads


@pytest.mark.parametrize("mode", ["hybrid", "la_only"])
def test_a_decay_with_holes_and_feature_chunks(mode):
    """The decay with padding in holes (packed and put back) and phi's F = 80 in chunks of 64: rho's gradient sums
    every chunk's share."""
    T = 100
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    mask[1, 20:24] = 0
    check_decay(triton_attention, with_decay(T, seed=8, F=80), mask, window=16, mode=mode, sinks=3)


@pytest.mark.parametrize(("mode", "window"), [("hybrid", 16), ("la_only", 16), (HYBRID_SINKS, 16), ("hybrid", 100)])
def test_a_decayed_initial_state_equals_the_chunked_path(mode, window):
    """Stage 1's units: an initial state (as query w - 1 of the sequence sees it) with a decay, a left-padded row
    beside a full one: outputs and gradients (rho's and the state's) against the chunked path, which the decay
    tests check against the spec."""
    T, F = 150, 16  # (three chunks: the state carries the initial one through the scan)
    x = with_decay(T, seed=12, F=F)
    g = torch.Generator().manual_seed(3)
    state = (torch.rand(2, 2, F, 16, generator=g), torch.rand(2, 2, F, generator=g))
    check_decay(triton_attention, x, left_padded(T), ref_fn=chunked.chunk_hybrid_attention,
                initial_state=state, window=window, **variant(mode), sinks=3, chunk_size=8)  # fmt: skip


def test_denominators_and_none_mode():
    x = make(40)
    y, den_e, den_l = triton_attention(*(x[n] for n in NAMES), window=16, return_denominators=True)
    ref = naive.naive_hybrid_attention(*(x[n] for n in NAMES), window=16, return_denominators=True)
    for a, b in zip((y, den_e, den_l), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kernels.EPS == naive.EPS
    zero = triton_attention(*(x[n] for n in NAMES), window=16, mode="none")
    assert torch.equal(zero, torch.zeros_like(zero))


DECODED = [(m, 16, False) for m in (*MODES, HYBRID_SINKS)] + [("hybrid", 1, False), ("swa_sinks", 4, False)]
DECODED += [(HYBRID_SINKS, 4, False), ("hybrid", 16, True), ("la_only", 4, True), (HYBRID_SINKS, 4, True)]
DECODED += [("swa_sinks", 16, True)]  # (a mode with no LA still carries a decayed state on)


@pytest.mark.parametrize(("mode", "window", "decay"), DECODED)
def test_fused_decode_step_equals_the_full_forward_and_extend(mode, window, decay):
    x = {n: t.detach() for n, t in (with_decay(40, seed=7) if decay else make(40, seed=7)).items()}
    rho = x.pop("rho", None)
    mask = left_padded(40, pad=5)
    options = dict(window=window, **variant(mode), sinks=3, **({"la_decay": rho} if decay else {}))
    full = naive.naive_hybrid_attention(*(x[n] for n in NAMES), **options, attention_mask=mask)
    B, Hkv, _, D = x["k"].shape
    fused = DecodeState.empty(
        Shape(
            kv_heads=Hkv,
            head_dim=D,
            value_dim=D,
            features=x["fk"].shape[-1],
            window=window,
            sinks=3,
            dtype=torch.float32,
        ),
        B,
        window,
        "cpu",
    )
    ref = copy.deepcopy(fused)

    def step(a, b):
        return dict(q=x["q"][:, :, a:b], k=x["k"][:, :, a:b], v=x["v"][:, :, a:b], fq=x["fq"][:, :, a:b],
                    fk=x["fk"][:, :, a:b], gamma=x["gamma"])  # fmt: skip

    P = 9  # a prompt, then one token at a time: the ring grows, fills, evicts into the state
    for state in (fused, ref):
        extend(state, *step(0, P).values(), attention_mask=mask[:, :P], **options)
    for t in range(P, 40):
        y = triton_decode(fused, *step(t, t + 1).values(), attention_mask=mask[:, t : t + 1], **options)
        y_ref = extend(ref, *step(t, t + 1).values(), attention_mask=mask[:, t : t + 1], **options)
        torch.testing.assert_close(y, full[:, :, t : t + 1], rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=2e-6)
    tol = 1e-5 if decay else 1e-6  # (a decayed state is multiplied every step: rounding of a few ulps of its sums)
    for a, b in zip(fused.tensors(), ref.tensors(), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert fused.ring == window and torch.equal(fused.count, ref.count) and fused.seen == ref.seen == 40


def test_the_decode_step_is_one_launch_of_at_least_32_programs_and_no_other_op(monkeypatch):
    """At Llama-3-8B's attention (B = 1, 32 heads, 8 KV heads, head dim 128, feature dim 256) the step splits the
    state over its value dim into >= 32 programs, and after the first step (which makes the step's counts) the
    wrapper runs no torch op but its own operator, which launches the kernel and allocates the output: a CUDA
    graph of it is one kernel node. (The kernel's launches are recorded here, not run.)"""
    from hybrid_scale_kernels.decode import _decode
    from torch.utils._python_dispatch import TorchDispatchMode

    launches = []  # (the kernel's class: JITFunction, or the interpreter's function here)
    record = lambda self, *a, grid, warmup, **kw: launches.append((self, grid, kw))  # noqa: E731
    monkeypatch.setattr(type(_decode), "run", record)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    B, H, Hkv, D, F, w = 1, 32, 8, 128, 256, 64
    state = DecodeState.empty(
        Shape(kv_heads=Hkv, head_dim=D, value_dim=D, features=F, window=w, sinks=8, dtype=torch.bfloat16), B, w, "cpu"
    )

    def one(*size, dtype=torch.bfloat16):
        return torch.ones(*size, dtype=dtype)

    inputs = (one(B, H, 1, D), one(B, Hkv, 1, D), one(B, Hkv, 1, D), one(B, H, 1, F), one(B, Hkv, 1, F), one(H))
    options = dict(window=w, sinks=8, hybrid_sinks=True, la_decay=one(Hkv, dtype=torch.float32),
                   attention_mask=one(B, 1, dtype=torch.long))  # fmt: skip
    triton_decode(state, *inputs, **options)
    with Ops() as mode:
        triton_decode(state, *inputs, **options)
    # one operator (the launch: an opaque node for torch.compile), and detach (a view: no kernel)
    assert set(mode.ops) == {"hybrid_scale_kernels.decode_step.default", "aten.detach.default"}, mode.ops
    assert len(launches) == 2 and {k.fn.__name__ if hasattr(k, "fn") else k.__name__ for k, _, _ in launches} == {
        "_decode"
    }
    grid = launches[-1][1]
    assert grid[0] >= 32 and launches[-1][2]["NSPLIT"] * launches[-1][2]["BLOCK_DV"] == D, grid


@pytest.mark.slow  # 11 s in the interpreter: `make test` runs it, `make test-fast` does not
def test_a_converted_model_runs_on_the_triton_backend(tiny):
    torch.manual_seed(0)
    models = {}
    for backend in ("torch", "triton"):
        model = hs.convert_model(tiny("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
                                 {"window": 16, "backend": backend, "la_decay": True})  # fmt: skip
        layers = hs.attention.layer.hybrid_layers(model).values()
        assert {m.backend for m in layers} == {backend}
        with torch.no_grad():  # a slow and a fast head, so the decay shows
            for m in layers:
                m.la_decay_rho.copy_(torch.tensor([0.05, 0.3]))
        models[backend] = model
    ids = torch.randint(3, 128, (2, 45))
    mask = left_padded(45, pad=6)
    out = {}
    for backend, model in models.items():
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        logits[mask.bool()].logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        gen = model.generate(ids[:, :30], attention_mask=mask[:, :30], max_new_tokens=6, do_sample=False)
        out[backend] = (logits.detach(), grads, gen)
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=1e-4, atol=1e-4)
    assert out["triton"][1].keys() == out["torch"][1].keys()
    for n, g in out["torch"][1].items():
        torch.testing.assert_close(out["triton"][1][n], g, rtol=1e-3, atol=1e-4, msg=n)
    assert torch.equal(out["triton"][2], out["torch"][2])


def test_the_backend_switch(monkeypatch):
    assert backends.resolve("auto", torch.device("cpu")) == "chunk"
    assert backends.resolve("torch", "cuda") == "chunk"
    monkeypatch.setattr(backends, "_CHECKED", {})
    monkeypatch.setattr(backends, "self_check", lambda name, device, **_: None)  # what passing it on a GPU gives
    assert backends.resolve("auto", torch.device("cuda")) == "triton"  # registered from its entry point
    assert backends.get_backend("triton") is kernels.forward and backends.get_decode("triton") is kernels.decode
    assert backends.get_decode("chunk") is None
    assert load_config(None).attention.backend == "auto"
    with pytest.raises(ConfigError, match="'attention.backend': 'cuda' is not allowed; choose one of: auto, torch, t"):
        load_config(None, ["attention.backend=cuda"])
    x = make(20)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a CPU machine outside the tests has
    with pytest.raises(ValueError, match="attention backend 'triton' runs on CUDA tensors, got cpu; use attention"):
        hs.attention.layer.attend(*(x[n] for n in NAMES[:5]), gamma=x["gamma"], window=4, backend="triton")


def test_a_copy_of_the_attention_files_finds_the_installed_kernels(tmp_path):
    """What an exported model carries (the attention package flattened beside its modeling file:
    export/remote_code.py) registers the kernels from their entry point into its own registry, and resolves auto to
    them for CUDA tensors."""
    from hybrid_scale.export.remote_code import write_remote_code

    (tmp_path / "exported").mkdir()
    write_remote_code(tmp_path / "exported")
    (tmp_path / "exported" / "__init__.py").write_text("")
    code = (
        "import sys; sys.modules.pop('hybrid_scale', None)\n"
        "from exported import backends, layer\n"
        "backends.self_check = lambda name, device, **_: None\n"  # no GPU here: as if it passed there
        "print(backends.resolve('auto', 'cuda'), backends.resolve('auto', 'cpu'), "
        "backends.get_backend('triton').__module__, backends.get_decode('triton').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton", "chunk", "hybrid_scale_kernels", "decode"]


@pytest.mark.slow  # 26 s in the interpreter
def test_auto_uses_the_kernels_only_after_they_pass_their_self_check(registry, monkeypatch):
    """auto checks the kernels once per device (forward, backward, decode against the torch path); a failure is a
    warning naming it, and the torch path runs."""
    assert backends.self_check("triton", "cpu", torch.float32) is None  # under the interpreter, fp32
    registry.register_backend("off", lambda *a, **k: 1.01 * chunked.chunk_hybrid_attention(*a, **k))
    assert backends.self_check("off", "cpu", torch.float32).startswith("output (unpadded batch) differs from the torch")
    assert backends.self_check("triton", "cuda").startswith(("RuntimeError", "AssertionError"))  # no CUDA here
    monkeypatch.setattr(backends, "_CHECKED", {})
    with pytest.warns(UserWarning, match=r"attention backend 'triton' failed its self-check on cuda at 4 heads"):
        assert backends.resolve("auto", "cuda") == "chunk"
    assert backends.resolve("auto", "cuda") == "chunk"  # checked once: no second warning, same answer
    with pytest.raises(ValueError, match=r"attention backend 'triton' failed its self-check on cuda at 4 heads / 2 K"):
        backends.resolve("triton", "cuda")  # asked for by name: refused at the check, not later


def test_the_self_check_runs_at_the_model_shape_and_refuses_what_the_kernels_cannot_take(registry, monkeypatch):
    """The check runs once per device and attention shape, at that shape; a shape the kernels declare they cannot
    take fails it by name, so auto uses torch and backend=triton refuses it before anything runs."""
    seen = []
    real = backends.self_check
    monkeypatch.setattr(backends, "_CHECKED", {})
    monkeypatch.setattr(backends, "self_check", lambda name, device, **kw: seen.append(kw["shape"]))
    llama = backends.Shape(32, 8, 128, 128, 256, 64, 8, torch.bfloat16)
    smol = backends.Shape(9, 3, 64, 64, 128, 64, 8, torch.bfloat16)
    for shape in (llama, smol, llama):
        assert backends.resolve("auto", "cuda", shape) == "triton"
    assert seen == [llama, smol]  # once per shape
    x = make(20, H=6, Hkv=2, D=32, F=16)
    with pytest.warns(UserWarning):  # the real check, with a stub that would fail anything: shape recorded
        monkeypatch.setattr(backends, "self_check", lambda name, device, **kw: seen.append(kw["shape"]) or "no")
        shape = backends.Shape.of(x["q"], x["k"], x["v"], x["fq"], AttentionOptions(window=4, sinks=2))
        backends.resolve("auto", "cuda", shape)
    assert seen[-1] == backends.Shape(6, 2, 32, 32, 16, 4, 2, torch.float32)
    wide = backends.Shape(16, 16, 256, 256, 512, 64, 8, torch.bfloat16)  # head dim 256: not compile-checked
    why = real("triton", "cuda", shape=wide)
    assert why == "it cannot take this shape: head dim 256 is over 128, the largest the kernels are compile-checked at"
    assert kernels.supports(128, 128, 256, 8, torch.bfloat16) is None
    assert "value dim 64 differs" in kernels.supports(128, 64, 256, 8, torch.bfloat16)
    own = backends.Shape.of(x["q"], x["k"], x["v"], x["fq"], AttentionOptions(window=4, sinks=2, hybrid_sinks=True))
    assert own.hybrid_sinks and "2 sinks (the hybrid's own)" in str(own)
    # the real check of a hybrid with its sinks (forward, backward, 20 decode steps), here in the interpreter
    assert real("triton", "cpu", shape=backends.Shape(2, 1, 16, 16, 16, 4, 2, torch.float32, True)) is None


def test_the_attention_package_never_imports_the_kernels():
    root = os.path.join(os.path.dirname(hs.__file__), "attention")
    for name in os.listdir(root):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                text = f.read()
                assert "import hybrid_scale_kernels" not in text and "from hybrid_scale_kernels" not in text, name


def test_la_only_equals_flash_linear_attention_naive_reference():
    """An independent check of the linear-attention math: la_only (the spec, the chunked path and the kernels under
    the interpreter) against fla-core's naive recurrent linear attention, normalised, with phi_q, phi_k as its q, k
    (its scale cancels in the normalised form: 1 here)."""
    fla_naive = pytest.importorskip(
        "fla.ops.linear_attn.naive", reason="fla-core is a dev extra"
    ).naive_recurrent_linear_attn
    x = make(45, H=3, Hkv=3, F=24, seed=9)
    ref, _ = fla_naive(*(x[n].detach().double().transpose(1, 2) for n in ("fq", "fk", "v")), scale=1.0, normalize=True)
    ref = ref.transpose(1, 2)
    args = [x[n].detach() for n in NAMES]
    for fn in (naive.naive_hybrid_attention, chunked.chunk_hybrid_attention, triton_attention):
        y = fn(*args, window=8, mode="la_only")
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6, msg=fn.__name__)
