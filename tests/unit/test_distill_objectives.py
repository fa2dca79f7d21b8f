"""Stage-1 objectives against direct computations."""

import torch
from conftest import attention_inputs

from hybrid_scale.attention.layer import Projections
from hybrid_scale.distill.objectives import weights_xent
from hybrid_scale.models.streaming import teacher_output


def test_weights_xent_equals_dense_soft_cross_entropy_for_any_block():
    x = attention_inputs(B=2, H=4, Hkv=2, T=20, D=8, F=6, dtype=torch.float64)
    q, k, fq, fk = x["q"], x["k"], x["fq"], x["fk"]
    scale = 8**-0.5
    kk, fkk = k.repeat_interleave(2, 1), fk.repeat_interleave(2, 1)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    teacher = torch.softmax((scale * q @ kk.transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1)
    lin = (fq @ fkk.transpose(-1, -2)).masked_fill(~causal, 0)
    rows = lin / lin.sum(-1, keepdim=True)
    expect = -(teacher * torch.log(rows).masked_fill(~causal, 0)).sum(-1).mean((1, 2))
    for block in (1, 7, 20, 64):
        torch.testing.assert_close(weights_xent(q, k, fq, fk, scale, block), expect)
    # Gibbs: never below the teacher rows' own entropy, which it reaches only when the rows agree
    entropy = -(teacher * torch.log(teacher.clamp_min(1e-300))).sum(-1).mean((1, 2))
    assert (expect > entropy + 1e-3).all()


def test_teacher_output_is_causal_softmax_attention():
    x = attention_inputs(B=1, H=4, Hkv=2, T=9, D=8, F=6, dtype=torch.float64)
    y = teacher_output(x["q"], x["k"], x["v"], 0.3)
    kk, vv = x["k"].repeat_interleave(2, 1), x["v"].repeat_interleave(2, 1)
    a = (0.3 * x["q"] @ kk.transpose(-1, -2)).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(y, torch.softmax(a, -1) @ vv)


def test_stage_1_units_split_over_any_number_of_ranks_sum_to_the_dense_objective():
    """What stage 1 computes: each rank's query-block units (split_units) through unit_loss; summed over the ranks
    they equal the whole-sequence soft cross-entropy (summed over the batch), for any block size and world."""
    from types import SimpleNamespace

    from hybrid_scale.attention.kinds import DEFAULT
    from hybrid_scale.attention.parts import part_of
    from hybrid_scale.data.batches import split_units
    from hybrid_scale.distill.objectives import unit_loss

    x = attention_inputs(B=2, H=4, Hkv=2, T=20, D=8, F=6, dtype=torch.float64)
    scale = 8**-0.5
    expect = weights_xent(x["q"], x["k"], x["fq"], x["fk"], scale, 20).sum()
    m = SimpleNamespace(scaling=scale, all_heads=4, part=part_of(DEFAULT.name))
    for block, world in ((1, 3), (7, 2), (20, 4), (6, 1)):
        ranks = split_units(1, 20, block, world)
        n = -(-20 // block)
        assert sum(len(r) for r in ranks) == n and sum(bool(r) for r in ranks) == min(world, n)  # no rank idles
        got = sum(
            unit_loss(m, Projections(*(x[n] for n in Projections._fields[:5])), a, b, 20, {"weights_xent": 1.0})
            for units in ranks
            for _, a, b in units
        )
        torch.testing.assert_close(got, expect)
    # tensor parallelism: each rank holds 2 of the 4 query heads (and 1 of the 2 KV heads); the sum over the ranks
    # of their partial sums over heads is the objective
    halves = [{k: x[k][:, h * n : (h + 1) * n] for k, n in (("q", 2), ("fq", 2), ("k", 1), ("v", 1), ("fk", 1))}
              for h in (0, 1)]  # fmt: skip
    parts = [Projections(*(p[n] for n in Projections._fields[:5])) for p in halves]
    got = sum(unit_loss(m, x, 0, 20, 20, {"weights_xent": 1.0}) for x in parts)
    torch.testing.assert_close(got, expect)
