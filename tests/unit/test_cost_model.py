"""The kernels' cost model (benchmarks/attention/roofline.py, kernel_tiles.py): it counts the launches the wrappers
make with the state scan planned for an H100's 132 SMs (recorded here on their own), every output a kernel stores
in full and every input it reads, memsets and both sides of a cast in the glue, y in the irreducible bytes, tiles
shared by resident programs once per wave, and needed FLOPs that the kernels' own do not undercut. Today's figures
(2.89x the irreducible bytes, issue 67's target of 3x met; 1.26x the needed FLOPs, met) are bounds that keep them
from getting worse."""

from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hybrid_scale_kernels import chunk_h
from hybrid_scale_kernels.chunk import triton_hybrid_attention

from benchmarks.attention import roofline
from hybrid_scale.attention.options import AttentionOptions
from tools.compile_check import Launch, record_launches

H, HKV, D, F = 32, 8, 128, 256  # Llama-3-8B's attention, Hedgehog's feature dim


@pytest.fixture(scope="module")
def counted():
    return {T: roofline.count(T) for T in roofline.LENGTHS}


def recorded(T: int) -> list:
    """The launches of one forward + backward at the model's shape, recorded here, the scan planned for 132 SMs."""

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    q, k, v, fq, fk = meta(1, H, T, D), meta(1, HKV, T, D), meta(1, HKV, T, D), meta(1, H, T, F), meta(1, HKV, T, F)
    gamma, rho = torch.empty(H, device="meta", requires_grad=True), torch.empty(HKV, device="meta", requires_grad=True)
    with mock.patch.object(chunk_h, "SMS_OFF_GPU", 132), record_launches() as launches:
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, AttentionOptions(window=64, sinks=8, hybrid_sinks=True),
                                    la_decay=rho)  # fmt: skip
        torch.autograd.grad(y, (q, k, v, fq, fk, gamma, rho), torch.empty_like(y))
    return launches


def test_the_counted_launches_are_the_recorded_ones_planned_for_132_sms(counted):
    for T in roofline.LENGTHS:
        launches = recorded(T)
        costs = counted[T][0]
        assert {c.name: c.launches for c in costs} == Counter(x.name for x in launches), T
        assert {c.name: c.programs for c in costs} == {c.name: sum(x.programs for x in launches if x.name == c.name)
                                                        for c in costs}  # fmt: skip
        names = {c.name for c in costs}  # (both scans split, each with its fix)
        assert {"_segment_fix", "_dstates_fix"} <= names and sum(c.launches for c in costs) == 7


# What a kernel stores whole (each tile once per program that writes it) and reads whole at least once.
WRITTEN = {
    "_chunk_states": ("HKV", "HK", "END", "ZEND"),
    "_chunk_output": ("Y", "YLO", "M", "ZS", "IDX"),
    "_chunk_bwd_dq": ("DQ", "DFQ", "DLZ", "RSUM", "SINK_DS", "SINK_E"),
    "_chunk_bwd_dkv": ("DFK",),  # (and dk, dv: their sink rows twice, below)
}
# Rows of each head no L term reaches at window 64, so the kernel need not read them: phi_q of the first chunk's
# queries (no state before them either), phi_k of the last chunk's keys (no query 64 past them)
PARTLY = {("_chunk_output", "FQ"): 64, ("_chunk_bwd_dkv", "FQ"): 64, ("_chunk_output", "FK"): 64,
          ("_chunk_bwd_dq", "FK"): 64, ("_chunk_bwd_dkv", "FK"): 64}  # fmt: skip
READ = {
    "_chunk_output": ("Q", "K", "V", "FQ", "FK"),
    "_chunk_bwd_dq": ("Q", "K", "V", "FK", "DY", "Y", "YLO", "M", "ZS", "IDX"),
    "_chunk_bwd_dkv": ("Q", "K", "V", "FQ", "FK", "DY", "ZS", "DLZ", "M", "IDX", "RSUM", "SINK_DS", "SINK_E"),
}


def test_every_store_is_counted_and_every_input_read(counted):
    """y is stored once in bf16 and its rounding error beside it (training: for the backward's dlz); the sink keys'
    rows of dk and dv twice (their chunk's program, then the KV head's last with the sinks' sums)."""
    costs = {c.name: c for c in counted[4096][0]}
    for launch in recorded(4096):
        names = launch.kernel.arg_names
        tensors = {n: t for n, t in zip(names, launch.args, strict=False) if isinstance(t, torch.Tensor)}
        for name in WRITTEN.get(launch.name, ()):
            assert costs[launch.name].written[name] == tensors[name].numel() * tensors[name].element_size(), name
        for name in READ.get(launch.name, ()):
            t = tensors[name]
            unread = PARTLY.get((launch.name, name), 0) * t.numel() // t.shape[-2]  # (rows of each head)
            assert costs[launch.name].read[name] >= (t.numel() - unread) * t.element_size(), (launch.name, name)
    assert costs["_chunk_output"].written["Y"] == costs["_chunk_output"].written["YLO"] == H * 4096 * D * 2
    for name in ("DK", "DV"):
        assert costs["_chunk_bwd_dkv"].written[name] == (4096 + 16) * HKV * D * 2, name


def test_the_glue_counts_memsets_both_sides_of_a_cast_and_ops_on_more_than_t_f_elements():
    glue = roofline.Glue(big=1000)
    with glue:
        torch.zeros(2000, device="meta")  # a memset: 8000 bytes written
        x = torch.empty(2000, device="meta")  # an allocation: nothing
        x.to(torch.bfloat16)  # a cast: 8000 bytes read, 4000 written
        x.sum()  # 8000 bytes read, 4 written: on 2000 elements, though its output is one
        torch.empty(2000, device="meta", dtype=torch.bfloat16).copy_(x)  # 8000 bytes read, 4000 written
        torch.zeros(0, device="meta")  # on no element: launches nothing
    assert (glue.ops, glue.memsets, glue.nbytes) == (4, 1, 8000 + 12000 + 8004 + 12000)
    assert glue.over == ["zeros", "_to_copy", "sum", "copy_"]


