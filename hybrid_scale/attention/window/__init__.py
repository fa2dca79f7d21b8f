"""The softmax window with its sinks: positions counted in real tokens (naive.py), packing and the sinks-only softmax
(chunk.py), and the decode state every hybrid layer keeps (recurrent.py: the ring, the sinks, the LA's state)."""
