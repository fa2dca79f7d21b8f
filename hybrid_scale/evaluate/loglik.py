"""Log-likelihood scoring of (context, continuation) requests, batched by length, each context run once.

Requests that share a context form a group. Groups are sorted globally by length (longest first) and cut into
batches; batch b goes to data-parallel rank b mod dp (every rank of a tensor-parallel group scores the same batches;
without tensor parallelism dp = world), so the batches -- and therefore every number -- are the same for any
number of ranks. In a batch the contexts are prefilled once (left-padded) with the model's cache, the cache rows are
repeated for the continuations, and the continuations (right-padded) extend it. Tokenisation follows
lm-evaluation-harness: trailing spaces of the context move to the continuation, the pair is encoded whole and split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..attention.hf.cache import HybridCache
from ..attention.layer import hybrid_layers
from ..distributed.runtime import Runtime


@dataclass
class Group:
    context: list[int]
    continuations: list[list[int]] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)  # global request index of each continuation

    @property
    def length(self) -> int:
        return len(self.context) + max(len(c) for c in self.continuations)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], tokenizer.encode(continuation)
    return ctx, whole[len(ctx) :]


def make_groups(tokenizer, requests: list[tuple[str, str]], max_length: int) -> list[Group]:
    """Consecutive requests with the same context share one group. Over-long pairs lose context on the left."""
    groups: list[Group] = []
    previous = None
    for i, (context, continuation) in enumerate(requests):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        if len(cont) > max_length:
            raise ValueError(f"request {i}: the continuation alone has {len(cont)} tokens > max length {max_length}")
        ctx = ctx[-(max_length - len(cont)) :] if len(ctx) + len(cont) > max_length else ctx
        if not groups or previous != context or groups[-1].context != ctx:
            groups.append(Group(ctx))
            previous = context
        groups[-1].continuations.append(cont)
        groups[-1].requests.append(i)
    return groups


def make_batches(groups: list[Group], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(groups)), key=lambda g: (-groups[g].length, g))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def score_batch(model, groups: list[Group], pad_id: int, device) -> list[tuple[int, float, bool]]:
    B = len(groups)
    Lc = max(len(g.context) for g in groups)
    ids = torch.full((B, Lc), pad_id, dtype=torch.long)
    mask = torch.zeros(B, Lc, dtype=torch.long)
    for b, g in enumerate(groups):
        ids[b, Lc - len(g.context) :] = torch.tensor(g.context)
        mask[b, Lc - len(g.context) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # a converted model's decode rings hold the longest context this batch will see, not the whole window (at a
    # 4096 window they took gigabytes for every continuation row)
    longest = Lc + max(max(len(c) for g in groups for c in g.continuations) - 1, 1)
    inner = getattr(model, "module", model)  # (an engine's or DDP's model)
    cache = HybridCache(inner, max_length=longest) if hybrid_layers(inner) else None
    out = model(ids, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True, logits_to_keep=1)
    first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    cache = out.cache

    rows = [b for b, g in enumerate(groups) for _ in g.continuations]
    conts = [c for g in groups for c in g.continuations]
    reqs = [r for g in groups for r in g.requests]
    index = torch.tensor(rows, device=device)
    cache.batch_select_indices(index)
    R, Lk = len(conts), max(len(c) for c in conts)
    ext = torch.full((R, max(Lk - 1, 1)), pad_id, dtype=torch.long)
    ext_mask = torch.zeros(R, ext.shape[1], dtype=torch.long)
    for r, c in enumerate(conts):
        ext[r, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
        ext_mask[r, : len(c) - 1] = 1
    ext, ext_mask = ext.to(device), ext_mask.to(device)
    full_mask = torch.cat([mask[index], ext_mask], dim=1)
    logp = torch.log_softmax(
        model(
            ext,
            attention_mask=full_mask,
            position_ids=_positions(full_mask)[:, -ext.shape[1] :],
            cache=cache,
            use_cache=True,
        ).logits.float(),
        dim=-1,
    )
    results = []
    for r, c in enumerate(conts):
        dist = torch.cat([first[rows[r]][None], logp[r, : len(c) - 1]], dim=0)  # predicts c[0], c[1], ...
        target = torch.tensor(c, device=device)
        ll = dist.gather(1, target[:, None]).sum().item()
        greedy = bool((dist.argmax(-1) == target).all())
        results.append((reqs[r], ll, greedy))
    return results


@dataclass(frozen=True)
class Scoring:
    """How a task's batches are scored: batch_size groups per batch, padded with pad_id; lockstep (ZeRO-3 weights or
    a tensor-parallel split): a rank without a batch in the last round repeats its first one and drops the result;
    desc and progress: the rank-0 progress bar."""

    batch_size: int
    pad_id: int
    lockstep: bool = False
    desc: str = "scoring"
    progress: bool = True


def score(
    model, groups: list[Group], how: Scoring, rt: Runtime, stop: Callable[[int], bool] | None = None
) -> dict[int, tuple[float, bool]] | None:
    """This rank's share of the batches, scored `how`. Returns {request index: (log-likelihood, is_greedy)}.
    The batches run in rounds of one per data-parallel rank (ceil(batches / dp) rounds on every rank). stop (a
    collective: every rank calls it equally often) is called between rounds with the number of rounds done; when it
    returns True the scoring ends and None is returned."""
    batches = make_batches(groups, how.batch_size)
    mine = batches[rt.dp_rank :: rt.dp]
    rounds = -(-len(batches) // rt.dp)
    out: dict[int, tuple[float, bool]] = {}
    shown = how.progress and rt.main
    with tqdm(total=rounds, desc=how.desc, disable=not shown, unit="batch", dynamic_ncols=True) as bar:
        for i in range(rounds):
            if i < len(mine):
                scored = score_batch(model, [groups[g] for g in mine[i]], how.pad_id, rt.device)
                out.update((req, (ll, greedy)) for req, ll, greedy in scored)
            elif how.lockstep:  # every rank joins every forward
                score_batch(model, [groups[g] for g in (mine[0] if mine else batches[0])], how.pad_id, rt.device)
            bar.update()
            if stop is not None and i + 1 < rounds and stop(i + 1):
                return None
    return out
