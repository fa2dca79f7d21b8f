"""What each rank reads and holds when a converted model is loaded at launch.tensor_parallel = 1, 2 and 4, measured
side by side in one run: the peak resident host memory (ru_maxrss, after the load and one forward) of each rank, the
part of it the load and the forward added, the
allocator's peak on a GPU (max_memory_allocated), the parameter bytes held, the decode state after --tokens tokens,
the load time, and the logits against tp 1.

The model is the evaluation's: a random Llama written as a safetensors checkpoint (several shards), converted (every
layer hybrid, phi/gamma in hybrid_params.safetensors) with a stage-2 LoRA adapter, loaded with load_converted as
stage 2 and evaluation load it, then split by parallelize. At tp > 1 each rank reads only its rows or columns of
each weight (streaming.split_model), so its host peak should fall with tp; at tp 1 the whole model is read.

    .venv/bin/python -m benchmarks.memory.tensor_parallel [--hidden 2048] [--layers 8] [--tp 1 2 4] [--device cpu]

Each tp runs as its own torchrun job (a process's peak RSS is for its lifetime). Prints a table with the ratios to
tp 1 and writes benchmarks/out/tensor_parallel_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def rss() -> int:
    """This process's resident set now, in bytes (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_model(args, root: Path) -> Path:
    """A random converted Llama (base checkpoint in two shards, phi/gamma, a LoRA adapter) under root; its path."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import hybrid_scale as hs
    from hybrid_scale.attention.layer import hybrid_layers
    from hybrid_scale.models.converted import ADAPTER_DIR

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    base = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    base.save_pretrained(root / "base", max_shard_size=weights // 2 + 1)  # several shards
    model = hs.convert_model(base, {"window": 16, "feature_map": "hedgehog"})
    with torch.no_grad():  # phi/gamma away from their initial values, so that a wrong slice shows in the logits
        for m in hybrid_layers(model).values():
            for _, p in m.hybrid_parameters():
                p.add_(torch.randn_like(p) * 0.05)
    out = hs.save_converted(model, root / "converted", base_path=root / "base")
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    lora.save_pretrained(root / "peft")
    (out / ADAPTER_DIR).mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "peft" / name).rename(out / ADAPTER_DIR / name)
    return out


def worker(args) -> None:
    """One rank of one tp: load, split, run the logits and a decode state; its record to <results>/rank<R>.json."""
    from transformers import AutoModelForCausalLM

    from hybrid_scale.attention.hf.cache import HybridCache
    from hybrid_scale.distributed import runtime, tensor_parallel
    from hybrid_scale.distributed.parallelize import parallelize
    from hybrid_scale.models.converted import base_config, base_dir, load_converted

    rt = runtime.init(args.device, tp=args.tp[0])
    with torch.device("meta"):  # the modules the load imports, imported before the baseline
        AutoModelForCausalLM.from_config(base_config(base_dir(args.path)))
    runtime.barrier(rt)
    before, start = rss(), time.perf_counter()
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    model = load_converted(args.path, getattr(torch, args.dtype), rt.device, "torch", rt)
    model = parallelize(model, rt=rt)[1]
    seconds = time.perf_counter() - start
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(rt.device)
    cache = HybridCache(model)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -8:].float().cpu()
    peak = peak_rss()  # after a forward: weights that the load left mapped from the shards are resident by now
    record = {
        "tp": args.tp[0],
        "rank": rt.rank,
        "peak_rss": peak,
        "load_rss": peak - before,
        "allocated": torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else None,
        "parameters": tensor_parallel.parameter_bytes(model),
        "decode_state": cache.nbytes,
        "load_s": seconds,
        "logits": logits.tolist() if rt.main else None,  # (every rank has the whole logits)
    }
    (Path(args.results) / f"rank{rt.rank}.json").write_text(json.dumps(record))


def worker_args(args, path: Path, tp: int) -> list[str]:
    """The arguments of this script's worker for one tp (its results go to <path>/../tp<tp>/, made here)."""
    results = path.parent / f"tp{tp}"
    results.mkdir(exist_ok=True)
    return [
        *("--worker", "--path", str(path), "--tp", str(tp), "--dtype", args.dtype, "--device", args.device),
        *("--vocab", str(args.vocab), "--tokens", str(args.tokens), "--results", str(results)),
    ]


def read_results(path: Path, tp: int) -> list[dict]:
    return [json.loads((path.parent / f"tp{tp}" / f"rank{r}.json").read_text()) for r in range(tp)]


def run_tp(args, path: Path, tp: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", "--standalone", "-m", __spec__.name]
    cmd += worker_args(args, path, tp)
    root = Path(__file__).resolve().parents[2]  # `-m`: from the repository root
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)
    if proc.returncode:
        raise SystemExit(f"tp {tp} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return read_results(path, tp)


def main() -> None:
    args = parser().parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="tp-memory-") as tmp:
        path = make_model(args, Path(tmp))
        shards = sorted((path.parent / "base").glob("*.safetensors"))
        results = {tp: run_tp(args, path, tp) for tp in args.tp}
        lines, summary = report(args, results, shards)
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "per_tp": summary, "table": lines}, indent=1))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=64, help="prefill length of the logits and the decode state")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "out" / "tensor_parallel_memory.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    return ap


def report(args, results: dict[int, list[dict]], shards: list[Path]) -> tuple[list[str], dict]:
    """The table (ratios to the first tp) and the JSON summary of every tp's ranks."""
    checkpoint = sum(f.stat().st_size for f in shards)
    one = results[args.tp[0]][0]
    ref = torch.tensor(one["logits"])
    lines = [
        f"model: Llama {args.layers} layers x hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, "
        f"vocab {args.vocab}, {args.dtype}, checkpoint {checkpoint / 2**20:,.0f} MiB in {len(shards)} shards; "
        f"converted (hedgehog), LoRA adapter merged; device {args.device}",
        f"{'tp':>3}{'rank peak RSS MiB':>19}{'ratio':>7}{'load added MiB':>16}{'ratio':>7}"
        f"{'params MiB':>12}{'ratio':>7}{'decode KiB':>12}{'load s':>8}{'max |dlogit|':>14}",
    ]
    for tp, ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak_rss"])
        diff = (torch.tensor(ranks[0]["logits"]) - ref).abs().max().item()
        lines.append(
            f"{tp:>3}{worst['peak_rss'] / 2**20:>19,.0f}{worst['peak_rss'] / one['peak_rss']:>7.3f}"
            f"{worst['load_rss'] / 2**20:>16,.0f}{worst['load_rss'] / one['load_rss']:>7.3f}"
            f"{worst['parameters'] / 2**20:>12,.1f}{worst['parameters'] / one['parameters']:>7.3f}"
            f"{worst['decode_state'] / 2**10:>12,.1f}{max(r['load_s'] for r in ranks):>8.1f}{diff:>14.2e}"
        )
        if worst["allocated"] is not None:
            lines.append(f"    allocator peak {worst['allocated'] / 2**20:,.0f} MiB")
    summary = {
        str(tp): {
            "max_dlogit": (torch.tensor(ranks[0]["logits"]) - ref).abs().max().item(),
            "ranks": [{k: v for k, v in r.items() if k != "logits"} for r in ranks],
        }
        for tp, ranks in results.items()
    }
    return lines, summary


if __name__ == "__main__":
    main()
