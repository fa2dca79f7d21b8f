"""The GPU check: the whole toolkit on one GPU in one call, with its figures in one table.

Steps (each guarded: a failing step is reported with its traceback and FAILED in the table, the others still run):
  a. build: a tiny random Llama with a byte-level tokenizer made here (no download), briefly pretrained on
     benchmarks/gpu_check/text.jsonl (generated prose) so that its attention is not uniform, and two small synthetic
     task datasets (PIQA- and ARC-Easy-shaped) for the evaluation;
  b. pipeline: distill -> finetune -> evaluate -> export through the CLI (one subprocess per stage) on the checked
     device/dtype (default cuda/bfloat16) and on the reference (default cpu/float32; the GPU is hidden from it);
     every output finite, the stage-1 final losses, stage-2 held-out losses, perplexities by mode and bucket, task
     log-likelihoods and the export's held-out loss compared within stated relative tolerances (TOL), and the
     export's cached decode checked against its full forward; both runs under tests/collectives' checker (every
     torch.distributed collective recorded, one on another device than the run's reported). The reference starts
     in the background when step a is done; on the GPU, steps c, d and e run meanwhile (one at a time), then b's GPU
     run, which then joins it;
  c. big: a Llama-3.2-1B-shaped random model (hidden 2048, 32 heads, 8 KV heads, head_dim 64, intermediate 8192; 4
     layers by default) in the checked dtype on the checked device: seconds per stage-1 layer and per stage-2 step;
  d. attention: hybrid attention (every registered backend, the Triton kernels on CUDA only; naive only up to
     GPU_CHECK_NAIVE_MAX) vs SDPA (is_causal, GQA) at 4k and 16k tokens, batch 1, the 1B head shape: forward and
     forward+backward time (CUDA events, after warm-up) and peak memory, with the ratios to SDPA;
  e. kernels: benchmarks/kernel_speed.py (the fused Triton kernels vs SDPA, FlashAttention if importable and the
     torch path, T = 1k..64k, SmolLM2 and Llama-3-8B head shapes; decode at 1k/8k/32k context vs a KV-cache decode)
     within GPU_CHECK_KERNEL_BUDGET seconds; its kernel_speed.md/json land beside the report;
  f. the table (gpu_check.md) and every figure (gpu_check.json) in GPU_CHECK_OUT (default $OUT, else docs/results),
     rewritten after each step; printed at the end with a one-line summary; exit status 1 if any check failed.

Run on the GPU machine: `bash benchmarks/gpu_check.sh` (installs the carried wheels of `make gpu-wheels` first).
Environment (defaults in brackets):
  GPU_CHECK_DEVICE [cuda], GPU_CHECK_DTYPE [bfloat16]            the checked run (b, c, d)
  GPU_CHECK_REF_DEVICE [cpu], GPU_CHECK_REF_DTYPE [float32]      the reference of step b
  GPU_CHECK_SMALL [0]             1 = toy sizes (the CPU dry run of tests/integration/test_gpu_check.py)
  GPU_CHECK_STEPS [a,b,c,d,e]     the steps to run
  GPU_CHECK_LENGTHS [4096,16384], GPU_CHECK_NAIVE_MAX [8192]     step d
  GPU_CHECK_KERNEL_BUDGET [100]   step e: seconds after which kernel_speed.py starts no measurement
  GPU_CHECK_BIG_LAYERS [4]        depth of the 1B-shaped model of step c (16 = Llama-3.2-1B's)
  GPU_CHECK_PRETRAIN_STEPS [300]  pretraining of the tiny model (step a)
  GPU_CHECK_CLI [stages]          one CLI process per stage; `pipeline` = one `hybrid-scale pipeline` per run
  GPU_CHECK_PARALLEL [0]          1 = steps b, c, d at once (the CPU dry run: its timings mean nothing anyway)
  GPU_CHECK_TIMEOUT [240]         seconds per subprocess
  GPU_CHECK_DEADLINE [450]        seconds, from gpu_check.sh's start (its wheel installation included), after
                                  which no subprocess runs on (each is cut to what is left) and no step starts;
                                  step b's stages end 30 s before it (its export check runs after them), steps c
                                  and d 150 s before it (step b's GPU run comes after them): the report is complete
                                  inside an 8-minute call of the device tool
  GPU_CHECK_WORK [a temporary folder], GPU_CHECK_OUT [$OUT, else docs/results]
(GPU_CHECK_SMALL=1 switches the defaults of GPU_CHECK_CLI to pipeline and of GPU_CHECK_PARALLEL to 1.)
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


# --- a. build -----------------------------------------------------------------------------------------------------


def synthetic_tasks(root: Path, n: int, seed: int = 0) -> None:
    """PIQA- and ARC-Easy-shaped `datasets` directories of n items each, in the corpus' vocabulary."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    things = ["lantern", "basket", "ladder", "kettle", "rope", "map", "bell", "wheel", "blanket", "compass"]
    places = ["the market", "the old bridge", "the mill", "the harbour", "the orchard", "the square"]
    piqa = []
    for _ in range(n):
        t = rng.choice(things)
        a, b = rng.sample(places, 2)
        piqa.append(
            {
                "goal": f"To find the {t} that was kept by the door,",
                "sol1": f"walk to {a} and ask the people there.",
                "sol2": f"count the boats at {b} and wait for dusk.",
                "label": rng.randrange(2),
            }
        )
    Dataset.from_list(piqa).save_to_disk(str(root / "piqa"))
    arc = []
    for i in range(n):
        k = rng.randint(2, 9)
        options = [str(k + 1), str(k + 2), str(k + 3), str(k + 5)]
        rng.shuffle(options)
        answer = options.index(str(k + 1))
        arc.append(
            {
                "id": f"synthetic-{i}",
                "question": f"A ferryman counted {k} boats at the harbour, then one more. How many boats were there?",
                "choices": {"text": options, "label": ["A", "B", "C", "D"]},
                "answerKey": "ABCD"[answer],
            }
        )
    Dataset.from_list(arc).save_to_disk(str(root / "arc_easy"))


