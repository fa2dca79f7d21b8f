"""The evaluation's results as one record (EvalResults), as {out_dir}/results.json holds it: `to_json()` is that file's
object, `EvalResults.load(path)` reads it back. The file carries its schema version (`"schema": SCHEMA`); a file
without one (written before the version existed) is read when its shape is today's, else refused with one line, and
a file of another version is refused. No torch here: the report, the quickstart and the scripts read it cheaply.

Shapes: `tasks` per task (TaskInfo), `modes` per mode (ModeScores: per task a TaskScore, then `avg` and `rec`),
the paired-bootstrap deltas per task and `avg` (Interval), the verdict on the held-out text past the window
(BeyondWindow), perplexity by position bucket (Perplexity), the LA share (LaShare), and the passkey and recall probes
(Probe). `config`, `identity`, `heldout` and `tensor_parallel_split` stay the plain objects their own modules write.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..config.schema import eval_cache, eval_mode
from ..errors import InputError

SCHEMA = 1  # the version of results.json's shape; raise it with every change of the shape
SCHEMA_KEY = "schema"
RERUN = "rerun `hybrid-scale evaluate` to rewrite it"


class ShapeError(ValueError):
    """A results object whose shape is not this schema's (a key missing or unknown, or of the wrong kind)."""


def _build(cls, d, **parsed):
    """`cls` from the JSON object `d`: each field from its key (`parsed` ones given converted), an absent field with a
    default left at it; a missing required key or an unknown key raises ShapeError."""
    if not isinstance(d, dict):
        raise ShapeError(f"{cls.__name__} is not an object")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ShapeError(f"unknown key {unknown[0]!r} in {cls.__name__}")
    _require(cls, d)
    return cls(**{name: parsed[name] if name in parsed else d[name] for name in names if name in d or name in parsed})


def _require(cls, d: dict) -> None:
    """ShapeError naming the first field of `cls` without a default that `d` lacks."""
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING]
    if missing:
        raise ShapeError(f"no {missing[0]!r} in {cls.__name__}")


def _flat(obj, omit_none: tuple[str, ...] = ()) -> dict:
    """The fields of `obj` in order, those named in `omit_none` left out when None."""
    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if not (f.name in omit_none and getattr(obj, f.name) is None)
    }


def _obj(d, what: str) -> dict:
    """`d` when it is a JSON object, else ShapeError naming `what`."""
    if not isinstance(d, dict):
        raise ShapeError(f"{what} is not an object")
    return d


def _each(d, parse, what: str) -> dict:
    """A JSON object's values parsed (a per-task, per-mode or per-distance mapping)."""
    return {k: parse(v) for k, v in _obj(d, what).items()}


@dataclasses.dataclass
class TaskInfo:
    """One task: its reported metric's name (acc or acc_norm), its item count, and the share of scored tokens at
    positions >= each window (the evaluation's, 16 and 64; keyed by the window)."""

    metric: str
    n: int
    beyond_window: dict[int, float]

    def to_json(self) -> dict:
        return _flat(self)

    @classmethod
    def from_json(cls, d) -> TaskInfo:
        beyond = _obj(_obj(d, "TaskInfo").get("beyond_window"), "TaskInfo.beyond_window")
        return _build(cls, d, beyond_window={int(w): s for w, s in beyond.items()})


@dataclasses.dataclass
class TaskScore:
    """One (mode, task) cell: the reported metric and its stderr, the item count, acc and acc_norm, the per-item
    correctness of the reported metric and each item's continuation log-likelihoods."""

    metric: float
    stderr: float
    n: int
    acc: float
    acc_norm: float
    correct: list
    loglik: list[list[float]]

    def to_json(self) -> dict:
        return _flat(self)

    @classmethod
    def from_json(cls, d) -> TaskScore:
        return _build(cls, d)


@dataclasses.dataclass
class ModeScores:
    """One mode's scores: per task (TaskScore), their average, and Rec.% against the base (None without a base).
    In the file the tasks are keys beside `avg` and `rec`."""

    tasks: dict[str, TaskScore]
    avg: float
    rec: float | None = None

    def to_json(self) -> dict:
        rec = {} if self.rec is None else {"rec": self.rec}
        return {**{t: s.to_json() for t, s in self.tasks.items()}, "avg": self.avg, **rec}

    @classmethod
    def from_json(cls, d) -> ModeScores:
        if not isinstance(d, dict) or "avg" not in d:
            raise ShapeError("no 'avg' in a mode's scores")
        tasks = {t: TaskScore.from_json(s) for t, s in d.items() if t not in ("avg", "rec")}
        return cls(tasks, d["avg"], d.get("rec"))


