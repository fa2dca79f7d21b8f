"""Peak memory of the export (streamed LoRA merge) on a synthetic 8-shard Llama checkpoint with a LoRA adapter on
q/k/v/o of every layer. The export reads one input shard at a time, so the memory it adds on top of the process
(python + torch + transformers: its resident size just before the export starts) should be about one shard, a
fraction of the whole model. Each run is a fresh process. Writes benchmarks/out/export_memory.json.

    .venv/bin/python -m benchmarks.memory.export [--hidden 2048]
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

from benchmarks.memory.distill import write_checkpoint

CHILD = """
import sys
from hybrid_scale.config import load_config
from hybrid_scale.export.stage import export

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))

before = status("VmRSS:")  # resident now, after the imports
export(load_config(overrides=sys.argv[1:]))
print("RSS_KB", before, status("VmHWM:"))
"""


def converted_with_adapter(ckpt: Path, out: Path, layers: int, hidden: int, r: int = 8) -> None:
    """A converted model referencing ckpt (identity hedgehog maps) plus a random LoRA adapter on q/k/v/o."""
    from hybrid_scale.models.converted import ADAPTER_DIR, write_converted

    heads, kv, d = hidden // 64, max(1, hidden // 256), 64
    params = {}
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        params[p + "feature_map_q.weight"] = torch.eye(d).expand(heads, d, d).contiguous()
        params[p + "feature_map_k.weight"] = torch.eye(d).expand(kv, d, d).contiguous()
        params[p + "gamma_logit"] = torch.full((heads,), -2.1972)
    settings = {
        "window": 64,
        "feature_map": "hedgehog",
        "feature_dim": d,
        "gamma_init": 0.1,
        "sinks": 8,
        "mode": "hybrid",
        "layers": list(range(layers)),
        "chunk_size": 64,
    }
    write_converted(out, "LlamaForCausalLM", str(ckpt), settings, params)
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (heads * d, hidden), "k_proj": (kv * d, hidden), "v_proj": (kv * d, hidden)}
    shapes["o_proj"] = (hidden, heads * d)
    lora = {}
    for i in range(layers):
        for name, (o, n) in shapes.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            lora[f"{key}.lora_A.weight"] = torch.randn(r, n, generator=g) * 0.01
            lora[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g) * 0.01
    (out / ADAPTER_DIR).mkdir()
    save_file(lora, out / ADAPTER_DIR / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "bias": "none"}
    adapter_config["target_modules"] = list(shapes)
    (out / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps(adapter_config))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=7, help="decoder layers; +1 shard for the embedding")
    args = ap.parse_args()
    from hybrid_scale.data.assets import require

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "llama"
        total = write_checkpoint(ckpt, args.layers, args.hidden, require().model)
        shards = sorted(ckpt.glob("*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
        converted_with_adapter(ckpt, Path(tmp) / "converted", args.layers, args.hidden)
        overrides = [f"export.model={Path(tmp) / 'converted'}", f"export.out_dir={Path(tmp) / 'export'}"]
        out = subprocess.run([sys.executable, "-c", CHILD, *overrides], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        before, peak = (int(x) * 1024 for x in out.stdout.split("RSS_KB")[1].split()[:2])
        written = sorted((Path(tmp) / "export").glob("model-*.safetensors"))
    added = peak - before
    row = {
        "shards": len(shards),
        "model_bytes": total,
        "largest_shard_bytes": largest,
        "rss_before_export_bytes": before,
        "peak_rss_bytes": peak,
        "added_bytes": added,
        "output_shards": len(written),
        "added_over_largest_shard": added / largest,
        "added_over_model": added / total,
    }
    mib = 2**20
    print(
        f"{len(shards)} input shards, model {total / mib:.0f} MiB, largest shard {largest / mib:.0f} MiB\n"
        f"RSS before export {before / mib:.0f} MiB, peak {peak / mib:.0f} MiB: the export added {added / mib:.0f} MiB\n"
        f"added / largest shard = {added / largest:.2f}; added / whole model = {added / total:.2f}"
    )
    dest = Path(__file__).resolve().parents[1] / "out"
    dest.mkdir(exist_ok=True)
    (dest / "export_memory.json").write_text(json.dumps({"args": vars(args), **row}, indent=2))


if __name__ == "__main__":
    main()
