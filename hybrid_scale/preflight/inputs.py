"""What preflight checks of every stage's user-supplied inputs before the stage writes its first byte, and how a stage
declares the rest. Each stage checks its own inputs where it lives (distill/inputs.py, finetune/inputs.py,
evaluate/inputs.py, export/inputs.py): a `StageInputs` of two checks, `now` (the stage's own model is there) and
`ahead` (before a pipeline's first stage: what can be checked while the later stages' models do not exist yet).
entry.stage_entry passes the stage's declaration to preflight (plan.preflight / preflight_ahead), which runs the
checks common to every stage (the run directory, the metrics packages) and then the stage's own. Shared here: the
check of a converted model (stage 1/2 output or an export), which three stages read. Each problem is one clear error
naming the thing and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..config.schema import Config
from ..errors import ConfigError, InputError
from ..models import streaming
from ..models.converted import ADAPTER_DIR, CONFIG_NAME, PARAMS_NAME
from ..run.metrics import check_packages
from ..run.resolved import Resolved
from ..run.sources import ModelSource


@dataclass(frozen=True)
class StageInputs:
    """A stage's declaration of what it reads from the user: `now(cfg, resolved)` checks it with the stage's own model
    resolved (resolved.model), `ahead(cfg, resolved)` before a pipeline's first stage (resolved of the pipeline)."""

    now: Callable[[Config, Resolved], None]
    ahead: Callable[[Config, Resolved], None]
    plans_from_model: bool = True  # plan from its model's base (False: from model.path / model.arch, as `plan` does)


def check(cfg: Config, r: Resolved, *checks: Callable[[Config, Resolved], None]) -> None:
    """The checks every stage shares, then `checks` (a stage's `now`, or the `ahead` of every stage still to run)."""
    check_run_dir(cfg)
    check_packages(cfg)
    for stage_check in checks:
        stage_check(cfg, r)


def check_run_dir(cfg: Config) -> None:
    """run_dir must be a directory or not exist yet (nor any of its parents be a file)."""
    path = Path(cfg.run_dir)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(
                f"config key 'run_dir': {p} is a file, not a directory; set run_dir to a directory (it is created "
                "when missing)"
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