@dataclasses.dataclass
class Interval:
    """A difference and its 95% CI (paired bootstrap): accuracy points / 100 for the tasks, nats per token past the
    window."""

    delta: float
    lo: float
    hi: float

    def to_json(self) -> dict:
        return _flat(self)

    @classmethod
    def from_json(cls, d) -> Interval:
        return _build(cls, d)


def deltas(d) -> dict[str, Interval]:
    """The paired-bootstrap deltas (balance.paired_bootstrap): per task and `avg`."""
    return _each(d, Interval.from_json, "deltas")


@dataclasses.dataclass
class Comparison(Interval):
    """The hybrid against one mode past the window: the NLL gain (Interval) and the perplexity ratio hybrid / mode."""

    ratio: float

    @classmethod
    def from_json(cls, d) -> Comparison:
        return _build(cls, d)


@dataclasses.dataclass
class BeyondWindow(Comparison):
    """The verdict on the held-out text past the window (balance.beyond_window): the hybrid against `against` (the
    strongest mode without LA; the inherited fields), the window, the tokens compared, the margin, each mode's
    perplexity there, the hybrid against swa_only (None when not evaluated) and the verdict."""

    against: str
    window: int
    tokens: int
    margin: float
    perplexity: dict[str, float]
    swa_only: Comparison | None = dataclasses.field(default=None, kw_only=True)
    verdict: str

    def to_json(self) -> dict:
        out = _flat(self, omit_none=("swa_only",))
        if self.swa_only is not None:
            out["swa_only"] = self.swa_only.to_json()
        return out

    @classmethod
    def from_json(cls, d) -> BeyondWindow:
        swa = _obj(d, "BeyondWindow").get("swa_only")
        return _build(cls, d, swa_only=None if swa is None else Comparison.from_json(swa))


@dataclasses.dataclass
class Perplexity:
    """Perplexity by position bucket: the sequence length, the held-out sequences, per mode per bucket label."""

    seq_len: int
    sequences: int
    by_mode: dict[str, dict[str, float]]

    def to_json(self) -> dict:
        return _flat(self)

    @classmethod
    def from_json(cls, d) -> Perplexity:
        return _build(cls, d)


@dataclasses.dataclass
class LaShare:
    """The LA's share of the hybrid's normaliser and its output effect (balance.la_share), per layer, bucket and head,
    on `sequences` sequence(s) of `seq_len` tokens; the learned horizon 1/rho per layer and KV head when it decays;
    each memory's share of the output per layer and bucket (window, sinks, cache, LA; absent in older files)."""

    seq_len: int
    sequences: int
    share: dict[str, dict[str, list[float]]]
    effect: dict[str, dict[str, list[float]]]
    horizon: dict[str, list[float | None]] | None = None
    memories: dict[str, dict[str, dict[str, float]]] | None = None  # layer -> bucket -> {window, sinks, cache, la}

    def to_json(self) -> dict:
        return _flat(self, omit_none=("horizon", "memories"))

    @classmethod
    def from_json(cls, d) -> LaShare:
        return _build(cls, d)


@dataclasses.dataclass
class ProbeScore:
    """One mode at one distance of a probe: exact-match rate, mean answer log-likelihood, trials, and per trial
    [log-likelihood, exact]."""

    exact: float
    loglik: float
    trials: int
    per_trial: list

    def to_json(self) -> dict:
        return _flat(self)

    @classmethod
    def from_json(cls, d) -> ProbeScore:
        return _build(cls, d)


@dataclasses.dataclass
class Probe:
    """The passkey (or recall) probe: its distances, trials per distance, answer digits, chance (exact and loglik),
    per mode per distance (as a string) its ProbeScore, the failed sanity checks, and recall's word pairs."""

    distances: list[int]
    trials: int
    digits: int
    chance: dict[str, float]
    by_mode: dict[str, dict[str, ProbeScore]]
    sanity: list[str]
    pairs: int | None = None

    def to_json(self) -> dict:
        by_mode = {m: {d: s.to_json() for d, s in by_d.items()} for m, by_d in self.by_mode.items()}
        return _flat(self, omit_none=("pairs",)) | {"by_mode": by_mode}

    @classmethod
    def from_json(cls, d) -> Probe:
        by_mode = _obj(_obj(d, "Probe").get("by_mode"), "Probe.by_mode")
        by_mode = {m: _each(by_d, ProbeScore.from_json, "Probe.by_mode") for m, by_d in by_mode.items()}
        return _build(cls, d, by_mode=by_mode)


OPTIONAL = ("delta_swa", "delta_la", "verdict_tasks", "tensor_parallel_split", "la_share", "passkey", "recall")


