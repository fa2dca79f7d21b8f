"""Every user-supplied input of a stage checked before the stage writes its first byte: the run directory, the model
checkpoint (config, index, every shard's header, tokenizer), the training and held-out text, the converted layers,
the evaluation's data and text, and where each stage will write. Each problem is one clear error naming the thing
and the fix; the stages call `check(cfg, stage)` from their preflight, the pipeline for every stage still to run.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..config.schema import Config
from ..data import assets, corpus, passkey
from ..errors import ConfigError, InputError
from ..models import streaming
from ..models.converted import ADAPTER_DIR, CONFIG_NAME, PARAMS_NAME
from ..run.metrics import check_packages
from ..run.resolved import Resolved
from ..run.sources import ModelSource, check_stage_model, stage_model
from ..storage.commits import check_destination, is_export

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_run_dir(cfg: Config) -> None:
    """run_dir must be a directory or not exist yet (nor any of its parents be a file)."""
    path = Path(cfg.run_dir)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(
                f"config key 'run_dir': {p} is a file, not a directory; set run_dir to a directory (it is created "
                "when missing)"
            )


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


def check_converted(model: ModelSource) -> None:
    """A converted model (stage 1/2 output or an export): its files readable, its base present, its adapter whole."""
    path, key = model.path, model.key
    if not model.converted:
        raise InputError(
            f"config key '{key}': {path} is not a converted model (no {CONFIG_NAME}); point it at a stage-1/stage-2 "
            "output or an export (or leave it unset for the run's own model)"
        )
    base = model.base
    if not (base / "config.json").is_file():
        raise InputError(
            f"config key '{key}': the base model {base} named in {path / CONFIG_NAME} is missing; restore it or edit "
            "'base_model' there"
        )
    params = path / PARAMS_NAME
    try:
        with safe_open(params, "pt") as finetune:
            list(finetune.keys())
    except (SafetensorError, OSError) as e:
        raise InputError(f"{params} is not a readable safetensors file ({e}); rerun the stage that wrote it") from None
    adapter = path / ADAPTER_DIR
    if adapter.is_dir():
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not (adapter / name).is_file():
                raise InputError(f"{adapter} lacks {name}; rerun stage 2 or restore it")
        try:
            with safe_open(adapter / "adapter_model.safetensors", "pt") as finetune:
                lora = {k: finetune.get_slice(k).get_shape() for k in finetune.keys()}
        except (SafetensorError, OSError) as e:
            raise InputError(f"{adapter / 'adapter_model.safetensors'} is not readable ({e}); rerun stage 2") from None
        check_adapter_fits(adapter, lora, base, key)


def check_adapter_fits(adapter: Path, lora: dict[str, list[int]], base: Path, key: str) -> None:
    """Every LoRA pair adapts a weight the base has, with its shape (from the headers alone)."""
    where = streaming.shard_map(base, key)
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, shape in lora.items():
        module, kind = name.removeprefix("base_model.model.").rsplit(".lora_", 1)
        pairs.setdefault(f"{module}.weight", {})[kind.split(".")[0]] = shape
    for name, p in sorted(pairs.items()):
        if name not in where:
            raise InputError(
                f"config key '{key}': the adapter in {adapter} adapts {name}, which the base model {base} does not "
                "have: it was trained on another model; use the stage-2 output made from this base"
            )
        with safe_open(base / where[name], "pt") as finetune:
            shape = list(finetune.get_slice(name).get_shape())
        delta = [p.get("B", [0])[0], p.get("A", [0, 0])[-1]]
        if delta != shape:
            raise InputError(
                f"config key '{key}': the adapter in {adapter} gives {name} a delta of shape {delta} but the base "
                f"model {base} holds {shape}: it was trained on another model; use the stage-2 output made from "
                "this base"
            )


def check_training_text(cfg: Config, tokenizer_dir: Path | None, stage: str) -> None:
    """data.source parses (every line of a JSONL, the text field), and yields what the stage asks of it."""
    from transformers import AutoTokenizer

    d = cfg.data
    if stage == "distill":
        docs = corpus.read_documents(d.source, d.text_field)
        if d.source:
            docs, _ = corpus.split_documents(docs, d.heldout_fraction)
        if tokenizer_dir is not None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
            corpus.pack(tokenizer, docs, d.seq_len, d.num_sequences, cfg.seed)
    else:  # finetune: the training documents and the selection half of the held-out ones
        train, held = corpus.train_and_heldout(d.source, d.text_field, d.heldout_fraction, "selection")
        if tokenizer_dir is not None:
            finetune = cfg.finetune
            T = finetune.seq_len or d.seq_len
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
            held_ids = corpus.pack(tokenizer, held, T, None, cfg.seed)
            if len(held_ids) < finetune.heldout_sequences:
                raise corpus.CorpusError(
                    f"the held-out text yields {len(held_ids)} sequences of {T} tokens; finetune.heldout_sequences "
                    f"asks for {finetune.heldout_sequences}: lower it or finetune.seq_len, or give more held-out text"
                )
            corpus.pack(tokenizer, train, T, finetune.global_batch, cfg.seed)  # at least one optimizer step's worth


def check_eval_inputs(cfg: Config, r: Resolved, tokenizer_dir: Path) -> None:
    """The evaluation's text, task data, passkey prompts (with the tokenizer in `tokenizer_dir`) and out_dir."""
    evaluation = cfg.eval
    if evaluation.ppl_text and not Path(evaluation.ppl_text).is_file():
        raise ConfigError(
            f"config key 'eval.ppl_text': {evaluation.ppl_text} does not exist; point it at a text file, or leave it "
            "unset for the report half of the held-out text"
        )
    root = Path(evaluation.data_dir) if evaluation.data_dir else None
    if root is not None:
        missing = [t for t in evaluation.tasks if not (root / t).is_dir()]
        if missing:
            raise ConfigError(
                f"config key 'eval.data_dir': {root} has no {', '.join(missing)} dataset(s) (one save_to_disk "
                "directory per task); point eval.data_dir at such a folder, or leave it unset for the embedded "
                "default's (hybrid-scale assets)"
            )
    elif not assets.paths().datasets.is_dir():
        assets.require()  # one clear error saying how to make them
    if passkey.probe_modes(evaluation):
        check_passkey_prompts(cfg, tokenizer_dir)
    out = r.layout.eval
    if out.exists() and not out.is_dir():
        raise ConfigError(f"config key 'eval.out_dir': {out} is a file; set eval.out_dir to a directory")
    if out.is_dir() and any(out.iterdir()) and not ((out / "results.json").is_file() or r.layout.cells.is_dir()):
        raise ConfigError(
            f"config key 'eval.out_dir': {out} is a non-empty directory without an evaluation of ours "
            "(results.json or cells/); nothing was touched: choose a new or empty directory"
        )


