"""Helpers shared by the steps: the byte-level tokenizer (steps a and c), synchronising the device, the versions
and the machine for the report (in the parts, each of which runs in its own process); and the subprocesses: the
children's environment (the checkout first on PYTHONPATH, the collective checker when asked), the log of
everything they print, and run_child, which cuts each one at GPU_CHECK_DEADLINE (DEADLINE, set by the driver)."""

from __future__ import annotations

import math
import os
import platform
import shlex
import subprocess
import threading
import time
from pathlib import Path

from .settings import COLLECTIVES, ROOT

# --- shared helpers of the parts (each runs in its own process) ----------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the tokenizers ByteLevel pre-tokenizer maps bytes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def byte_tokenizer():
    """A byte-level tokenizer (ids 0-2: <pad>, <s>, </s>; 3-258: the 256 bytes), built here, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for _, ch in sorted(bytes_to_unicode().items()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "peft", "deepspeed", "tokenizers", "safetensors", "datasets", "omegaconf", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import hybrid_scale

    out["hybrid_scale_from"] = str(Path(hybrid_scale.__file__).parent)
    return out


def device_info(device: str) -> dict:
    import torch

    info = {"device": device}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info |= {
            "gpu": p.name,
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}",
        }
    else:
        info |= {"gpu": None, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    return info


# --- subprocesses ------------------------------------------------------------------------------------------------


def child_env(extra: dict | None = None) -> dict:
    checker = [str(COLLECTIVES)] if (extra or {}).get("HYBRID_SCALE_COLLECTIVES") else []
    path = os.pathsep.join(filter(None, [str(ROOT), *checker, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(extra or {})}


class Log:
    """Everything the subprocesses print, in one file beside the table."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        path.write_text("")

    def add(self, title: str, text: str) -> None:
        with self.lock, self.path.open("a") as f:
            f.write(f"\n===== {title} =====\n{text}\n")


DEADLINE = [math.inf]  # time.monotonic() by which every subprocess must have ended (GPU_CHECK_DEADLINE)
EXPORT_CHECK_RESERVE = 30  # s before the deadline by which step b's stages end: its export check runs after them
B_RESERVE = 150  # s before the deadline by which steps c, d and e end when step b's GPU run comes after them


def run_child(cmd: list[str], title: str, log: Log, timeout: int, extra_env: dict | None = None, reserve: int = 0):
    """cmd run to its end, cut at `timeout` s or at `reserve` s before the deadline, whichever comes first."""
    t0 = time.perf_counter()
    timeout = max(1, min(timeout, int(DEADLINE[0] - reserve - time.monotonic())))
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=child_env(extra_env), capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + f"\n[timed out: {timeout} s]"
    seconds = time.perf_counter() - t0
    log.add(f"{title} (rc {rc}, {seconds:.1f} s): {shlex.join(cmd)}", f"--- stdout\n{out}\n--- stderr\n{err}")
    return rc, out, err, seconds
