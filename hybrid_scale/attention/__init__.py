"""Hybrid attention: naive (the spec), chunked, recurrent (decode), feature maps, and the nn.Module (hybrid).

Nothing here imports the rest of hybrid_scale or Triton: the export copies these files next to a modeling file.
"""
