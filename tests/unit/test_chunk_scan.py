"""The chunked state scans split over the sequence (kernels/hybrid_scale_kernels/chunk_h.py) store what the
unsplit scans store, in Triton's interpreter (fp32): the forward's states at every segment count, with and without a
decay, with the hybrid's sinks left out, T not a multiple of the chunk, GQA rows; the reverse scan's state gradients,
the initial state's and rho's share through the carries, at segment counts that leave the last segment short;
`plan`'s choice of segments; and the prefill (forward and backward) with both scans split equals the spec."""

import dataclasses

import pytest
import torch
from kernel_inputs import with_keywords

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
triton_attention = with_keywords(kernels.triton_hybrid_attention)
from hybrid_scale_kernels import chunk_h  # noqa: E402
from hybrid_scale_kernels.chunk import Case  # noqa: E402
from hybrid_scale_kernels.chunk_h import dstates, plan, resident, states  # noqa: E402
from triton import language as tl  # noqa: E402


def _inputs(T, B=2, Hkv=2, F=32, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, Hkv, T, F, generator=g), torch.randn(B, Hkv, T, D, generator=g)


def _scan(fk, v, rho, n_excl, ns, segments, init=None):
    return states(fk, v, rho, n_excl, ns, block_f=32, block_dv=16, warps=4, dt=tl.float32, prec="ieee",
                  segments=segments, init=init)  # fmt: skip


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize(("decay", "n_excl", "init"), [(False, 0, False), (True, 0, True), (True, 4, False),
                                                       (False, 4, True)])  # fmt: skip
