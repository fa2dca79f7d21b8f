"""Hybrid attention, in flash-linear-attention's layout: one folder per kind of memory the layer holds, each with its
spec (naive.py), its chunked form (chunk.py) and its decode step (recurrent.py):

- window/       the softmax window with its sinks: positions in real tokens, packing, the decode state (its ring);
- hedgehog/     the Hedgehog LA (feature maps, optional decay) under the window's normaliser, and its part.py;
- gated_delta/  the gated delta-rule LA (the recurrence, its WY chunks, its join to the window, its gates), part.py;
- hf/           the Hugging Face integration an export carries: cache, generation, modeling, configuration, the
                architectures;

and the layer that composes them (layer.py: HybridAttention, `attend`), the interface of a part (part.py), the one
registry of kinds (kinds.py) and their parts (parts.py), the one record of settings (settings.py), one call's options
(options.py), the backend registry (backends.py) and the shape a backend is checked at (shape.py).

Nothing here imports the rest of hybrid_scale or Triton: the export copies the package, flattened, next to a modeling
file (export/remote_code.py). This file and the subfolders' are empty of imports, so that the torch-free modules
(settings.py, kinds.py, hedgehog/feature_specs.py) are read without torch.
"""
