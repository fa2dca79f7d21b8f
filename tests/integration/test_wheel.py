"""A wheel of the repository carries the presets (configs/) and sbatch templates (slurm/) as package data, and an
install from it finds them without the repository: built with the venv's setuptools (no network), installed into a
fresh venv that borrows only the dependencies from this one (a .pth file; the editable install's finder is not loaded
from there), and run from a directory outside the repository."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from hybrid_scale.config import PRESETS
from hybrid_scale.launch.slurm import TEMPLATES
from hybrid_scale.resources import PACKAGE, data_dir

ROOT = Path(__file__).resolve().parents[2]
# what a build must not see: this venv, VCS data, build outputs and caches (the copy is what `pip wheel .` reads)
NOT_SOURCES = {".venv", ".git", "build", "dist", "runs", ".cache", ".pytest_cache", ".ruff_cache", "__pycache__"}


def test_a_checkout_reads_the_top_level_folders():
    """configs/ and slurm/ stay the only copies: the package's _data entries are relative links to them."""
    assert PRESETS == data_dir("configs") == ROOT / "configs"
    assert TEMPLATES == data_dir("slurm") == ROOT / "slurm"
    for name in ("configs", "slurm"):
        link = PACKAGE / "_data" / name
        assert link.is_symlink() and os.readlink(link) == f"../../{name}", f"{link} must link to ../../{name}"


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 120) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_wheel_install_finds_presets_and_templates(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1", OMP_NUM_THREADS="1")

    # build from a copy (an in-tree build would write build/ and *.egg-info into the repository); links stay links
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=lambda d, names: [
            n for n in names if n in NOT_SOURCES or n.endswith((".egg-info", ".safetensors", ".gguf"))
        ],
    )
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hybrid_scale-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"hybrid_scale/_data/configs/{p.relative_to(ROOT / 'configs')}" for p in ROOT.glob("configs/**/*.yaml")}
    shipped |= {f"hybrid_scale/_data/slurm/{p.name}" for p in ROOT.glob("slurm/*.sbatch")}
    assert "hybrid_scale/_data/configs/models/llama3-8b.yaml" in shipped and len(shipped) >= 10
    assert shipped <= names, f"missing from the wheel: {sorted(shipped - names)}"
    data = {n for n in names if n.startswith("hybrid_scale/_data/")}
    assert data == shipped, f"in the wheel but not in configs/ or slurm/: {sorted(data - shipped)}"
    packages = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("hybrid_scale/**/__init__.py")}
    assert packages <= names, f"packages missing from the wheel: {sorted(packages - names)}"
    assert not any(n.split("/")[0] in ("configs", "slurm") for n in names), "top-level data folders in site-packages"
    # the Triton kernels: their own package (never a top-level `kernels`), found by the attention via an entry point
    kernels = {f"hybrid_scale_kernels/{p.name}" for p in ROOT.glob("kernels/hybrid_scale_kernels/*.py")}
    assert len(kernels) >= 3 and kernels <= names, f"missing from the wheel: {sorted(kernels - names)}"
    assert not any(n.startswith("kernels/") for n in names)
    (points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(points).decode()
    assert "[hybrid_scale.attention_backends]\ntriton = hybrid_scale_kernels:register" in text, text

    # a fresh venv: the wheel in its own site-packages, this venv's site-packages only for the dependencies
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([python, "-c", where], tmp_path, env).strip())
    deps = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    (purelib / "_borrowed_dependencies.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    _run([*pip, "install", "-q", "--no-deps", "--target", purelib, wheel], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"  # no configs/, slurm/ or hybrid_scale/ here
    elsewhere.mkdir()
    out = _run([python, "-m", "hybrid_scale", "config", "models/llama3-8b.yaml", "seed=7"], elsewhere, env)
    assert "path: /path/to/Meta-Llama-3-8B" in out and "hidden_size: 4096" in out and "window: 64" in out
    assert "seed: 7" in out

    probe = (
        "import hybrid_scale, hybrid_scale.config as c, hybrid_scale.launch.slurm as s\n"
        "print(hybrid_scale.__file__); print(c.PRESETS); print(s.TEMPLATES)\n"
        "cfg = c.load_config('models/llama3-8b.yaml')\n"
        "print(s.render(cfg, 'finetune', None, []))\n"
        "print(s.render(cfg, 'export', None, []))\n"
    )
    lines = _run([python, "-c", probe], elsewhere, env).splitlines()
    installed = (purelib / "hybrid_scale").resolve()
    assert Path(lines[0]).resolve() == installed / "__init__.py", f"imported {lines[0]}, not the wheel's"
    assert Path(lines[1]) == installed / "_data" / "configs" and Path(lines[2]) == installed / "_data" / "slurm"
    script = "\n".join(lines[3:])
    assert f"from {installed / '_data' / 'slurm' / 'stage.sbatch'}" in script
    assert f"from {installed / '_data' / 'slurm' / 'export.sbatch'}" in script
    assert "#SBATCH --nodes=1" in script and "#SBATCH --cpus-per-task=12" in script
    assert str(ROOT) not in "\n".join(lines[:3]) + script
