"""`make gpu-wheels`: the wheels the GPU check needs on a machine without network, into .whl/ (git-ignored).

The GPU machine (Python 3.12, x86-64, torch 2.11+cu130, transformers 5.17, tokenizers, safetensors, accelerate,
huggingface-hub, numpy, pandas, pyarrow, psutil, py-cpuinfo, msgpack, ninja, einops, matplotlib, tqdm, pyyaml...)
lacks some of what this package needs. Those are fetched here at the version installed in this virtual environment
(the versions the test suite runs with), so the GPU run uses the tested combination:

  * omegaconf (config), datasets + dill + multiprocess (task datasets, `datasets` directories as data.source);
  * deepspeed (stage 2, ZeRO-3) + hjson + pydantic, pydantic-core, annotated-types, typing-inspection and
    typing-extensions (pydantic needs a newer one than some images have); deepspeed is on PyPI only as an sdist, so
    its wheel is built here with DS_BUILD_OPS=0 (pure Python: its ops compile on first use, and stage 2 needs none
    on a GPU with torch's AdamW);
  * peft at the tested version (the image's version is not known in advance; pyproject needs >= 0.17);
  * transformers at the tested version: the image's 5.17 is inside pyproject's >=5,<6 but too old for this code
    (evaluate/loglik.py reads `out.cache`, which 5.17's model outputs lack: evaluation fails there); 5.24 imports with
    the image's huggingface-hub 1.33, tokenizers 0.23 and safetensors 0.8;
  * fla-core (flash-linear-attention's kernels; pinned in pyproject's dev extra): the baseline that
    benchmarks/device/speed.py and kernel_speed.py measure the hybrid against, never a dependency of the toolkit. The
    H200 run of 2026-12-04 measured no fla: these wheels did not carry it, and the image has none that imports
    (kernel_speed.py swallowed the error, so its log does not say which). Pure Python; it needs einops (carried too,
    in case the image lacks it), torch >= 2.7 and triton >= 3.3, which the image's torch 2.11 and bundled triton 3.6
    meet (0.6.0 imports with triton 3.6.0: checked on CPU); installed with --no-deps like every wheel here, it never
    pulls a torch or triton of its own;
  * this package itself (`pip wheel --no-deps` of the checkout's tracked and untracked-not-ignored files).

Not carried: torch (the image's 2.11+cu130 stands in for the tested 2.13; a CUDA build is far over the size limit),
huggingface-hub (the image's 1.33; transformers 5.24 needs >= 1.31), the asset packages (the GPU check builds its
own tiny model, tokenizer and task data). Add more with GPU_WHEELS_EXTRA="name==version ...". Prints every wheel and
the total size, and fails above --max-mib (the device tool carries 64 MiB in all, the repository included).

    .venv/bin/python -m tools.gpu_wheels [--dest .whl] [--max-mib 40]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING_ON_DEVICE = [
    "omegaconf",
    "datasets",
    "dill",
    "multiprocess",
    "deepspeed",
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "peft",
    "transformers",
    "pytest",  # the device harness (benchmarks/device.sh) runs the gpu-marked tests
    "fla-core",  # the linear-attention baseline of benchmarks/device/speed.py (a baseline only, not a dependency)
    "einops",  # fla-core's one requirement
    "iniconfig",
    "pluggy",
    "pygments",
]
SDIST_ONLY = {"deepspeed"}  # built into a wheel here
# Versions for the device that differ from this environment's: transformers >= 5.25 needs huggingface-hub >= 2.4 (and
# httpx2, kernels), the image has 1.33; 5.24.0 imports with 1.33 (seen on the H200 on 2026-12-04, where 5.25.0 did not).
DEVICE_VERSIONS = {"transformers": "5.24.0"}
TARGET = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[
        f"--platform={p}"
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
    ],
]


def pins() -> list[str]:
    """name==version for each package: DEVICE_VERSIONS, else the version installed in this environment; a name in
    GPU_WHEELS_EXTRA replaces its pin."""
    out = {}
    for name in MISSING_ON_DEVICE:
        try:
            out[name] = f"{name}=={DEVICE_VERSIONS.get(name) or metadata.version(name)}"
        except metadata.PackageNotFoundError:
            sys.exit(f"gpu-wheels: {name} is not installed in {sys.prefix}: run `make install` first")
    for extra in os.environ.get("GPU_WHEELS_EXTRA", "").split():
        out[extra.split("==")[0].lower().replace("_", "-")] = extra
    return list(out.values())


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def checkout_copy(dest: Path) -> Path:
    """The checkout's tracked and untracked-not-ignored files (symbolic links kept), what `pip wheel` should see."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for raw in filter(None, files):
        rel = raw.decode()
        src, dst = ROOT / rel, dest / rel
        if not src.exists() and not src.is_symlink():  # deleted but still tracked
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--max-mib", type=float, default=40.0)
    args = parser.parse_args()
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    wanted = pins()
    binary = [p for p in wanted if p.split("==")[0] not in SDIST_ONLY]
    built = [p for p in wanted if p.split("==")[0] in SDIST_ONLY]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(dest), *binary)
    if built:
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), *built, env={"DS_BUILD_OPS": "0"})
    with tempfile.TemporaryDirectory() as tmp:
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(checkout_copy(Path(tmp) / "src")))
    wheels = sorted(dest.glob("*.whl"))
    names = [w.name.split("-")[0].lower().replace("_", "-") for w in wheels]
    if len(set(names)) != len(names):
        sys.exit(f"gpu-wheels: two versions of one package in {dest} (pip would refuse to install them): {names}")
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels in {dest} (carry it as `.whl`)")
    if total > args.max_mib * 2**20:
        sys.exit(f"gpu-wheels: {total / 2**20:.1f} MiB is over --max-mib {args.max_mib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
