"""Stage 1 and stage 2 of a shaped random Llama, timed (in its own process): the pipeline check's part c (a
Llama-3.2-1B shape, 4 layers by default, GPU_CHECK_BIG_LAYERS, in the checked dtype on the checked device) and the
speed benchmark's part big (big.py: the Llama-3-8B shape): seconds per stage-1 layer and per stage-2 optimizer step
(timed by wrapping the stages' own functions), peak memory. s["big"] may also give `vocab` (default: the byte-level
tokenizer's 259), `tie` (tied embeddings, default true), `micro_batch` (default 1) and `overrides` (more config
overrides, e.g. the preset's attention settings). `section` is the check's report of part c."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from benchmarks.device.machine import byte_tokenizer, device_info, llama_config, sync
from benchmarks.device.settings import TEXT
from benchmarks.report_table import fmt


def timed(fn, device, store: list):
    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        store.append(time.perf_counter() - t0)
        return out

    return wrapper


def part_stages(s: dict, work: Path) -> dict:
    """Stage 1 and stage 2 of the shaped random model s["big"]; seconds per layer and per step, peak memory."""
    import torch
    from transformers import LlamaForCausalLM

    from hybrid_scale.config import load_config
    from hybrid_scale.distill import stage as stage1
    from hybrid_scale.finetune import stage as stage2

    b, device, dtype = s["big"], s["device"], s["dtype"]
    cuda = torch.device(device).type == "cuda"
    tok = byte_tokenizer()
    vocab = b.get("vocab", len(tok))  # (a larger vocabulary than the tokenizer's: ids above 258 unused)
    special = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    config = llama_config(b, vocab, max(4096, b["seq_len"]), b.get("tie", True), special)
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


def section(d: dict) -> list[str]:
    """The check's part c in its report (none when it did not run)."""
    big, s = d.get("big"), d["settings"]
    if not big:
        return []
    layer = big["stage1_layer_s"]
    steps = big["stage2_step_s"]
    later = steps[1:] or steps
    bb = big["config"]
    return [
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
