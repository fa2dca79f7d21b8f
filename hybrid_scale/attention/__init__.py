"""Hybrid attention: naive (the spec), chunked, recurrent (decode), feature maps, the backend registry (backends) and
the entry point `attend` with the nn.Module (hybrid).

Nothing here imports the rest of hybrid_scale or Triton: the export copies these files next to a modeling file.
"""
