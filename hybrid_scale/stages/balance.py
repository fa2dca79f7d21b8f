"""Balance diagnostics (DESIGN.md section 2): is the linear attention used?

* paired bootstrap deltas over the same items, stratified by task: delta_SWA = hybrid - swa_only,
  delta_LA = la_only - none, and the verdict on delta_LA with a margin;
* perplexity per mode by position bucket on long held-out text (LA only matters beyond the window);
* the LA share of the shared normaliser, sum_P L / (sum_W E + sum_P L), per layer, head and position bucket, in
  `hybrid` mode, next to the output effect ||y_hybrid - y_swa_only|| / ||y_hybrid||.
"""

from __future__ import annotations

import math

import torch

from ..attention.hybrid import hybrid_layers
from ..distributed.deepspeed import gathered


def paired_bootstrap(a: dict[str, list[float]], b: dict[str, list[float]], resamples: int, seed: int) -> dict:
    """Per task and for the task average: delta = mean(a) - mean(b) and its 95% percentile CI, resampling the
    same item indices for a and b within each task."""
    g = torch.Generator().manual_seed(seed)
    tasks = sorted(a)
    out, boot_avg = {}, torch.zeros(max(resamples, 1), dtype=torch.float64)
    for task in tasks:
        diff = torch.tensor(a[task], dtype=torch.float64) - torch.tensor(b[task], dtype=torch.float64)
        n = len(diff)
        idx = torch.randint(0, n, (resamples, n), generator=g)
        boot = diff[idx].mean(1) if resamples else diff.mean()[None]
        boot_avg += boot / len(tasks)
        out[task] = _summary(diff.mean().item(), boot)
    avg = sum(out[t]["delta"] for t in tasks) / len(tasks)
    out["avg"] = _summary(avg, boot_avg)
    return out


def _summary(delta: float, boot: torch.Tensor) -> dict:
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=boot.dtype)).tolist()
    return {"delta": delta, "lo": lo, "hi": hi}


def verdict(delta_la: dict, margin: float) -> str:
    """On the task-average delta_LA = la_only - none."""
    lo, hi = delta_la["lo"], delta_la["hi"]
    if lo > margin:
        return "LA used"
    if -margin <= lo and hi <= margin:
        return "LA bypassed"
    if hi < 0:
        return "LA harmful"
    return "inconclusive"


def bucket_labels(buckets: list[int]) -> list[str]:
    return [f"{a}-{b}" for a, b in zip(buckets[:-1], buckets[1:], strict=True)]


@torch.no_grad()
def perplexity_by_bucket(model, sequences: torch.Tensor, buckets: list[int]) -> dict[str, float]:
    """exp(mean NLL) of the tokens at positions [a, b) of each bucket (position of the predicted token)."""
    nll_sum = torch.zeros(len(buckets) - 1, dtype=torch.float64)
    count = torch.zeros(len(buckets) - 1, dtype=torch.float64)
    for seq in sequences:
        ids = seq[None].to(next(model.parameters()).device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").double().cpu()
        pos = torch.arange(1, ids.shape[1])
        for i, (a, b) in enumerate(zip(buckets[:-1], buckets[1:], strict=True)):
            sel = (pos >= a) & (pos < b)
            nll_sum[i] += nll[sel].sum()
            count[i] += sel.sum()
    return {
        label: (math.exp(s / c) if c else float("nan"))
        for label, s, c in zip(bucket_labels(buckets), nll_sum.tolist(), count.tolist(), strict=True)
    }


@torch.no_grad()
def la_share(model, ids: torch.Tensor, buckets: list[int]) -> dict:
    """Per hybrid layer: LA share and output effect per head and position bucket, on one batch of ids [B, T]."""
    layers = hybrid_layers(model)
    captured: dict[int, tuple] = {}

    def hook(module, args, kwargs):
        captured[module.layer_idx] = (
            kwargs.get("hidden_states", args[0] if args else None),
            kwargs["position_embeddings"],
        )

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers.values()]
    try:
        model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    labels = bucket_labels(buckets)
    pos = torch.arange(ids.shape[1])
    share, effect = {}, {}
    for i, m in sorted(layers.items()):
        hidden, rope = captured[i]
        q, k, v, fq, fk = m.project(hidden, rope)
        with gathered(m):  # gamma is the module's own parameter: whole only inside its forward under ZeRO-3
            gamma = m.gamma.detach().clone()
        y, soft, lin = m.attend(q, k, v, fq, fk, gamma=gamma, mode="hybrid", return_denominators=True)
        y_swa = m.attend(q, k, v, fq, fk, gamma=gamma, mode="swa_only")
        ratio = (lin / (soft + lin)).float()  # [B, H, T]
        diff = (y - y_swa).float().pow(2).sum(-1)  # [B, H, T]
        norm = y.float().pow(2).sum(-1)
        share[i], effect[i] = {}, {}
        for label, a, b in zip(labels, buckets[:-1], buckets[1:], strict=True):
            sel = (pos >= a) & (pos < b)
            if not sel.any():
                continue
            share[i][label] = ratio[..., sel].mean(dim=(0, 2)).tolist()
            effect[i][label] = (diff[..., sel].sum(dim=(0, 2)) / norm[..., sel].sum(dim=(0, 2))).sqrt().tolist()
    return {"seq_len": ids.shape[1], "sequences": ids.shape[0], "share": share, "effect": effect}
