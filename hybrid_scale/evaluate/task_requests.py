"""One task's items as the scoring's requests (context, continuation), grouped by shared context (loglik), and what
the evaluation reports of them: the share of scored tokens past the window (TaskInfo) and a (mode, task) cell's
result from its scores."""

from __future__ import annotations

import dataclasses

from .. import tasks
from . import loglik
from .cells import digest
from .results import TaskInfo

BEYOND = (16, 64)  # windows at which the share of scored tokens beyond the window is always reported


class Requests:
    """One task's items as (context, continuation) requests, grouped by shared context for scoring; `digest` names
    the items and their tokens (a cell's key)."""

    def __init__(self, task: str, items: list, tokenizer, max_len: int):
        self.task, self.items, requests, self.spans = task, items, [], []
        for item in items:
            self.spans.append((len(requests), len(item.continuations)))
            requests += item.requests()
        self.groups = loglik.make_groups(tokenizer, requests, max_len)
        self.lengths = {
            r: (len(g.context), len(c)) for g in self.groups for r, c in zip(g.requests, g.continuations, strict=True)
        }
        tokens = [(g.context, g.continuations, g.requests) for g in self.groups]
        self.digest = digest({"items": [dataclasses.asdict(item) for item in items], "tokens": tokens})

    def beyond_window(self, window: int) -> TaskInfo:
        """The task's metric, n, and the share of scored tokens beyond the window (at `window`, 16 and 64)."""
        scored = [self.lengths[r] for r in range(len(self.lengths))]
        total = sum(k for _, k in scored)
        beyond = {w: sum(max(0, c + k - max(c, w)) for c, k in scored) / total for w in sorted({window, *BEYOND})}
        return TaskInfo(tasks.TASKS[self.task].reported, len(self.items), beyond)

    def result(self, scores: dict[int, tuple[float, bool]]) -> dict:
        """The reported metric and its stderr, acc, acc_norm, per-item correctness and log-likelihoods."""
        lls, acc, acc_norm = [], [], []
        for item, (start, n) in zip(self.items, self.spans, strict=True):
            ll = [scores[r][0] for r in range(start, start + n)]
            c = tasks.correct(item, ll)
            lls.append(ll)
            acc.append(c["acc"])
            acc_norm.append(c["acc_norm"])
        per_item = acc if tasks.TASKS[self.task].reported == "acc" else acc_norm
        value, stderr = tasks.mean_stderr(per_item)
        return {
            "metric": value,
            "stderr": stderr,
            "n": len(self.items),
            "acc": sum(acc) / len(acc),
            "acc_norm": sum(acc_norm) / len(acc_norm),
            "correct": per_item,
            "loglik": lls,
        }
