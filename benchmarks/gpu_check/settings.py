"""The GPU check's settings: where things are (the repository, the text, the collective checker), the tolerances
of the checked run against the reference, and settings(): every size and budget of steps a-e from the GPU_CHECK_*
environment variables (toy sizes with GPU_CHECK_SMALL=1); plus the two number helpers the checks share."""

from __future__ import annotations

import math
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "benchmarks" / "gpu_check" / "text.jsonl"
COLLECTIVES = ROOT / "tests" / "collectives"  # sitecustomize.py: records torch.distributed calls (and off-device ones)
HELDOUT_FRACTION = 0.1
MODES = ["base", "hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none"]
# relative tolerances of the checked run against the reference (bf16 against fp32 by default): bf16 keeps 8 bits of
# mantissa (0.4 % per rounding), and stages 1 and 2 train a few steps on top of it. Measured at the full step-b sizes
# on CPU, bf16 vs fp32 (60 pretraining steps): stage-1 losses within 0.07 %, stage-2 losses 0.04 %, perplexities
# 0.45 %, task log-likelihoods 0.13 %, the export's loss 0.003 % -- so these leave a factor 5-10 for the GPU's kernels
TOL = {
    "stage1_loss": 0.03,
    "stage2_train_loss": 0.02,
    "stage2_heldout_loss": 0.02,
    "perplexity": 0.03,
    "task_loglik": 0.02,
    "export_loss": 0.02,
}
DECODE_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # cached decode vs full forward, max|d|/max|logit|


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def settings() -> dict:
    small = env("GPU_CHECK_SMALL", "0") == "1"
    s = {
        "small": small,
        "device": env("GPU_CHECK_DEVICE", "cuda"),
        "dtype": env("GPU_CHECK_DTYPE", "bfloat16"),
        "ref_device": env("GPU_CHECK_REF_DEVICE", "cpu"),
        "ref_dtype": env("GPU_CHECK_REF_DTYPE", "float32"),
        "steps": env("GPU_CHECK_STEPS", "a,b,c,d,e").split(","),
        "kernel_budget": int(env("GPU_CHECK_KERNEL_BUDGET", "100")),
        "timeout": int(env("GPU_CHECK_TIMEOUT", "240")),
        "deadline": int(env("GPU_CHECK_DEADLINE", "450")),
        "cli": env("GPU_CHECK_CLI", "pipeline" if small else "stages"),
        "parallel": env("GPU_CHECK_PARALLEL", "1" if small else "0") == "1",
    }
    if small:
        s["tiny"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        s["tiny"] |= dict(num_key_value_heads=2, head_dim=16)
        s["pretrain"] = dict(steps=10, seq_len=64, batch=4, lr=3e-3)
        s["pipe"] = dict(window=16, seq_len=64, num_sequences=8, epochs=1, distill_batch=4, steps=4, global_batch=2)
        s["pipe"] |= dict(micro_batch=1, eval_every=2, heldout=2, limit=4, ppl_seq_len=128, ppl_sequences=1)
        s["pipe"] |= dict(buckets=[0, 16, 64, 128], la_share=64, decode_steps=4, passkey=[20, 40], passkey_trials=2)
        s["big"] = dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, seq_len=64, sequences=8)
        s["big"] |= dict(distill_batch=4, steps=3, global_batch=2)
        s["attn"] = dict(lengths=[256, 512], heads=4, kv=2, head_dim=16, feature=32, naive_max=512, window=16)
        s["attn"] |= dict(warmup=1, repeats=2)
    else:
        s["tiny"] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
        s["tiny"] |= dict(num_key_value_heads=2, head_dim=64)
        s["pretrain"] = dict(steps=300, seq_len=256, batch=16, lr=3e-3)
        s["pipe"] = dict(window=64, seq_len=256, num_sequences=32, epochs=2, distill_batch=8, steps=8, global_batch=4)
        s["pipe"] |= dict(micro_batch=2, eval_every=4, heldout=4, limit=16, ppl_seq_len=512, ppl_sequences=2)
        s["pipe"] |= dict(buckets=[0, 64, 256, 512], la_share=256, decode_steps=8, passkey=[32, 128, 512])
        s["pipe"] |= dict(passkey_trials=8)
        s["big"] = dict(layers=4, hidden=2048, heads=32, kv=8, head_dim=64, inter=8192, seq_len=2048, sequences=16)
        s["big"] |= dict(distill_batch=4, steps=4, global_batch=4)
        s["attn"] = dict(lengths=[4096, 16384], heads=32, kv=8, head_dim=64, feature=128)
        s["attn"] |= dict(naive_max=8192, window=64, warmup=2, repeats=5)
    if "GPU_CHECK_LENGTHS" in os.environ:
        s["attn"]["lengths"] = [int(x) for x in os.environ["GPU_CHECK_LENGTHS"].split(",")]
    if "GPU_CHECK_NAIVE_MAX" in os.environ:
        s["attn"]["naive_max"] = int(os.environ["GPU_CHECK_NAIVE_MAX"])
    if "GPU_CHECK_PRETRAIN_STEPS" in os.environ:
        s["pretrain"]["steps"] = int(os.environ["GPU_CHECK_PRETRAIN_STEPS"])
    if "GPU_CHECK_BIG_LAYERS" in os.environ:
        s["big"]["layers"] = int(os.environ["GPU_CHECK_BIG_LAYERS"])
    return s


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
