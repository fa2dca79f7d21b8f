"""Inputs and one call of a hybrid attention backend with its gradients, shared by the kernel tests
(test_triton_kernels.py, test_triton_kernels_bf16.py)."""

import torch

from hybrid_scale.attention.options import AttentionOptions

MODES = ("hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only")
NAMES = ("q", "k", "v", "fq", "fk", "gamma")


def make(T, B=2, H=3, Hkv=1, D=16, F=16, dtype=torch.float32, device="cpu", seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, H, T, D, generator=g),
        k=torch.randn(B, Hkv, T, D, generator=g),
        v=torch.randn(B, Hkv, T, D, generator=g),
        fq=torch.rand(B, H, T, F, generator=g),
        fk=torch.rand(B, Hkv, T, F, generator=g),
        gamma=0.05 + 0.9 * torch.rand(H, generator=g),
    )
    x = {n: t.to(device=device, dtype=dtype if n != "gamma" else torch.float32) for n, t in x.items()}
    return {n: t.requires_grad_(requires_grad) for n, t in x.items()}


def left_padded(T, pad=7):
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def run(fn, x, mask, **options):
    y = fn(*(x[n] for n in NAMES), attention_mask=mask, **options)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    grads = torch.autograd.grad(y, [x[n] for n in NAMES], dy, allow_unused=True)
    return y, {n: torch.zeros_like(x[n]) if g is None else g for n, g in zip(NAMES, grads, strict=True)}


def with_keywords(fn, tensors=NAMES):
    """`fn` (the backends' contract: its tensors, then one AttentionOptions, then the optional tensors by keyword)
    called the way the torch ops may be: the tensors by position or name, the settings as keywords."""

    def call(*args, **kw):
        args = [*args, *(kw.pop(n) for n in tensors[len(args) :] if n in kw)]
        optional = {n: kw.pop(n) for n in ("attention_mask", "initial_state", "la_decay") if n in kw}
        return fn(*args, AttentionOptions(**kw), **optional)

    return call
