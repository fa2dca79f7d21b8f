"""How precisely the Triton backward's gamma gradient can come out in bf16, modelled on CPU (no GPU needed).

The backward kernels (kernels/hybrid_scale_kernels) form every softmax term's dp_nj = (dy_n/Z_n) . v_j - delta_n/Z_n
and gamma's gradient as sum_n sum_j E_nj dp_nj. Their dots take dy/Z rounded to the inputs' dtype (bf16) with fp32
accumulation. Where the softmax makes up the whole output (the first tokens, before any LA), the two halves of dp
cancel exactly in exact arithmetic, so whatever rounding differs between them is all that is left. This script
forms the same sums in torch with the roundings of each way of taking delta, on the inputs of the bf16 GPU test
(tests/unit/test_triton_kernels_bf16.py::test_bf16_on_gpu_against_the_spec: T 700, 6 heads, 2 KV heads, head dim 64,
features 128, a left-padded row, hybrid mode), and prints the largest error of gamma's gradient relative to its
largest value against the fp64 spec's autograd:

  before:  delta = dy . y_bf16 (fp32 products of the bf16 output), dy/Z rounded in the dots -- the kernels until
           2026-12-04 (the H200 measured 0.128 / 0.045 / 0.018 at windows 1 / 64 / 100);
  fp32 y:  delta = Z (round(dy/Z) . y_fp32), the same rounding as the dots, the forward's fp32 output (the chunked
           backward's dlz until 2026-12-07, when the forward stored y in fp32 and again in bf16);
  y only:  delta = Z (round(dy/Z) . y_bf16), the same rounding as the dots, y as the forward returns it (y stored
           once, in the model's dtype, as flash-attention takes its delta from O);
  now:     the same with y_bf16 + bf16(y_fp32 - y_bf16): y and its rounding error, which the forward stores beside it
           in bf16 (4 bytes an element in all; the chunked backward's dlz, `_chunk_bwd_dq`);
  fp32:    no rounding at all (what the chunked torch path, fp32 inside, comes close to).

    .venv/bin/python -m tools.kernel_grad_precision
"""

from __future__ import annotations

import math

import torch

from hybrid_scale.attention.hedgehog import naive

B, H, HKV, T, D, F, PAD = 2, 6, 2, 700, 64, 128, 37


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """The bf16 GPU test's inputs (its make(): same draws, same order), as fp32 copies of the bf16 values."""
    g = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, H, T, D, generator=g),
        k=torch.randn(B, HKV, T, D, generator=g),
        v=torch.randn(B, HKV, T, D, generator=g),
        fq=torch.rand(B, H, T, F, generator=g),
        fk=torch.rand(B, HKV, T, F, generator=g),
        gamma=0.05 + 0.9 * torch.rand(H, generator=g),
    )
    return {n: t if n == "gamma" else t.to(torch.bfloat16).float() for n, t in x.items()}


def errors(window: int) -> dict[str, float]:
    x = inputs(seed=window)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :PAD] = 0
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    y_ref = naive.naive_hybrid_attention(*ref.values(), window=window, mode="hybrid", attention_mask=mask)
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    (want,) = torch.autograd.grad(y_ref, ref["gamma"], dy.double())

    group = H // HKV
    k, v, fk = (x[n].repeat_interleave(group, 1) for n in ("k", "v", "fk"))
    q, fq, gamma = x["q"], x["fq"], x["gamma"].view(1, H, 1, 1)
    pos = naive.real_positions(mask, B, T, "cpu")
    pq, pk = pos[:, None, :, None], pos[:, None, None, :]
    causal = (pq >= 0) & (pk >= 0) & (pk <= pq)
    win, past = causal & (pk > pq - window), causal & (pk <= pq - window)
    a = q @ k.transpose(-1, -2) / math.sqrt(D)
    c = torch.where(win, a, -torch.inf).amax(-1, keepdim=True)
    e = torch.where(win, torch.exp(a - torch.where(torch.isfinite(c), c, 0)), 0)
    lin = torch.where(past, fq @ fk.transpose(-1, -2), 0)
    z = (gamma * e.sum(-1, keepdim=True) + lin.sum(-1, keepdim=True)).clamp_min(1e-30)
    y32 = (gamma * e @ v + lin @ v) / z
    dyz = dy / z
    rounded = dyz.to(torch.bfloat16).float()
    hi = y32.to(torch.bfloat16).float()
    real = (pos >= 0)[:, None, :, None]

    def gamma_grad(dz, dyz_in_dots):
        dp = dyz_in_dots @ v.transpose(-1, -2) - dz
        return (torch.where(real, e * dp, 0)).sum((0, 2, 3)).double()

    ways = {
        "before": ((dy * y32.to(torch.bfloat16).float()).sum(-1, keepdim=True) / z, rounded),
        "fp32 y": ((rounded * y32).sum(-1, keepdim=True), rounded),
        "y only": ((rounded * hi).sum(-1, keepdim=True), rounded),
        "now": ((rounded * (hi + (y32 - hi).to(torch.bfloat16).float())).sum(-1, keepdim=True), rounded),
        "fp32": ((dyz * y32).sum(-1, keepdim=True), dyz),
    }
    top = want.abs().max()
    return {name: ((gamma_grad(*w) - want).abs().max() / top).item() for name, w in ways.items()}


def main() -> None:
    print("gamma's gradient in bf16, largest error / largest value against the fp64 spec (hybrid mode)")
    ways = ("before", "fp32 y", "y only", "now", "fp32")
    print("| window | " + " | ".join(ways) + " |")
    print("|---:|" + "---:|" * len(ways))
    for window in (1, 64, 100):
        e = errors(window)
        print(f"| {window} | " + " | ".join(f"{e[w]:.2e}" for w in ways) + " |")


if __name__ == "__main__":
    main()
