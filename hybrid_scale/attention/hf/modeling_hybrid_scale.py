"""An exported hybrid model for plain transformers (`trust_remote_code=True`): the base architecture's causal LM with
the attention of the layers in `config.hybrid["layers"]` replaced by HybridAttention (the attention package's layer.py,
the same code hybrid_scale trains with). Chunked hybrid attention for prompts, constant-memory decode with
`generate()`, padding handled from the 2D attention mask. Imports only torch, transformers and its siblings.

One class per architecture record (architectures.py), HybridScale{prefix}ForCausalLM. Switch components at run time
with `model.set_hybrid_mode("la_only")` (or a {layer: mode} dict); the mode in config.hybrid["mode"] is the one the
model was exported with. The cache of exact keys (config.hybrid["cache"]) changes with `model.set_hybrid_cache(32)`, or
at load time with `from_pretrained(path, trust_remote_code=True, hybrid={**config.hybrid, "cache": 32})`; its
budgets per KV head (config.hybrid["cache_budgets"], {layer: [Hkv]}: attention.cache_heads=retrieval) are applied at
load time (a load-time "cache" other than the one they share out needs "cache_budgets" dropped or replaced).
"""

import transformers

from ..layer import HybridAttention, hybrid_layers, set_layers_cache
from ..settings import CACHE_SELECTS
from ..window.naive import check_mode
from .architectures import ARCHITECTURES
from .configuration_hybrid_scale import CONFIGS
from .generation import attach


class HybridScaleMixin:
    def _convert_attention(self):
        settings = dict(self.config.hybrid)
        decoder = self.model
        for i in settings["layers"]:
            decoder.layers[i].self_attn = HybridAttention.from_softmax(
                decoder.layers[i].self_attn, self.config, i, settings
            )
        attach(self)
        if settings.get("cache_budgets"):  # attention.cache_heads=retrieval: the export's calibrated budgets
            self.set_hybrid_cache(int(settings.get("cache", 0)), None, settings["cache_budgets"])
        if settings.get("layer_modes"):
            self.set_hybrid_mode({int(i): m for i, m in settings["layer_modes"].items()})

    def set_hybrid_mode(self, mode):
        """One mode for every hybrid layer (hybrid, swa_only, swa_sinks, la_only, sinks_only, none), or
        {layer: mode}."""
        layers = hybrid_layers(self)
        modes = dict.fromkeys(layers, mode) if isinstance(mode, str) else dict(mode)
        for i, m in modes.items():
            check_mode(m)
            layers[i].mode = m

    def set_hybrid_cache(self, keys: int, select: str | None = None, budgets=None):
        """The cache of exact keys of every hybrid layer (attention.cache: keys per KV head, 0 = off; select:
        attention | self_recall | recency; budgets: {layer: [Hkv] ints}, the layer's keys x Hkv slots shared out
        over its KV heads, as config.hybrid["cache_budgets"] holds them: attention.cache_heads=retrieval; None: keys
        for every head). No training needed; start a new decode cache after a change."""
        if isinstance(keys, bool) or not isinstance(keys, int) or keys < 0:
            raise ValueError(f"the cache must be an integer >= 0 (keys per KV head), got {keys!r}")
        if select is not None and select not in CACHE_SELECTS:
            raise ValueError(f"cache select {select!r} is not allowed; choose one of: {', '.join(CACHE_SELECTS)}")
        set_layers_cache(hybrid_layers(self), keys, select, budgets)


def hybrid_causal_lm(base: type, config_class: type, name: str) -> type:
    """`base` (a transformers causal LM class) whose converted layers' attention is HybridAttention, as `name`."""

    def __init__(self, config):
        base.__init__(self, config)
        self._convert_attention()

    return type(name, (HybridScaleMixin, base), {"__init__": __init__, "config_class": config_class,
                                                  "__module__": __name__})  # fmt: skip


MODELS: dict[str, type] = {  # by prefix; each also a name of this module (an export's auto_map names it)
    a.prefix: hybrid_causal_lm(
        getattr(transformers, f"{a.prefix}ForCausalLM"), CONFIGS[a.prefix], f"HybridScale{a.prefix}ForCausalLM"
    )
    for a in ARCHITECTURES.values()
}
globals().update({cls.__name__: cls for cls in MODELS.values()})