def check_passkey_prompts(cfg: Config, tokenizer_dir: Path) -> None:
    """The passkey probe's prompts can be built with the evaluated model's tokenizer (in `tokenizer_dir`): every
    distance fits the tokenizer's question and the held-out text holds enough filler (checked before a pipeline's
    first stage, not after its training)."""
    from transformers import AutoTokenizer

    evaluation = cfg.eval
    try:
        if not (tokenizer_dir / "tokenizer_config.json").is_file():
            return  # a missing or broken model: the model checks name it (this check needs its tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception:
        return
    try:
        filler = tokenizer.encode(corpus.report_text(cfg)[0])  # the text the probe cuts its filler from
        passkey.probes(
            tokenizer, filler, list(evaluation.passkey_distances), 1, cfg.seed, max(passkey.LEAD, cfg.attention.sinks)
        )
    except ValueError as err:
        raise ConfigError(f"config key 'eval.passkey_distances': {err}") from None


def check_export_output(cfg: Config, out: Path, *protected: Path) -> Path:
    """export.out_dir (`out`), refused before any work when writing there could lose data: the input model, its base,
    the run directory or a directory holding one of them, a file, or an existing directory that is not an export of
    ours (a previous export is replaced)."""
    key = "export.out_dir"
    resolved = out.resolve()
    for path in (Path(cfg.run_dir), *protected):
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise ConfigError(
                f"config key '{key}': {out} is or holds {path}, which the export reads or the run keeps; nothing was "
                f"touched: choose a new directory, e.g. export.out_dir={Path(cfg.run_dir) / 'export'}"
            )
    check_destination(out, key, owned=is_export, what="an export written by hybrid_scale")
    return out


