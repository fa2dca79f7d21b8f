"""The interface of a part of a hybrid layer: what one kind of linear part (kinds.py) is to the layer that composes it
with the window and the sinks (layer.py), to its decode cache (hf/cache.py), to the backend registry (backends.py)
and to the stages. Each kind's folder implements it in its part.py; parts.py maps a kind to its part.

A part holds no tensors: its parameters are modules of the layer (named as before this interface, so checkpoints and
exports keep their names), which `build` adds and the part's other methods read.

- build: the part's modules on the layer, from the layer's settings (settings.py's record); the layer's feature_dim;
- project: the LA's queries and keys (and its per-token gates, if any) of a sequence;
- recall_scores / cached_join: its side of the cache of exact keys (cache/): the self_recall score, and its LA over
  the keys in the order they leave the cache;
- attend: what the part contributes to the output: its terms under the shared normaliser with the window's, or its
  mixed output (the same entry for every mode; opts.return_denominators gives the window's and the LA's weights,
  the balance report's LA share);
- decode / decode_shape: its decode step over the layer's DecodeState (window/recurrent.py: the ring, the sinks, and
  the state it folds leaving keys into) and the shape that state is allocated for;
- narrow: its tensor-parallel slice (a rank's query heads and their KV heads);
- la_parameters: what stage 1 and stage 2 train as its feature maps;
- check: its self-check of an implementation against its chunked torch form (the registry runs it);
- its parameter count for `plan`, the stage-1 objectives it takes and what gamma weighs (the export's gamma fit) are
  its kind's (kinds.Kind), read without torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .kinds import Kind
from .shape import Shape


class Projections(NamedTuple):
    """A layer's projections of a sequence (HybridAttention.project): q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, and the
    LA's queries and keys fq [B,H,T,F], fk [B,Hkv,T,F] (phi_q(q), phi_k(k); the gated delta rule's own q and k) and
    its per-token `gates` (gated_delta/naive.DeltaGates; None for a kind without). A tuple: `attend(*x[:5],
    gates=x.gates, ...)` takes them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fq: torch.Tensor
    fk: torch.Tensor
    gates: NamedTuple | None = None


class Part:
    """One kind of linear part, its torch side (module doc)."""

    kind: Kind
    modules: tuple[str, ...] = ()  # the layer's submodules that are this part's

    def build(self, layer: nn.Module, settings: dict, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def project(self, layer: nn.Module, raw: tuple, rotated: tuple, hidden, mask=None, tails=None) -> Projections:
        """raw (q, k, v) before RoPE and rotated (q, k) after it; hidden [B,T,D] the layer's input; mask [B,T] and
        tails (the decode state's last convolution inputs) for a kind with a convolution."""
        raise NotImplementedError

    def attend(self, x: Projections, gamma, opts, *, attention_mask=None, initial_state=None, la_decay=None,
               backend="auto"):  # fmt: skip
        raise NotImplementedError

    def recall_scores(self, x: Projections, opts, first: int, *, impl, dense: bool) -> torch.Tensor:
        """The cache's self_recall score of each key [B,Hkv,T] (cache/attend.py): how badly this LA's state of the
        candidates before it (from `first`) predicts its value."""
        raise NotImplementedError

    def cached_join(self, x: Projections, gamma, opts, soft, drop, first: int, *, la_decay, impl, dense: bool):
        """The hybrid's output beside a cache: the softmax part `soft` = (num, den, {memory: its share of den}) over
        the sinks, the window and the cache, and this LA over the keys in the order they reach it (drop times:
        cache/select.py). Returns (y [B,H,T,Dv], {memory: weight [B,H,T]}), cache/attend.MEMORIES."""
        raise NotImplementedError

    def decode_shape(self, layer: nn.Module, x: Projections, opts) -> Shape:
        raise NotImplementedError

    def decode(self, cache_layer, layer: nn.Module, x: Projections, mask):
        raise NotImplementedError

    def narrow(self, layer: nn.Module, start: int, stop: int, group: int) -> None:
        raise NotImplementedError

    def check(self, fn, decode, device: torch.device, shape: Shape) -> str | None:
        raise NotImplementedError

    def la_parameters(self, layer: nn.Module) -> list[nn.Parameter]:
        return [p for name in self.modules if hasattr(layer, name) for p in getattr(layer, name).parameters()]

    def gamma_fit_problem(self, layer: nn.Module) -> str | None:
        """Why the export cannot fit this layer's gamma (None: it can)."""
        return None
