"""The values the `attention` config keys take, without torch: the config and the command line read them here, so a
process that only parses a config (`hybrid-scale launch`, `submit`, `--help`) never imports torch. The code behind
each value is in naive.py (MODES), feature_maps.py (FEATURE_MAPS: a test checks that the two lists agree) and
backends.py (BACKENDS)."""

MODES = ("hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none")
FEATURE_MAPS = ("hedgehog", "exp", "t2r", "relu", "elu1")
BACKENDS = ("auto", "torch", "triton")  # the values of attention.backend
LA_KINDS = ("hedgehog", "gated_delta")  # attention.la_kind: the linear part (feature_maps.py; delta.py)
LA_COMBINES = ("normaliser", "mix")  # attention.la_combine: how gated_delta joins the window (delta.COMBINES)
