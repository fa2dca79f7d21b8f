"""The gated delta-rule LA: the recurrence (naive.py, the spec; chunk.py, the WY form), its join to the window
(hybrid.py), its decode (recurrent.py), its gates and convolutions (modules.py) and its part of the layer (part.py)."""
