"""Whether a stage's output is current: the one rule every stage and the pipeline use.

A stage records beside its output the identity of what made it: a flat JSON dict of what its result depends on,
under config-key names (its result settings, the files it read by content, the text, the seed). Each stage builds
its own identity (stage 1: run/settings.stage1_settings in its manifest; stage 2: run/settings.stage2_settings in
each checkpoint's state.json; an evaluation cell: its key, evaluate/cells.py, and the whole evaluation:
evaluate/cells.identity in results.json; the export: export/identity.export_identity in identity.json); this module
compares a recorded one with the one the stage would record now, the same way for all of them:

- `differing(recorded, now)`: the sorted keys whose values differ; a key one side lacks counts as changed (nothing
  says it was the same);
- `changes(recorded, now)`: the same as 'key old -> new' lines, for a refusal that names what changed;
- `is_current(recorded, now)`: the output describes what the stage would make now (nothing recorded: it does not).

A stage whose recorded identity differs either refuses (stages 1 and 2: their work would mix two settings) or runs
again (an evaluation cell, the evaluation and the export in the pipeline).
"""

from __future__ import annotations

import json

_MISSING = object()


def differing(recorded: dict, now: dict) -> list[str]:
    """The sorted keys whose values differ; a key that one side lacks counts as changed."""
    return sorted(k for k in recorded.keys() | now.keys() if recorded.get(k, _MISSING) != now.get(k, _MISSING))


def changes(recorded: dict, now: dict) -> list[str]:
    """'key old -> new' for each key of `differing` ('(not recorded)' for a side that lacks it)."""

    def show(d: dict, key: str) -> str:
        if key not in d:
            return "(not recorded)"
        return d[key] if isinstance(d[key], str) else json.dumps(d[key])

    return [f"{k} {show(recorded, k)} -> {show(now, k)}" for k in differing(recorded, now)]


def is_current(recorded: dict | None, now: dict) -> bool:
    """The recorded identity is the one the stage would record now (compared as JSON holds them)."""
    return recorded is not None and differing(json.loads(json.dumps(recorded)), json.loads(json.dumps(now))) == []
