"""Explorations, one folder per question, each with a README.md (its question, status, the commit its figures come
from and the command that reproduces them). Run from the repository root as `python -m experiments.NAME.MODULE`."""