def test_the_irreducible_bytes_hold_y_which_the_backward_reads(counted):
    for T in roofline.LENGTHS:
        inputs = (H * T * (D + F) + HKV * T * (2 * D + F)) * 2
        y = H * T * D * 2
        assert counted[T][2] == 3 * inputs + 3 * y  # fwd: inputs, y; bwd: inputs, y, dy, the inputs' gradients
    assert counted[4096][2] == 503_316_480


def _fake(a):
    def program(p, x, y, z):
        p.read("X", 0, 64, 0, 128)  # every program: the same tile
        p.write("X", 64 * (x + 1), 64, 0, 128)  # its own
        p.dot(64, 64, 128)

    return program


@pytest.mark.parametrize("kwargs, ctas", [(dict(num_warps=8, maxnreg=255), 1), (dict(num_warps=4, maxnreg=128), 4),
                                          (dict(num_warps=4), 1)])  # fmt: skip
def test_tiles_shared_by_resident_programs_count_once_per_wave(monkeypatch, kwargs, ctas):
    """1000 programs read one tile and write their own: with no L2 reuse 2000 tiles; shared once, the read tile once
    per wave of 132 SMs x CTAs per SM (8 waves of 132, or 2 of 528)."""
    monkeypatch.setitem(roofline.KERNELS, "_fake", _fake)
    x = torch.empty(64 * 1001, 128, device="meta", dtype=torch.bfloat16)
    cost = roofline.Cost("_fake")
    roofline.cost_of(Launch(SimpleNamespace(__name__="_fake", arg_names=["X"]), (x,), kwargs, (1000,)), cost)
    tile = 64 * 128 * 2
    assert (cost.programs, cost.ctas, cost.flops) == (1000, ctas, 1000 * 2 * 64 * 64 * 128)
    assert cost.nbytes == 2000 * tile
    assert cost.shared == (-(-1000 // (132 * ctas)) + 1000) * tile


FORWARD = {"_chunk_states", "_segment_fix", "_chunk_output"}


def test_the_kernels_flops_are_the_needed_and_the_recompute_the_loops_make(counted):
    """What the kernels compute beyond the needed products, per query head and band block (B = 2 T / 64 - 1 of them;
    X = q k^T's 2 x 64 x 64 x D, Y = phi_q phi_k^T's 2 x 64 x 64 x F). Forward: the row max's own pass over the
    scores (X), and the scan's product of a last state no one reads. Backward: _chunk_bwd_dkv computes the scores and
    dp once more than the needed (2X; they are computed once in it, once in _chunk_bwd_dq, each tile once);
    _chunk_bwd_dq computes on the masked block before position 0 of chunk 0 (3X + Y per head); with the decay,
    _chunk_dstates computes phi_q^T (e lag do) beside phi_q^T (lag do) for rho's share through the lags (the needed
    product again: 2 F D per head for each query that reads a state, T - 128 of them). The sinks' products are the
    needed ones."""
    for T in roofline.LENGTHS:
        costs, glue, _ = counted[T]
        need = roofline.needed_flops(T)
        fwd = sum(c.flops for c in costs if c.name in FORWARD)
        bwd = sum(c.flops for c in costs if c.name not in FORWARD) + glue.flops
        blocks, x, y = 2 * T // 64 - 1, 2 * 64 * 64 * D, 2 * 64 * 64 * F
        assert fwd - need["forward"] == H * blocks * x + 2 * HKV * 64 * F * D, T
        assert bwd - need["backward"] == H * blocks * 2 * x + H * (3 * x + y) + H * (T - 128) * 2 * F * D, T


def test_the_cost_model_holds_its_ground(counted):
    """Issue 67's targets at both lengths: <= 7 launches (met: 7, both scans split, each with its fix), no torch op
    on more than T x F elements (met), FLOPs <= 1.3x the needed (met: 1.26x); bytes <= 3x the irreducible (met:
    2.89x, 2.30x with shared tiles once; the bounds keep the figures from getting worse)."""
    for T in roofline.LENGTHS:
        t = roofline.summary(T, counted[T])
        assert t["launches"] <= roofline.TARGET_LAUNCHES, t
        assert t["ratio"] <= roofline.TARGET_BYTES and t["ratio"] < 2.90, t
        assert t["shared_ratio"] < 2.30 and t["shared"] < t["moved"], t
        assert t["flops_ratio"] <= roofline.TARGET_FLOPS and t["flops_ratio"] < 1.27, t
        assert t["over"] == [], t


def _overlapping(a):
    def program(p, x, y, z):
        p.read("X", 16, 32, 0, 128)  # rows 16..47, every column
        p.read("X", 0, 64, 0, 32)  # rows 0..63, columns 0..31
        p.read("Z", 0, 16)  # a vector's 16 rows, twice
        p.read("Z", 0, 16)

    return program


def test_a_program_counts_the_union_of_the_tiles_it_reads(monkeypatch):
    monkeypatch.setitem(roofline.KERNELS, "_overlapping", _overlapping)
    x = torch.empty(64, 128, device="meta", dtype=torch.bfloat16)
    z = torch.empty(64, device="meta")
    cost = roofline.Cost("_overlapping")
    kernel = SimpleNamespace(__name__="_overlapping", arg_names=["X", "Z"])
    roofline.cost_of(Launch(kernel, (x, z), {}, (1,)), cost)
    assert cost.nbytes == (32 * 128 + 32 * 32) * 2 + 16 * 4
