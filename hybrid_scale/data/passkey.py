"""The retrieval probes' prompts (evaluate/retrieval.py scores them; its docstring draws one), built from the held-out
text and the tokenizer alone, so that the preflight can check that every distance fits before any training:

* passkey: a random key stated in a needle after LEAD filler tokens, more filler, the question, the answer;
* associative recall (`recall_probes`, eval.recall_pairs): a line of `pairs` key-value pairs (keys: distinct words of
  the held-out text, values: random 4-digit numbers) after the lead filler, more filler, then one of the keys again,
  whose value is the answer: the model must pick the right value among several, not only carry one.
Neither format is in the training text (stage 1 and 2 read the corpus as it is: no synthetic recall documents)."""

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
RECALL_DIGITS = 4  # digits of a recall value
RECALL_PAIR = " {key}: {value}"  # pairs joined by "," and ended by "."; the query is " {key}:"
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


def _recall_keys(text_words: list[str], count: int, g: torch.Generator) -> list[str]:
    """`count` distinct words of 5-10 letters from the held-out text (capitalised: never the filler's own token)."""
    pool = sorted({w.strip(".,;:!?\"'()").lower() for w in text_words})
    pool = [w.capitalize() for w in pool if w.isalpha() and 5 <= len(w) <= 10]
    if len(pool) < count:
        raise ValueError(
            f"the recall probe needs {count} distinct words of 5-10 letters, the held-out text has {len(pool)}"
        )
    idx = torch.randperm(len(pool), generator=g)[:count].tolist()
    return [pool[i] for i in idx]


@dataclass(frozen=True)
class Recall:
    """The recall prompts' layout: `pairs` key-value pairs on the line, `lead` filler tokens before it."""

    pairs: int = 4
    lead: int = LEAD


def recall_probes(
    tokenizer, filler: list[int], distances: list[int], trials: int, seed: int, layout: Recall = Recall()
) -> list[Probe]:
    """`trials` associative-recall prompts per distance, seeded: [lead filler] Key1: 1234, Key2: 5678, ... .
    [filler] Keyi: -> the answer " value_i". `distance` counts from the pair line's last token to the first answer
    token (as the passkey's); the queried pair is drawn uniformly, so the answer may lie up to the whole line
    further back. Keys are words of the held-out text (so they are ordinary tokens), values random."""
    pairs, lead = layout.pairs, layout.lead
    g = torch.Generator().manual_seed(seed + 7919)
    words = tokenizer.decode(filler[: min(len(filler), 20000)]).split()
    out = []
    for d in distances:
        for _ in range(trials):
            keys = _recall_keys(words, pairs, g)
            values = ["".join(str(int(x)) for x in torch.randint(0, 10, (RECALL_DIGITS,), generator=g)) for _ in keys]
            line = ",".join(RECALL_PAIR.format(key=k, value=v) for k, v in zip(keys, values, strict=True)) + "."
            pick = int(torch.randint(0, pairs, (1,), generator=g))
            query = tokenizer.encode(f" {keys[pick]}:", add_special_tokens=False)
            gap = d - len(query) - 1
            if gap < 0:
                raise ValueError(f"recall distances must be >= {len(query) + 1} (the query takes {len(query)} tokens)")
            need = lead + gap
            if need > len(filler):
                raise ValueError(
                    f"recall distance {d} needs {need} tokens of filler, the held-out text has {len(filler)}; lower "
                    "the distance or give longer text with eval.ppl_text"
                )
            start = int(torch.randint(0, len(filler) - need + 1, (1,), generator=g))
            cut = filler[start : start + need]
            answer = tokenizer.encode(" " + values[pick], add_special_tokens=False)
            ids = cut[:lead] + tokenizer.encode(line, add_special_tokens=False) + cut[lead:] + query + answer
            out.append(Probe(d, values[pick], ids, len(answer)))
    return out
