"""The Hedgehog LA: feature maps (feature_maps.py; their torch-free specs, feature_specs.py), the hybrid with it under
the window's normaliser (naive.py, the spec; chunk.py; recurrent.py, decode) and its part of the layer (part.py)."""
