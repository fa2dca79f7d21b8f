"""The feature maps' specs, read without torch (the config's choices, preflight's counts, kinds.py): each map's size
and parameters. hedgehog/feature_maps.py holds their math.

Torch-free; imports nothing (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FeatureMapSpec:
    """What a feature map is, read without torch: its size and its parameters (preflight's counts, the config's
    choices) and the module's own shape (feature_maps.py, which holds the math, takes `learnable` and
    `out_dim` from here). A new map is a spec here and a class there (tests/unit/test_feature_maps.py checks the two
    agree)."""

    name: str
    learnable: bool  # a per-head projection u = x W_h + b_h, head_dim -> feature_dim
    widen: int = 1  # phi's width per feature: hedgehog's [softmax(u), softmax(-u)] is 2

    def out_dim(self, head_dim: int, feature_dim: int | None = None) -> int:
        """The size phi returns (feature_dim None: head_dim)."""
        return self.widen * (head_dim if feature_dim is None else int(feature_dim))

    def params(self, heads: int, head_dim: int, feature_dim: int | None = None) -> int:
        """Its parameters over `heads` heads: a weight [head_dim, feature_dim] and a bias per head, if learnable."""
        f = head_dim if feature_dim is None else int(feature_dim)
        return heads * (head_dim * f + f) if self.learnable else 0


FEATURE_MAP_SPECS = {
    s.name: s
    for s in (
        FeatureMapSpec("hedgehog", learnable=True, widen=2),
        FeatureMapSpec("exp", learnable=True),
        FeatureMapSpec("t2r", learnable=True),
        FeatureMapSpec("relu", learnable=False),
        FeatureMapSpec("elu1", learnable=False),
    )
}
FEATURE_MAPS = tuple(FEATURE_MAP_SPECS)
