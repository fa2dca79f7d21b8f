"""What the stages write and how: commit markers, partial directories and the rule for replacing one, atomic small
files, content hashes, tensors (commits.py); and the fault injection the resume tests use (faults.py)."""
