"""hybrid_scale: convert Llama-family LLMs into hybrid sliding-window softmax + linear attention models.

The names below load on first use (PEP 562): `import hybrid_scale` and the command line's parsing import no torch,
so `hybrid-scale --help`, `launch`, `submit` and `config` start in a fraction of a second."""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {  # name -> the module that defines it (the config too: a test may declare a setting before it is built)
    "ConfigError": ".config",
    "load_config": ".config",
    "hybrid_layers": ".attention.layer",
    "HybridAttention": ".attention.layer",
    "HybridCache": ".attention.hf.cache",
    "UnsupportedArchitectureError": ".models.convert",
    "components": ".models.convert",
    "convert_model": ".models.convert",
    "get_modes": ".models.convert",
    "set_modes": ".models.convert",
    "set_window": ".models.convert",
    "load_converted": ".models.converted",
    "save_converted": ".models.converted",
}

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hybrid_scale' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
