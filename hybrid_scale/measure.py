"""What every stage measures a model with, outside any one stage: the NLL of every token, and perplexity by
position bucket (the evaluation's cells, the export's model card and gamma calibration, stage 2's checks); the FLOPs
of training (plan, stage 2's MFU) and a process's peak memory (the stages' metrics)."""

from __future__ import annotations

import math

import torch


def bucket_labels(buckets: list[int]) -> list[str]:
    return [f"{a}-{b}" for a, b in zip(buckets[:-1], buckets[1:], strict=True)]


@torch.no_grad()
def token_nll(model, sequences: torch.Tensor) -> torch.Tensor:
    """NLL of every predicted token, [N, T-1] fp64 (column t predicts the token at position t+1)."""
    rows = []
    for seq in sequences:
        ids = seq[None].to(next(model.parameters()).device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        rows.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").double().cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)


def by_bucket(nll: torch.Tensor, buckets: list[int]) -> dict[str, float]:
    """exp(mean NLL) of the tokens at positions [a, b) of each bucket (position of the predicted token)."""
    pos = torch.arange(1, nll.shape[-1] + 1)
    out = {}
    for label, a, b in zip(bucket_labels(buckets), buckets[:-1], buckets[1:], strict=True):
        sel = nll[:, (pos >= a) & (pos < b)]
        out[label] = math.exp(sel.mean().item()) if sel.numel() else float("nan")
    return out


def perplexity_by_bucket(model, sequences: torch.Tensor, buckets: list[int]) -> dict[str, float]:
    return by_bucket(token_nll(model, sequences), buckets)


def training_flops(params: int, tokens: int) -> float:
    """The FLOPs of a forward and backward over `tokens` tokens of a model of `params` parameters (6 per parameter
    and token): `plan`'s stage-2 time and stage 2's measured MFU."""
    return 6.0 * params * tokens


def peak_memory(device) -> dict[str, float]:
    """Peak memory of this process so far, in GB: the host's resident set, and the device's allocations on CUDA."""
    import resource

    out = {"host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    if getattr(device, "type", "cpu") == "cuda":
        out["device_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out
