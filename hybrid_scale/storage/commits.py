"""Commit helpers shared by the stages: atomic small files, content hashes, commit markers written last, the rule
for replacing a directory (the fault injection the resume tests use: faults.py).

The rule for the whole code base: a stage only ever replaces or removes a directory that the toolkit itself created
for that purpose, recognised by its own marker -- `COMMITTED` (written last into every finished directory) or
`PARTIAL_TAG` (written first into every directory a stage builds before moving it into place). Anything else at a
destination is one clear error that names the config key and the fix, and nothing is touched."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from ..errors import DestinationError

MARKER = "COMMITTED"
PARTIAL_TAG = ".hybrid_scale_partial"  # first file of a directory under construction (removed by commit())


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_tensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' save_file, its I/O errors raised as the OSError they are: a disk that fills while it writes
    gives ENOSPC (one line from the CLI, like every other full-disk write), not a SafetensorError traceback."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def commit(directory: Path) -> None:
    """Write the marker of a finished directory: the sha256 of every file in it, written last (then the partial tag
    goes: the marker alone now says the toolkit made it)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MARKER, PARTIAL_TAG))
    atomic_write(directory / MARKER, json.dumps({str(p.relative_to(directory)): sha256(p) for p in files}, indent=1))
    (directory / PARTIAL_TAG).unlink(missing_ok=True)


def is_committed(directory: Path) -> bool:
    """A marker whose hashes match every file it names (a partial or corrupt directory is never trusted)."""
    marker = directory / MARKER
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text())
    except ValueError:
        return False
    return all((directory / name).is_file() and sha256(directory / name) == h for name, h in files.items())


def made_by_toolkit(path: Path) -> bool:
    """A directory this toolkit created: a committed one (its marker) or one under construction (its tag)."""
    return path.is_dir() and not path.is_symlink() and ((path / MARKER).is_file() or (path / PARTIAL_TAG).is_file())


def check_destination(
    dest: Path, key: str, owned=made_by_toolkit, what: str = "a directory hybrid_scale wrote"
) -> None:
    """Refuse, before any work, a destination that holds something the toolkit did not create: `dest` itself (which
    will be replaced) and its `.partial` / `.old` siblings (which are removed). Nothing is touched."""
    for path, own in ((dest, owned), (sibling(dest, "partial"), made_by_toolkit), (sibling(dest, "old"), owned)):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise DestinationError(
                f"config key '{key}': {path} exists and is not a directory; nothing was touched: choose a path "
                "that does not exist yet"
            )
        if path.exists() and not own(path):
            raise DestinationError(
                f"config key '{key}': {path} exists and is not {what} (no {MARKER} marker of its own); nothing was "
                "touched: choose a new directory or move that one away yourself"
            )


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.name}.{suffix}")


def start_partial(dest: Path, key: str) -> Path:
    """The `.partial` directory in which `dest` is built: a leftover of the toolkit's is cleared, anything else is
    refused; the tag goes in first so that a crash leaves a directory the next run may clear."""
    tmp = sibling(dest, "partial")
    if tmp.exists() or tmp.is_symlink():
        if not made_by_toolkit(tmp):
            check_destination(dest, key)  # raises, naming the foreign .partial directory
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL_TAG).write_text("")
    return tmp


def replace_dir(tmp: Path, dest: Path, key: str, owned=made_by_toolkit, what: str = "a directory hybrid_scale wrote"):
    """Move a committed tmp directory into place. What was at `dest` is dropped only when the toolkit made it for this
    purpose (`owned`); anything else is refused (DestinationError) and left as it is."""
    check_destination(dest, key, owned, what)
    old = sibling(dest, "old")
    if dest.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old.exists():
        shutil.rmtree(old)


def remove_dir(path: Path) -> None:
    """Remove a directory the toolkit made (its marker or tag); anything else stays (returns without a sound)."""
    if made_by_toolkit(path):
        shutil.rmtree(path)


def is_export(path: Path) -> bool:
    """An export this toolkit wrote (or is writing): its own marker and a hybrid_scale config.json."""
    if not path.is_dir() or path.is_symlink():
        return False
    if (path / PARTIAL_TAG).is_file():
        return True
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return False
    return (path / MARKER).is_file() and str(model_type).startswith("hybrid_scale_")
