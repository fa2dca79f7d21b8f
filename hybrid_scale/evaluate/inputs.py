"""What the evaluation reads from the user, checked where it lives: its model (eval.model, else the run's: readable,
its base present), its text, task data and passkey prompts, and its out_dir. entry.stage_entry has preflight run
`INPUTS.now` before the stage writes its first byte, and a pipeline runs `INPUTS.ahead` (the run's model does not
exist yet: the inputs are checked with its base's tokenizer)."""

from __future__ import annotations

from pathlib import Path

from ..config.schema import Config
from ..data import assets, corpus, passkey
from ..errors import ConfigError
from ..preflight.inputs import StageInputs, check_converted
from ..run.resolved import Resolved
from ..run.sources import check_stage_model, stage_model


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


def now(cfg: Config, r: Resolved) -> None:
    if cfg.eval.model and r.model.converted:
        check_converted(r.model)
    check_eval_inputs(cfg, r, r.model.base)
    check_stage_model(cfg, "evaluate", r.model)


def ahead(cfg: Config, r: Resolved) -> None:
    check_eval_inputs(cfg, r, stage_model(cfg, "evaluate", r.layout).base)


INPUTS = StageInputs(now, ahead)
