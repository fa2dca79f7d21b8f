"""Balance diagnostics (docs/design.md §2-3): is the linear attention used?

* paired bootstrap deltas over the same items, stratified by task: delta_SWA = hybrid - swa_only,
  delta_LA = la_only - none, and its verdict with a margin (the tasks' scored tokens mostly lie inside the window);
* perplexity per mode by position bucket on long held-out text (LA only matters beyond the window), and the main
  verdict: the hybrid against the strongest mode without LA on the tokens beyond the window (beyond_window);
* the LA share of the shared normaliser, sum_P L / (sum_W E + sum_P L), per layer, head and position bucket, in
  `hybrid` mode, and each memory's share (window, sinks, cache, LA: attention/cache/) per layer and bucket, next to
  the output effect ||y_hybrid - y_swa_only|| / ||y_hybrid||; and the LA's learned length decay as its horizon 1/rho
  per layer and KV head (attention.la_decay).
"""

from __future__ import annotations

import math

import torch

from ..attention.layer import hybrid_layers
from ..distributed.deepspeed import gathered
from ..measure import bucket_labels


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
    """On a delta with a CI (`lo`, `hi`) where positive means the LA helps: the task-average delta_LA = la_only -
    none, or the beyond-window NLL of the strongest mode without LA minus the hybrid's."""
    lo, hi = delta_la["lo"], delta_la["hi"]
    if lo > margin:
        return "LA used"
    if -margin <= lo and hi <= margin:
        return "LA bypassed"
    if hi < 0:
        return "LA harmful"
    return "inconclusive"


BLOCK = 16  # tokens per block of the beyond-window bootstrap (neighbouring tokens are not independent)
NO_LA = ("swa_only", "swa_sinks", "sinks_only", "none")  # the modes without linear attention


def blocks_beyond(nll: torch.Tensor, window: int) -> list[list[float]]:
    """[NLL sum, tokens] of consecutive BLOCK-token blocks of each sequence's tokens at positions >= window: the
    units the beyond-window verdict resamples."""
    out = []
    for row in nll[:, max(window - 1, 0) :]:
        for part in row.split(BLOCK):
            out.append([part.sum().item(), part.numel()])
    return out


def beyond_window(blocks: dict[str, list[list[float]]], window: int, margin: float, resamples: int, seed: int):
    """The verdict on the held-out text past the window, from NLL differences in nats per token with paired
    bootstrap CIs over BLOCK-token blocks (positive: the hybrid is better):

    * is the LA used? the hybrid against `swa_only`, the same model with its LA removed (`swa_only` key);
    * is it worth its cost? the hybrid against the strongest mode without LA (`against`: the lowest NLL of NO_LA
      present, e.g. swa_sinks), the top-level delta / lo / hi / ratio.

    "LA used" needs both; "LA used; no better than X" / "LA used; X without LA is better" say that the LA carries
    something past the window but a cheaper mode does as well or better. Without swa_only the verdict is on
    `against` alone. None without hybrid or a mode without LA."""
    no_la = [m for m in NO_LA if m in blocks]
    if "hybrid" not in blocks or not no_la or not blocks["hybrid"]:
        return None
    t = {m: torch.tensor(b, dtype=torch.float64) for m, b in blocks.items()}
    mean = {m: (x[:, 0].sum() / x[:, 1].sum()).item() for m, x in t.items()}
    count = t["hybrid"][:, 1]
    idx = torch.randint(0, len(count), (max(resamples, 1), len(count)), generator=torch.Generator().manual_seed(seed))

    def compare(mode: str) -> dict:
        diff = t[mode][:, 0] - t["hybrid"][:, 0]  # per block, summed over its tokens
        out = _summary((diff.sum() / count.sum()).item(), diff[idx].sum(1) / count[idx].sum(1))
        return out | {"ratio": math.exp(mean["hybrid"] - mean[mode])}

    against = min(no_la, key=mean.get)
    out = compare(against) | {"against": against, "window": window, "tokens": int(count.sum().item())}
    out |= {"margin": margin, "perplexity": {m: math.exp(v) for m, v in mean.items()}}
    used = verdict(out, margin)
    if "swa_only" in mean:
        out["swa_only"] = compare("swa_only")
        used = verdict(out["swa_only"], margin)
        if used == "LA used" and against != "swa_only":
            worth = verdict(out, margin)
            if worth == "LA harmful":
                used = f"LA used; {against} without LA is better"
            elif worth != "LA used":
                used = f"LA used; no better than {against} without LA"
    out["verdict"] = used
    return out


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
    share, effect, horizon, memories = {}, {}, {}, {}
    for i, m in sorted(layers.items()):
        hidden, rope = captured[i]
        x = m.project(hidden, rope)  # (with la_kind gated_delta, x carries its gates too)
        with gathered(m):  # gamma is the module's own parameter: whole only inside its forward under ZeRO-3
            gamma = m.gamma.detach().clone()
            rho = None if m.la_decay is None else m.la_decay.detach().clone()
        if rho is not None:  # 1/rho: tokens past the window over which a key's LA weight falls by e (None: no decay)
            horizon[i] = [1.0 / r if r > 0 else None for r in rho.tolist()]
        opts = dict(gates=x.gates, gamma=gamma, la_decay=rho)
        y, soft, lin = m.attend(*x[:5], mode="hybrid", return_denominators=True, **opts)
        y_swa = m.attend(*x[:5], mode="swa_only", **opts)
        # the LA's weight in the output: Hedgehog sum L / (sum E + sum L); gated_delta (attention/gated_delta/hybrid.py)
        # its read-out's gamma / (sum E + gamma) under the normaliser, the gate m under la_combine=mix
        ratio = (lin / (soft + lin).clamp_min(1e-30)).float()  # [B, H, T]
        # each memory's weight (attention/cache/attend.py): the softmax's split between window, sinks and cache
        _, parts = m.attend(*x[:5], mode="hybrid", return_parts=True, **opts)
        total = sum(parts.values()).clamp_min(1e-30)
        ratios = {name: (w / total).float() for name, w in parts.items()}  # [B, H, T] each
        diff = (y - y_swa).float().pow(2).sum(-1)  # [B, H, T]
        norm = y.float().pow(2).sum(-1)
        share[i], effect[i], memories[i] = {}, {}, {}
        for label, a, b in zip(labels, buckets[:-1], buckets[1:], strict=True):
            sel = (pos >= a) & (pos < b)
            if not sel.any():
                continue
            share[i][label] = ratio[..., sel].mean(dim=(0, 2)).tolist()
            memories[i][label] = {name: float(r[..., sel].mean()) for name, r in ratios.items()}
            effect[i][label] = (diff[..., sel].sum(dim=(0, 2)) / norm[..., sel].sum(dim=(0, 2))).sqrt().tolist()
    out = {"seq_len": ids.shape[1], "sequences": ids.shape[0], "share": share, "effect": effect,
           "memories": memories}  # fmt: skip
    return out | ({"horizon": horizon} if horizon else {})
