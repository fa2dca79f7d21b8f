"""Component-ablation evaluation: the same model with each attention component on or off, on the paper's tasks,
plus perplexity by position bucket, the LA share, the paired-bootstrap deltas and the verdict.

`evaluate(cfg)` reads the config's `eval` section, writes {out_dir}/results.json, table.md and PNGs (rank 0), and
returns them (results.EvalResults: the file's record). Under torchrun the batches are sharded over ranks (see
loglik); the numbers do not depend on the number of ranks.

The work is cut into cells: one per (mode, task) of the benchmark scoring, one per mode of the perplexity by position
bucket, one for the LA share, one per mode of the passkey and the recall probe (retrieval.py). Rank 0 commits each
finished cell to {out_dir}/cells/<name>.json (`<mode>.<task>`, `perplexity.<mode>`, `la_share`, `passkey.<mode>`,
`recall.<mode>`): its result and
the key it was computed from (the model and its files, the window, dtype, device type, CPU threads and library
versions, the task's items and tokens or the held-out text, and the eval settings that change the numbers). A rerun
loads every cell whose key matches and recomputes the others (logged), so that its results.json equals an
uninterrupted run's apart from timings_s. The cells stay after the run (they are small); delete {out_dir}/cells to
compute everything again. The cells and their keys are in cells.py.

Signals (distributed/requeue.py): USR1/TERM only set a flag; the ranks agree on it at every cell boundary and between
rounds of batches inside a cell (whose work is then dropped); the stage writes the requeue marker and raises Requeue
(the CLI exits EXIT_REQUEUE). {out_dir}/log.txt says which cells were resumed, recomputed or dropped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from .. import measure, tasks
from ..config.schema import Config
from ..data import assets, corpus, passkey
from ..distributed import runtime
from ..entry import Entry, stage_entry
from ..errors import ConfigError
from ..models.converted import base_config, load_tokenizer
from ..preflight import costs, shape
from . import balance, loglik, report, retrieval
from .cells import Cells, count_cells, digest, identity, model_key
from .inputs import INPUTS
from .models import Models
from .results import BeyondWindow, EvalResults, LaShare, ModeScores, Perplexity, Probe, ProbeScore, TaskScore
from .results import deltas as parse_deltas
from .task_requests import Requests


def _heldout_sequences(tokenizer, cfg: Config, held_text: tuple[str, str] | None = None) -> torch.Tensor:
    """The report text (corpus.report_text, read here unless given) as eval.ppl_sequences rows of eval.ppl_seq_len."""
    evaluation = cfg.eval
    text, where = held_text if held_text is not None else corpus.report_text(cfg)
    ids = tokenizer.encode(text)
    n = min(evaluation.ppl_sequences, len(ids) // evaluation.ppl_seq_len)
    if n == 0 and evaluation.ppl_sequences:
        raise ConfigError(
            f"config key 'eval.ppl_seq_len': the {where} has {len(ids)} tokens, fewer than eval.ppl_seq_len = "
            f"{evaluation.ppl_seq_len}; lower it, or give longer text with eval.ppl_text"
        )
    return torch.tensor(ids[: n * evaluation.ppl_seq_len]).view(n, evaluation.ppl_seq_len)


def heldout_record(cfg: Config, where: str) -> dict:
    """Which held-out text chose the checkpoint and which one (`where`, from corpus.report_text) the perplexity is
    reported on (results.json)."""
    return {
        "selection": f"selection half of the held-out documents of {corpus.heldout_source(cfg.data.source)} "
        "(stage 2's held-out loss: best/ and early stopping)",
        "report": where,
    }


def evaluate(cfg: Config) -> EvalResults:
    """The component ablation: every task scored in every mode, the paired-bootstrap deltas and the verdict,
    perplexity by position bucket and the LA share; written to eval/ by rank 0. Resumes from the committed cells;
    raises Requeue after a signal."""
    # preflight, runtime, lock, signal flag (entry.py): a signal stops the ranks at their next check (rounds, cells)
    with stage_entry(cfg, "evaluate", INPUTS) as entry:
        results = _evaluate(entry)
    runtime.barrier(entry.rt)
    return results


def _evaluate(entry: Entry) -> EvalResults:
    """evaluate's work, under the signal flag: the cells in order (loaded or computed), then the report."""
    cfg, rt, source = entry.cfg, entry.rt, entry.model
    evaluation = cfg.eval
    tasks.check_tasks(evaluation.tasks)
    path, converted = source.path, source.converted
    tokenizer = load_tokenizer(source.base)
    models = Models(cfg, source, rt)
    data_dir = Path(evaluation.data_dir) if evaluation.data_dir else assets.require().datasets
    config = base_config(source.base)
    max_len = getattr(config, "max_position_embeddings", 8192)
    requests = {
        task: Requests(task, tasks.build(task, data_dir, evaluation.limit), tokenizer, max_len)
        for task in evaluation.tasks
    }
    held_text = (
        corpus.report_text(cfg) if evaluation.ppl_sequences else None
    )  # read once: recorded here, scored at the end
    window = models.window()
    results = EvalResults(
        model=str(path),
        converted=converted,
        untrained_feature_maps=not converted,
        window=window,
        sinks=models.sinks()[0],
        hybrid_sinks=models.sinks()[1],  # the hybrid's softmax keeps the S sinks: swa_only is then window + sinks
        la_decay=models.la_decay(),  # the LA decays past the window (hybrid and la_only; never the sinks)
        world_size=rt.world,
        tensor_parallel=rt.tp,
        config=OmegaConf.to_container(cfg, resolve=True),
        identity=identity(cfg, source, rt.device),  # what these results describe (the pipeline's "done")
        heldout=heldout_record(cfg, held_text[1]) if held_text else None,
        tasks={task: r.beyond_window(window) for task, r in requests.items()},
        modes={},
        timings_s={},
    )
    common = model_key(cfg, source, window, rt.device)
    cells = Cells(entry, total=count_cells(evaluation, models.sinks()[1]))
    src = Sources(cfg, rt, models, tokenizer, cells, common, held_text)
    try:
        cells.log(_first_line(cfg, config, models))
        for mode in (
            evaluation.modes if evaluation.tasks else ()
        ):  # (eval.tasks=[]: the held-out text and the probe only)
            if twin := models.twin(mode, results.modes):
                results.modes[mode] = results.modes[twin]
                cells.log(f"{mode}: {models.twin_reason(mode, twin)}: its task scores are {twin}'s")
                continue
            t0 = time.perf_counter()
            per_task = {}
            for task in evaluation.tasks:
                name = f"{mode}.{task}"
                key = {
                    **common,
                    "mode": mode,
                    **models.cache_key(mode),
                    "task": task,
                    "limit": evaluation.limit,
                    "data_dir": str(data_dir.resolve()),
                }
                key |= {"batch_size": evaluation.batch_size, "requests": requests[task].digest}
                stop = cells.between_rounds(name)
                cell = cells.result(name, key, partial(_score_task, src, mode, requests[task], stop))
                per_task[task] = TaskScore.from_json(cell)
            avg = sum(per_task[t].metric for t in evaluation.tasks) / len(evaluation.tasks)
            results.modes[mode] = ModeScores(per_task, avg)
            results.timings_s[mode] = time.perf_counter() - t0
        _deltas(results, evaluation.tasks, cfg)
        if models.split:
            results.tensor_parallel_split = dict(models.split)
        t0 = time.perf_counter()
        if evaluation.ppl_sequences:
            _perplexity_and_la_share(results, src)
        results.timings_s["perplexity_and_la_share"] = time.perf_counter() - t0
        probes = ["passkey", "recall"][: 1 + bool(evaluation.recall_pairs)] if passkey.probe_modes(evaluation) else []
        for probe in probes:
            t0 = time.perf_counter()
            _passkey(results, src, probe)
            results.timings_s[probe] = time.perf_counter() - t0
        _verdict(results)
        cells.finish()
    finally:
        cells.metrics.close()  # (idempotent) an error must not lose the events not yet flushed
    if rt.main:
        out_dir = entry.layout.eval
        (out_dir / "results.json").write_text(results.dumps())
        (out_dir / "table.md").write_text(report.table(results))
        report.plots(results, out_dir)
    return results