def check_la_objectives(cfg: Config, objectives: dict[str, float]) -> None:
    """Stage 1 of a gated_delta LA: no attention weights to transfer, so weights_xent (hedgecats', ssd's and
    la_only's recipe objective) has no meaning; refused with the objectives that do."""
    if cfg.attention.la_kind == "gated_delta" and objectives.get("weights_xent"):
        d = cfg.distill
        via = "distill.objectives" if d.objectives else f"recipe {d.recipe}'s stage-1 objective"
        raise ConfigError(
            f"config key 'distill.objectives': weights_xent ({via}) transfers attention weights, which "
            "attention.la_kind=gated_delta does not have; set distill.objectives={output_mse: 1.0} (the LA alone "
            "matches the teacher's output) or {hybrid_output_mse: 1.0}"
        )


def check(cfg: Config, stage: str, r: Resolved) -> None:
    """The inputs `stage` reads from the user, all checked before it writes anything; r.model is the model it reads
    (run/sources.stage_model)."""
    check_run_dir(cfg)
    check_packages(cfg)
    model = r.model
    if stage == "distill":
        check_la_objectives(cfg, r.derived.objectives)
        config = check_base_model(model.path, "model.path")
        check_layers(cfg, config)
        check_training_text(cfg, model.path, stage)
    elif stage == "finetune":
        check_early_stopping(cfg, r)
        tokenizer_dir = None
        if cfg.finetune.model or model.converted:
            check_converted(model)
            if (model.path / ADAPTER_DIR).exists():
                raise ConfigError(
                    f"config key 'finetune.model': {model.path} already carries a LoRA adapter; export it (merged) "
                    "first and fine-tune the export"
                )
            tokenizer_dir = model.base
        check_training_text(cfg, tokenizer_dir, stage)
    elif stage == "evaluate":
        if cfg.eval.model and model.converted:
            check_converted(model)
        check_eval_inputs(cfg, r, model.base)
    elif stage == "export":  # export.model, else the run's model: readable, base present, adapter fits
        check_stage_model(cfg, stage, model)  # first: nothing else can be checked without it
        check_converted(model)
        check_not_an_export(model.path)
        check_export_output(cfg, r.layout.export, model.path, model.base)
    if stage in ("finetune", "evaluate"):
        check_stage_model(cfg, stage, model)


def check_not_an_export(path: Path) -> None:
    """The export merges a model's adapter into its base's shards; an export's shards are merged already and carry its
    own architecture: refused in one line (it used to fail on the architecture, naming the wrong fix)."""
    config = path / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or [""])[0] if config.is_file() else ""
    if arch.startswith("HybridScale"):
        raise ConfigError(
            f"config key 'export.model': {path} is an export already ({arch}); export from the stage-2 or stage-1 "
            "model it was made from (its model card names it), with the new export.* settings"
        )


def check_early_stopping(cfg: Config, r: Resolved) -> None:
    if r.derived.early_stopping and not cfg.finetune.eval_every:
        raise ConfigError("config key 'finetune.eval_every': early stopping needs held-out evaluations (set it > 0)")


def check_ahead(cfg: Config, stages: list[str], r: Resolved) -> None:
    """Before a pipeline: the inputs of every stage still to run that exist already (the later stages' models do
    not yet), so that a doomed stage stops the run before anything is written."""
    check_run_dir(cfg)
    check_packages(cfg)
    if "distill" in stages:
        check(cfg, "distill", Resolved(r.layout, r.derived, stage_model(cfg, "distill", r.layout)))
    if "finetune" in stages:
        check_early_stopping(cfg, r)
        # stage 2's tokenizer: finetune.model's (when it is there), else the teacher's, which stage 1's output keeps
        given = stage_model(cfg, "finetune", r.layout) if cfg.finetune.model else None
        teacher = stage_model(cfg, "distill", r.layout).path
        check_training_text(cfg, given.base if given is not None and given.exists else teacher, "finetune")
    if "evaluate" in stages:
        check_eval_inputs(cfg, r, stage_model(cfg, "evaluate", r.layout).base)
    if "export" in stages:
        check_export_output(cfg, r.layout.export, *([Path(cfg.export.model)] if cfg.export.model else []))
