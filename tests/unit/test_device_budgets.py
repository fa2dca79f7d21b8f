"""The device speed run's clock (benchmarks/device/settings.py, issue 67): the budgets of the parts a GPU run takes by
default, with the startup allowance, add up to at most its deadline, and so does every part named alone; settings
that break this are refused with one error before any device time is spent; the decode targets are floors."""

import pytest

from benchmarks.device import settings
from benchmarks.device.run import Run


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in ("PARTS", "BUDGETS", "DEADLINE", "TILES", "FLA_CONFIGS"):
        monkeypatch.delenv(f"DEVICE_SPEED_{name}", raising=False)


def spent(cfg: dict) -> float:
    return cfg["startup"] + sum(settings.budgets_of(cfg).values())


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry_run"])
def test_the_default_parts_budgets_fit_the_deadline(dry):
    cfg = settings.speed_settings(dry)
    assert cfg["parts"] == list(settings.SPEED_PARTS if dry else settings.DEFAULT_PARTS)
    assert spent(cfg) <= cfg["deadline"], (spent(cfg), cfg["deadline"])


def test_the_gpu_runs_order_and_budgets():
    """Correctness first, then prefill, decode and one profiler pass (issue 67); 285 s in all today."""
    cfg = settings.speed_settings(False)
    assert cfg["parts"] == ["grad", "delta", "prefill", "decode", "profile", "tests"]
    assert settings.budgets_of(cfg) == dict(grad=35, delta=30, prefill_warm=40, prefill=25, decode=45, profile=15,
                                            tests=70)  # fmt: skip
    assert (spent(cfg), cfg["deadline"]) == (285, 285)


@pytest.mark.parametrize("part", ["tiles", "generate", "big"])
def test_a_part_left_out_of_the_default_fits_when_named(monkeypatch, part):
    monkeypatch.setenv("DEVICE_SPEED_PARTS", part)
    if part == "tiles":
        monkeypatch.setenv("DEVICE_SPEED_TILES", "a:warps=8")
    cfg = settings.speed_settings(False)
    assert cfg["parts"] == [part] and spent(cfg) <= cfg["deadline"]


def test_parts_run_in_the_settings_order_whatever_order_they_are_named_in(monkeypatch):
    monkeypatch.setenv("DEVICE_SPEED_PARTS", "profile,grad,decode")
    assert settings.speed_settings(False)["parts"] == ["grad", "decode", "profile"]


@pytest.mark.parametrize(
    "env",
    [
        {"DEVICE_SPEED_BUDGETS": "decode=200"},
        {"DEVICE_SPEED_DEADLINE": "200"},
        {"DEVICE_SPEED_PARTS": "grad,delta,prefill,decode,profile,tests,generate"},
    ],
    ids=["budget_raised", "deadline_lowered", "part_added"],
)
def test_settings_that_break_the_deadline_are_refused_with_one_error(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as refused:
        settings.speed_settings(False)
    message = str(refused.value)
    assert message.startswith("device_speed: the budgets add up to ") and "(startup 25 + grad=35, delta=30, " in message
    assert message.endswith("lower some with DEVICE_SPEED_BUDGETS, or run fewer parts with DEVICE_SPEED_PARTS"), message
    if "DEVICE_SPEED_BUDGETS" in env:
        assert "add up to 440 s " in message and "decode=200, " in message and "deadline of 285 s" in message


def test_budgets_lowered_or_a_later_deadline_are_taken(monkeypatch):
    monkeypatch.setenv("DEVICE_SPEED_BUDGETS", "tests=10,decode=60")
    monkeypatch.setenv("DEVICE_SPEED_DEADLINE", "300")
    cfg = settings.speed_settings(False)
    assert (cfg["budgets"]["tests"], cfg["budgets"]["decode"], cfg["deadline"]) == (10, 60, 300)


def test_tile_variants_without_their_part_are_refused(monkeypatch):
    monkeypatch.setenv("DEVICE_SPEED_TILES", "a:warps=8")
    with pytest.raises(SystemExit, match="DEVICE_SPEED_TILES is set but part tiles does not run: name it in"):
        settings.speed_settings(False)


def test_the_decode_targets_are_floors(tmp_path):
    """At least 1.8x a graphed KV cache's tokens/s at 8k and 4x at 32k: met at or above, missed below."""
    run = Run("speed", "device_speed", settings.speed_settings(True), tmp_path, "test", lambda d: "")
    for ctx, floor in ((8192, 1.8), (32768, 4.0)):
        key = f"decode tokens/s hybrid/kv_cache, B=32, ctx={ctx}"
        assert settings.FLOORS[key] == floor
        run.ratio(key, floor)
        assert run.data["ratios"][key] == dict(value=floor, target=floor, at=">=", met=True, note="")
        run.ratio(key, floor * 0.99)
        assert run.data["ratios"][key]["met"] is False
    run.ratio("prefill fwd+bwd hybrid ms, T=4096", 0.9)  # (a TARGETS key: at most 0.8)
    assert run.data["ratios"]["prefill fwd+bwd hybrid ms, T=4096"]["met"] is False
