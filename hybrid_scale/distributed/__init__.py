"""Process groups, parallelize (tensor parallel -> activation checkpointing -> ZeRO-3), DeepSpeed, commit markers and
the directory rule, save-and-requeue, Slurm."""
