"""What stage 1 reads from the user, checked where stage 1 lives: its teacher (model.path: config, every shard's
header, tokenizer), the layers it converts, its objectives, and data.source's training text tokenized into its
sequences. entry.stage_entry has preflight run `INPUTS.now` before the stage writes its first byte, and a pipeline
runs `INPUTS.ahead` before its first stage; the stage then reads the same sequences (`training_sequences`,
tokenized once: data/corpus.pack)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..attention.kinds import kind_of
from ..config.schema import Config
from ..data import corpus
from ..errors import ConfigError, InputError
from ..models import streaming
from ..models.converted import CONFIG_NAME, load_tokenizer
from ..preflight.inputs import StageInputs
from ..run.resolved import Resolved
from ..run.sources import stage_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_base_model(path: Path, key: str) -> dict:
    """A plain Hugging Face model directory (what stage 1 reads as its teacher): not an export, not a converted
    model; config, weights and tokenizer present. Returns its config.json."""
    if not path.exists():
        raise InputError(
            f"config key '{key}': {path} does not exist; set {key} to a local Hugging Face model directory"
        )
    if not path.is_dir():
        raise InputError(f"config key '{key}': {path} is a file; set {key} to the model's directory")
    if (path / CONFIG_NAME).is_file() and not (path / "config.json").is_file():
        ref = json.loads((path / CONFIG_NAME).read_text()).get("base_model", "?")
        raise InputError(
            f"config key '{key}': {path} is a converted model (a stage-1/stage-2 output), not a base model; set {key} "
            f"to its base model ({ref}), or pass it as finetune.model / eval.model / export.model"
        )
    if not (path / "config.json").is_file():
        raise InputError(f"config key '{key}': {path} is not a Hugging Face model directory (no config.json)")
    config = streaming.read_json(path / "config.json", f"restore {path / 'config.json'}")
    if str(config.get("model_type", "")).startswith("hybrid_scale_"):
        raise InputError(
            f"config key '{key}': {path} is a hybrid_scale export, not a base model; set {key} to the plain model "
            "it was made from (evaluate the export with eval.model, or fine-tune it with finetune.model after "
            "converting)"
        )
    if not any((path / t).is_file() for t in TOKENIZER_FILES):
        raise InputError(f"config key '{key}': {path} has no tokenizer files; copy the tokenizer next to the weights")
    streaming.shard_map(path, key)
    return config


def check_layers(cfg: Config, config: dict) -> None:
    n = config.get("num_hidden_layers")
    chosen = cfg.attention.layers
    if chosen is None or n is None:
        return
    bad = sorted(i for i in chosen if i >= n)
    if bad:
        raise ConfigError(
            f"config key 'attention.layers': layer(s) {bad} do not exist; the model has {n} layers (0-{n - 1})"
        )


def check_la_objectives(cfg: Config, objectives: dict[str, float]) -> None:
    """Stage 1's objectives must be ones the LA's kind trains with (attention/kinds.py): the gated delta rule has no
    attention weights to transfer, so weights_xent (hedgecats', ssd's and la_only's recipe objective) has no meaning
    there; refused with the objectives that do."""
    if objectives.get("weights_xent") and "weights_xent" not in kind_of(cfg.attention).objectives:
        d = cfg.distill
        via = "distill.objectives" if d.objectives else f"recipe {d.recipe}'s stage-1 objective"
        raise ConfigError(
            f"config key 'distill.objectives': weights_xent ({via}) transfers attention weights, which "
            "attention.la_kind=gated_delta does not have; set distill.objectives={output_mse: 1.0} (the LA alone "
            "matches the teacher's output) or {hybrid_output_mse: 1.0}"
        )


def training_sequences(cfg: Config, tokenizer) -> torch.Tensor:
    """Stage 1's [data.num_sequences, data.seq_len] token ids: data.source's training documents (the held-out
    fraction left out; all of the embedded default's training text), packed with the run's seed."""
    d = cfg.data
    docs = corpus.read_documents(d.source, d.text_field)
    if d.source:
        docs, _ = corpus.split_documents(docs, d.heldout_fraction)
    return corpus.pack(tokenizer, docs, d.seq_len, d.num_sequences, cfg.seed)


def now(cfg: Config, r: Resolved) -> None:
    check_la_objectives(cfg, r.derived.objectives)
    config = check_base_model(r.model.path, "model.path")
    check_layers(cfg, config)
    training_sequences(cfg, load_tokenizer(Path(r.model.path)))


def ahead(cfg: Config, r: Resolved) -> None:
    now(cfg, Resolved(r.layout, r.derived, stage_model(cfg, "distill", r.layout)))


INPUTS = StageInputs(now, ahead, plans_from_model=False)  # (its model is model.path: planned as `plan` does)
