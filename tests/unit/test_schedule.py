"""Stage 2's learning-rate schedule (finetune/schedule.py): the documented rates, step 1 and step N train, and a
resume at any step puts that step's rate into the optimizer. The runs' logged rates on both engines, through resumes:
tests/integration/test_finetune.py and test_finetune_tp.py (assert_schedule)."""

import pytest
import torch

from hybrid_scale.finetune.schedule import lr_factor, lr_schedule, resume_schedule


def rates(warmup: int, max_steps: int, lr: float = 1.0) -> list[float]:
    """The rates an optimizer steps with, read from it before each step as stage 2 logs them."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = lr_schedule(opt, warmup=warmup, max_steps=max_steps)
    out = []
    for _ in range(max_steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("warmup,max_steps", [(1, 8), (2, 10), (0, 5), (3, 3), (10, 100)])
def test_step_k_of_the_warmup_uses_lr_k_over_w_then_decays_linearly(warmup, max_steps):
    want = [k / warmup if k <= warmup else (max_steps + 1 - k) / (max_steps + 1 - warmup)
            for k in range(1, max_steps + 1)]  # fmt: skip
    assert rates(warmup, max_steps) == pytest.approx(want, abs=1e-12)
    assert rates(warmup, max_steps)[0] > 0 and rates(warmup, max_steps)[-1] > 0  # every step trains


def test_the_quickstarts_one_step_warmup_trains_at_full_rate_from_step_one():
    assert rates(1, 8, 1e-3)[:3] == pytest.approx([1e-3, 1e-3 * 7 / 8, 1e-3 * 6 / 8])


@pytest.mark.parametrize("done", [0, 1, 2, 5, 9])
def test_a_resume_at_any_step_continues_the_same_rates(done):
    whole = rates(2, 10, 2e-3)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    sched = lr_schedule(opt, warmup=2, max_steps=10)
    resume_schedule(sched, done)
    got = []
    for _ in range(10 - done):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(whole[done:], abs=1e-15)


def test_lr_factor_is_the_documented_formula_at_its_edges():
    assert lr_factor(1, 0, 4) == pytest.approx(4 / 5)  # no warmup: decay from the first step
    assert lr_factor(4, 4, 4) == 1.0 and lr_factor(5, 4, 4) == 0.0
