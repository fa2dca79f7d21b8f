"""The query heads of a KV head folded into one program of `_chunk_output` and `_chunk_bwd_dq` (issue 67: their KV
head's keys, values, phi_k and state read once for GF query heads, not once per head).

`chunk_h.fold` picks GF, the largest divisor of the group that still leaves twice as many programs as SMs; Triton's
interpreter (no SMs: SMS_OFF_GPU 0) folds the whole group, so every other kernel test runs folded. Here the same
calls run with GF = 1 and with GF = 2 of a group of 4 (SMS_OFF_GPU raised so that folding would leave SMs idle), each
against the fp64 spec, and the launches at Llama-3-8B's shape are checked to fold 4 heads on 132 SMs.
"""

import pytest
import torch
from kernel_inputs import with_keywords
from test_chunk_backward import check, inputs

from tools.compile_check import record_launches

kernels = pytest.importorskip("hybrid_scale_kernels", reason="the kernels need triton: pip install -e '.[triton]'")
from hybrid_scale_kernels import chunk_h  # noqa: E402


def test_fold_takes_the_largest_divisor_that_keeps_the_sms_busy():
    assert chunk_h.fold(4, 32 * 64, 132) == 4  # Llama-3-8B at 4k: 512 programs >= 264
    assert chunk_h.fold(4, 32 * 16, 132) == 1  # at 1k, 128 or 256 programs would leave SMs idle
    assert chunk_h.fold(4, 32 * 32, 132) == 2  # at 2k: 512 programs, not 256
    assert chunk_h.fold(3, 9 * 32, 132) == 1  # SmolLM2-135M (9 heads, 3 KV heads) at 2k
    assert chunk_h.fold(6, 12, 0) == 6  # the interpreter folds the whole group
    assert chunk_h.fold(1, 10, 0) == 1
    x = torch.empty(1)
    assert chunk_h.heads_per_program(x, 12, 6, {"fold": 1}) == 6
    assert chunk_h.heads_per_program(x, 12, 6, {"fold": 0}) == 1  # (the settings turn it off)


@pytest.mark.parametrize(("sms", "gf"), [(10**6, 1), (3, 2), (0, 4)])
@pytest.mark.parametrize(("mode", "decay"), [("hybrid", True), ("swa_sinks", False)])
def test_each_fold_computes_the_spec(monkeypatch, sms, gf, mode, decay):
    """GQA 4:1 at T = 200 (4 chunks, 16 one-head programs): GF = 1, 2 or 4 heads a program, y and every gradient
    against the fp64 spec; the launches' grids say which GF ran."""
    monkeypatch.setattr(chunk_h, "SMS_OFF_GPU", sms)
    chosen, fold = [], chunk_h.fold
    monkeypatch.setattr(chunk_h, "fold", lambda *a: chosen.append(fold(*a)) or chosen[-1])
    x, dy = inputs(200, H=4, Hkv=1, seed=11)
    check(x, dy, decay=decay, window=16, mode=mode, sinks=5)
    assert chosen == [gf, gf]  # (the forward's and _chunk_bwd_dq's)


def test_the_8b_shape_folds_four_heads_a_program_on_132_sms(monkeypatch):
    monkeypatch.setattr(chunk_h, "SMS_OFF_GPU", 132)
    T, H, Hkv, D, F = 4096, 32, 8, 128, 256
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, fq = torch.empty(1, H, T, D, **meta, requires_grad=True), torch.empty(1, H, T, F, **meta, requires_grad=True)
    k, v = (torch.empty(1, Hkv, T, D, **meta, requires_grad=True) for _ in range(2))
    fk = torch.empty(1, Hkv, T, F, **meta, requires_grad=True)
    gamma = torch.empty(H, device="meta", requires_grad=True)
    fn = with_keywords(kernels.triton_hybrid_attention)
    with record_launches() as launches:
        fn(q, k, v, fq, fk, gamma, window=64, mode="hybrid").sum().backward()
    grids = {launch.name: launch.grid for launch in launches}
    assert grids["_chunk_output"] == (Hkv, T // 64)
    assert grids["_chunk_bwd_dq"] == (Hkv, T // 64)
