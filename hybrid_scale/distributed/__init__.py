"""Distributed runtime, DeepSpeed, tensor parallel, checkpoints, Slurm."""
