"""The chunked prefill's state scan split over the sequence (kernels/hybrid_scale_kernels/chunk_split.py) stores what
the unsplit scan stores, in Triton's interpreter (fp32): every segment count, with and without a decay, with the
hybrid's sinks left out, T not a multiple of the chunk, GQA rows; and `plan`'s choice of segments."""

import pytest
import torch

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
from hybrid_scale_kernels import chunk_prefill, chunk_split  # noqa: E402
from hybrid_scale_kernels.chunk_split import plan, split_states  # noqa: E402
from triton import language as tl  # noqa: E402


def _inputs(T, B=2, Hkv=2, F=32, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, Hkv, T, F, generator=g), torch.randn(B, Hkv, T, D, generator=g)


def _unsplit(fk, v, rho, n_excl, ns):
    cfg = chunk_prefill._settings(fk, fk.shape[-1], fk.shape[-1])
    return chunk_prefill._states(fk, v, rho, n_excl, ns, cfg, tl.float32, "ieee")


@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize(("decay", "n_excl"), [(False, 0), (True, 0), (True, 4), (False, 4)])
def test_the_split_scan_stores_the_unsplit_scans_states(segments, decay, n_excl):
    T = 5 * 64 + 17  # 6 chunks, the last partial
    fk, v = _inputs(T)
    rho = torch.tensor([0.002, 0.05]) if decay else None
    ns = -(-T // 64)
    h_ref, z_ref = _unsplit(fk, v, rho, n_excl, ns)
    h, z = torch.empty_like(h_ref), torch.empty_like(z_ref)
    split_states(fk, v, rho, n_excl, ns, h, z, segments=segments, block_f=32, block_dv=16, warps=4,
                 dt=tl.float32, prec="ieee")  # fmt: skip
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-4)
    assert h_ref[:, :, 1:].abs().amax() > 1  # (the states are not all zero)


def test_plan_splits_only_what_leaves_sms_idle():
    assert plan(programs=128, chunks=256, sms=132) == 3  # Llama-3-8B at 16k: 128 programs; 384 fill the SMs twice
    assert plan(programs=256, chunks=256, sms=132) == 1  # enough programs already
    assert plan(programs=12, chunks=256, sms=132) == 22  # SmolLM2 at 16k
    assert plan(programs=12, chunks=64, sms=132) == 8  # 4k: segments of at least 8 chunks
    assert plan(programs=12, chunks=15, sms=132) == 1  # too short to be worth it
    assert chunk_split.CHUNK == chunk_prefill.CHUNK
