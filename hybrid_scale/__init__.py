"""hybrid_scale: convert Llama-family LLMs into hybrid sliding-window softmax + linear attention models."""

from .attention.hybrid import HybridAttention, HybridCache
from .config import ConfigError, load_config
from .models.convert import UnsupportedArchitectureError, components, convert_model, get_modes, set_modes, set_window
from .models.converted import load_converted, save_converted

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "HybridAttention",
    "HybridCache",
    "UnsupportedArchitectureError",
    "components",
    "convert_model",
    "get_modes",
    "load_config",
    "load_converted",
    "save_converted",
    "set_modes",
    "set_window",
]
