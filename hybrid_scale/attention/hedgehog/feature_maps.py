"""Feature maps phi for the linear-attention part, one registry for all.

Every map works per head on [B, heads, T, head_dim] and returns [B, heads, T, out_dim]. Maps with a learnable
projection u = x W_h + b_h (one W_h per head) are identity-initialised when feature_dim == head_dim, so a freshly
converted model starts from phi(x) = act(x). q and k get separate maps: q has one per query head, k one per KV head.

Each map's size and parameters are its spec (feature_specs.FEATURE_MAP_SPECS, read without torch by preflight and
the config); this file holds the math. It imports only torch and its sibling feature_specs.py (the export copies the
package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .feature_specs import FEATURE_MAP_SPECS, FeatureMapSpec


class FeatureMap(nn.Module):
    """Base class: a subclass names its spec (`spec`: choices.FeatureMapSpec); `learnable` maps own a per-head
    projection, `out_dim` is the size phi returns."""

    spec: FeatureMapSpec
    name = "base"
    learnable = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name, cls.learnable = cls.spec.name, cls.spec.learnable

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None):
        super().__init__()
        feature_dim = head_dim if feature_dim is None else int(feature_dim)
        if feature_dim <= 0:
            raise ValueError(f"feature_dim must be positive, got {feature_dim}")
        if not self.learnable and feature_dim != head_dim:
            raise ValueError(
                f"feature map '{self.name}' has no projection, so feature_dim must equal head_dim ({head_dim}); "
                f"got {feature_dim}. Leave feature_dim unset or pick a learnable map (hedgehog, exp, t2r)."
            )
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        if self.learnable:
            self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))
            self.bias = nn.Parameter(torch.zeros(num_heads, feature_dim))
            self.reset_parameters()

    @property
    def out_dim(self) -> int:
        return self.spec.out_dim(self.head_dim, self.feature_dim)

    def reset_parameters(self) -> None:
        if not self.learnable:
            return
        with torch.no_grad():
            if self.feature_dim == self.head_dim:
                self.weight.copy_(torch.eye(self.head_dim).expand_as(self.weight))
            else:
                nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.head_dim))
            self.bias.zero_()

    def narrow(self, start: int, stop: int) -> None:
        """Keep heads start..stop-1 only (tensor parallelism: a rank's own heads)."""
        if self.learnable:
            for name in ("weight", "bias"):
                p = getattr(self, name)
                setattr(self, name, nn.Parameter(p.detach()[start:stop].clone(), requires_grad=p.requires_grad))
        self.num_heads = stop - start

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.num_heads:
            raise ValueError(f"{self.name} feature map has {self.num_heads} heads, input has {x.shape[1]}")
        return torch.einsum("bhtd,hdf->bhtf", x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)[None, :, None]

    def activate(self, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.project(x) if self.learnable else x)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}, out={self.out_dim}"


class Hedgehog(FeatureMap):
    """Hedgehog: [softmax(u), softmax(-u)] over the feature axis; output 2 * feature_dim."""

    spec = FEATURE_MAP_SPECS["hedgehog"]

    def activate(self, u):
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


class Exp(FeatureMap):
    """exp(u - max_f u): the exponential map with a per-row stabiliser."""

    spec = FEATURE_MAP_SPECS["exp"]

    def activate(self, u):
        return torch.exp(u - u.amax(dim=-1, keepdim=True))


class T2R(FeatureMap):
    """T2R (Kasai et al. 2021): relu of a learned projection."""

    spec = FEATURE_MAP_SPECS["t2r"]

    def activate(self, u):
        return F.relu(u)


class ReLU(FeatureMap):
    """relu(x), no parameters."""

    spec = FEATURE_MAP_SPECS["relu"]

    def activate(self, u):
        return F.relu(u)


class Elu1(FeatureMap):
    """1 + elu(x) (Katharopoulos et al. 2020), no parameters."""

    spec = FEATURE_MAP_SPECS["elu1"]

    def activate(self, u):
        return 1.0 + F.elu(u)


FEATURE_MAPS: dict[str, type[FeatureMap]] = {cls.name: cls for cls in (Hedgehog, Exp, T2R, ReLU, Elu1)}
assert list(FEATURE_MAPS) == list(FEATURE_MAP_SPECS), "every spec has its class (feature_specs.FEATURE_MAP_SPECS)"


def make_feature_map(name: str, num_heads: int, head_dim: int, feature_dim: int | None = None) -> FeatureMap:
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map '{name}'; available: {', '.join(sorted(FEATURE_MAPS))}")
    return FEATURE_MAPS[name](num_heads, head_dim, feature_dim)