def part_build(s: dict, work: Path) -> dict:
    """Step a: the tiny model (pretrained briefly on the check's device in fp32), its tokenizer, the task data."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_scale.data import corpus

    device = s["device"]
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **s["tiny"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    p = s["pretrain"]
    train_docs, _ = corpus.train_and_heldout(str(TEXT), "text", HELDOUT_FRACTION)  # never the held-out documents
    ids = corpus.pack(tok, train_docs, p["seq_len"], None, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    losses = []
    t0 = time.perf_counter()
    model.train()
    for step in range(p["steps"]):
        for group in opt.param_groups:  # short warm-up, then constant
            group["lr"] = p["lr"] * min(1.0, (step + 1) / 20)
        batch = ids[torch.randint(len(ids), (p["batch"],), generator=g)].to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    sync(device)
    seconds = time.perf_counter() - t0
    out = work / "tiny"
    model.eval().to("cpu").save_pretrained(out)  # float32 safetensors
    tok.save_pretrained(out)
    synthetic_tasks(work / "tasks", max(s["pipe"]["limit"], 8))
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": str(out),
        "tasks": str(work / "tasks"),
        "params": params,
        "vocab": len(tok),
        "pretrain_steps": p["steps"],
        "pretrain_loss_first": losses[0],
        "pretrain_loss_last": losses[-1],
        "pretrain_s": seconds,
        "versions": versions(),
        "device_info": device_info(device),
    }


# --- b. pipeline --------------------------------------------------------------------------------------------------


def pipeline_overrides(s: dict, model: str, tasks: str, run_dir: Path, device: str, dtype: str) -> list[str]:
    p = s["pipe"]
    return [
        f"model.path={model}",
        f"model.device={device}",
        f"model.dtype={dtype}",
        f"run_dir={run_dir}",
        f"data.source={TEXT}",
        "data.text_field=text",
        f"data.seq_len={p['seq_len']}",
        f"data.num_sequences={p['num_sequences']}",
        f"data.heldout_fraction={HELDOUT_FRACTION}",
        f"attention.window={p['window']}",
        f"distill.epochs={p['epochs']}",
        f"distill.batch_size={p['distill_batch']}",
        "distill.progress=false",
        "finetune.recipe=ssd",
        f"finetune.max_steps={p['steps']}",
        f"finetune.global_batch={p['global_batch']}",
        f"finetune.micro_batch={p['micro_batch']}",
        f"finetune.eval_every={p['eval_every']}",
        f"finetune.save_every={p['eval_every']}",
        f"finetune.heldout_sequences={p['heldout']}",
        "finetune.lr=0.001",
        "finetune.warmup_steps=2",
        "finetune.progress=false",
        "eval.tasks=[piqa,arc_easy]",
        f"eval.data_dir={tasks}",
        f"eval.limit={p['limit']}",
        f"eval.modes=[{','.join(MODES)}]",
        f"eval.ppl_seq_len={p['ppl_seq_len']}",
        f"eval.ppl_sequences={p['ppl_sequences']}",
        f"eval.buckets=[{','.join(map(str, p['buckets']))}]",
        f"eval.la_share_seq_len={p['la_share']}",
        f"eval.passkey_distances=[{','.join(map(str, p['passkey']))}]",
        f"eval.passkey_trials={p['passkey_trials']}",
        "eval.bootstrap=100",
        "eval.batch_size=8",
        "eval.progress=false",
    ]


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


def run_pipeline(s: dict, tag: str, device: str, dtype: str, built: dict, work: Path, log: Log, extra_env) -> dict:
    """The four stages through the CLI: one process per stage (`hybrid-scale distill ...` etc., each timed), or with
    GPU_CHECK_CLI=pipeline one `hybrid-scale pipeline` process (fewer interpreter starts: the CPU dry run)."""
    run_dir = work / f"run_{tag}"
    overrides = pipeline_overrides(s, built["model"], built["tasks"], run_dir, device, dtype)
    result = {"device": device, "dtype": dtype, "run_dir": str(run_dir), "stage_s": {}, "failed": None}
    prefix = work / f"collectives_{tag}"
    if (COLLECTIVES / "sitecustomize.py").is_file():  # every collective of the stages recorded; one whose tensor is
        # not on the run's device is reported by own_checks (recorded, not refused: the run's other figures survive)
        kind = "cuda" if device.startswith("cuda") else "cpu"
        extra_env = {
            **extra_env,
            "HYBRID_SCALE_COLLECTIVES": str(prefix),
            "HYBRID_SCALE_COLLECTIVES_DEVICE": kind,
            "HYBRID_SCALE_COLLECTIVES_REFUSE": "0",
        }
        result["collectives_file"] = str(prefix) + ".rank0"
    commands = ["pipeline"] if s["cli"] == "pipeline" else ["distill", "finetune", "evaluate", "export"]
    for stage in commands:
        cmd = [sys.executable, "-m", "hybrid_scale.cli", stage, *overrides]
        rc, _, err, seconds = run_child(cmd, f"{tag}: {stage}", log, s["timeout"], extra_env, EXPORT_CHECK_RESERVE)
        result["stage_s"][stage] = seconds
        if rc != 0:
            result["failed"] = f"{stage} (exit {rc}): {err.strip()[-1500:]}"
            return result
    if s["cli"] == "pipeline":  # the stages' own timings, as the pipeline records them
        result["stage_s"] |= json.loads((run_dir / "timings.json").read_text())
    if result.get("collectives_file"):
        path = Path(result["collectives_file"])
        calls = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        result["collectives"] = {
            "calls": len(calls),
            "devices": sorted({d for c in calls for d in c["device"]}),
            "ops": dict(collections.Counter(c["op"] for c in calls)),
        }
    return result | collect(run_dir)


def collect(run_dir: Path) -> dict:
    """The figures a run left on disk: stage-1 final losses, stage-2 curves, evaluation results."""
    from safetensors import safe_open

    stage1 = {}
    for f in sorted((run_dir / "stage1").glob("layer_*.safetensors")):
        with safe_open(str(f), "pt") as h:
            losses = json.loads((h.metadata() or {}).get("losses", "[]"))
        if losses:
            stage1[int(f.stem.split("_")[1])] = losses[-1]
    curves = json.loads((run_dir / "stage2" / "curves.json").read_text())
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    logliks = {
        mode: [ll for r in per.values() if isinstance(r, dict) for item in r["loglik"] for ll in item]
        for mode, per in results["modes"].items()
    }
    return {
        "stage1_final_loss": stage1,
        "stage2_train_loss": curves["train"][-1],
        "stage2_heldout_hybrid": curves["hybrid"][-1],
        "stage2_heldout_la_only": curves["la_only"][-1],
        "perplexity": results["perplexity"]["by_mode"],
        "task_avg": {mode: per["avg"] for mode, per in results["modes"].items()},
        "logliks": logliks,
        "la_share_layers": len((results.get("la_share") or {}).get("share") or {}),
        "verdict": results.get("verdict"),
    }


def part_export_check(s: dict, work: Path) -> dict:
    """Both runs' exports (work/export_check_runs.json: [[run_dir, device, dtype], ...]), each checked by
    export_check."""
    runs = json.loads((work / "export_check_runs.json").read_text())
    return {run_dir: export_check(s, Path(run_dir), device, dtype) for run_dir, device, dtype in runs}


def export_check(s: dict, run_dir: Path, device: str, dtype_name: str) -> dict:
    """The export loaded as a user would (trust_remote_code) on the run's device and dtype: held-out loss, cached decode
    vs the full forward; and every tensor the run wrote is finite."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybrid_scale.data import corpus
    from hybrid_scale.models.converted import load_tokenizer

    p = s["pipe"]
    dtype = getattr(torch, dtype_name)
    export = run_dir / "export"
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    tok = load_tokenizer(export)  # the export's tokenizer without its remote code, as the toolkit reads it
    docs = corpus.heldout_documents(str(TEXT), "text", HELDOUT_FRACTION, "report")
    L, k = p["ppl_seq_len"], p["decode_steps"]
    ids = torch.tensor([tok.encode("\n\n".join(docs))[:L]], device=device)
    with torch.no_grad():
        full = model(ids, labels=ids, use_cache=False)
        out = model(ids[:, : L - k], use_cache=True)
        for j in range(L - k, L):
            out = model(ids[:, j : j + 1], past_key_values=out.past_key_values, use_cache=True)
    a, b = full.logits[0, -1].float(), out.logits[0, -1].float()
    decode_rel = ((a - b).abs().max() / a.abs().max()).item()
    bad, scanned = [], 0
    for f in sorted(run_dir.rglob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            scanned += 1
            if t.is_floating_point() and not torch.isfinite(t).all():
                bad.append(f"{f.relative_to(run_dir)}:{name}")
    return {
        "export_loss": full.loss.item(),
        "export_logits_finite": bool(torch.isfinite(full.logits).all()),
        "decode_rel_diff": decode_rel,
        "decode_steps": k,
        "tensors_scanned": scanned,
        "nonfinite_tensors": bad,
    }


def compare_pipelines(run: dict, ref: dict) -> list[dict]:
    """Rows (figure, value, reference, relative difference, tolerance, status)."""
    rows = []

    def add(figure, value, reference, tol_key):
        tol = TOL[tol_key]
        ok = finite(value) and finite(reference) and rel_diff(value, reference) <= tol
        d = rel_diff(value, reference) if finite(value) and finite(reference) else float("nan")
        rows.append(dict(figure=figure, value=value, ref=reference, rel=d, tol=tol, status="ok" if ok else "FAILED"))

    if not run["stage1_final_loss"] or not ref["stage1_final_loss"]:  # the layer files no longer carry their losses
        rows.append(
            dict(
                figure="stage 1 final losses (metadata 'losses' of stage1/layer_*.safetensors)",
                value=float("nan"),
                ref=float("nan"),
                rel=float("nan"),
                tol=TOL["stage1_loss"],
                status="FAILED",
            )
        )
    for layer in sorted(set(run["stage1_final_loss"]) | set(ref["stage1_final_loss"]), key=int):
        add(
            f"stage 1 final loss, layer {layer}",
            run["stage1_final_loss"].get(layer, float("nan")),
            ref["stage1_final_loss"].get(layer, float("nan")),
            "stage1_loss",
        )
    add("stage 2 last training loss", run["stage2_train_loss"], ref["stage2_train_loss"], "stage2_train_loss")
    add(
        "stage 2 held-out loss, hybrid",
        run["stage2_heldout_hybrid"],
        ref["stage2_heldout_hybrid"],
        "stage2_heldout_loss",
    )
    add(
        "stage 2 held-out loss, la_only",
        run["stage2_heldout_la_only"],
        ref["stage2_heldout_la_only"],
        "stage2_heldout_loss",
    )
    for mode in MODES:
        for bucket, value in run["perplexity"].get(mode, {}).items():
            add(
                f"perplexity {mode} {bucket}",
                value,
                ref["perplexity"].get(mode, {}).get(bucket, float("nan")),
                "perplexity",
            )
    for mode in MODES:
        a, b = run["logliks"].get(mode, []), ref["logliks"].get(mode, [])
        if a and len(a) == len(b):
            mean_abs = statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))
            scale = statistics.fmean(abs(y) for y in b)
            rows.append(
                dict(
                    figure=f"task log-likelihoods {mode}: mean abs diff / mean abs ll ({len(a)} requests)",
                    value=mean_abs,
                    ref=scale,
                    rel=mean_abs / scale,
                    tol=TOL["task_loglik"],
                    status="ok" if mean_abs / scale <= TOL["task_loglik"] else "FAILED",
                )
            )
    add("export held-out loss (trust_remote_code load)", run["export_loss"], ref["export_loss"], "export_loss")
    return rows


