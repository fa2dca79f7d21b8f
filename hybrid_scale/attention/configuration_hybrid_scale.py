"""Configs of an exported hybrid model: the base architecture's config plus a `hybrid` dict (window, feature map,
feature dim, sinks, mode, chunk size, converted layers, optional per-layer modes). Imports only transformers."""

from transformers import LlamaConfig, MistralConfig, Qwen2Config


def _hybrid_config(base, model_type: str):
    class HybridScaleConfig(base):
        def __init__(self, hybrid: dict | None = None, **kwargs):
            self.hybrid = dict(hybrid or {})
            super().__init__(**kwargs)

    HybridScaleConfig.model_type = model_type
    return HybridScaleConfig


class HybridScaleLlamaConfig(_hybrid_config(LlamaConfig, "hybrid_scale_llama")):
    pass


class HybridScaleMistralConfig(_hybrid_config(MistralConfig, "hybrid_scale_mistral")):
    pass


class HybridScaleQwen2Config(_hybrid_config(Qwen2Config, "hybrid_scale_qwen2")):
    pass


BASE_MODEL_TYPE = {"hybrid_scale_llama": "llama", "hybrid_scale_mistral": "mistral", "hybrid_scale_qwen2": "qwen2"}