def _score_task(src: Sources, mode: str, requests: Requests, stop: Callable[[int], bool]) -> dict | None:
    """One (mode, task) cell (Requests.result); None when the ranks stopped on a signal."""
    evaluation, rt = src.cfg.eval, src.rt
    lockstep = evaluation.shard_weights or rt.tp > 1  # every rank joins every forward of sharded or split weights
    how = loglik.Scoring(
        evaluation.batch_size, src.pad_id, lockstep, f"{mode:>10} {requests.task}", evaluation.progress
    )
    mine = loglik.score(src.models.get(mode), requests.groups, how, rt, stop)
    if mine is None:
        return None
    scores: dict[int, tuple[float, bool]] = {}
    for part in runtime.gather_objects(rt, mine):
        scores.update(part)
    return requests.result(scores)


def _deltas(results: EvalResults, names: list[str], cfg: Config) -> None:
    """Rec.% against the base, the paired-bootstrap deltas (hybrid - swa_only, la_only - none) and the verdict."""
    evaluation, m = cfg.eval, results.modes
    if "base" in m:
        base_avg = m["base"].avg
        for r in m.values():
            r.rec = 100.0 * r.avg / base_avg if base_avg else float("nan")

    def correct_of(mode):
        return {t: m[mode].tasks[t].correct for t in names}

    if "hybrid" in m and "swa_only" in m:
        delta = balance.paired_bootstrap(correct_of("hybrid"), correct_of("swa_only"), evaluation.bootstrap, cfg.seed)
        results.delta_swa = parse_deltas(delta)
    if "la_only" in m and "none" in m:
        delta = balance.paired_bootstrap(correct_of("la_only"), correct_of("none"), evaluation.bootstrap, cfg.seed)
        results.delta_la = parse_deltas(delta)
        results.verdict_tasks = balance.verdict(delta["avg"], evaluation.margin)