def own_checks(run: dict, tag: str) -> list[dict]:
    """Checks of one run on its own: finiteness, decode vs full forward."""
    rows = []
    bad = run["nonfinite_tensors"]
    rows.append(
        dict(
            check=f"{tag}: every tensor written is finite ({run['tensors_scanned']} tensors)",
            value=len(bad),
            limit=0,
            status="ok" if not bad else "FAILED",
            note=", ".join(bad[:5]),
        )
    )
    figures = [
        run["stage2_train_loss"],
        run["stage2_heldout_hybrid"],
        run["stage2_heldout_la_only"],
        run["export_loss"],
    ]
    figures += list(run["stage1_final_loss"].values()) + [x for m in run["perplexity"].values() for x in m.values()]
    figures += [x for m in run["logliks"].values() for x in m]
    nonfinite = sum(not finite(x) for x in figures)
    rows.append(
        dict(
            check=f"{tag}: every loss, perplexity and log-likelihood is finite ({len(figures)} figures)",
            value=nonfinite,
            limit=0,
            status="ok" if nonfinite == 0 and run["export_logits_finite"] else "FAILED",
            note="",
        )
    )
    if "collectives" in run:
        c = run["collectives"]
        kind = "cuda" if run["device"].startswith("cuda") else "cpu"
        wrong = [d for d in c["devices"] if not d.startswith(kind)]
        ops = ", ".join(f"{op} {n}" for op, n in sorted(c["ops"].items()))
        rows.append(
            dict(
                check=f"{tag}: torch.distributed collectives of the four stages on the run's device "
                "(tests/collectives checker)",
                value=c["calls"],
                limit=f"all on {kind}",
                status="ok" if not wrong else "FAILED",
                note=(f"off-device: {', '.join(wrong)}; " if wrong else "") + (ops or "none made"),
            )
        )
    tol = DECODE_TOL.get(run["dtype"], 3e-2)
    rows.append(
        dict(
            check=f"{tag}: export's cached decode ({run['decode_steps']} steps) vs full forward, "
            "max abs diff / max abs logit",
            value=run["decode_rel_diff"],
            limit=tol,
            status="ok" if finite(run["decode_rel_diff"]) and run["decode_rel_diff"] <= tol else "FAILED",
            note="",
        )
    )
    return rows


