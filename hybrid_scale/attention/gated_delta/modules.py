"""The learnable parts of the gated delta-rule LA (hybrid.py) that a converted layer adds: the gates from the hidden
state and the optional short causal convolution on q and k.

Initialisation (the layer starts as close to its softmax layer as the design allows): the layer is exact softmax
attention before the window fills whatever the LA holds, and past it the LA starts at gamma's mass beside the
window's softmax; the gates start data-independent (zero weights) at beta = 0.5 (the middle of the write strength,
where its sigmoid is steepest), alpha = exp(-1/horizon) (la_decay_horizon, default 16 windows: the state remembers
past the 8-window distances the probes ask for), and the mix gate (la_combine=mix) at 0.1; the convolution starts as
the identity (only its last tap is 1), so q and k enter the delta rule as the layer's own.

This file imports only torch and its siblings (the export copies the package flattened next to a modeling file).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .naive import DeltaGates

BETA_INIT = 0.5
MIX_INIT = 0.1
HORIZON_WINDOWS = 16  # the default horizon of the forget gate, in windows


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class DeltaGateProjection(nn.Module):
    """beta [B,Hkv,T] = sigmoid(x W_b + c_b), g = log alpha = -softplus(x W_a + c_a) [B,Hkv,T], and with `mix` the
    mix gate [B,H,T] = sigmoid(x W_m + c_m), from the layer's input hidden state x [B,T,hidden]. One weight and bias
    per gate, heads first (tensor parallelism splits and gathers them along dim 0, as it does phi and gamma)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, *, horizon: float, mix: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.mix = num_heads, num_kv_heads, bool(mix)
        self.beta_weight = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.beta_bias = nn.Parameter(torch.full((num_kv_heads,), _logit(BETA_INIT)))
        self.decay_weight = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.decay_bias = nn.Parameter(torch.full((num_kv_heads,), _inverse_softplus(1.0 / horizon)))
        if self.mix:
            self.mix_weight = nn.Parameter(torch.zeros(num_heads, hidden))
            self.mix_bias = nn.Parameter(torch.full((num_heads,), _logit(MIX_INIT)))

    def _gate(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
        return F.linear(x, w.to(x.dtype), b.to(x.dtype)).float().transpose(1, 2)  # [B, heads, T]

    def forward(self, x: torch.Tensor) -> DeltaGates:
        beta, g = torch.sigmoid(self._gate(x, "beta")), -F.softplus(self._gate(x, "decay"))
        return DeltaGates(beta, g, torch.sigmoid(self._gate(x, "mix")) if self.mix else None)

    def narrow(self, start: int, stop: int, group: int) -> None:
        """Keep query heads start..stop-1 and their KV heads (tensor parallelism)."""
        parts = [("beta", start // group, stop // group), ("decay", start // group, stop // group)]
        parts += [("mix", start, stop)] if self.mix else []
        for gate, lo, hi in parts:
            for name in (f"{gate}_weight", f"{gate}_bias"):
                p = getattr(self, name)
                setattr(self, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
        self.num_heads, self.num_kv_heads = stop - start, (stop - start) // group


class ShortConv(nn.Module):
    """A depthwise causal convolution over time with `taps` taps per channel of x [B, heads, T, D] (identity at
    initialisation). Padding (mask 0) enters as zeros, so a left-padded row equals the row alone. With `tail`
    ([B, heads, taps - 1, D]: the last inputs before x, decode) it continues from them and writes x's last inputs
    into it in place."""

    def __init__(self, num_heads: int, head_dim: int, taps: int):
        super().__init__()
        self.num_heads, self.head_dim, self.taps = num_heads, head_dim, int(taps)
        weight = torch.zeros(num_heads, head_dim, self.taps)
        weight[..., -1] = 1.0
        self.weight = nn.Parameter(weight)

    def forward(self, x, mask=None, tail=None):
        if mask is not None:
            x = x * mask[:, None, :, None].to(x.dtype)
        B, H, T, D = x.shape
        before = x.new_zeros(B, H, self.taps - 1, D) if tail is None else tail.to(x.dtype)
        xs = torch.cat([before, x], 2)
        w = self.weight.to(x.dtype)
        y = sum(xs[:, :, i : i + T] * w[None, :, None, :, i] for i in range(self.taps))
        if tail is not None and self.taps > 1:
            tail.copy_(xs[:, :, -(self.taps - 1) :].to(tail.dtype))
        return y

    def narrow(self, start: int, stop: int) -> None:
        self.weight = nn.Parameter(self.weight.detach()[start:stop].clone(), requires_grad=self.weight.requires_grad)
        self.num_heads = stop - start


class HeadLinear(nn.Module):
    """A learned linear map per head of x [B, heads, T, D] (the identity at conversion): gated_delta's queries and
    keys shaped for the delta rule (attention.la_qk_map), trained by stage 1 as a feature map is."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))

    def forward(self, x):
        return torch.einsum("bhtd,hde->bhte", x, self.weight.to(x.dtype))

    def narrow(self, start: int, stop: int) -> None:
        self.weight = nn.Parameter(self.weight.detach()[start:stop].clone(), requires_grad=self.weight.requires_grad)
        self.num_heads = stop - start
