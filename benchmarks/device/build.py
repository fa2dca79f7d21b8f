"""The pipeline check's part a, build (run in its own process): the tiny random Llama with the byte-level tokenizer,
briefly pretrained on benchmarks/device/text.jsonl so that its attention is not uniform, and the two small
synthetic task datasets (PIQA- and ARC-Easy-shaped) for the evaluation; `section`, its part of the report."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.device.machine import byte_tokenizer, device_info, sync, versions
from benchmarks.device.settings import HELDOUT_FRACTION, ROOT, TEXT


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


def section(d: dict) -> list[str]:
    b, s = d.get("build"), d["settings"]
    if not b:
        return []
    return [
        "## a. Tiny model",
        "",
        f"Llama {json.dumps(s['tiny'])}, vocab {b['vocab']} (byte-level tokenizer built here), "
        f"{b['params']:,} parameters; pretrained {b['pretrain_steps']} steps on {s['device']} in float32 on "
        f"{TEXT.relative_to(ROOT)} (loss {b['pretrain_loss_first']:.3f} -> "
        f"{b['pretrain_loss_last']:.3f}, {b['pretrain_s']:.1f} s); synthetic PIQA / ARC-Easy items for the "
        "evaluation.",
        "",
    ]