# --- c. big: the 1B shape -----------------------------------------------------------------------------------------


def timed(fn, device, store: list):
    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        store.append(time.perf_counter() - t0)
        return out

    return wrapper


def part_big(s: dict, work: Path) -> dict:
    """Step c: stage 1 and stage 2 of a 1B-shaped random model; seconds per layer and per step, peak memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_scale.config import load_config
    from hybrid_scale.stages import distill as stage1
    from hybrid_scale.stages import finetune as stage2

    b, device, dtype = s["big"], s["device"], s["dtype"]
    cuda = torch.device(device).type == "cuda"
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=b["hidden"],
        intermediate_size=b["inter"],
        num_hidden_layers=b["layers"],
        num_attention_heads=b["heads"],
        num_key_value_heads=b["kv"],
        head_dim=b["head_dim"],
        max_position_embeddings=max(4096, b["seq_len"]),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    path = work / "big"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    build_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.empty_cache()
    steps_per_layer = math.ceil(b["sequences"] / b["distill_batch"])
    cfg = load_config(
        overrides=[
            f"model.path={path}",
            f"model.device={device}",
            f"model.dtype={dtype}",
            f"run_dir={work / 'run_big'}",
            f"data.source={TEXT}",
            f"data.seq_len={b['seq_len']}",
            f"data.num_sequences={b['sequences']}",
            "data.heldout_fraction=0.2",
            "distill.epochs=1",
            f"distill.batch_size={b['distill_batch']}",
            f"distill.buffer_dtype={dtype}",
            "distill.progress=false",
            "finetune.recipe=lolcats",
            f"finetune.max_steps={b['steps']}",
            f"finetune.global_batch={b['global_batch']}",
            "finetune.micro_batch=1",
            "finetune.eval_every=0",
            "finetune.save_every=1000",
            "finetune.heldout_sequences=1",
            "finetune.warmup_steps=1",
            "finetune.progress=false",
        ]
    )
    out = {"params": params, "config": b, "build_s": build_s, "steps_per_layer": steps_per_layer}
    # stage 1: time each layer's transfer (training its feature maps) and teacher pass, when the stage has them
    transfer, teacher = [], []
    patched = []
    for name, store in (("transfer", transfer), ("advance", teacher)):
        if hasattr(stage1, name):
            patched.append((name, getattr(stage1, name)))
            setattr(stage1, name, timed(getattr(stage1, name), device, store))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        stage1.distill(cfg)
    finally:
        for name, fn in patched:
            setattr(stage1, name, fn)
    out["stage1_s"] = time.perf_counter() - t0
    out["stage1_layer_s"] = transfer or [out["stage1_s"] / b["layers"]]
    out["stage1_layer_timing"] = "distill.transfer per layer" if transfer else "whole stage / layers"
    out["stage1_teacher_s"] = teacher
    out["stage1_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    # stage 2: time each optimizer step (global_batch sequences of seq_len, micro-batch 1, accumulation)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step_s = []
    original = stage2.train_step
    stage2.train_step = timed(original, device, step_s)
    t0 = time.perf_counter()
    try:
        stage2.finetune(cfg)
    finally:
        stage2.train_step = original
    out["stage2_s"] = time.perf_counter() - t0
    out["stage2_step_s"] = step_s
    out["stage2_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out["device_info"] = device_info(device)
    return out


# --- d. attention vs SDPA -----------------------------------------------------------------------------------------


GRAD_KEYS = ("q", "k", "v", "fq", "fk")  # the inputs the attention benchmark differentiates


def part_attention(s: dict, work: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from kernel_speed import Clock  # benchmarks/ (this script's folder) is on sys.path

    from hybrid_scale.attention import backends, hybrid

    a, device, dtype = s["attn"], s["device"], getattr(torch, s["dtype"])
    cuda = torch.device(device).type == "cuda"
    H, Hkv, D, Fdim = a["heads"], a["kv"], a["head_dim"], a["feature"]

    def inputs(T):
        g = torch.Generator(device=device).manual_seed(T)

        def r(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=dtype)

        def features(heads):  # hedgehog-like: two softmaxes over F/2 features each
            x = torch.randn(1, heads, T, Fdim // 2, generator=g, device=device, dtype=torch.float32)
            return torch.cat([x.softmax(-1), (-x).softmax(-1)], -1).to(dtype)

        return dict(
            q=r(1, H, T, D),
            k=r(1, Hkv, T, D),
            v=r(1, Hkv, T, D),
            fq=features(H),
            fk=features(Hkv),
            gamma=torch.full((H,), 0.1, device=device, dtype=torch.float32),
        )

    def sdpa_flash_gqa(x):  # the flash kernel with grouped KV heads as they are
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)

    def sdpa_repeat(x):  # KV heads repeated to the query heads (what Llama's SDPA path does without enable_gqa)
        rep = H // Hkv
        k, v = x["k"].repeat_interleave(rep, 1), x["v"].repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(x["q"], k, v, is_causal=True)

    sdpa, sdpa_kind = sdpa_repeat, "k/v repeated to the query heads, backend chosen by torch"
    if cuda:  # native GQA in the flash kernel when this torch has it (forward and backward), else k/v repeated
        try:
            probe = {k: v.detach().requires_grad_(k in ("q", "k", "v")) for k, v in inputs(256).items()}
            sdpa_flash_gqa(probe).sum().backward()
            sdpa, sdpa_kind = sdpa_flash_gqa, "flash kernel, enable_gqa (KV heads not repeated)"
        except RuntimeError as e:
            print(f"gpu_check: SDPA flash with enable_gqa unavailable ({str(e).splitlines()[0][:200]}); k/v repeated")

    def call(name, x):
        if name == "sdpa":
            return sdpa(x)
        return hybrid.attend(
            x["q"],
            x["k"],
            x["v"],
            x["fq"],
            x["fk"],
            gamma=x["gamma"],
            window=a["window"],
            mode="hybrid",
            chunk_size=64,
            backend=name,
        )

    clock = Clock(device, a["warmup"], a["repeats"])  # CUDA events after warm-up; peak memory above the inputs

    # the Triton kernels are timed on CUDA only (in the interpreter they are a correctness tool, not a speed)
    names = ["sdpa", *(b for b in backends.available() if cuda or b != "triton")]
    rows = []
    for T in a["lengths"]:
        x = inputs(T)
        gy = torch.randn(1, H, T, D, device=device, dtype=dtype)
        for name in names:
            row = {"T": T, "backend": name}
            if name == "naive" and T > a["naive_max"]:
                rows.append(row | {"skipped": f"T > GPU_CHECK_NAIVE_MAX ({a['naive_max']})"})
                continue
            xg = {k: (v.detach().requires_grad_(k in GRAD_KEYS)) for k, v in x.items()}

            def fwd(name=name, x=x):
                with torch.no_grad():
                    return call(name, x)

            def fwd_bwd(name=name, xg=xg, gy=gy):
                for k in GRAD_KEYS:
                    xg[k].grad = None
                call(name, xg).backward(gy)

            try:
                y = fwd()
                row["finite"] = bool(torch.isfinite(y).all())
                del y
                row["fwd_ms"] = clock.ms(fwd)
                row["fwd_peak_mib"] = clock.peak_mib(fwd)
                row["fwd_bwd_ms"] = clock.ms(fwd_bwd)
                for k in GRAD_KEYS:  # the last timed call's gradients would count in the base, not the peak
                    xg[k].grad = None
                row["fwd_bwd_peak_mib"] = clock.peak_mib(fwd_bwd)
            except torch.cuda.OutOfMemoryError:  # what was measured before stays in the JSON; the table skips it
                row["skipped"] = "out of memory" + (" in fwd+bwd" if "fwd_ms" in row else "")
            except Exception as e:  # one backend failing at one length must not lose the other rows
                first = (str(e).strip().splitlines() or [""])[0][:200].replace("|", "/")
                row["skipped"] = row["error"] = f"{type(e).__name__}: {first}"
            for k in GRAD_KEYS:
                xg[k].grad = None
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    sdpa = {r["T"]: r for r in rows if r["backend"] == "sdpa" and "skipped" not in r}
    for r in rows:
        ref = sdpa.get(r["T"])
        if ref and "skipped" not in r:
            r["fwd_x_sdpa"] = r["fwd_ms"] / ref["fwd_ms"]
            r["fwd_bwd_x_sdpa"] = r["fwd_bwd_ms"] / ref["fwd_bwd_ms"]
            if r.get("fwd_bwd_peak_mib") is not None and ref.get("fwd_bwd_peak_mib"):
                r["mem_x_sdpa"] = r["fwd_bwd_peak_mib"] / ref["fwd_bwd_peak_mib"]
    shape = dict(batch=1, heads=H, kv_heads=Hkv, head_dim=D, feature=Fdim, window=a["window"], chunk=64)
    return {"rows": rows, "shape": shape, "sdpa": sdpa_kind, "dtype": s["dtype"], "device_info": device_info(device)}


# --- e. the kernels' own benchmark ---------------------------------------------------------------------------------


def kernel_speed(s: dict, out: Path, log: Log, reserve: int = 0) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_speed.py"), "--budget", str(s["kernel_budget"])]
    cmd += ["--out", str(out), *(["--small"] if s["small"] else ["--device", s["device"], "--dtype", s["dtype"]])]
    rc, stdout, err, _ = run_child(cmd, "kernel_speed", log, s["kernel_budget"] + 120, reserve=reserve)
    print(stdout[-4000:], end="", flush=True)
    if rc != 0:
        tail = (stdout + err).strip()[-2000:]
        raise RuntimeError(f"kernel_speed.py failed (exit {rc}); its output ends with:\n{tail}")
    return json.loads((out / "kernel_speed.json").read_text())


# --- f. the report ------------------------------------------------------------------------------------------------


def fmt(x, digits=4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


class Report:
    def __init__(self, s: dict, out: Path, command: str):
        self.s, self.out, self.command = s, out, command
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.steps: dict[str, dict] = {}
        self.data: dict = {}
        self.compare: list[dict] = []
        self.checks: list[dict] = []
        self.lock = threading.Lock()

    def step(self, key: str, title: str, status: str, seconds: float, note: str = "") -> None:
        self.steps[key] = dict(title=title, status=status, seconds=seconds, note=note)

    def failures(self) -> list[str]:
        out = [f"step {k} ({v['title']})" for k, v in sorted(self.steps.items()) if v["status"] == "FAILED"]
        out += [r["figure"] for r in self.compare if r["status"] == "FAILED"]
        out += [r["check"] for r in self.checks if r["status"] == "FAILED"]
        return out

    def markdown(self) -> str:
        s, d = self.s, self.data
        info = d.get("build", {}).get("device_info") or d.get("attention", {}).get("device_info") or {}
        v = d.get("build", {}).get("versions", {})
        lines = [
            "# GPU check" + (" (CPU dry run, toy sizes)" if s["small"] else ""),
            "",
            f"- date: {self.started.strftime('%Y-%m-%d %H:%M UTC')}",
            f"- device: {s['device']} ({info.get('gpu') or info.get('cpu') or '?'}"
            + (f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else "")
            + f"), checked dtype {s['dtype']}; reference {s['ref_device']} {s['ref_dtype']}",
            f"- torch {v.get('torch', '?')} (CUDA {v.get('cuda')}), transformers {v.get('transformers')}, "
            f"peft {v.get('peft')}, deepspeed {v.get('deepspeed')}, datasets {v.get('datasets')}, "
            f"omegaconf {v.get('omegaconf')}, python {v.get('python')}; hybrid_scale from {v.get('hybrid_scale_from')}",
            f"- command: `{self.command}`",
            "",
            "| step | status | seconds | note |",
            "|---|---|---|---|",
        ]
        for k, r in sorted(self.steps.items()):
            lines.append(f"| {k}. {r['title']} | {r['status']} | {r['seconds']:.1f} | {r['note']} |")
        lines.append("")
        b = d.get("build")
        if b:
            lines += [
                "## a. Tiny model",
                "",
                f"Llama {json.dumps(s['tiny'])}, vocab {b['vocab']} (byte-level tokenizer built here), "
                f"{b['params']:,} parameters; pretrained {b['pretrain_steps']} steps on {s['device']} in float32 on "
                f"benchmarks/gpu_check/text.jsonl (loss {b['pretrain_loss_first']:.3f} -> "
                f"{b['pretrain_loss_last']:.3f}, {b['pretrain_s']:.1f} s); synthetic PIQA / ARC-Easy items for the "
                "evaluation.",
                "",
            ]
        if self.compare or self.checks or d.get("pipeline"):
            tag, ref = f"{s['device']} {s['dtype']}", f"{s['ref_device']} {s['ref_dtype']}"
            lines += [
                "## b. Pipeline: distill -> finetune -> evaluate -> export (CLI), checked vs reference",
                "",
                f"Budgets: {json.dumps(s['pipe'])}; recipe hedgecats stage 1, ssd stage 2; modes {', '.join(MODES)}.",
                "",
            ]
            timing = d.get("pipeline", {})
            if timing:
                lines += [f"| stage | {tag} s | {ref} s |", "|---|---|---|"]
                stages = list(dict.fromkeys([*timing.get("run", {}), *timing.get("ref", {})]))
                for st in stages:
                    a_, b_ = timing.get("run", {}).get(st), timing.get("ref", {}).get(st)
                    lines.append(f"| {st} | {fmt(a_, 3)} | {fmt(b_, 3)} |")
                lines.append("")
            if self.compare:
                lines += [
                    f"| figure | {tag} | {ref} | rel. diff | tolerance | status |",
                    "|---|---|---|---|---|---|",
                ]
                for r in self.compare:
                    lines.append(
                        f"| {r['figure']} | {fmt(r['value'])} | {fmt(r['ref'])} | {fmt(r['rel'], 2)} | {r['tol']} | "
                        f"{r['status']} |"
                    )
                lines.append("")
            if self.checks:
                lines += ["| check | value | limit | status | note |", "|---|---|---|---|---|"]
                for r in self.checks:
                    lines.append(
                        f"| {r['check']} | {fmt(r['value'], 3)} | {r['limit']} | {r['status']} | {r['note']} |"
                    )
                lines.append("")
            extra = d.get("pipeline_info")
            if extra:
                lines += [f"Task accuracy (info, {s['pipe']['limit']} synthetic items per task, random labels):", ""]
                lines += [f"| mode | {tag} | {ref} |", "|---|---|---|"]
                for mode in MODES:
                    lines.append(f"| {mode} | {fmt(extra['run'].get(mode), 3)} | {fmt(extra['ref'].get(mode), 3)} |")
                lines.append("")
        big = d.get("big")
        if big:
            layer = big["stage1_layer_s"]
            steps = big["stage2_step_s"]
            later = steps[1:] or steps
            bb = big["config"]
            lines += [
                "## c. 1B-shaped model (random weights), stage 1 layer and stage 2 step"
                + (" (toy shape in this dry run)" if s["small"] else ""),
                "",
                f"Llama hidden {bb['hidden']}, {bb['layers']} layers, {bb['heads']} heads, {bb['kv']} KV heads, "
                f"head_dim {bb['head_dim']}, intermediate {bb['inter']}, vocab 259 ({big['params']:,} parameters), "
                f"{s['dtype']} on {s['device']}; {bb['sequences']} sequences x {bb['seq_len']} tokens.",
                "",
                "| figure | value |",
                "|---|---|",
                f"| stage 1: s per layer ({big['stage1_layer_timing']}; {big['steps_per_layer']} steps of "
                f"{bb['distill_batch']} x {bb['seq_len']} tokens, first layer / median of the rest) | "
                f"{fmt(layer[0], 3)} / {fmt(statistics.median(layer[1:] or layer), 3)} |",
                f"| stage 1: s per training step (median layer / steps) | "
                f"{fmt(statistics.median(layer[1:] or layer) / big['steps_per_layer'], 3)} |",
                f"| stage 1: teacher pass s per layer (median) | "
                f"{fmt(statistics.median(big['stage1_teacher_s']), 3) if big['stage1_teacher_s'] else 'n/a'} |",
                f"| stage 1: whole stage s / peak GiB | {fmt(big['stage1_s'], 3)} / {fmt(big['stage1_peak_gib'], 3)} |",
                f"| stage 2: s per optimizer step ({bb['global_batch']} x {bb['seq_len']} tokens, micro-batch 1; "
                f"first / median of the rest) | {fmt(steps[0], 3) if steps else 'n/a'} / "
                f"{fmt(statistics.median(later), 3) if steps else 'n/a'} |",
                f"| stage 2: tokens per s (median step) | "
                f"{fmt(bb['global_batch'] * bb['seq_len'] / statistics.median(later), 4) if steps else 'n/a'} |",
                f"| stage 2: whole stage s (load, ZeRO-3 init, steps, save) / peak GiB | {fmt(big['stage2_s'], 3)} / "
                f"{fmt(big['stage2_peak_gib'], 3)} |",
                "",
            ]
        att = d.get("attention")
        if att:
            sh = att["shape"]
            lines += [
                "## d. Hybrid attention vs SDPA (hybrid mode)",
                "",
                f"batch 1, {sh['heads']} heads, {sh['kv_heads']} KV heads, head_dim {sh['head_dim']}, features "
                f"{sh['feature']}, window {sh['window']}, chunk {sh['chunk']}, {att['dtype']} on {s['device']}; median "
                f"of {s['attn']['repeats']} after {s['attn']['warmup']} warm-up; peak = max_memory_allocated above "
                f"the inputs. SDPA: is_causal, {att.get('sdpa', '?')}. Hybrid: phi inputs given (hedgehog-like "
                "features), the feature maps themselves not timed.",
                "",
                "| T | backend | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd x SDPA | fwd+bwd x SDPA "
                "| mem x SDPA |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in att["rows"]:
                if "skipped" in r:
                    lines.append(f"| {r['T']} | {r['backend']} | {r['skipped']} | | | | | | |")
                    continue
                lines.append(
                    f"| {r['T']} | {r['backend']} | {fmt(r['fwd_ms'], 4)} | {fmt(r['fwd_bwd_ms'], 4)} | "
                    f"{fmt(r['fwd_peak_mib'], 4)} | {fmt(r['fwd_bwd_peak_mib'], 4)} | {fmt(r.get('fwd_x_sdpa'), 3)} | "
                    f"{fmt(r.get('fwd_bwd_x_sdpa'), 3)} | {fmt(r.get('mem_x_sdpa'), 3)} |"
                )
            lines.append("")
        kernel_md = self.out / "kernel_speed.md"
        if d.get("kernel_speed") and kernel_md.is_file():  # its own tables, under this report's heading
            lines += ["## e. Fused Triton kernels (benchmarks/kernel_speed.py)", ""]
            lines += [line for line in kernel_md.read_text().splitlines()[1:] if not line.startswith("Command:")]
        lines += ["", f"**Summary:** {self.summary()}", ""]
        return "\n".join(lines)

    def summary(self) -> str:
        failed = self.failures()
        n_checks = len(self.compare) + len(self.checks)
        n_ok = sum(r["status"] == "ok" for r in [*self.compare, *self.checks])  # failed steps are not figures
        steps = ", ".join(f"{k} {v['status']}" for k, v in sorted(self.steps.items()))
        total = (datetime.datetime.now(datetime.timezone.utc) - self.started).total_seconds()
        head = "gpu_check: PASSED" if not failed else f"gpu_check: FAILED ({len(failed)}: {'; '.join(failed[:6])})"
        return f"{head}; steps {steps}; {n_ok}/{n_checks} figure checks ok; {total:.0f} s"

    def write(self) -> None:
        with self.lock:
            self._write()

    def safe_markdown(self) -> str:
        """The table, or (a figure it did not expect) the traceback and the summary: the report is never lost."""
        try:
            return self.markdown()
        except Exception:
            tb = traceback.format_exc()
            return f"# GPU check\n\nThe table failed (the figures are in gpu_check.json):\n\n```\n{tb}```\n\n" + (
                f"**Summary:** {self.summary()}\n"
            )

    def _write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = dict(
            settings=self.s,
            command=self.command,
            date=self.started.isoformat(),
            steps=self.steps,
            compare=self.compare,
            checks=self.checks,
            tolerances=TOL,
            decode_tolerances=DECODE_TOL,
            **self.data,
        )
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(self.safe_markdown())


# --- driver -------------------------------------------------------------------------------------------------------


def run_part(name: str, s: dict, work: Path, log: Log, extra: list[str] = (), reserve: int = 0) -> dict:
    json_path = work / f"{name}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__)), "--part", name, "--work", str(work), "--json", str(json_path), *extra]
    rc, out, err, _ = run_child(cmd, f"part {name}", log, s["timeout"], reserve=reserve)
    print(out[-4000:], end="", flush=True)
    if rc != 0:
        raise RuntimeError(f"part {name} failed (exit {rc}); its stderr ends with:\n{err.strip()[-3000:]}")
    return json.loads(json_path.read_text())


def threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def start_reference(s: dict, report: Report, work: Path, log: Log, pool) -> concurrent.futures.Future:
    """The reference pipeline of step b, started in the background (on the CPU: the GPU hidden from it, half the
    cores, DeepSpeed's one-time C++ op build on a quarter of them)."""
    env = {"OMP_NUM_THREADS": str(threads()), "MAX_JOBS": str(max(1, threads() // 2))}
    if s["ref_device"] == "cpu" and s["device"] != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    built = report.data["build"]
    return pool.submit(run_pipeline, s, "ref", s["ref_device"], s["ref_dtype"], built, work, log, env)


def step_pipeline(s: dict, report: Report, work: Path, log: Log, ref_job: concurrent.futures.Future) -> None:
    built = report.data["build"]
    run = run_pipeline(s, "run", s["device"], s["dtype"], built, work, log, {"OMP_NUM_THREADS": str(threads())})
    ref = ref_job.result()
    report.data["pipeline"] = {"run": run["stage_s"], "ref": ref["stage_s"]}
    tags = {"run": f"{s['device']} {s['dtype']}", "ref": f"{s['ref_device']} {s['ref_dtype']}"}
    done = {key: r for key, r in (("run", run), ("ref", ref)) if not r["failed"]}
    if done:  # a run that finished is checked on its own even when the other one failed
        (work / "export_check_runs.json").write_text(
            json.dumps([[r["run_dir"], r["device"], r["dtype"]] for r in done.values()])
        )
        t0 = time.perf_counter()
        try:
            checked = run_part("export_check", s, work, log)
            for r in done.values():
                r |= checked[r["run_dir"]]
                report.checks += own_checks(r, tags["run" if r is run else "ref"])
        except Exception as e:
            for r in done.values():
                r["failed"] = f"export check: {e}"
        report.data["pipeline"]["run"]["export check (both runs)"] = time.perf_counter() - t0
    report.data["pipeline_figures"] = {"run": run, "ref": ref}
    if not run["failed"] and not ref["failed"]:
        report.data["pipeline_info"] = {"run": run["task_avg"], "ref": ref["task_avg"]}
        report.compare = compare_pipelines(run, ref)
    for r in report.compare:
        print(f"  {r['status']:>6}  {r['figure']}: {fmt(r['value'])} vs {fmt(r['ref'])} (rel {fmt(r['rel'], 2)})")
    for r in report.checks:
        print(f"  {r['status']:>6}  {r['check']}: {fmt(r['value'], 3)} (limit {r['limit']})")
    problems = [f"{tags[key]}: {r['failed']}" for key, r in (("run", run), ("ref", ref)) if r["failed"]]
    if problems:
        raise RuntimeError("\n".join(problems))


def command_line(s: dict) -> str:
    if os.environ.get("GPU_CHECK_COMMAND"):
        return os.environ["GPU_CHECK_COMMAND"]
    internal = ("GPU_CHECK_OUT", "GPU_CHECK_WORK", "GPU_CHECK_STARTED")
    keys = sorted(k for k in os.environ if k.startswith("GPU_CHECK_") and k not in internal)
    prefix = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in keys)
    return (prefix + " " if prefix else "") + "python benchmarks/gpu_check.py"


def main_parts(args) -> int:
    s = settings()
    work = Path(args.work)
    if args.part == "build":
        result = part_build(s, work)
    elif args.part == "big":
        result = part_big(s, work)
    elif args.part == "attention":
        result = part_attention(s, work)
    else:
        result = part_export_check(s, work)
    Path(args.json).write_text(json.dumps(result, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["build", "big", "attention", "export_check"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        return main_parts(args)
    s = settings()
    out = Path(os.environ.get("GPU_CHECK_OUT") or os.environ.get("OUT") or ROOT / "docs" / "results")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check_children.log")
    report = Report(s, out, command_line(s))
    # counted from gpu_check.sh's start (GPU_CHECK_STARTED, epoch s): its wheel installation is inside the call too
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    DEADLINE[0] = time.monotonic() + s["deadline"] - max(0.0, time.time() - started)
    print(f"gpu_check: {json.dumps({k: s[k] for k in ('device', 'dtype', 'ref_device', 'ref_dtype', 'small')})}")
    print(f"gpu_check: work in {work}, results in {out}", flush=True)

    def guarded(key: str, title: str, fn, needs: str | None = None) -> None:
        if key not in s["steps"]:
            return
        t0 = time.perf_counter()
        if time.monotonic() > DEADLINE[0] - 20:
            report.step(key, title, "FAILED", 0.0, "not started: GPU_CHECK_DEADLINE reached")
            print(f"\n== step {key}: {title}: not started, GPU_CHECK_DEADLINE reached", flush=True)
            report.write()
            return
        if needs and report.steps.get(needs, {}).get("status") != "ok":
            report.step(key, title, "skipped", 0.0, f"needs step {needs}")
            print(f"\n== step {key}: {title}: skipped (needs step {needs})", flush=True)
            report.write()
            return
        print(f"\n== step {key}: {title}", flush=True)
        try:
            fn()
            report.step(key, title, "ok", time.perf_counter() - t0)
        except Exception as e:
            traceback.print_exc()
            sys.stdout.flush()
            note = str(e).strip().splitlines()[-1][:300].replace("|", "/") if str(e).strip() else type(e).__name__
            report.step(key, title, "FAILED", time.perf_counter() - t0, note)
        print(f"== step {key}: {report.steps[key]['status']} ({report.steps[key]['seconds']:.1f} s)", flush=True)
        report.write()

    def build():
        report.data["build"] = run_part("build", s, work, log)

    def pipeline():
        step_pipeline(s, report, work, log, ref_job)

    def gpu_reserve() -> int:  # c, d and e leave step b's GPU run its time when it comes after them
        return B_RESERVE if ref_job is not None and not s["parallel"] else 0

    def big():
        report.data["big"] = run_part("big", s, work, log, reserve=gpu_reserve())

    def attention():
        report.data["attention"] = data = run_part("attention", s, work, log, reserve=gpu_reserve())
        bad = [f"{r['backend']} at {r['T']}: {r['error']}" for r in data["rows"] if "error" in r]
        bad += [f"{r['backend']} at {r['T']}: output not finite" for r in data["rows"] if r.get("finite") is False]
        if bad:
            raise RuntimeError("; ".join(bad))

    def kernels():
        report.data["kernel_speed"] = kernel_speed(s, out, log, reserve=gpu_reserve())

    guarded("a", "build the tiny model, tokenizer and task data", build)
    step_b = ("b", "pipeline via the CLI, checked vs reference", pipeline, "a")
    step_c = ("c", "1B-shaped stage-1 layer and stage-2 step", big, None)
    step_d = ("d", "hybrid attention vs SDPA", attention, None)
    step_e = ("e", "Triton kernels vs SDPA: prefill and decode", kernels, None)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ref_job = None
        if "b" in s["steps"] and report.steps.get("a", {}).get("status") == "ok":
            ref_job = start_reference(s, report, work, log, pool)
            print("gpu_check: the reference pipeline of step b runs in the background from now on", flush=True)
        if s["parallel"]:  # the CPU dry run: its timings mean nothing, its wall time does
            for f in [pool.submit(guarded, *step) for step in (step_b, step_c, step_d, step_e)]:
                f.result()
        else:  # the GPU steps one at a time (c, d while the CPU reference runs; then b's GPU run, joined with it)
            for step in (step_c, step_d, step_e, step_b):
                guarded(*step)
    report.write()
    print("\n" + report.safe_markdown())
    print(report.summary(), flush=True)
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
