"""What stage 2 reads from the user, checked where stage 2 lives: its model (finetune.model or stage 1's output:
readable, its base present, no adapter yet), early stopping's evaluations, and data.source's text tokenized into its
training and held-out sequences with its model's tokenizer (`data.batches.finetune_data`, the stage's own call:
tokenized once, data/corpus.pack). entry.stage_entry has preflight run `INPUTS.now` before the stage writes its first
byte, and a pipeline runs `INPUTS.ahead` (before stage 1 there is no stage-1 output: the teacher's tokenizer, which
stage 1's output keeps)."""

from __future__ import annotations

from pathlib import Path

from ..config.schema import Config
from ..data import corpus
from ..data.batches import finetune_data, heldout_data
from ..errors import ConfigError
from ..models.converted import ADAPTER_DIR, load_tokenizer
from ..preflight.inputs import StageInputs, check_converted
from ..run.resolved import Resolved
from ..run.sources import check_stage_model, stage_model


def check_early_stopping(cfg: Config, r: Resolved) -> None:
    if r.derived.early_stopping and not cfg.finetune.eval_every:
        raise ConfigError("config key 'finetune.eval_every': early stopping needs held-out evaluations (set it > 0)")


def check_text(cfg: Config, r: Resolved, tokenizer_dir: Path | None, whole: bool = True) -> None:
    """data.source parses (every line of a JSONL, the text field); with a tokenizer, it yields the held-out sequences
    finetune.heldout_sequences asks for and at least one optimizer step's worth of training sequences. `whole`: the
    stage's own call (batches.finetune_data, whose packing the stage then reads); else (a pipeline, before stage 1:
    the whole text would be held through it) the held-out text and one step's worth of training text alone."""
    d = cfg.data
    if tokenizer_dir is None:
        corpus.train_and_heldout(d.source, d.text_field, d.heldout_fraction, "selection")
        return
    T, batch, tokenizer = r.derived.stage2_seq_len, cfg.finetune.global_batch, load_tokenizer(tokenizer_dir)
    if not whole:
        train_docs, held_docs = corpus.train_and_heldout(d.source, d.text_field, d.heldout_fraction)
        heldout_data(cfg, tokenizer, T, held_docs)
        corpus.pack(tokenizer, train_docs, T, batch, cfg.seed)  # (too few: its error names the count asked for)
        return
    train, _ = finetune_data(cfg, tokenizer, T)
    if len(train) < batch:
        raise corpus.CorpusError(
            f"the training text yields {len(train)} sequences of {T} tokens; one optimizer step takes "
            f"finetune.global_batch = {batch}: lower it or finetune.seq_len, or give more text"
        )


def now(cfg: Config, r: Resolved) -> None:
    check_early_stopping(cfg, r)
    model, tokenizer_dir = r.model, None
    if cfg.finetune.model or model.converted:
        check_converted(model)
        if (model.path / ADAPTER_DIR).exists():
            raise ConfigError(
                f"config key 'finetune.model': {model.path} already carries a LoRA adapter; export it (merged) "
                "first and fine-tune the export"
            )
        tokenizer_dir = model.base
    check_text(cfg, r, tokenizer_dir)
    check_stage_model(cfg, "finetune", model)


def ahead(cfg: Config, r: Resolved) -> None:
    check_early_stopping(cfg, r)
    given = stage_model(cfg, "finetune", r.layout) if cfg.finetune.model else None
    teacher = stage_model(cfg, "distill", r.layout).path
    check_text(cfg, r, given.base if given is not None and given.exists else teacher, whole=False)


INPUTS = StageInputs(now, ahead)
