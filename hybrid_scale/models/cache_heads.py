"""attention.cache_heads=retrieval: a layer's cache slots (attention.cache x its KV heads) shared out over its KV heads
by how much each retrieves, measured on passkey prompts that the probes never use.

The measure (`retrieval_mass`): on passkey prompts (data/passkey.probes, with a seed offset the evaluation's probes
never take) run through the converted model (in hybrid mode, with the uniform cache of the same size), each hybrid
layer's own q and k (HybridAttention.project, from the inputs a forward pre-hook sees) give the full causal softmax;
a KV head's mass is the probability its query heads (averaged) put on the needle's tokens from the answer rows (the
last question token up to the last answer token but one: the rows that predict the answer), averaged over those rows
and summed over the prompts. The budgets (`share`): a floor of max(1, cache // 4) slots each, the rest in proportion
to the mass (largest remainders), summing to cache x Hkv in every layer (experiments/cache_selection/: passkey at 256
tokens, window 16, 32 keys per KV head on average: 62 % against 25 % for the uniform budget, 8 prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..attention.layer import hybrid_layers
from ..data import passkey
from .convert import components, set_cache

SEED_OFFSET = 12345  # the calibration's prompts: seed + this (the probes take the run's seed)
WINDOWS = (3, 6, 12)  # the calibration's passkey distances, in windows (the exploration's 48 / 96 / 192 at w 16)


def share(mass: torch.Tensor, cache: int) -> torch.Tensor:
    """One layer's budgets [Hkv] long from its heads' mass [Hkv] >= 0: a floor of max(1, cache // 4) each (at most
    cache), the other cache x Hkv - Hkv x floor slots in proportion to the mass (all heads alike if it is all 0),
    rounded by the largest remainders; the sum is cache x Hkv."""
    K = mass.numel()
    total = K * cache
    if cache == 0:
        return torch.zeros(K, dtype=torch.long)
    floor = min(max(1, cache // 4), cache)
    m = mass.double().clamp(min=0)
    weights = m / m.sum() if float(m.sum()) > 0 else torch.full_like(m, 1.0 / K)
    raw = floor + (total - K * floor) * weights
    b = raw.floor().long()
    rest = total - int(b.sum())
    b[(raw - b).argsort(descending=True, stable=True)[:rest]] += 1
    return b


def needle_spans(tokenizer, items: Sequence[passkey.Probe], lead: int) -> list[tuple[int, int, int, int]]:
    """(needle start, needle end, first answer row, end of the answer rows) of each prompt (passkey.probes' layout:
    lead filler, the needle, filler, the question, the answer)."""
    end = tokenizer.encode(passkey.NEEDLE_END, add_special_tokens=False)
    out = []
    for p in items:
        needle = len(tokenizer.encode(passkey.NEEDLE.format(key=p.key), add_special_tokens=False)) + len(end)
        T = len(p.ids)
        out.append((lead, lead + needle, T - p.answer - 1, T - 1))
    return out


class Prompts(NamedTuple):
    """The calibration's passkey prompts: their distances, prompts per distance, the filler before the needle, and
    the probes' seed (the prompts take it plus SEED_OFFSET, so that they are never the probes' own)."""

    distances: Sequence[int]
    trials: int
    lead: int
    seed: int


def retrieval_mass(model: nn.Module, tokenizer, filler: list[int], prompts: Prompts) -> dict[int, torch.Tensor]:
    """{layer: [Hkv] fp64}: each hybrid layer's KV heads' softmax mass from the answer rows to the needle (module
    doc), summed over `prompts.trials` prompts per distance, in the model's current modes and cache."""
    distances, trials, lead, seed = prompts
    layers = hybrid_layers(model)
    for m in layers.values():
        if m.head_range is not None:
            raise ValueError(
                "attention.cache_heads=retrieval calibrates on the whole layer: a model split over tensor-parallel "
                "ranks cannot (calibrate on one device and pass the budgets to set_cache)"
            )
    items = passkey.probes(tokenizer, filler, list(distances), trials, seed + SEED_OFFSET, lead)
    spans = needle_spans(tokenizer, items, lead)
    mass = {i: torch.zeros(m.num_key_value_heads, dtype=torch.float64) for i, m in layers.items()}
    current: list[tuple[int, int, int, int]] = []

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        x = module.project(hidden, kwargs["position_embeddings"])
        q, k = x[0].double(), x[1].double()
        B, H, T, D = q.shape
        K = k.shape[1]
        a = (q @ k.repeat_interleave(H // K, 1).transpose(-1, -2)) * module.scaling
        causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
        p = a.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, T, T]
        for b, (s0, s1, r0, r1) in enumerate(current):
            m = p[b, :, r0:r1, s0:s1].sum(-1).mean(-1)  # [H]
            mass[module.layer_idx] += m.view(K, H // K).mean(-1).cpu()

    by_len: dict[int, list[int]] = {}
    for n, p in enumerate(items):
        by_len.setdefault(len(p.ids), []).append(n)
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers.values()]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for group in by_len.values():
                current[:] = [spans[n] for n in group]
                ids = torch.tensor([items[n].ids for n in group], device=device)
                model(ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return mass


def default_prompts(model: nn.Module, seed: int) -> Prompts:
    """8 prompts at 3, 6 and 12 windows (of the first hybrid layer), the needle after max(passkey.LEAD, the sinks)."""
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("retrieval_budgets needs a converted model (no hybrid layer found)")
    first = layers[min(layers)]
    return Prompts([w * first.window for w in WINDOWS], 8, max(passkey.LEAD, first.sinks), seed)


def retrieval_budgets(
    model: nn.Module, tokenizer, filler: list[int], cache: int, prompts: Prompts, *, select: str | None = None
) -> dict[int, torch.Tensor]:
    """{layer: LongTensor [Hkv]}: each hybrid layer's cache x Hkv slots shared out over its KV heads by their
    retrieval mass (module doc), measured with the model in hybrid mode and the uniform cache of `cache` keys chosen
    by `select` (the model's own if None); the model's modes and cache are as before afterwards. `filler`: token ids
    of the text the prompts cut their filler from (the evaluation's held-out text, the export's calibration text);
    prompts: the calibration's (default_prompts)."""
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("retrieval_budgets needs a converted model (no hybrid layer found)")
    if cache <= 0:
        return {}
    before = {i: (m.cache_keys, m.cache_select, m.cache_budget) for i, m in layers.items()}
    try:
        set_cache(model, cache, select)
        with components(model, "hybrid"):
            mass = retrieval_mass(model, tokenizer, filler, prompts)
    finally:
        for i, (keys, sel, budget) in before.items():
            layers[i].cache_keys, layers[i].cache_select, layers[i].cache_budget = keys, sel, budget
    return {i: share(m, cache) for i, m in sorted(mass.items())}