def _first_line(cfg: Config, config, models) -> str:
    """What this evaluation will compute: its cells, and the passkey probe's modes and estimated time."""
    evaluation = cfg.eval
    cells = count_cells(evaluation, models.sinks()[1])
    what = f"{cells} cells: {len(evaluation.modes)} mode(s) x {len(evaluation.tasks)} task(s)"
    if evaluation.ppl_sequences:
        what += f", perplexity in {len(evaluation.modes)} mode(s)" + (
            ", the LA share" if evaluation.la_share_seq_len else ""
        )
    probe = costs.passkey_estimate(cfg, shape.counts(config.to_dict())["total"], _probe_lead(cfg, models))
    return what + (f"; passkey probe: {probe}" if probe else "; no passkey probe")


def _verdict(results: EvalResults) -> None:
    """The verdict: beyond the window (hybrid vs the strongest mode without LA on held-out text) when measured, else
    the tasks' (la_only - none); `verdict_basis` says which."""
    if results.beyond_window:
        results.verdict, results.verdict_basis = results.beyond_window.verdict, "beyond_window"
    elif results.verdict_tasks is not None:
        results.verdict, results.verdict_basis = results.verdict_tasks, "tasks"


@dataclasses.dataclass
class Sources:
    """What the evaluation's cells read: the config, the ranks, the models, the tokenizer, the cells' store and
    their common key, and the held-out text (read once when the evaluation starts; None without perplexity)."""

    cfg: Config
    rt: runtime.Runtime
    models: Models
    tokenizer: PreTrainedTokenizerBase  # (the base model's)
    cells: Cells
    common: dict
    held_text: tuple[str, str] | None

    @property
    def pad_id(self) -> int:
        """What the batches are padded with: the tokenizer's pad token, else its end of sequence."""
        t = self.tokenizer
        return t.pad_token_id if t.pad_token_id is not None else t.eos_token_id


