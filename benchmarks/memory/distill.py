"""Peak memory of stage 1 on synthetic Llama checkpoints of 4 and 32 layers of the same width.

Stage 1 streams one layer at a time from the safetensors shards, so its peak RSS should hardly depend on depth
(goal: ratio 32-layer / 4-layer <= 1.2), while loading the whole model would cost 8x the weights. Each checkpoint is
written shard by shard (one layer per shard, random weights) without ever building the model, and each run is a
fresh process that reports its own peak RSS. Writes benchmarks/out/distill_memory.json.

    .venv/bin/python -m benchmarks.memory.distill [--hidden 1024] [--layers 4 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

CHILD = """
import resource, sys
from hybrid_scale.config import load_config
from hybrid_scale.distill.stage import distill
distill(load_config(overrides=sys.argv[1:]))
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_checkpoint(path: Path, layers: int, hidden: int, tokenizer_dir: Path) -> int:
    """A LlamaForCausalLM checkpoint, one shard per layer; returns the weight bytes."""
    from transformers import AutoTokenizer, LlamaConfig

    heads, kv, inter, vocab = hidden // 64, max(1, hidden // 256), int(hidden * 2.75), 49152
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        pad_token_id=2,
        eos_token_id=2,
        bos_token_id=1,
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0

    def shard(name, tensors):
        nonlocal total
        save_file(tensors, path / name)
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    shard("embed.safetensors", {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(
            f"layer-{i:03d}.safetensors",
            {
                p + "self_attn.q_proj.weight": w(heads * 64, hidden),
                p + "self_attn.k_proj.weight": w(kv * 64, hidden),
                p + "self_attn.v_proj.weight": w(kv * 64, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * 64),
                p + "mlp.gate_proj.weight": w(inter, hidden),
                p + "mlp.up_proj.weight": w(inter, hidden),
                p + "mlp.down_proj.weight": w(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            },
        )
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, nargs=2, default=[4, 32])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=16)
    args = ap.parse_args()
    from hybrid_scale.data.assets import require

    tok = require().model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.layers:
            ckpt = Path(tmp) / f"llama_{n}"
            size = write_checkpoint(ckpt, n, args.hidden, tok)
            overrides = [
                f"model.path={ckpt}",
                f"run_dir={Path(tmp) / f'run_{n}'}",
                f"data.seq_len={args.seq_len}",
                f"data.num_sequences={args.sequences}",
                "distill.epochs=1",
                "distill.batch_size=4",
                "distill.progress=false",
            ]
            out = subprocess.run([sys.executable, "-c", CHILD, *overrides], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            peak = int(out.stdout.split("PEAK_RSS_KB")[1].split()[0]) * 1024
            rows.append({"layers": n, "weights_bytes": size, "peak_rss_bytes": peak})
            print(f"{n:>3} layers: weights {size / 2**20:8.0f} MiB   peak RSS {peak / 2**20:8.0f} MiB", flush=True)
    ratio = rows[1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
    weights_ratio = rows[1]["weights_bytes"] / rows[0]["weights_bytes"]
    a, b = args.layers
    print(f"peak RSS ratio {b}/{a} layers: {ratio:.3f} (goal <= 1.2; the weights grow x{weights_ratio:.2f})")
    out = Path(__file__).resolve().parents[1] / "out"
    out.mkdir(exist_ok=True)
    (out / "distill_memory.json").write_text(json.dumps({"rows": rows, "ratio": ratio, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
