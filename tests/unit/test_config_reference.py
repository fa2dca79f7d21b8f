"""docs/reference/config.md is generated from the config dataclasses and their comments: it is current, and every key
has a description."""

from pathlib import Path

from hybrid_scale import config_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


def test_every_config_key_has_a_comment():
    assert config_reference.undocumented() == [], "add a comment to these fields in hybrid_scale/config/schema.py"


def test_the_reference_page_is_current():
    assert PAGE.read_text() == config_reference.render(), "docs/reference/config.md is stale: run `make docs`"


def test_the_page_names_every_key_with_its_default():
    text = config_reference.render()
    for row in ("| `attention.window` | `int` | `64` |", "| `finetune.ssd_schedule` |", "| `seed` | `int` | `0` |"):
        assert row in text
    assert "## `slurm`: sbatch scripts" in text


def test_a_comment_above_a_field_and_one_after_it_both_count():
    source = "class A:\n    # first line\n    # second line\n    x: int = 1  # trailing\n    y: int = 2\n"
    expected = {"A": {"x": ("int", "first line second line trailing"), "y": ("int", "")}}
    assert config_reference.field_docs(source) == expected
