"""How close is the delta rule's read-out to what the window drops, before any training? For a few layers of the
embedded default on held-out text: the cosine similarity between the teacher's attention over the keys that have
left the window (its normalised average of their values, per query head) and the gated delta rule's read-out of the
same keys (attention/gated_delta/hybrid.py, lag w, the gates at conversion), with the rule on q and k before RoPE
(the toolkit's choice) or after it, and beta / the horizon varied. A read-out unrelated to the dropped part only
adds noise.

    .venv/bin/python -m experiments.gated_delta.diagnose [--window 16] [--layers 3 10 20] [--tokens 512]
"""

from __future__ import annotations

import argparse

import torch

from hybrid_scale.attention.gated_delta.chunk import lagged_delta
from hybrid_scale.attention.gated_delta.naive import l2norm
from hybrid_scale.attention.layer import apply_rope
from hybrid_scale.data import assets


def past_average(q, k, v, scale, window):
    """[B,H,T,D]: softmax over the keys j <= n - w only (q, k after RoPE), 0 where there is none."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    T = q.shape[2]
    n, j = torch.arange(T)[:, None], torch.arange(T)[None]
    past = j <= n - window
    a = (scale * q @ k.transpose(-1, -2)).masked_fill(~past, float("-inf"))
    w = torch.softmax(a, -1).nan_to_num(0.0)
    return w @ v, past.any(-1)


def heads(x, head_dim):
    """[B, T, H * D] -> [B, H, T, D]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def cosine(a, b, rows):
    c = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [B,H,T]
    return c[..., rows].mean().item()


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="*", default=[3, 10, 20, 27])
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prep = assets.prepare()
    tok = AutoTokenizer.from_pretrained(prep.model)
    model = AutoModelForCausalLM.from_pretrained(prep.model, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prep.heldout_text.read_text())[: a.tokens]])
    captured = {}
    hooks = [
        model.model.layers[i].self_attn.register_forward_pre_hook(
            lambda mod, args, kw, i=i: captured.__setitem__(i, (kw["hidden_states"], kw["position_embeddings"])),
            with_kwargs=True,
        )
        for i in a.layers
    ]
    model(ids)
    for h in hooks:
        h.remove()
    w = a.window
    print("| layer | variant | cos(read-out, dropped part) |\n|---|---|---|")
    for i in a.layers:
        attn = model.model.layers[i].self_attn
        hidden, rope = captured[i]
        B, T, _ = hidden.shape
        q, k, v = (heads(p(hidden), attn.head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        qr, kr = apply_rope(q, k, *rope)
        target, rows = past_average(qr, kr, v, attn.scaling, w)
        Hkv = k.shape[1]
        for name, (qq, kk) in {"before RoPE": (q, k), "after RoPE": (qr, kr)}.items():
            for beta, horizon in ((0.5, 16 * w), (1.0, 16 * w), (0.1, 16 * w), (0.5, 4 * w)):
                b = torch.full((B, Hkv, T), beta)
                g = torch.full((B, Hkv, T), -1.0 / horizon)
                o = lagged_delta(l2norm(qq), l2norm(kk), v, b, g, lag=w)
                print(f"| {i} | {name}, beta {beta}, horizon {horizon} | {cosine(o, target, rows):.3f} |")
        # baseline: the plain mean of the values that left the window (no query at all)
        n, j = torch.arange(T)[:, None], torch.arange(T)[None]
        uniform = (j <= n - w).to(v.dtype)
        mean = (uniform @ v.repeat_interleave(q.shape[1] // Hkv, 1)) / uniform.sum(-1, keepdim=True).clamp_min(1)
        print(f"| {i} | the plain mean of the dropped values (no query: baseline) | {cosine(mean, target, rows):.3f} |")
        # the additive LA with an exp feature map on the same keys, for comparison (Hedgehog's shape, no training)
        f = lambda x: torch.exp(l2norm(x) * 4)  # noqa: E731
        fq, fk = f(qr), f(kr).repeat_interleave(q.shape[1] // Hkv, 1)
        lin = (fq @ fk.transpose(-1, -2)) * (j <= n - w)
        o = (lin @ v.repeat_interleave(q.shape[1] // Hkv, 1)) / lin.sum(-1, keepdim=True).clamp_min(1e-9)
        print(f"| {i} | additive exp(4 cos) features after RoPE (reference) | {cosine(o, target, rows):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
