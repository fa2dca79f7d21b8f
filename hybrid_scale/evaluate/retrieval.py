"""Passkey retrieval past the window: does anything cross it?

A prompt states a random key (``NEEDLE``: twice, in one place), then runs filler and a question, and the model must
continue with the key:

    [LEAD tokens of filler] The pass key is 73921. Remember it. The pass key is 73921. [filler] The pass key is 73921
                                                                                  ^ key's last token      ^ first answer
                                                                                    token: `distance` positions later

Everything is seeded: the keys and the places the filler is cut from (the held-out text). The lead filler keeps the
needle away from the first tokens, so that attention sinks (swa_sinks, sinks_only) cannot hold it. With distance >=
window the key has left the window of every answer token: a model that only attends within the window (swa_only,
swa_sinks) can answer only by chance. With distance + DIGITS - 1 < window the whole key is inside the window of the
first answer token.

Each prompt is scored teacher-forced in one forward: the log-likelihood of the answer's tokens and greedy exact
match. Greedy decoding produces the answer iff at every answer position the argmax given the true prefix is the
true token, so the argmax check over the forced answer *is* greedy exact match, without generating. Chance: the key
has `DIGITS` random digits, exact match by guessing 10^-DIGITS, and a log-likelihood near DIGITS * ln(1/10).
"""

from __future__ import annotations

import torch

from ..data.passkey import Probe


@torch.no_grad()
def score(model, batch: list[Probe], device) -> list[tuple[float, bool]]:
    """(log-likelihood of the answer, greedy exact match) for prompts of one length, in one forward that computes
    the logits of the answer positions only."""
    ids = torch.tensor([p.ids for p in batch], device=device)
    n = batch[0].answer
    logits = model(ids, use_cache=False, logits_to_keep=n + 1).logits[:, :-1].float()
    target = ids[:, -n:]
    ll = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0].sum(-1)
    exact = (logits.argmax(-1) == target).all(-1)
    return list(zip(ll.double().cpu().tolist(), exact.cpu().tolist(), strict=True))


def score_probes(model, items: list[Probe], device, tokens_per_batch: int = 8192, progress=None) -> dict:
    """Every probe scored (batches of equal-length prompts, up to tokens_per_batch tokens each), summarised per
    distance: exact-match rate, mean answer log-likelihood, and the per-trial values (for reruns and plots)."""
    results: dict[int, list[tuple[float, bool]]] = {}
    by_length: dict[int, list[Probe]] = {}
    for p in items:
        by_length.setdefault(len(p.ids), []).append(p)
    for length, group in by_length.items():
        batch_size = max(1, tokens_per_batch // length)
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            for p, r in zip(chunk, score(model, chunk, device), strict=True):
                results.setdefault(p.distance, []).append(r)
            if progress is not None:
                progress.update(len(chunk))
    return {
        str(d): {
            "exact": sum(e for _, e in rs) / len(rs),
            "loglik": sum(ll for ll, _ in rs) / len(rs),
            "trials": len(rs),
            "per_trial": [[round(ll, 6), bool(e)] for ll, e in rs],
        }
        for d, rs in sorted(results.items())
    }


def sanity(by_mode: dict, window: int) -> list[str]:
    """The probe's built-in checks: a window-only mode (swa_only, swa_sinks) must be at chance -- no exact match --
    at every distance >= window; a failure means the window leaks (or the lead filler let a sink hold the key)."""
    problems = []
    for mode in ("swa_only", "swa_sinks"):
        for d, r in by_mode.get(mode, {}).items():
            if int(d) >= window and r["exact"] > 0:
                problems.append(f"{mode} retrieved {100 * r['exact']:.0f}% of keys at distance {d} >= window {window}")
    return problems
