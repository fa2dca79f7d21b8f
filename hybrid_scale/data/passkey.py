"""The passkey probe's prompts (evaluate/retrieval.py scores them; its docstring draws one): a random key stated
in a needle after LEAD filler tokens, more filler, the question, the answer. Built from the held-out text and the
tokenizer alone, so that the preflight can check that every distance fits before any training."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEEDLE = " The pass key is {key}. Remember it. The pass key is {key}"  # then NEEDLE_END
NEEDLE_END = "."
QUESTION = " The pass key is"
DIGITS = 5
LEAD = 32  # filler tokens before the needle (evaluate uses at least the sink count: no sink may hold the key)
CHANCE_LOGLIK = DIGITS * math.log(0.1)  # guessing each digit uniformly
PROMPT_EXTRA = 25  # a prompt's tokens besides its lead filler and its distance: the needle and the answer (about)


def probe_modes(e) -> list[str]:
    """The modes the probe scores (config `eval`): eval.passkey_modes, or the evaluated modes when it is unset; none
    without distances or trials."""
    if not (e.passkey_distances and e.passkey_trials):
        return []
    return list(e.modes if e.passkey_modes is None else e.passkey_modes)


def probe_tokens(distances: list[int], trials: int, lead: int = LEAD) -> int:
    """The tokens one mode's probe reads (every prompt once), about."""
    return trials * sum(d + lead + PROMPT_EXTRA for d in distances)


@dataclass
class Probe:
    distance: int
    key: str
    ids: list[int]  # the whole prompt, answer included (at the end)
    answer: int  # number of answer tokens


def probes(tokenizer, filler: list[int], distances: list[int], trials: int, seed: int, lead: int = LEAD) -> list[Probe]:
    """`trials` prompts per distance, seeded: the same prompts for every mode and every run with this seed; `lead`
    filler tokens before the needle (at least the model's sink count)."""
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    end = tokenizer.encode(NEEDLE_END, add_special_tokens=False)
    shortest = len(end) + len(question) + 1
    if min(distances, default=shortest) < shortest:
        raise ValueError(
            f"passkey distances must be >= {shortest} (the needle's end and the question take {shortest - 1} tokens)"
        )
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in distances:
        gap = d - len(end) - len(question) - 1  # filler between the needle and the question
        need = lead + gap
        if need > len(filler):
            raise ValueError(
                f"passkey distance {d} needs {need} tokens of filler, the held-out text has {len(filler)}; lower the "
                "distance or give longer text with eval.ppl_text"
            )
        for _ in range(trials):
            key = "".join(str(int(x)) for x in torch.randint(0, 10, (DIGITS,), generator=g))
            start = int(torch.randint(0, len(filler) - need + 1, (1,), generator=g))
            cut = filler[start : start + need]
            needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False) + end
            answer = tokenizer.encode(" " + key, add_special_tokens=False)
            ids = cut[:lead] + needle + cut[lead:] + question + answer
            out.append(Probe(d, key, ids, len(answer)))
    return out
