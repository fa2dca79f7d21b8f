"""The config core: one structured omegaconf config with a section per stage.

`load_config(path, overrides)` reads YAML, applies `key=value` overrides and validates. Any wrong key, type or value
raises one `ConfigError` naming the key and what is allowed. Later stages add fields to their own section.

- schema.py: the dataclasses, one per section, and the allowed values (docs/reference/config.md is generated from it);
- validate.py: the checks of each key and of the combinations that cannot run;
- load.py: YAML files with `defaults:`, overrides, the presets directory.
"""

from ..errors import ConfigError
from .load import PRESETS, attention_settings, load_config
from .schema import (
    DEVICES,
    DTYPES,
    EVAL_MODES,
    EVAL_TASKS,
    JOBS,
    LAUNCHERS,
    OBJECTIVES,
    SSD_GRANULARITY,
    STAGES,
    AttentionConfig,
    Config,
    DataConfig,
    DistillConfig,
    EvalConfig,
    ExportConfig,
    FinetuneConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    SlurmConfig,
    on_gpus,
)
from .validate import validate

__all__ = [
    "ConfigError",
    "PRESETS",
    "attention_settings",
    "load_config",
    "validate",
    "DEVICES",
    "DTYPES",
    "EVAL_MODES",
    "EVAL_TASKS",
    "JOBS",
    "LAUNCHERS",
    "OBJECTIVES",
    "SSD_GRANULARITY",
    "STAGES",
    "AttentionConfig",
    "Config",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "ExportConfig",
    "FinetuneConfig",
    "LaunchConfig",
    "LogConfig",
    "ModelConfig",
    "SlurmConfig",
    "on_gpus",
]
