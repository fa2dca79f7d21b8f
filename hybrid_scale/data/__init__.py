"""Data: the embedded default assets, benchmark tasks, training text."""
