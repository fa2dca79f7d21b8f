"""Decode state: any split of a sequence into extensions equals the naive spec over the whole sequence."""

import pytest
import torch
from conftest import HYBRID_SINKS, attention_inputs, variant

from hybrid_scale.attention.hedgehog import naive, recurrent
from hybrid_scale.attention.settings import MODES
from hybrid_scale.attention.shape import Shape


def slices(x, a, b):
    return {n: (t if n == "gamma" else t[:, :, a:b]) for n, t in x.items()}


CUTS = {
    "long prefill": [
        0,
        21,
        24,
        27,
        28,
        29,
        30,
        31,
        45,
        50,
    ],  # long prefill (chunked), 3-token chunks, single tokens, 14
    "short prefill": [0, 2, 5, 30, 31, 50],  # the sinks still in the ring, then leaving it in a long extension
}


@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("mode", [*MODES, HYBRID_SINKS])
@pytest.mark.parametrize("window", [1, 4, 9, 64])
def test_extensions_equal_full(mode, window, cuts):
    T = 50
    x = attention_inputs(B=2, H=4, Hkv=2, T=T, D=8, F=6, seed=window)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :7] = 0  # left padding, longer than the sinks
    mask[1, 30] = 0
    ref = naive.naive_hybrid_attention(**x, window=window, **variant(mode), sinks=3, attention_mask=mask)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=8, value_dim=8, features=6, window=window, sinks=3, dtype=torch.float64),
        2,
        min(window, T),
        "cpu",
    )
    cuts = CUTS[cuts]
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        x_ab = slices(x, a, b)
        outs.append(
            recurrent.extend(
                state, **x_ab, window=window, **variant(mode), sinks=3, attention_mask=mask[:, a:b], chunk_size=8
            )
        )
    torch.testing.assert_close(torch.cat(outs, 2), ref, rtol=1e-10, atol=1e-12)
    assert state.count.tolist() == mask.sum(1).tolist() and state.seen == T


def test_state_size_is_constant_its_tensors_stay_in_place_and_window_is_fixed():
    x = attention_inputs(B=1, T=300, D=8, F=6, dtype=torch.float32)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=8, value_dim=8, features=6, window=16, sinks=4, dtype=torch.float32), 1, 16, "cpu"
    )
    assert state.ring == 16  # allocated at the window, never re-laid out
    storage = {name: t.data_ptr() for name, t in vars(state).items() if isinstance(t, torch.Tensor)}
    size = state.nbytes
    for t in range(0, 300):
        recurrent.extend(state, **slices(x, t, t + 1), window=16, sinks=4)
    recurrent.extend(state, **slices(x, 0, 5), window=16, sinks=4)
    assert state.nbytes == size and int(state.seen) == 305
    assert {name: t.data_ptr() for name, t in vars(state).items() if isinstance(t, torch.Tensor)} == storage
    with pytest.raises(ValueError, match="a live cache cannot change window"):
        recurrent.extend(state, **slices(x, 0, 1), window=8, sinks=4)
    with pytest.raises(ValueError, match="this cache keeps 4 sinks, the layer now has 2"):
        recurrent.extend(state, **slices(x, 0, 1), window=16, sinks=2)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("mode", [*MODES, HYBRID_SINKS])
@pytest.mark.parametrize("window", [1, 4, 9])
def test_compiled_decode_step_equals_full_and_writes_in_place(mode, window, decay):
    """recurrent.step (fixed shapes, no host sync, in place) after a prefill, one token at a time through padding,
    the sinks leaving the ring and the window filling, equals the spec over the whole sequence."""
    T, P = 40, 5
    x = attention_inputs(B=2, H=4, Hkv=2, T=T, D=8, F=6, seed=window)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 20] = 0  # a padded step
    rho = {"la_decay": torch.tensor([0.05, 0.3], dtype=torch.float64)} if decay else {}
    opts = dict(window=window, **variant(mode), sinks=3, **rho)
    ref = naive.naive_hybrid_attention(**x, **opts, attention_mask=mask)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=8, value_dim=8, features=6, window=window, sinks=3, dtype=torch.float64),
        2,
        window,
        "cpu",
    )
    outs = [recurrent.extend(state, **slices(x, 0, P), **opts, attention_mask=mask[:, :P])]
    storage = [t.data_ptr() for t in state.tensors()]
    for t in range(P, T):
        outs.append(recurrent.step(state, **slices(x, t, t + 1), **opts, attention_mask=mask[:, t : t + 1]))
    torch.testing.assert_close(torch.cat(outs, 2), ref, rtol=1e-10, atol=1e-12)
    assert state.count.tolist() == mask.sum(1).tolist() and int(state.seen) == T
    assert [t.data_ptr() for t in state.tensors()] == storage
    with pytest.raises(ValueError, match="use extend"):
        recurrent.step(state, **slices(x, 0, 2), **opts)


def test_overflowing_a_short_ring_is_an_error():
    x = attention_inputs(B=1, T=12, D=8, F=6)
    state = recurrent.DecodeState.empty(
        Shape(kv_heads=2, head_dim=8, value_dim=8, features=6, window=64, sinks=4, dtype=torch.float64), 1, 10, "cpu"
    )  # max_length 10 < window
    recurrent.extend(state, **slices(x, 0, 10), window=64, sinks=4)
    with pytest.raises(ValueError, match="create the cache with a larger max_length"):
        recurrent.extend(state, **slices(x, 10, 12), window=64, sinks=4)


@pytest.mark.parametrize("mode", ["hybrid", "la_only", HYBRID_SINKS])
def test_a_half_precision_state_keeps_phi_k_in_its_dtype_and_loses_nothing(mode):
    """A bf16 model's rings keep phi_k in bf16 (half the bytes of fp32; every value they hold is an input's phi_k),
    and a prefill and single-token steps give exactly what rings of fp32 give."""
    T, window = 40, 9
    x = {n: t.to(torch.bfloat16) for n, t in attention_inputs(B=1, H=4, Hkv=2, T=T, D=8, F=6, seed=1).items()}
    shape = Shape(kv_heads=2, head_dim=8, value_dim=8, features=6, window=window, sinks=3, dtype=torch.bfloat16)
    half, wide = (recurrent.DecodeState.empty(shape, 1, window, "cpu") for _ in range(2))
    assert half.fk.dtype == half.sink_fk.dtype == torch.bfloat16 and half.kv.dtype == torch.float32
    wide.fk, wide.sink_fk = wide.fk.float(), wide.sink_fk.float()
    outs = {}
    for name, state in (("half", half), ("wide", wide)):
        steps = [recurrent.extend(state, **slices(x, 0, 20), window=window, **variant(mode), sinks=3, chunk_size=8)]
        for t in range(20, T):
            steps.append(recurrent.extend(state, **slices(x, t, t + 1), window=window, **variant(mode), sinks=3))
        outs[name] = torch.cat(steps, 2)
    assert torch.equal(outs["half"], outs["wide"])
    assert half.fk.nbytes * 2 == wide.fk.nbytes
