"""Launching the stages on a cluster: Slurm scripts, their submission and the requeue grace (slurm.py)."""
