"""Speed of the export's gamma calibration per layer: every Adam step through the full hybrid attention (the former
fit) against one attention pass and closed-form steps (export.fit_gamma), on one SmolLM2-shaped layer (9 heads, 3 KV
heads, head_dim 64, hedgehog maps) with the export's defaults (8 x 512 tokens, 60 steps, window 64). Prints both
times, their ratio and the fitted gammas' largest difference.

    .venv/bin/python -m experiments.gamma_calibration.gamma_fit_speed \
        [--sequences 8 --seq-len 512 --steps 60 --window 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from hybrid_scale.attention.layer import HybridAttention, Projections
from hybrid_scale.export.gamma import fit_gamma


def through_the_attention(m, q, k, v, fq, fk, target, steps):
    logit = m.gamma_logit.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([logit], lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        (m.attend(q, k, v, fq, fk, gamma=torch.sigmoid(logit), mode="hybrid") - target).pow(2).mean().backward()
        opt.step()
    return logit.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    settings = {"window": args.window, "feature_map": "hedgehog", "feature_dim": None, "gamma_init": 0.1}
    settings |= {"sinks": 8, "mode": "hybrid", "chunk_size": 64}
    m = HybridAttention.from_softmax(LlamaAttention(config, 0), config, 0, settings)
    hidden = torch.randn(args.sequences, args.seq_len, 576)
    rope = LlamaRotaryEmbedding(config)(hidden, torch.arange(args.seq_len)[None])
    with torch.no_grad():
        q, k, v, fq, fk = m.project(hidden, rope)
        target = m.attend(q, k, v, fq, fk, gamma=torch.full((9,), 0.6), mode="swa_only")
    t0 = time.perf_counter()
    old = through_the_attention(m, q, k, v, fq, fk, target, args.steps)
    t_old = time.perf_counter() - t0
    t0 = time.perf_counter()
    new, _, _ = fit_gamma(m, Projections(q, k, v, fq, fk), target, args.steps)
    t_new = time.perf_counter() - t0
    threads = torch.get_num_threads()
    print(f"{args.sequences} x {args.seq_len} tokens, {args.steps} steps, window {args.window}, {threads} threads")
    print(f"through the attention every step: {t_old:.2f} s")
    print(f"one attention pass + closed form: {t_new:.2f} s")
    diff = (torch.sigmoid(old) - torch.sigmoid(new)).abs().max()
    print(f"speed-up: {t_old / t_new:.1f}x; largest gamma difference {diff:.2e}")


if __name__ == "__main__":
    main()
