"""Reading a config: YAML files (after the files their `defaults:` list names), then `key=value` overrides, merged
into the schema and validated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from ..resources import data_dir
from .schema import Config
from .validate import validate


def _explain(e: OmegaConfBaseException, schema) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if type(e).__name__ == "ConfigKeyError":
        parent = key.rsplit(".", 1)[0] if "." in key else None
        node = OmegaConf.select(schema, parent) if parent else schema
        allowed = ", ".join(node.keys()) if isinstance(node, DictConfig) and len(node) else "(none yet)"
        return ConfigError(f"config key '{key}' is not known; allowed here: {allowed}")
    return ConfigError(f"config key '{key}': {msg}")


def _structured(schema, data) -> DictConfig:
    try:
        return OmegaConf.merge(schema, data)
    except OmegaConfBaseException as e:
        raise _explain(e, schema) from None


PRESETS = data_dir("configs")  # the repository's configs/ (in a wheel install, its copy in the package)


def _find(name: str, including: Path | None) -> Path:
    """A file named in `defaults`: relative to the including file, else to the presets directory."""
    candidates = [including.parent / name] if including else [Path(name)]
    candidates.append(PRESETS / name)
    for c in candidates:
        if c.is_file():
            return c
    where = f"in {including}" if including else "on the command line"
    raise ConfigError(
        f"config file {name} named {where} does not exist (looked in {', '.join(str(c.parent) for c in candidates)})"
    )


def _slurm_times_as_written(data: DictConfig, raw) -> None:
    """YAML 1.1 reads an unquoted 24:00:00 as the base-60 integer 86400, which Slurm would take as minutes: keep
    slurm.time and slurm.times values as they are written in the file."""
    slurm = (raw or {}).get("slurm") if isinstance(raw, dict) else None
    if not isinstance(slurm, dict) or "slurm" not in data:
        return
    if isinstance(slurm.get("time"), str):
        data.slurm.time = slurm["time"]
    if isinstance(slurm.get("times"), dict):
        for stage, value in slurm["times"].items():
            if isinstance(value, str):
                data.slurm.times[stage] = value


def _quote_slurm_time(override: str) -> str:
    """`slurm.time=24:00:00` / `slurm.times={export: 2:00:00}` on the command line: the times as written (see
    _slurm_times_as_written), not YAML's base-60 integers."""
    key, _, value = override.partition("=")
    if key.strip() == "slurm.time" or key.strip().startswith("slurm.times."):
        raw = yaml.load(value, Loader=yaml.BaseLoader) if value.strip() else value
        return f"{key}={json.dumps(raw)}" if isinstance(raw, str) else override
    if key.strip() == "slurm.times":
        raw = yaml.load(value, Loader=yaml.BaseLoader)
        return f"{key}={json.dumps(raw)}" if isinstance(raw, dict) else override
    return override


def _compose(path: Path, chain: tuple[Path, ...] = ()) -> list[DictConfig]:
    """The YAML layers of `path`: its `defaults` (in order, recursively), then its own keys."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config files include each other: {' -> '.join(str(p) for p in (*chain, path))}")
    try:
        data = OmegaConf.load(path)
    except Exception as e:  # yaml errors
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, attention:, ...)")
    _slurm_times_as_written(data, yaml.load(path.read_text(), Loader=yaml.BaseLoader))
    layers = []
    defaults = data.pop("defaults", None) or []
    if isinstance(defaults, str) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"config file {path}: 'defaults' must be a list of YAML file names, got {defaults}")
    for name in defaults:
        layers += _compose(_find(name, path), (*chain, path))
    return [*layers, data]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Defaults <- YAML file (after the files its `defaults:` list names, in order) <- `key=value` overrides,
    validated. A file is looked up as given, else in the presets directory (`configs/`)."""
    schema = OmegaConf.structured(Config)
    cfg = schema
    if path is not None:
        path = Path(path)
        if not path.is_file():
            if not (PRESETS / path).is_file():
                raise ConfigError(
                    f"config file {path} does not exist (nor in {PRESETS}): give the path of a YAML file or a preset "
                    "name such as models/llama3-8b.yaml"
                )
            path = PRESETS / path
        for layer in _compose(path):
            cfg = _structured(cfg, layer)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. attention.window=32)")
        try:
            dot = OmegaConf.from_dotlist([_quote_slurm_time(o) for o in overrides])
        except OmegaConfBaseException as e:
            raise ConfigError(f"overrides {list(overrides)} could not be parsed: {e}") from None
        cfg = _structured(cfg, dot)
    return validate(cfg)


def attention_settings(attention: Any) -> DictConfig:
    """A dict or an attention config section -> a validated AttentionConfig."""
    if isinstance(attention, DictConfig) and "attention" in attention:
        attention = attention.attention
    data = OmegaConf.to_container(attention) if isinstance(attention, DictConfig) else dict(attention or {})
    cfg = _structured(OmegaConf.structured(Config), {"attention": data})
    return validate(cfg).attention
