"""What runs before a stage writes its first byte: `plan` (memory, disk, time, blocking problems), the input
checks (`inputs`) and `plan --dry-run` (`dry_run`, the real set-up on the meta device)."""
