"""The data files shipped with hybrid_scale: the presets (`configs/`) and the sbatch templates (`slurm/`).

The repository's top-level `configs/` and `slurm/` are the only copies to edit. `hybrid_scale/_data/configs` and
`hybrid_scale/_data/slurm` are relative symlinks to them, so a source checkout and an editable install
(`pip install -e .`) read the repository's files, and a wheel carries them as package data
(`[tool.setuptools.package-data]` in pyproject.toml; the build copies the files the links point to) under
`site-packages/hybrid_scale/_data/`.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The shipped folder `name` ("configs" or "slurm"), resolved: in a checkout the repository's own folder (what the
    link points to), in a wheel install the package's copy. Where a checkout lost the links (symlinks checked out as
    plain files), the repository's folder next to the package."""
    for candidate in (PACKAGE / "_data" / name, PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate.resolve()
    return PACKAGE / "_data" / name  # missing: callers name this path in their errors