@dataclasses.dataclass
class EvalResults:
    """An evaluation's results (stage.evaluate; results.json): the model and whether it was converted (else a plain
    model converted on the fly: untrained feature maps), the window, the sinks and whether the hybrid keeps them,
    whether the LA decays, the ranks and tensor-parallel degree, the config, the identity the pipeline compares, the
    held-out text's record, per task and per mode the scores, the stage's timings; then, when measured: the deltas,
    the tasks' verdict, the tensor-parallel split, perplexity and the verdict past the window, the LA share, the
    probes, and the verdict with its basis (beyond_window or tasks). None: not measured (left out of the file; only
    `heldout` is written as null, and `beyond_window` is written, maybe null, whenever `perplexity` is)."""

    model: str
    converted: bool
    untrained_feature_maps: bool
    window: int
    sinks: int
    hybrid_sinks: bool
    la_decay: bool
    world_size: int
    tensor_parallel: int
    config: dict
    identity: dict
    heldout: dict | None
    tasks: dict[str, TaskInfo]
    modes: dict[str, ModeScores]
    timings_s: dict[str, float]
    delta_swa: dict[str, Interval] | None = None
    delta_la: dict[str, Interval] | None = None
    verdict_tasks: str | None = None
    tensor_parallel_split: dict | None = None
    perplexity: Perplexity | None = None
    beyond_window: BeyondWindow | None = None
    la_share: LaShare | None = None
    passkey: Probe | None = None
    recall: Probe | None = None
    verdict: str | None = None
    verdict_basis: str | None = None

    def to_json(self) -> dict:
        """results.json's object: the schema version, then every field in order (see the class for the left out)."""
        out = {SCHEMA_KEY: SCHEMA}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "beyond_window" and self.perplexity is None:
                continue
            if value is None and f.name not in ("heldout", "beyond_window"):
                continue
            if isinstance(value, dict) and f.name in ("tasks", "modes", "delta_swa", "delta_la"):
                value = {k: v.to_json() for k, v in value.items()}
            elif hasattr(value, "to_json"):
                value = value.to_json()
            out[f.name] = value
        return out

    def cached_modes(self) -> list[str]:
        """The modes measured with the cache of exact keys on (`+cache`, cache_only: config.schema.eval_mode), in the
        order they first appear: the tasks', the perplexity's, the probes'."""
        probes = [p.by_mode for p in (self.passkey, self.recall) if p]
        names = [*self.modes, *(self.perplexity.by_mode if self.perplexity else ()), *(m for b in probes for m in b)]
        return [m for m in dict.fromkeys(names) if eval_mode(m)[1]]

    def cache(self) -> tuple[int, str]:
        """The cache those modes ran with, from the config record: (keys per KV head, attention.cache_select)."""
        return eval_cache(self.config), self.config["attention"]["cache_select"]

    def dumps(self) -> str:
        """results.json's text."""
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def from_json(cls, d) -> EvalResults:
        """The record from results.json's object (of this schema, or of no schema when its shape is this one's)."""
        d = {k: v for k, v in _obj(d, "results").items() if k != SCHEMA_KEY}
        _require(cls, d)

        def parsed(name, parse):
            return None if d.get(name) is None else parse(d[name])

        return _build(
            cls,
            d,
            tasks=_each(d.get("tasks"), TaskInfo.from_json, "tasks"),
            modes=_each(d.get("modes"), ModeScores.from_json, "modes"),
            delta_swa=parsed("delta_swa", deltas),
            delta_la=parsed("delta_la", deltas),
            perplexity=parsed("perplexity", Perplexity.from_json),
            beyond_window=parsed("beyond_window", BeyondWindow.from_json),
            la_share=parsed("la_share", LaShare.from_json),
            passkey=parsed("passkey", Probe.from_json),
            recall=parsed("recall", Probe.from_json),
        )

    @classmethod
    def load(cls, path: str | Path) -> EvalResults:
        """The results.json at `path`; InputError (one line naming the file and the fix) for a file that is not
        JSON, of another schema version, or of no version and another shape."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: not readable as an evaluation's results.json ({err}); {RERUN}") from None
        version = d.get(SCHEMA_KEY) if isinstance(d, dict) else None
        if version is not None and version != SCHEMA:
            raise InputError(
                f"{path} has results schema {version!r}; this hybrid_scale reads schema {SCHEMA}: use the "
                f"hybrid_scale that wrote it, or {RERUN}"
            )
        try:
            return cls.from_json(d)
        except (ValueError, TypeError) as err:  # (ShapeError, and a value of the wrong kind)
            if version is None:
                raise InputError(
                    f"{path} was written by an older hybrid_scale (no schema version; {err}); {RERUN}"
                ) from None
            raise InputError(f"{path} is not a schema-{SCHEMA} results.json ({err}); {RERUN}") from None