def _perplexity_and_la_share(results: EvalResults, src: Sources) -> None:
    """The cells of the held-out text: perplexity by position bucket per mode, then the LA share of `hybrid`. Rank 0
    computes them, every rank when the weights are sharded or split (every rank joins every forward)."""
    cfg, rt, models, tokenizer, cells, common, held_text = astuple_shallow(src)
    evaluation = cfg.eval
    here = rt.main or evaluation.shard_weights or rt.tp > 1
    seqs = _heldout_sequences(tokenizer, cfg, held_text) if here else None
    text = {"text": digest(held_text[0]), "ppl_seq_len": evaluation.ppl_seq_len, "buckets": list(evaluation.buckets)}
    buckets = [b for b in evaluation.buckets if b < evaluation.ppl_seq_len] + [evaluation.ppl_seq_len]
    window = results.window
    by_mode, blocks = {}, {}
    for mode in evaluation.modes:
        if twin := models.twin(mode, evaluation.modes[: evaluation.modes.index(mode)]):
            if here:
                by_mode[mode], blocks[mode] = by_mode[twin], blocks[twin]
            cells.log(f"{mode}: {models.twin_reason(mode, twin)}: its perplexity is {twin}'s")
            continue
        key = {**common, **text, "mode": mode, "ppl_sequences": evaluation.ppl_sequences, "format": 2}
        key |= models.cache_key(mode)
        cell = cells.result(f"perplexity.{mode}", key, partial(_perplexity, models, mode, seqs, buckets, window), here)
        if here:
            by_mode[mode], blocks[mode] = cell["buckets"], cell["blocks"]
    if here:
        results.perplexity = Perplexity(evaluation.ppl_seq_len, len(seqs), by_mode)
        b = balance.beyond_window(blocks, window, evaluation.ppl_margin, evaluation.bootstrap, cfg.seed)
        results.beyond_window = BeyondWindow.from_json(b) if b is not None else None
    if evaluation.la_share_seq_len:
        key = {**common, **text, "la_share_seq_len": evaluation.la_share_seq_len}
        share = cells.result("la_share", key, partial(_la_share, models, seqs, cfg, rt), here)
        if here:
            results.la_share = LaShare.from_json(share)


def _perplexity(models: Models, mode: str, seqs: torch.Tensor, buckets: list[int], window: int) -> dict:
    nll = measure.token_nll(models.get(mode), seqs)
    return {"buckets": measure.by_bucket(nll, buckets), "blocks": balance.blocks_beyond(nll, window)}


PASSKEY_TOKENS = 8192  # tokens per forward of the passkey probe (prompts of one length batched up to this)


def astuple_shallow(src: Sources) -> tuple:
    """The fields of `src` in order, not copied (dataclasses.astuple would deep-copy the models)."""
    return tuple(getattr(src, f.name) for f in dataclasses.fields(src))


