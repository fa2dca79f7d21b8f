"""Step c, big (the part `big`, run in its own process): stage 1 and stage 2 of a Llama-3.2-1B-shaped random model
(4 layers by default, GPU_CHECK_BIG_LAYERS) in the checked dtype on the checked device: seconds per stage-1 layer
and per stage-2 optimizer step (timed by wrapping the stages' own functions), peak memory.
benchmarks/device_speed.py runs it at the Llama-3-8B shape: s["big"] may also give `vocab` (default: the byte-level
tokenizer's 259), `tie` (tied embeddings, default true), `micro_batch` (default 1) and `overrides` (more config
overrides, e.g. the preset's attention settings)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from .common import byte_tokenizer, device_info, sync
from .settings import TEXT


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
    from hybrid_scale.distill import stage as stage1
    from hybrid_scale.finetune import stage as stage2

    b, device, dtype = s["big"], s["device"], s["dtype"]
    cuda = torch.device(device).type == "cuda"
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=b.get("vocab", len(tok)),  # (a larger vocabulary than the tokenizer's: ids above 258 unused)
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
        tie_word_embeddings=b.get("tie", True),
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
            f"finetune.micro_batch={b.get('micro_batch', 1)}",
            "finetune.eval_every=0",
            "finetune.save_every=1000",
            "finetune.heldout_sequences=1",
            "finetune.warmup_steps=1",
            "finetune.progress=false",
            *b.get("overrides", ()),
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
