"""Configs of an exported hybrid model: the base architecture's config plus a `hybrid` dict (window, feature map,
feature dim, sinks, mode, chunk size, converted layers, optional per-layer modes). Imports only transformers."""

from transformers import LlamaConfig, MistralConfig, Qwen2Config

from .architectures import BY_MODEL_TYPE


def _hybrid_config(base, model_type: str):
    class HybridScaleConfig(base):
        def __init__(self, hybrid: dict | None = None, **kwargs):
            self.hybrid = dict(hybrid or {})
            super().__init__(**kwargs)

    HybridScaleConfig.model_type = model_type
    return HybridScaleConfig


class HybridScaleLlamaConfig(_hybrid_config(LlamaConfig, BY_MODEL_TYPE["llama"].export_type)):
    pass


class HybridScaleMistralConfig(_hybrid_config(MistralConfig, BY_MODEL_TYPE["mistral"].export_type)):
    pass


class HybridScaleQwen2Config(_hybrid_config(Qwen2Config, BY_MODEL_TYPE["qwen2"].export_type)):
    pass