def _passkey(results: EvalResults, src: Sources, probe: str = "passkey") -> None:
    """The passkey (or recall: data/passkey.py) cells, one per mode of eval.passkey_modes, on seeded prompts whose
    filler is the report text. Rank 0 computes them, every rank when the weights are sharded or split."""
    cfg, rt, models, tokenizer, cells, common, held_text = astuple_shallow(src)
    evaluation = cfg.eval
    here = rt.main or evaluation.shard_weights or rt.tp > 1
    text = (held_text or corpus.report_text(cfg))[0]
    lead = _probe_lead(cfg, models)
    try:
        filler = tokenizer.encode(text)
        args = (tokenizer, filler, evaluation.passkey_distances, evaluation.passkey_trials, cfg.seed)
        if probe == "recall":
            items = passkey.recall_probes(*args, passkey.Recall(evaluation.recall_pairs, lead))
        else:
            items = passkey.probes(*args, lead)
    except ValueError as err:
        raise ConfigError(f"config key 'eval.passkey_distances': {err}") from None
    key = {
        **common,
        "text": digest(text),
        "distances": list(evaluation.passkey_distances),
        "trials": evaluation.passkey_trials,
    }
    key |= {"seed": cfg.seed, "lead": lead, "prompts": digest([p.ids for p in items])}
    key |= {"probe": probe} if probe != "passkey" else {}  # (the passkey cells' keys stay as they were)
    by_mode, modes = {}, passkey.probe_modes(evaluation)
    for mode in modes:
        if twin := models.twin(mode, modes[: modes.index(mode)]):
            by_mode[mode] = by_mode[twin]
            cells.log(f"{mode}: {models.twin_reason(mode, twin)}: its {probe} retrieval is {twin}'s")
            continue
        score = partial(_passkey_mode, models, mode, items, rt, evaluation.progress, probe)
        by_mode[mode] = cells.result(f"{probe}.{mode}", {**key, "mode": mode, **models.cache_key(mode)}, score, here)
    if here:
        digits = passkey.RECALL_DIGITS if probe == "recall" else passkey.DIGITS
        scores = {m: {d: ProbeScore.from_json(s) for d, s in by_d.items()} for m, by_d in by_mode.items()}
        chance = {"exact": 10.0**-digits, "loglik": digits * math.log(0.1)}
        pairs = evaluation.recall_pairs if probe == "recall" else None
        what = (list(evaluation.passkey_distances), evaluation.passkey_trials, digits, chance, scores)
        setattr(results, probe, Probe(*what, retrieval.sanity(by_mode, results.window), pairs))  # .passkey, .recall


def _probe_lead(cfg: Config, models) -> int:
    """Filler tokens before the passkey's needle: at least the model's sink count (no sink may hold the key)."""
    return max(passkey.LEAD, models.sinks()[0])


def _passkey_mode(models: Models, mode: str, items: list, rt, progress: bool, probe: str = "passkey") -> dict:
    with tqdm(total=len(items), desc=f"{mode:>10} {probe}", disable=not (progress and rt.main), unit="prompt") as bar:
        return retrieval.score_probes(models.get(mode), items, rt.device, PASSKEY_TOKENS, bar)


def _la_share(models: Models, seqs: torch.Tensor, cfg: Config, rt) -> dict:
    ids = seqs[:1, : cfg.eval.la_share_seq_len]
    buckets = [b for b in cfg.eval.buckets if b < ids.shape[1]] + [ids.shape[1]]
    result = balance.la_share(models.get("hybrid"), ids.to(rt.device), buckets)
    result["seq_len"] = ids.shape[1]  # (eval.la_share_seq_len, at most the sequence's length: eval.ppl_seq_len)
    if rt.tp > 1:  # each rank measured its own heads: put the tensor-parallel group's heads together, in order
        parts = runtime.gather_objects(rt, result)[: rt.tp]
        for kind in ("share", "effect"):
            for i, by_bucket in result[kind].items():
                for label in by_bucket:
                    by_bucket[label] = [h for part in parts for h in part[kind][i][label]]
        for i in result.get("horizon", {}):  # per layer, one value per KV head
            result["horizon"][i] = [h for part in parts for h in part["horizon"][i]]
        for i, by_bucket in result.get("memories", {}).items():  # each rank's mean over as many heads as the others'
            for label, shares in by_bucket.items():
                by_bucket[label] = {
                    n: sum(part["memories"][i][label][n] for part in parts) / len(parts) for n in shares
                }
    return result
