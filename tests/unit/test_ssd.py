"""SSD schedule, early-stopping rule, and the generated DeepSpeed config."""

import pytest
import torch

from hybrid_scale.config import ConfigError, load_config
from hybrid_scale.data.batches import global_batch
from hybrid_scale.distributed.deepspeed import train_config
from hybrid_scale.recipes.early_stopping import EarlyStopping
from hybrid_scale.recipes.ssd import SSD, at, phase

DEFAULT = [[0.0, 0.9], [1 / 3, 0.75], [2 / 3, 0.5]]


def test_step_schedule_values_and_phases():
    assert [at(DEFAULT, x) for x in (0.0, 0.3, 1 / 3, 0.5, 0.7, 0.99)] == [0.9, 0.9, 0.75, 0.75, 0.5, 0.5]
    assert [phase(DEFAULT, x) for x in (0.0, 0.34, 0.9)] == [0, 1, 2]
    assert at([[0.0, 16], [0.5, 64]], 0.49) == 16 and at([[0.0, 16], [0.5, 64]], 0.5) == 64


def test_decisions_depend_only_on_seed_and_step():
    a = SSD(DEFAULT, "layer", list(range(6)), seed=3)
    b = SSD(DEFAULT, "layer", list(range(6)), seed=3)
    seq_a = [a.drops(s, 90) for s in range(90)]
    seq_b = [b.drops(s, 90) for s in reversed(range(90))][::-1]  # other order (a resume): same decisions
    assert seq_a == seq_b
    assert seq_a != [SSD(DEFAULT, "layer", list(range(6)), seed=4).drops(s, 90) for s in range(90)]


def test_granularity_step_drops_all_layers_together_and_rates_follow_the_schedule():
    s = SSD(DEFAULT, "step", list(range(4)), seed=0)
    for step in range(3000):
        d = s.drops(step, 3000)
        assert len(set(d.values())) == 1
    for got, p in zip(s.realised(), (0.9, 0.75, 0.5), strict=True):
        assert got["realised"] == pytest.approx(p, abs=0.04)  # 1000 steps per phase
    per_layer = SSD(DEFAULT, "layer", list(range(30)), seed=0)
    mixed = sum(len(set(per_layer.drops(step, 300).values())) > 1 for step in range(300))
    assert mixed > 250  # 30 independent layers almost never agree
    assert per_layer.realised()[2]["realised"] == pytest.approx(0.5, abs=0.04)


def test_state_round_trip_and_window_schedule():
    s = SSD(DEFAULT, "layer", [0, 1], seed=0, windows=[[0.0, 16], [0.5, 64]])
    for step in range(5):
        s.drops(step, 10)
    t = SSD(DEFAULT, "layer", [0, 1], seed=0, windows=[[0.0, 16], [0.5, 64]])
    t.load_state_dict(s.state_dict())
    assert t.realised() == s.realised()
    assert [s.window(k, 10) for k in (0, 4, 5, 9)] == [16, 16, 64, 64]
    assert SSD(DEFAULT, "step", [0], seed=0).window(3, 10) is None


def test_early_stopping_rule():
    e = EarlyStopping()
    assert e.update(5, 3.0, 4.0) and e.verdict(2, 0.05) is None
    assert e.update(10, 2.9, 3.9) and e.best_step == 10
    assert not e.update(15, 2.95, 3.92) and e.verdict(2, 0.05) is None  # la_only within the margin
    assert not e.update(20, 2.95, 3.96)
    assert e.verdict(2, 0.05).startswith("la_only loss 3.9600 rose more than 0.05 above its best 3.9000")
    p = EarlyStopping()
    p.update(1, 3.0, 4.0)
    p.update(2, 3.1, 3.9)
    assert p.verdict(2, 0.05) is None
    p.update(3, 3.2, 3.8)
    assert p.verdict(2, 0.05) == "patience: no better hybrid loss in 2 evaluations"


def test_global_batches_cover_each_epoch_once_in_a_new_order_each_epoch():
    """9 sequences in batches of 4: steps 2 and 4 straddle an epoch boundary. (That every rank count consumes the same
    sequences per step is checked on finetune() itself: test_finetune's test_each_step_consumes_the_same_sequences_on_
    one_and_two_ranks.)"""
    seen = [i for step in range(9) for i in global_batch(step, 9, 4, seed=1)]  # 36 = 4 epochs
    epochs = [seen[9 * e : 9 * e + 9] for e in range(4)]
    assert all(sorted(e) == list(range(9)) for e in epochs)  # each sequence once per epoch, across the step edges
    assert len({tuple(e) for e in epochs}) == 4 and epochs[0] != list(range(9))  # shuffled, anew each epoch
    assert global_batch(2, 9, 4, seed=1) == [*epochs[0][8:], *epochs[1][:3]]
    assert global_batch(0, 9, 4, seed=2) != global_batch(0, 9, 4, seed=1)  # the seed picks the order


def test_deepspeed_config_is_generated_from_ours():
    f = load_config(
        overrides=["finetune.global_batch=16", "finetune.micro_batch=2", "finetune.clip=0.5", "finetune.offload=true"]
    ).finetune
    ds = train_config(f, torch.bfloat16, world=4)
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_batch_size"] == 16
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert ds["optimizer"]["params"]["lr"] == f.lr and "scheduler" not in ds  # (the engines take finetune.schedule's)
    with pytest.raises(ValueError, match="cannot be split into micro-batches of 2 over 3 ranks"):
        train_config(f, torch.float32, world=3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("finetune.recipe=lora", "'finetune.recipe': 'lora' is not allowed"),
        ("finetune.global_batch=6", "'finetune.global_batch': 6 is not a multiple of finetune.micro_batch (4)"),
        ("finetune.ssd_schedule=[[0.1,0.9]]", "fractions of training must start at 0"),
        ("finetune.ssd_schedule=[[0,1.5]]", "values must be in [0.0, 1.0]"),
        ("finetune.ssd_granularity=head", "'finetune.ssd_granularity': 'head' is not allowed"),
        ("finetune.keep=1", "'finetune.keep': must be >= 2"),
        ("finetune.lora_targets=[]", "name at least one module"),
    ],
)
def test_finetune_config_errors(override, message):
    extra = ["finetune.micro_batch=4"] if "global_batch" in override else []
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override, *extra])
    assert message in str(e.value)
