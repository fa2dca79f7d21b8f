"""The kinds of linear part a hybrid layer can hold, one record each: the one place that names them.

A kind says, without torch, what the config, preflight and the stages need to know of it: the settings only it reads
(another kind refuses them when set), the implementations it has (the backend registry resolves `attention.backend`
among them), the stage-1 objectives it can train with, what gamma weighs in it (the export's gamma fit), and its
parameter and feature counts (`plan`). Its torch side is its folder's part.py (hedgehog/, gated_delta/), which the
layer composes (parts.py maps each kind to its part). Stage code asks the kind or the part, never compares names:
tests/unit/test_kinds.py scans hybrid_scale/ for a comparison with a kind's name outside this file.

Adding a kind is one record here, one folder with its spec, chunked form, decode step and part.py, and one line in
parts.py.

Torch-free (the config reads it) and imports only hedgehog/feature_specs.py (the export copies the package flattened).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .hedgehog.feature_specs import FEATURE_MAP_SPECS


@dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    backends: tuple[str, ...]  # its implementations: naive (the spec), chunk (torch) and the accelerated ones
    objectives: tuple[str, ...]  # the stage-1 objectives it trains with
    gamma_scales: str  # what gamma weighs: "window" (the softmax terms) or "la" (the LA's mass in the normaliser)
    # (head_dim, settings) -> the width of the LA's queries and keys (phi's output, or the delta rule's head_dim)
    features: Callable[[int, Mapping[str, Any]], int]
    # (counts: H query heads, K KV heads, hd head dim, D hidden size; settings) -> one layer's LA parameters that
    # train as its feature maps (`plan`)
    params: Callable[[Mapping[str, int], Mapping[str, Any]], int]
    refuses: Mapping[str, str] = field(default_factory=dict)  # setting -> why it does not apply (when set)
    gated: bool = False  # its projections carry per-token gates (what an op called without a kind tells it by)
    ring_gates: int = 0  # per-token gates its decode state keeps beside each ring key (beta, log alpha)
    ring_fp32: bool = False  # its decode state keeps the ring's LA keys in fp32 (else as they came)

    @property
    def accelerated(self) -> tuple[str, ...]:
        """Its implementations beyond the torch ones (what attention.backend=auto tries first on a GPU)."""
        return tuple(b for b in self.backends if b not in ("naive", "chunk"))

    def problem(self, settings: Mapping[str, Any]) -> tuple[str, str] | None:
        """(setting, why) for the first setting this kind refuses or a backend it does not have; else None."""
        for key, why in self.refuses.items():
            if settings.get(key):
                return key, why
        backend = settings.get("backend", "auto")
        if backend not in ("auto", "torch", *self.backends):
            return "backend", (
                f"'{backend}' is not an implementation of the {self.name} LA; it has {', '.join(self.backends)} "
                "(or auto, torch)"
            )
        return None


def _phi_features(head_dim: int, settings: Mapping[str, Any]) -> int:
    return FEATURE_MAP_SPECS[settings["feature_map"]].out_dim(head_dim, settings.get("feature_dim"))


def _phi_params(counts: Mapping[str, int], settings: Mapping[str, Any]) -> int:
    """phi_q per query head and phi_k per KV head (hedgehog/feature_maps.py)."""
    spec = FEATURE_MAP_SPECS[settings["feature_map"]]
    return spec.params(counts["H"] + counts["K"], counts["hd"], settings.get("feature_dim"))


def _delta_params(counts: Mapping[str, int], settings: Mapping[str, Any]) -> int:
    """The gates (beta and alpha per KV head, the mix gate per query head; a weight over the hidden size and a bias
    each), the short convolutions and the q/k maps (gated_delta/modules.py)."""
    mix = counts["H"] if settings.get("la_combine") == "mix" else 0
    gates = (2 * counts["K"] + mix) * (counts["D"] + 1)
    qk = settings.get("la_conv", 0) + (counts["hd"] if settings.get("la_qk_map") else 0)
    return gates + (counts["H"] + counts["K"]) * counts["hd"] * qk


_DELTA_ONLY = "applies to attention.la_kind=gated_delta only; set attention.la_kind=gated_delta or leave {} unset"
HEDGEHOG = Kind(
    "hedgehog",
    "feature maps phi_q . phi_k summed into one state under the window's normaliser (LoLCATs); optional decay",
    backends=("naive", "chunk", "triton"),
    objectives=("weights_xent", "output_mse", "hybrid_output_mse"),
    gamma_scales="window",
    features=_phi_features,
    params=_phi_params,
    refuses={k: _DELTA_ONLY.format(k) for k in ("la_conv", "la_delta_horizon", "la_qk_map")},
)
GATED_DELTA = Kind(
    "gated_delta",
    "the gated delta rule (Gated DeltaNet) on L2-normalised q and k, a write strength and forget gate per token",
    backends=("naive", "chunk", "fla"),
    objectives=("output_mse", "hybrid_output_mse"),
    gamma_scales="la",
    gated=True,
    features=lambda head_dim, _settings: head_dim,
    params=_delta_params,
    refuses={
        "la_decay": "the Hedgehog LA's decay; attention.la_kind=gated_delta has its own forget gate "
        "(attention.la_delta_horizon sets where it starts): set attention.la_decay=false"
    },
    ring_gates=2,
    ring_fp32=True,
)
KINDS: dict[str, Kind] = {k.name: k for k in (HEDGEHOG, GATED_DELTA)}
DEFAULT = HEDGEHOG  # what a layer without gates is, and what an entry point registered without a kind serves


def kind_of(settings: Mapping[str, Any]) -> Kind:
    """The kind a layer's (or a config's) settings name (older settings without la_kind: Hedgehog)."""
    return KINDS[settings.get("la_kind") or DEFAULT.name]


def for_inputs(gates) -> Kind:
    """The kind an attention call is of when it names none: the one whose projections carry gates when `gates` are
    given, else the default."""
    return next(k for k in KINDS.values() if k.gated) if gates is not None else DEFAULT