def test_the_split_scan_stores_the_unsplit_scans_states(segments, decay, n_excl, init):
    """With an initial state only the first segment starts from it; the later ones get it through the fix."""
    T = 5 * 64 + 17  # 6 chunks, the last partial
    fk, v = _inputs(T)
    rho = torch.tensor([0.002, 0.05]) if decay else None
    ns = -(-T // 64)
    h0 = (torch.rand(2, 2, 32, 16), torch.rand(2, 2, 32)) if init else None
    h_ref, z_ref = _scan(fk, v, rho, n_excl, ns, segments=1, init=h0)
    h, z = _scan(fk, v, rho, n_excl, ns, segments=segments, init=h0)
    if init:
        torch.testing.assert_close(h_ref[:, :, 0], h0[0])  # (state 0 is the initial state)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-4)
    assert h_ref[:, :, 1:].abs().amax() > 1  # (the states are not all zero)


def _reverse(monkeypatch, segments, decay, init):
    """dstates of one call (hybrid, window 16, GQA 2:1) with `plan` giving `segments`: 10 chunks, 9 states; feature
    and value blocks of 16 and 8 (two of each: the programs that store dz and those that do not)."""
    monkeypatch.setattr(chunk_h, "plan", lambda *a, **k: segments)
    B, H, Hkv, T, F, D = 2, 4, 2, 9 * 64 + 17, 32, 16
    g = torch.Generator().manual_seed(4)
    fq, dy = torch.rand(B, H, T, F, generator=g), torch.randn(B, H, T, D, generator=g)
    zs, dlz = 1 + torch.rand(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    fk, v = _inputs(T, B=B, Hkv=Hkv, F=F, D=D, seed=1)
    rho = torch.tensor([0.002, 0.05]) if decay else None
    h0 = (torch.rand(B, Hkv, F, D, generator=g), torch.rand(B, Hkv, F, generator=g)) if init else None
    case = Case.of(torch.empty(B, H, T, D), fq, window=16, mode="hybrid", sinks=0, hybrid_sinks=False, scale=1.0,
                   decay=decay, init=init)  # fmt: skip
    case = dataclasses.replace(case, cfg=dict(case.cfg, block_f=16, block_dv=8))
    ns = -(-T // 64) - case.nb
    state = _scan(fk, v, rho, 0, ns, segments=1, init=h0)
    return dstates(fq, dy, zs, dlz, rho, state, case)


@pytest.mark.parametrize("segments", [2, 3, 5])  # (9 states: segments of 5 + 4, 3 x 3, 4 x 2 + 1)
@pytest.mark.parametrize(("decay", "init"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_split_reverse_scan_stores_the_unsplit_scans_gradients(monkeypatch, segments, decay, init):
    """Each segment starts from zero; `_dstates_fix` adds what the later ones carry in: every state's gradient, the
    initial state's (in the first segment), and rho's share through the carries (the part the segment's own scan
    could not see, from its weighted sum of states)."""
    (dh_ref, dz_ref), (dh0_ref, dz0_ref), r_ref = _reverse(monkeypatch, 1, decay, init)
    (dh, dz), (dh0, dz0), r = _reverse(monkeypatch, segments, decay, init)
    torch.testing.assert_close(dh[:, :, 1:], dh_ref[:, :, 1:], rtol=1e-5, atol=1e-4)  # (state 0's slot: unused)
    torch.testing.assert_close(dz[:, :, 1:], dz_ref[:, :, 1:], rtol=1e-5, atol=1e-4)
    assert dh_ref[:, :, 1:].abs().amax() > 1 and dz_ref[:, :, 1:].abs().amax() > 1
    if init:
        torch.testing.assert_close(dh0, dh0_ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(dz0, dz0_ref, rtol=1e-5, atol=1e-4)
    if decay:  # (rho's partial sums: one per program, summed per KV head as chunk.py sums them)
        total, total_ref = (t.double().view(2, 2, -1).sum(-1) for t in (r, r_ref))
        torch.testing.assert_close(total, total_ref, rtol=1e-5, atol=1e-3)
        assert total_ref.abs().min() > 1


def test_plan_splits_only_what_leaves_sms_idle():
    assert plan(programs=128, chunks=256, sms=132) == 3  # Llama-3-8B at 16k: 128 programs; 384 fill the SMs twice
    assert plan(programs=256, chunks=256, sms=132) == 1  # enough programs already
    assert plan(programs=12, chunks=256, sms=132) == 22  # SmolLM2 at 16k
    assert plan(programs=12, chunks=64, sms=132) == 8  # 4k: segments of at least 8 chunks
    assert plan(programs=12, chunks=15, sms=132) == 1  # too short to be worth it


def test_plan_keeps_a_one_per_sm_launch_in_one_wave():
    """sm_90's reverse scan ([64, 128] tiles, 8 warps under a cap of 255: one program per SM) at Llama-3-8B's shape: 32
    programs, cut into 4 segments (128 programs, one wave of 16-state chains), not the 9 that fill the SMs twice (288
    programs: three waves, the last partly filled, of 8-state chains)."""
    assert resident(warps=8, maxnreg=255) == 1
    assert resident(warps=4, maxnreg=255) == 2  # (sm_80's reverse scan)
    assert resident(warps=4, maxnreg=128) == 4  # (the forward scan)
    assert resident(warps=4, maxnreg=None) == 1
    assert plan(programs=32, chunks=64, sms=132) == 8
    assert plan(programs=32, chunks=64, sms=132, per_sm=1) == 4
    assert plan(programs=32, chunks=256, sms=132, per_sm=1) == 4
    assert plan(programs=128, chunks=256, sms=132, per_sm=4) == 3  # (the twice-filled rule bounds it first)
    assert plan(programs=100, chunks=256, sms=132, per_sm=1) == 1


def test_the_prefill_with_a_split_scan_equals_the_spec(monkeypatch):
    """The entry (forward and backward) where `plan` splits both scans (the SM count of a GPU stood in for)."""
    from hybrid_scale.attention.hedgehog import naive

    monkeypatch.setattr(chunk_h, "SMS_OFF_GPU", 132)
    calls = []
    monkeypatch.setattr(chunk_h, "plan", lambda *a, **k: calls.append(a) or 3)
    from kernel_inputs import make

    x = make(3 * 64 * 2 + 5, B=1, H=4, Hkv=2, D=16, F=32, seed=3, requires_grad=False)
    rho = torch.tensor([0.01, 0.2])
    opts = dict(window=16, mode="hybrid", sinks=4, hybrid_sinks=True)
    leaf = {n: t.clone().requires_grad_() for n, t in x.items()}
    r = rho.clone().requires_grad_()
    y = triton_attention(**leaf, **opts, la_decay=r)
    grads = torch.autograd.grad(y.square().sum(), [*leaf.values(), r])
    ref_leaf = {n: t.double().requires_grad_() for n, t in x.items()}
    r_ref = rho.double().requires_grad_()
    y_ref = naive.naive_hybrid_attention(**ref_leaf, **opts, la_decay=r_ref)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [*ref_leaf.values(), r_ref])
    assert calls  # the split ran
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=2e-5)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
