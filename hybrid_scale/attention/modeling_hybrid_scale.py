"""An exported hybrid model for plain transformers (`trust_remote_code=True`): the base architecture's causal LM with
the attention of the layers in `config.hybrid["layers"]` replaced by HybridAttention (this directory's hybrid.py,
the same code hybrid_scale trains with). Chunked hybrid attention for prompts, constant-memory decode with
`generate()`, padding handled from the 2D attention mask. Imports only torch, transformers and its siblings.

Switch components at run time with `model.set_hybrid_mode("la_only")` (or a {layer: mode} dict); the mode in
config.hybrid["mode"] is the one the model was exported with.
"""

from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

from .configuration_hybrid_scale import HybridScaleLlamaConfig, HybridScaleMistralConfig, HybridScaleQwen2Config
from .generation import attach
from .hybrid import HybridAttention, hybrid_layers
from .naive import check_mode


class HybridScaleMixin:
    def _convert_attention(self):
        settings = dict(self.config.hybrid)
        decoder = self.model
        for i in settings["layers"]:
            decoder.layers[i].self_attn = HybridAttention.from_softmax(
                decoder.layers[i].self_attn, self.config, i, settings
            )
        attach(self)
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


class HybridScaleLlamaForCausalLM(HybridScaleMixin, LlamaForCausalLM):
    config_class = HybridScaleLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self._convert_attention()


class HybridScaleMistralForCausalLM(HybridScaleMixin, MistralForCausalLM):
    config_class = HybridScaleMistralConfig

    def __init__(self, config):
        super().__init__(config)
        self._convert_attention()


class HybridScaleQwen2ForCausalLM(HybridScaleMixin, Qwen2ForCausalLM):
    config_class = HybridScaleQwen2Config

    def __init__(self, config):
        super().__init__(config)
        self._convert_attention()
