"""Each kind of linear part (kinds.py) with its torch side (its folder's part.py): what the layer composes.

This file imports only its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from .gated_delta.part import PART as GATED_DELTA_PART
from .hedgehog.part import PART as HEDGEHOG_PART
from .kinds import KINDS
from .part import Part

PARTS: dict[str, Part] = {p.kind.name: p for p in (HEDGEHOG_PART, GATED_DELTA_PART)}
assert set(PARTS) == set(KINDS), "every kind has its part (kinds.py, parts.py)"


def part_of(kind: str) -> Part:
    """The part of the LA kind `kind`."""
    if kind not in PARTS:
        raise ValueError(f"unknown attention.la_kind '{kind}'; available: {', '.join(PARTS)}")
    return PARTS[kind]
