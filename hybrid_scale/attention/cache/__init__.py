"""The cache of exact keys: the layer's third memory, beside the window (recent tokens) and the LA state (everything
else): the few keys the state cannot hold, chosen by a score (select.py; naive.py the token-by-token spec, chunk.py
the blocked prefill, recurrent.py the decode step, attend.py the one entry the parts call)."""
