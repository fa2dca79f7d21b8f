"""Training text: JSONL errors name file:line; the held-out text is cut into two disjoint halves, one for stage 2's
checkpoint choice (selection) and one for the reported perplexity (report)."""

import json

import pytest

from hybrid_scale.data import corpus


def test_the_selection_and_report_halves_are_disjoint_and_cover_the_held_out_documents(tmp_path):
    docs = [f"document number {i} " + "word " * (i % 7) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    src = str(tmp_path / "d.jsonl")
    train, selection = corpus.train_and_heldout(src, "text", 0.25, "selection")
    train2, report = corpus.train_and_heldout(src, "text", 0.25, "report")
    assert train == train2 == [d.strip() for d in docs[:30]]
    assert selection == [d.strip() for d in docs[30:35]] and report == [d.strip() for d in docs[35:]]
    assert not set(selection) & set(report) and not (set(selection) | set(report)) & set(train)


def test_the_embedded_default_splits_its_own_held_out_text(smollm2):
    _, selection = corpus.train_and_heldout(None, "text", 0.05, "selection")
    _, report = corpus.train_and_heldout(None, "text", 0.05, "report")
    held = corpus.read_documents(smollm2.heldout_text)
    assert selection + report == held and len(selection) == len(held) // 2 and not set(selection) & set(report)


def test_one_held_out_document_cannot_make_two_splits(tmp_path):
    (tmp_path / "t.txt").write_text("one\n\ntwo\n\nthree\n")
    with pytest.raises(corpus.CorpusError) as e:
        corpus.train_and_heldout(str(tmp_path / "t.txt"), "text", 0.2)
    assert str(e.value) == (
        f"data.source {tmp_path / 't.txt'} holds 1 held-out document(s); two disjoint held-out splits (selection, "
        "report) need at least 2: raise data.heldout_fraction or give more documents"
    )


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], "d.jsonl:2 is not valid JSON (Expecting ',' delimiter"),
        (['{"text": "a"}', '"just a string"'], "d.jsonl:2 is a JSON str, not an object; write one object per line"),
        (['{"text": "a"}', '{"text": 3}'], "d.jsonl:2: field 'text' is a int, not text; set data.text_field"),
        (['{"body": "a"}'], "d.jsonl:1 has no field 'text'; set data.text_field"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, lines, message):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(corpus.CorpusError) as e:
        corpus.read_documents(tmp_path / "d.jsonl")
    assert str(e.value).startswith(f"{tmp_path}/{message}")


def test_the_text_is_tokenized_once_for_preflight_and_the_stage(tiny_run_model, tmp_path, monkeypatch):
    """Issue 61: stage 1's and stage 2's preflights (each stage's inputs.py) tokenize data.source into the very
    sequences the stages then read (buffers' training_sequences, batches.finetune_data): one tokenization each, the
    same tensor. A different seed is a new one. A pipeline's check ahead of stage 1 packs stage 2's held-out text and
    one step of its training text alone (the whole of it is not held through stage 1), and the pipeline forgets
    the packings between stages. Planted: without the memo in corpus.pack (each call packs) the stages pack again:
    6 calls, not 3."""
    from conftest import tiny_run_overrides

    from hybrid_scale.config import load_config
    from hybrid_scale.data import corpus
    from hybrid_scale.data.batches import finetune_data
    from hybrid_scale.distill import inputs as distill_inputs
    from hybrid_scale.finetune import inputs as finetune_inputs
    from hybrid_scale.models.converted import load_tokenizer
    from hybrid_scale.run.resolved import Resolved

    calls = []
    real = corpus._pack
    monkeypatch.setattr(corpus, "_pack", lambda *a: calls.append(a[2:]) or real(*a))
    monkeypatch.setattr(corpus, "_PACKED", {})
    cfg = load_config(overrides=tiny_run_overrides(tiny_run_model, tmp_path / "run"))
    r = Resolved.of(cfg)
    distill_inputs.ahead(cfg, r)  # stage 1's preflight (its `now` on the teacher)
    finetune_inputs.check_text(cfg, r, tiny_run_model)  # stage 2's `now` (the teacher's tokenizer: stage 1's keeps it)
    assert len(calls) == 3  # stage 1's sequences; stage 2's training and held-out text
    tokenizer = load_tokenizer(tiny_run_model)
    first = distill_inputs.training_sequences(cfg, tokenizer)  # what stage 1's buffers read
    train, held = finetune_data(cfg, tokenizer, r.derived.stage2_seq_len)  # what stage 2 reads
    assert len(calls) == 3 and first is distill_inputs.training_sequences(cfg, tokenizer)
    assert first.shape == (8, 64) and train.shape[1] == 64 and len(held) == cfg.finetune.heldout_sequences
    finetune_inputs.ahead(cfg, r)  # a pipeline's check: the held-out text kept, one step of training text packed
    assert calls[3:] == [(64, cfg.finetune.global_batch, cfg.seed)]
    corpus.forget()
    cfg.seed += 1
    distill_inputs.training_sequences(cfg, tokenizer)
    assert len(calls) == 5  # another seed: packed anew


def test_a_pipeline_forgets_a_stages_packings_before_the_next_stage(tmp_path, monkeypatch):
    """The packings kept for a stage (its preflight's, read again by the stage) are dropped when it is done: stage 2's
    whole training text is not held while the evaluation runs. Planted: without corpus.forget in the pipeline's loop
    the evaluation sees stage 2's packing."""
    from types import SimpleNamespace

    from hybrid_scale import pipeline
    from hybrid_scale.config import load_config
    from hybrid_scale.data import corpus
    from hybrid_scale.distributed.runtime import Runtime
    from hybrid_scale.run.layout import RunLayout

    seen = {}
    monkeypatch.setattr(corpus, "_PACKED", {})
    monkeypatch.setattr(pipeline, "distill", lambda cfg: corpus._PACKED.update(stage1=None))
    monkeypatch.setattr(pipeline, "finetune", lambda cfg: seen.update(finetune=len(corpus._PACKED)))
    monkeypatch.setattr(pipeline, "evaluate", lambda cfg: seen.update(evaluate=len(corpus._PACKED)))
    cfg = load_config(overrides=[f"run_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    entry = SimpleNamespace(cfg=cfg, rt=Runtime(), layout=RunLayout.of(cfg), signal=SimpleNamespace(raised=False))
    monkeypatch.setattr(pipeline, "record_config", lambda *a: None)
    pipeline._run_stages(entry, ("distill", "finetune", "evaluate"), lambda line: None)
    assert seen == {"finetune": 0, "evaluate": 0}
