"""Configs of an exported hybrid model: the base architecture's config plus a `hybrid` dict (window, feature map,
feature dim, sinks, mode, chunk size, converted layers, optional per-layer modes). One class per architecture record
(architectures.py), HybridScale{prefix}Config, made here from transformers' {prefix}Config. Imports only
transformers."""

import transformers

from .architectures import ARCHITECTURES


def hybrid_config(base: type, model_type: str, name: str) -> type:
    """`base` (a transformers config class) with the `hybrid` settings, as `name` for `model_type`."""

    def __init__(self, hybrid: dict | None = None, **kwargs):
        self.hybrid = dict(hybrid or {})
        base.__init__(self, **kwargs)

    return type(name, (base,), {"__init__": __init__, "model_type": model_type, "__module__": __name__})


CONFIGS: dict[str, type] = {  # by prefix; each also a name of this module (an export's auto_map names it)
    a.prefix: hybrid_config(getattr(transformers, f"{a.prefix}Config"), a.export_type, f"HybridScale{a.prefix}Config")
    for a in ARCHITECTURES.values()
}
globals().update({cls.__name__: cls for cls in CONFIGS.values()})
