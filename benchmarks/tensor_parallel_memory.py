"""What each rank holds at launch.tensor_parallel = 1 and 2: parameter bytes of the frozen base, of the trainable
state, and of the decode state, measured on a random Llama-shaped model converted and LoRA-wrapped as stage 2 does
it, whole (tp 1) and split over 2 gloo ranks on CPU (tp 2), side by side in one run. Prints a table with the ratios
and writes benchmarks/out/tensor_parallel_memory.json.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/tensor_parallel_memory.py \\
        [--hidden 1024] [--layers 8] [--heads 16] [--kv-heads 8] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hybrid_scale as hs
from hybrid_scale.attention.hybrid import HybridCache
from hybrid_scale.distributed import runtime, tensor_parallel


def held(model, cache=None) -> dict:
    """Bytes this rank holds: frozen parameters, trainable ones (fp32: x4 with gradients and AdamW moments), and a
    decode cache."""
    frozen = sum(
        tensor_parallel.local(p).numel() * tensor_parallel.local(p).element_size()
        for p in {id(p): p for p in model.parameters()}.values()
        if not p.requires_grad
    )
    trainable = sum(tensor_parallel.local(p).numel() * 4 * 4 for p in model.parameters() if p.requires_grad)
    return {"frozen_base": frozen, "trainable_state": trainable, "decode_state": cache.nbytes if cache else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=256, help="prefill length of the decode-state measurement")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "tensor_parallel_memory.json"))
    args = ap.parse_args()
    rt = runtime.init("cpu", tp=2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    model = hs.convert_model(LlamaForCausalLM(config).to(torch.bfloat16).eval(), {"window": 64})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)  # what stage 2 trains: LoRA (fp32) on the frozen bf16 base
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    results = {}
    for tp in (1, 2):
        m = copy.deepcopy(model)
        if tp == 2:
            tensor_parallel.apply(m, rt)
        cache = HybridCache(m.get_base_model())
        with torch.no_grad():
            m(input_ids=ids, past_key_values=cache, use_cache=True)
        results[tp] = held(m, cache)
    per_rank = runtime.gather_objects(rt, results)
    if rt.main:
        lines = [
            f"model: Llama {args.layers} layers x hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, "
            f"vocab {args.vocab}, bf16 base, LoRA r=8 on q/k/v/o (fp32), decode state after {args.tokens} tokens",
            f"{'bytes per rank':<20}{'tp 1':>14}{'tp 2 rank 0':>14}{'tp 2 rank 1':>14}{'ratio':>8}",
        ]
        for key in ("frozen_base", "trainable_state", "decode_state"):
            one, a, b = per_rank[0][1][key], per_rank[0][2][key], per_rank[1][2][key]
            lines.append(f"{key:<20}{one:>14,}{a:>14,}{b:>14,}{max(a, b) / one:>8.3f}")
        print("\n".join(lines))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "per_rank": per_rank}, indent=1))


if __name__ == "__main__":
    main()
