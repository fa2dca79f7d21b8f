"""The attention settings, each declared once: its name, type, default, the check of its value and its doc line.

The config's `attention` section (config/schema.py builds AttentionConfig from this record and
docs/reference/config.md takes each key's doc line from it), the validator (config/validate.py runs each setting's
check), the layer (HybridAttention takes exactly these keywords, layer.py), the options of one call (options.py:
the settings marked `call`) and hybrid_config.json (models/converted.py writes every setting, the live value where
the layer holds one, and reads an older file through `older`) all read this record. Adding a setting is one
`Setting` here, read where it matters.

Torch-free: the config and the command line read it (a process that only parses a config never imports torch).
Also the values the keys take (MODES, BACKENDS, the feature maps' specs, the LA kinds: kinds.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .hedgehog.feature_specs import FEATURE_MAPS
from .kinds import KINDS

MODES = ("hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "cache_only", "none")
BACKENDS = ("auto", "torch", "triton", "fla")  # the values of attention.backend (each kind has some: kinds.py)
LA_COMBINES = ("normaliser", "mix")  # attention.la_combine: how gated_delta joins the window (gated_delta/hybrid.py)
CACHE_SELECTS = ("attention", "self_recall", "recency")  # attention.cache_select: the cache's score (cache/select.py)
CACHE_HEADS = ("uniform", "retrieval")  # attention.cache_heads: how a layer's cache slots go to its KV heads
GAMMA_PARAMS = ("sigmoid", "exp")  # attention.gamma_param (layer.py GAMMA_PARAMS holds the functions)
_NONE = object()  # no older meaning declared: an older hybrid_config.json without the key means its default


def one_of(*allowed: str) -> Callable[[Any, Mapping], str | None]:
    def check(value, _settings) -> str | None:
        return None if value in allowed else f"'{value}' is not allowed; choose one of: {', '.join(allowed)}"

    return check


def at_least(minimum: int) -> Callable[[Any, Mapping], str | None]:
    def check(value, _settings) -> str | None:
        return None if value is None or value >= minimum else f"must be >= {minimum}, got {value}"

    return check


def _gamma_init(value, settings: Mapping) -> str | None:
    """gamma must be reachable by its parametrisation: (0, 1) for sigmoid, > 0 for exp."""
    sigmoid = settings.get("gamma_param", "sigmoid") == "sigmoid"
    if 0.0 < value < 1.0 if sigmoid else value > 0.0:
        return None
    return f"must be {'in (0, 1) with attention.gamma_param=sigmoid' if sigmoid else '> 0'}, got {value}"


def _needs_decay(name: str, what: str) -> Callable[[Any, Mapping], str | None]:
    def check(value, settings: Mapping) -> str | None:
        if value < 0:
            return f"must be >= 0, got {value}"
        if value and not settings.get("la_decay"):
            return f"{what}, but attention.la_decay is false; set attention.la_decay=true or leave {name} at 0"
        return None

    return check


def _kind(value, _settings) -> str | None:
    return one_of(*KINDS)(value, _settings)


@dataclass(frozen=True)
class Setting:
    """One attention setting. `type` is its annotation in the config schema; `check(value, all settings)` returns why
    the value is wrong (the text after "config key 'attention.NAME': "), or None. `call`: a field of one attention
    call's options (options.AttentionOptions). `layer`: a keyword of HybridAttention. Every setting is written to
    hybrid_config.json; `live`: the layer's attribute that holds its current value (set_window, set_modes and the
    parts change them after conversion), which is what is written. `older`: what a hybrid_config.json written before
    the key existed means, with `why`."""

    name: str
    type: Any
    default: Any
    doc: str
    check: Callable[[Any, Mapping], str | None] | None = None
    call: bool = False
    layer: bool = True  # a keyword of the layer (HybridAttention); false: the conversion's own (which layers)
    live: str | None = None
    older: Any = _NONE
    why: str = ""

    @property
    def missing(self) -> Any:
        """The value a hybrid_config.json without this key means."""
        return self.default if self.older is _NONE else self.older


SETTINGS: tuple[Setting, ...] = (
    Setting("window", int, 64, "sliding-window size in real tokens", at_least(1), call=True, live="window"),
    Setting("feature_map", str, "hedgehog", "phi of the linear attention: hedgehog | exp | relu | elu1 | t2r",
            one_of(*sorted(FEATURE_MAPS)), live="feature_map_name"),
    Setting("feature_dim", int | None, None, "None = head_dim (hedgehog then outputs 2 * head_dim)", at_least(1),
            live="feature_dim"),
    Setting("gamma_init", float, 0.1, "initial window weight gamma of every head", _gamma_init),
    Setting("gamma_param", str, "sigmoid",
            "gamma = f(a learnable logit) per head: sigmoid (LoLCATs: gamma in (0, 1), the window never outweighs the "
            "LA's per-key weight) | exp (gamma in (0, inf): the window can outweigh a weak LA)",
            one_of(*GAMMA_PARAMS), live="gamma_param",
            older="sigmoid", why="exports made before gamma_param had LoLCATs' sigmoid gamma"),
    Setting("sinks", int, 8, "S, the first real tokens that swa_sinks and sinks_only attend to besides the window (0: "
            "none; swa_sinks is then swa_only)", at_least(0), call=True, live="sinks"),
    Setting("hybrid_sinks", bool, False,
            "the hybrid's softmax also covers those S sinks and its LA leaves them out (false: LoLCATs' hybrid, window "
            "only); its no-LA ablation swa_only is then the window plus the same S sinks",
            call=True, live="hybrid_sinks", older=False, why="exports made before hybrid_sinks had LoLCATs' hybrid"),
    Setting("la_decay", bool, False,
            "the LA's keys decay past the window: a key that left it counts alpha_h^(its distance past the window), "
            "alpha_h = exp(-rho_h) per KV head, rho_h >= 0 learnt from 0 (the formula without decay) in stage 1 and "
            "stage 2", live="has_la_decay", older=False, why="exports made before la_decay had no decay"),
    Setting("la_decay_horizon", int, 0,
            "with la_decay: rho_h of every KV head starts at 1/la_decay_horizon (a key that many tokens past the "
            "window counts 1/e); 0 = from rho 0, exactly the hybrid without decay. Read by the conversion",
            _needs_decay("la_decay_horizon", "sets where the LA's decay starts")),
    Setting("la_decay_max_horizon", int, 0,
            "with la_decay: every KV head decays at least as fast as 1/la_decay_max_horizon (rho_h >= 1/H, in every "
            "stage and at inference): no key more than about H tokens past the window keeps a weight above 1/e, so "
            "the LA's mass stops growing with the position; 0 = no floor (rho_h >= 0). Read by the attention",
            _needs_decay("la_decay_max_horizon", "bounds the LA's decay"),
            older=0, why="exports made before la_decay_max_horizon had no floor on the decay"),
    Setting("la_kind", str, "hedgehog",
            "the linear part (attention/kinds.py): hedgehog (feature maps phi_q . phi_k summed into one state, "
            "LoLCATs) | gated_delta (the gated delta rule of Gated DeltaNet on L2-normalised q and k, a learned "
            "write strength and forget gate per token and KV head). gated_delta has no feature map (feature_map, "
            "feature_dim and la_decay do not apply)", _kind, live="la_kind",
            older="hedgehog", why="exports made before la_kind (issue 59) are Hedgehog"),
    Setting("la_combine", str, "mix",
            "gated_delta: how its read-out joins the window's softmax: mix (y = (1 - m) softmax + m LA, m a gate per "
            "query head and token from the hidden state; the measured choice: experiments/gated_delta/) | normaliser "
            "(it counts as gamma keys' worth of mass under the one normaliser; the window's terms are exp(a - c) <= "
            "1). Recorded in hybrid_config.json; the Hedgehog LA always shares the normaliser (this key does not "
            "apply to it)", one_of(*LA_COMBINES), call=True, live="la_combine",
            older="normaliser", why="exports made before la_combine (issue 59) are Hedgehog: one shared normaliser"),
    Setting("la_conv", int, 0,
            "gated_delta: taps of a short causal depthwise convolution on the delta rule's q and k (identity at "
            "conversion); 0 = none", at_least(0), live="la_conv", older=0, why="exports before it had no convolution"),
    Setting("la_delta_horizon", int, 0,
            "gated_delta: its forget gate starts at alpha = exp(-1/la_delta_horizon) (a key that many tokens old "
            "counts 1/e before any overwrite); 0 = 16 windows. Read by the conversion", at_least(0)),
    Setting("la_qk_map", bool, False,
            "gated_delta: a learned linear map per head on its q and k (after the convolution; the identity at "
            "conversion), trained with the gates in stage 1 (distill.train_feature_maps) and stage 2 "
            "(finetune.train_feature_maps)", live="la_qk_map", older=False, why="exports before it had no q/k map"),
    Setting("mode", str, "hybrid",
            "component mode of a converted model: hybrid | swa_only | swa_sinks | la_only | sinks_only | cache_only "
            "(the softmax over the cache's keys alone) | none",
            one_of(*MODES), call=True, live="mode"),
    Setting("cache", int, 0,
            "exact keys per KV head kept beside the window, the sinks and the LA state (attention/cache/): a key that "
            "leaves the window competes with the cached ones on attention.cache_select's score, the `cache` best stay "
            "exact softmax keys under the window's normaliser and the one that loses goes into the LA state "
            "(nothing is dropped; swa_sinks drops it); 0 = off, the hybrid without it. No training needed "
            "(attention.cache_train): the evaluation's +cache modes (eval.cache) and the export take the run's value "
            "whatever the converted model was made with; a loaded export changes it with model.set_hybrid_cache, any "
            "converted model with models.convert.set_cache", at_least(0), call=True,
            live="cache_keys", older=0, why="exports made before the cache (issue 66) had none"),
    Setting("cache_select", str, "attention",
            "the score a key competes on for the cache: attention (the softmax attention it received from the "
            "queries whose window held it: heavy hitters, no LA needed) | self_recall (how badly the LA state of the "
            "keys before it predicts its value: Hedgehog's normalised read-out at phi_k(k), the gated delta rule's "
            "residual v - S^T k) | recency (the newest stay: a control)", one_of(*CACHE_SELECTS), call=True,
            live="cache_select", older="attention", why="exports made before the cache (issue 66) had none"),
    Setting("cache_heads", str, "uniform",
            "how a layer's cache x Hkv slots go to its KV heads: uniform (attention.cache keys each) | retrieval (a "
            "floor of cache/4 each, the rest in proportion to the softmax attention each head gives from a passkey "
            "answer to its needle on calibration prompts the probes never use: models/cache_heads.py). Acts where the "
            "cache is set from the run: the evaluation's +cache modes and cache_only (calibrated once per model on "
            "the held-out text) and the export (calibrated on its calibration text, written to config.json's "
            "hybrid.cache_budgets); stage 1 and stage 2 train with uniform budgets", one_of(*CACHE_HEADS),
            layer=False),
    Setting("cache_train", bool, False,
            "stage 1 and stage 2 train with the cache on (false: they train the hybrid without it, and it joins "
            "after training: the measured choice, experiments/cache_selection/)", layer=False),
    Setting("layers", list[int] | None, None, "layers to convert; None = all (the others keep softmax)", layer=False),
    Setting("chunk_size", int, 64, "query block of the torch path (the Triton kernels pick their own tile)",
            at_least(1), call=True, live="chunk_size"),
    Setting("backend", str, "auto",
            "what computes the attention in every stage: auto = the fastest implementation the LA kind has that "
            "passes its self-check on the device (hedgehog: the Triton kernels of kernels/, `pip install "
            "hybrid_scale[triton]`; gated_delta: fla-core's kernel) for CUDA tensors, the chunked torch path "
            "elsewhere; torch; triton (hedgehog, CUDA); fla (gated_delta, CUDA)", one_of(*BACKENDS), live="backend",
            older="auto", why="exports made before the backend choice ran the torch path wherever no kernel was"),
)  # fmt: skip


def by_name() -> dict[str, Setting]:
    """{name: Setting} of the record as it is now (a test may declare one more)."""
    return {s.name: s for s in SETTINGS}


def defaults() -> dict[str, Any]:
    return {s.name: s.default for s in SETTINGS}


def layer_settings(given: Mapping[str, Any], *, older: bool = False) -> dict[str, Any]:
    """Every keyword of the layer from `given` (a config section, a hybrid_config.json's settings or keywords): its
    value where given, else its default, or with `older` what a hybrid_config.json without it means (`missing`)."""
    return {
        s.name: given[s.name] if s.name in given else (s.missing if older else s.default) for s in SETTINGS if s.layer
    }


def problems(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, why) for every setting whose value its check refuses, in the record's order."""
    out = []
    for s in SETTINGS:
        if s.check is not None and s.name in settings:
            why = s.check(settings[s.name], settings)
            if why is not None:
                out.append((s.name, why))
    return out
