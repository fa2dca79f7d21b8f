"""Write benchmarks/device/text.jsonl: the pipeline check's training and held-out text, generated, not copied.

Deterministic (seeded `random`): about 250 short documents of invented prose -- a made-up place, its people and their
errands -- in which the names of a document recur throughout it, so that a model gains from looking further back
than the sliding window. Nothing in it is taken from any existing text. Regenerate (byte-identical) with

    .venv/bin/python -m benchmarks.device.make_text
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "text.jsonl"
DOCUMENTS = 250

SYLLABLES = ["ka", "lo", "mir", "ten", "sa", "vu", "ri", "don", "el", "ba", "no", "fi", "ar", "zu", "pe", "tal"]
TRADES = ["baker", "weaver", "smith", "ferryman", "miller", "potter", "gardener", "clockmaker", "carpenter", "teacher"]
THINGS = ["lantern", "basket", "ladder", "kettle", "rope", "map", "bell", "wheel", "blanket", "compass", "jar", "key"]
COLOURS = ["red", "green", "grey", "blue", "yellow", "white", "brown", "black"]
PLACES = ["the market", "the old bridge", "the mill", "the harbour", "the orchard", "the square", "the hill road"]
TIMES = ["in the morning", "before noon", "at dusk", "after the rain", "on the second day", "late at night"]
FEELINGS = ["glad", "tired", "curious", "worried", "proud", "puzzled", "calm"]


def name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def document(rng: random.Random) -> str:
    names: list[str] = []
    while len(names) < 1 + rng.randint(2, 4):  # the town and its people, all different
        n = name(rng)
        if n not in names:
            names.append(n)
    town, people = names[0], names[1:]
    trade = {p: rng.choice(TRADES) for p in people}
    owned = {p: (rng.choice(COLOURS), rng.choice(THINGS)) for p in people}
    lines = [f"This is a story from {town}, a small town by the river."]
    for p in people:
        colour, thing = owned[p]
        lines.append(f"{p} was the {trade[p]} of {town} and kept a {colour} {thing} by the door.")
    for _ in range(rng.randint(6, 16)):
        a, b = rng.sample(people, 2)
        colour, thing = owned[a]
        pick = rng.randrange(6)
        if pick == 0:
            lines.append(f"{rng.choice(TIMES).capitalize()}, {a} walked to {rng.choice(PLACES)} to meet {b}.")
        elif pick == 1:
            lines.append(f"{b} asked {a} to lend the {colour} {thing}, and {a} said yes.")
        elif pick == 2:
            lines.append(f"{a} the {trade[a]} felt {rng.choice(FEELINGS)} and told {b} about {town}.")
        elif pick == 3:
            n = rng.randint(2, 9)
            lines.append(f"{a} counted {n} boats at {rng.choice(PLACES)}, then {n + 1}, then {n + 2}.")
        elif pick == 4:
            lines.append(f"When {b} came back, the {colour} {thing} of {a} was where it had always been.")
        else:
            lines.append(f"{b} and {a} ate bread together {rng.choice(TIMES)} and talked until it was dark.")
    p = rng.choice(people)
    colour, thing = owned[p]
    lines.append(f"In the end everyone in {town} remembered {p}, the {trade[p]} with the {colour} {thing}.")
    return " ".join(lines)


def main() -> None:
    rng = random.Random(20261201)
    with OUT.open("w", encoding="utf-8") as f:
        for i in range(DOCUMENTS):
            f.write(json.dumps({"id": i, "text": document(rng)}) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {DOCUMENTS} documents)")


if __name__ == "__main__":
    main()
