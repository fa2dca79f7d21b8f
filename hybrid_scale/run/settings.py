"""Which settings change a result, in one place.

`derive(cfg)` resolves the settings other settings decide (stage 1's objectives and whether gamma trains, stage 2's
recipe, early stopping and sequence length) once, for a stage's whole run. `result_settings` lists, under the
dotted keys a user writes and as they take effect, every setting that changes what stage 1 or stage 2 computes;
stage 1 records it in its manifest, stage 2 in each checkpoint, the pipeline compares the two stages' settings with
the run's recorded config; whether a recorded identity is current is run/identity.py's one rule, for every stage.

Left out, as they do not change what is computed: the number of ranks (stage 1's buffers are per sequence, stage 2
reshards its state), model.device and model.arch (the device moves only rounding; arch is for `plan`), the progress
bars, distill.buffer_dir (where the buffers live, not what they hold), distill.recipe (only through the objectives it
resolves to), distill.query_block and finetune.micro_batch (the same loss summed in other blocks: memory and rounding
only), finetune.gradient_checkpointing and finetune.offload (memory only), finetune.save_every and finetune.keep
(which checkpoints stay on disk) and attention.backend (the same attention computed by another implementation:
rounding only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..config.schema import Config
from ..recipes import RECIPES, Recipe

STAGE1_KEYS = (
    "model.path",
    "model.dtype",
    "seed",
    "data.source",
    "data.text_field",
    "data.heldout_fraction",
    "data.seq_len",
    "data.num_sequences",
    "distill.objectives",
    "distill.train_feature_maps",
    "distill.train_gamma",
    "distill.lr",
    "distill.weight_decay",
    "distill.epochs",
    "distill.batch_size",
    "distill.buffer_dtype",
    "attention",  # every attention.* key but attention.backend
)
STAGE2_KEYS = (
    "finetune.recipe",
    "finetune.lora_r",
    "finetune.lora_alpha",
    "finetune.lora_dropout",
    "finetune.lora_targets",
    "finetune.train_feature_maps",
    "finetune.train_gamma",
    "finetune.train_decay",
    "finetune.lr",
    "finetune.weight_decay",
    "finetune.warmup_steps",
    "finetune.max_steps",
    "finetune.global_batch",
    "finetune.clip",
    "finetune.seq_len",
    "finetune.heldout_sequences",  # the held-out losses: early stopping and best/
    "finetune.eval_every",
    "finetune.early_stopping",
    "finetune.patience",
    "finetune.la_margin",
    "finetune.ssd_schedule",
    "finetune.ssd_windows",
    "finetune.ssd_granularity",
    "seed",
)
ROUNDING_ONLY = ("attention.backend",)


@dataclass(frozen=True)
class Derived:
    """The settings that other settings decide, resolved once per stage."""

    objectives: dict[str, float]  # stage 1: distill.objectives, else the recipe's one objective
    train_gamma: bool  # stage 1: distill.train_gamma, unset = only with a hybrid objective
    recipe: Recipe  # stage 2: finetune.recipe, else distill.recipe
    early_stopping: bool  # stage 2: finetune.early_stopping, else the recipe's default
    stage2_seq_len: int  # stage 2: finetune.seq_len, else data.seq_len


def derive(cfg: Config) -> Derived:
    distill, finetune = cfg.distill, cfg.finetune
    objectives = {k: float(v) for k, v in distill.objectives.items() if v} if distill.objectives else None
    objectives = objectives or {RECIPES[distill.recipe].objective: 1.0}
    gamma = bool(objectives.get("hybrid_output_mse")) if distill.train_gamma is None else bool(distill.train_gamma)
    recipe = RECIPES[finetune.recipe or distill.recipe]
    early = recipe.early_stopping if finetune.early_stopping is None else bool(finetune.early_stopping)
    return Derived(objectives, gamma, recipe, early, finetune.seq_len or cfg.data.seq_len)


def _value(cfg: Config, key: str):
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


CACHE_KEYS = ("attention.cache", "attention.cache_select", "attention.cache_heads")  # the cache of exact keys


def _attention(cfg: Config) -> dict:
    """The attention settings as they change what a stage trains: the cache's only when it trains with the cache
    (attention.cache_train; else it joins after training, and changing it retrains nothing)."""
    container = OmegaConf.to_container(cfg.attention, resolve=True)
    skip = set(ROUNDING_ONLY) | (set() if cfg.attention.cache_train else set(CACHE_KEYS))
    return {f"attention.{k}": v for k, v in container.items() if f"attention.{k}" not in skip}


def data_settings(cfg: Config) -> dict:
    """The text both training stages read (and its held-out split), as it takes effect: the source resolved; the
    embedded default ignores text_field and heldout_fraction."""
    data = cfg.data
    user_source = data.source is not None
    return {
        "data.source": str(Path(data.source).resolve()) if user_source else None,
        "data.text_field": data.text_field if user_source else None,
        "data.heldout_fraction": data.heldout_fraction if user_source else 0.0,
    }


def stage1_settings(cfg: Config, derived: Derived, model: Path | None = None) -> dict:
    """Stage 1's result settings as they take effect (JSON values): the teacher's resolved path (`model`; None
    leaves model.path as written), the data source resolved, the objectives and train_gamma resolved."""
    out = {key: _value(cfg, key) for key in STAGE1_KEYS if key != "attention"}
    out["model.path"] = str(Path(model).resolve()) if model is not None else cfg.model.path
    out |= data_settings(cfg)
    out["distill.objectives"] = derived.objectives
    out["distill.train_gamma"] = derived.train_gamma
    out.update(_attention(cfg))
    return json.loads(json.dumps(out))


def stage2_settings(cfg: Config, derived: Derived, model: Path | None = None) -> dict:
    """Stage 2's result settings, under the names its checkpoints record (the finetune.* keys without their prefix):
    the recipe and sequence length resolved, and `model`, the converted model it fine-tunes (None: not resolved)."""
    out = {key.removeprefix("finetune."): _value(cfg, key) for key in STAGE2_KEYS}
    out["recipe"], out["seq_len"] = derived.recipe.name, derived.stage2_seq_len
    out["early_stopping"] = derived.early_stopping
    out["model"] = str(Path(model).resolve()) if model is not None else None
    out |= data_settings(cfg)  # (the training text and the held-out losses' split)
    if cfg.attention.cache_train:  # stage 2 trains with the cache: a resume must have the same one
        out |= {key: v for key, v in _attention(cfg).items() if key in (*CACHE_KEYS, "attention.cache_train")}
    return json.loads(json.dumps(out))


def run_settings(cfg: Config) -> dict:
    """What the pipeline records and compares on a rerun: both training stages' settings, as configured (no model is
    resolved: the later stages' inputs may not exist yet)."""
    derived = derive(cfg)
    out = stage1_settings(cfg, derived)
    out |= {
        f"finetune.{k}": v
        for k, v in stage2_settings(cfg, derived).items()
        if k not in ("seed", "model") and not k.startswith("data.")
    }
    return out
