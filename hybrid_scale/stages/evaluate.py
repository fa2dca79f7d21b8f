"""Component-ablation evaluation: the same model with each attention component on or off, on the paper's tasks,
plus perplexity by position bucket, the LA share, the paired-bootstrap deltas and the verdict.

`evaluate(cfg)` reads the config's `eval` section, writes {out_dir}/results.json, table.md and PNGs (rank 0), and
returns the results. Under torchrun the batches are sharded over ranks (see loglik); the numbers do not depend on
the number of ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..data import assets, benchmarks, corpus
from ..distributed import runtime
from ..distributed.deepspeed import _import_deepspeed, zero3_config
from ..distributed.parallelize import parallelize
from ..errors import ConfigError
from ..models.convert import convert_model, set_modes, set_window
from ..models.converted import (
    base_config,
    load_base_model,
    load_converted,
    load_tokenizer,
    read_hybrid_config,
)
from . import balance, loglik, report, rundir
from .plan import preflight

BEYOND = (16, 64)  # windows at which the share of scored tokens beyond the window is always reported


class Models:
    """The base model and the converted model, each loaded once, on demand."""

    def __init__(self, cfg, path: Path, converted: bool, device):
        self.cfg, self.path, self.converted, self.device = cfg, path, converted, device
        self.dtype = getattr(torch, cfg.model.dtype)
        self._base = self._hybrid = None
        self.untrained = not converted
        self._zero3 = None
        if cfg.eval.shard_weights:  # load partitioned: no rank ever holds the whole model (ZeRO-3 init while alive)
            from transformers.integrations import HfDeepSpeedConfig

            _import_deepspeed().init_distributed(dist_backend="nccl" if torch.device(device).type == "cuda" else "gloo")
            self._zero3 = HfDeepSpeedConfig(zero3_config(self.dtype))

    def _load_base(self):
        # an export's base architecture: "base" is its softmax model (merged weights)
        return load_base_model(rundir.base_of(self.path, self.converted), self.dtype).to(self.device).eval()

    def _ready(self, model):
        return parallelize(model, zero3=zero3_config(self.dtype))[1] if self.cfg.eval.shard_weights else model

    def get(self, mode: str):
        if mode == "base":
            if self._base is None:
                self._base = self._ready(self._load_base())
            return self._base
        if self._hybrid is None:
            if self.converted:
                model = load_converted(self.path, dtype=self.dtype, device=self.device)
            else:  # a plain model: converted with untrained (identity) feature maps, said so in the report
                model = convert_model(self._load_base(), self.cfg.attention)
            if self.cfg.eval.window is not None:
                set_window(model, self.cfg.eval.window)
            self._hybrid = self._ready(model)
        set_modes(self._hybrid, mode)
        return self._hybrid

    def window(self) -> int:
        if self.cfg.eval.window is not None:
            return self.cfg.eval.window
        if self.converted:
            return read_hybrid_config(self.path)["attention"]["window"]
        return self.cfg.attention.window


def report_text(cfg) -> tuple[str, str]:
    """(text, description) of the held-out text the perplexity and the LA share are reported on: eval.ppl_text, else
    the `report` half of the held-out documents (of data.source, else of the embedded default) -- never the
    `selection` half on which stage 2 chose its checkpoint."""
    e = cfg.eval
    if e.ppl_text:
        path = Path(e.ppl_text)
        if not path.is_file():
            raise ConfigError(
                f"config key 'eval.ppl_text': {path} does not exist; point it at a text file, or leave it unset for "
                "the report half of the held-out text"
            )
        return path.read_text(), f"eval.ppl_text {path}"
    docs = corpus.heldout_documents(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction, "report")
    where = corpus.heldout_source(cfg.data.source)
    return "\n\n".join(docs), f"report half of the held-out documents of {where} ({len(docs)} documents)"


def _heldout_sequences(tokenizer, cfg, held_text: tuple[str, str] | None = None) -> torch.Tensor:
    """The report text (report_text, read here unless given) as eval.ppl_sequences rows of eval.ppl_seq_len."""
    e = cfg.eval
    text, where = held_text if held_text is not None else report_text(cfg)
    ids = tokenizer.encode(text)
    n = min(e.ppl_sequences, len(ids) // e.ppl_seq_len)
    if n == 0 and e.ppl_sequences:
        raise ConfigError(
            f"config key 'eval.ppl_seq_len': the {where} has {len(ids)} tokens, fewer than eval.ppl_seq_len = "
            f"{e.ppl_seq_len}; lower it, or give longer text with eval.ppl_text"
        )
    return torch.tensor(ids[: n * e.ppl_seq_len]).view(n, e.ppl_seq_len)


def heldout_record(cfg, where: str) -> dict:
    """Which held-out text chose the checkpoint and which one (`where`, from report_text) the perplexity is reported
    on (results.json)."""
    return {
        "selection": f"selection half of the held-out documents of {corpus.heldout_source(cfg.data.source)} "
        "(stage 2's held-out loss: best/ and early stopping)",
        "report": where,
    }


def evaluate(cfg) -> dict:
    """The component ablation: every task scored in every mode, the paired-bootstrap deltas and the verdict,
    perplexity by position bucket and the LA share; written to eval/ by rank 0."""
    preflight(cfg, "evaluate")  # the input model, its architecture, memory per rank
    rt = runtime.init(cfg.model.device)
    e = cfg.eval
    benchmarks.check_tasks(e.tasks)
    path, converted = rundir.eval_source(cfg)
    tokenizer = load_tokenizer(rundir.base_of(path, converted))
    models = Models(cfg, path, converted, rt.device)
    data_dir = Path(e.data_dir) if e.data_dir else assets.require().datasets
    items = {task: benchmarks.build(task, data_dir, e.limit) for task in e.tasks}
    max_len = getattr(base_config(rundir.base_of(path, converted)), "max_position_embeddings", 8192)
    requests = Requests(items, tokenizer, max_len)
    held_text = report_text(cfg) if e.ppl_sequences else None  # read once: recorded here, scored at the end
    window = models.window()
    results = {
        "model": str(path),
        "converted": converted,
        "untrained_feature_maps": not converted,
        "window": window,
        "world_size": rt.world,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "heldout": heldout_record(cfg, held_text[1]) if held_text else None,
        "tasks": requests.beyond_window(window),
        "modes": {},
        "timings_s": {},
    }
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for mode in e.modes:
        t0 = time.perf_counter()
        mine = loglik.score(
            models.get(mode),
            requests.groups,
            e.batch_size,
            pad_id,
            rt,
            desc=f"{mode:>10}",
            progress=e.progress,
            lockstep=e.shard_weights,
        )
        scores: dict[int, tuple[float, bool]] = {}
        for part in runtime.gather_objects(rt, mine):
            scores.update(part)
        results["modes"][mode] = requests.per_task(scores)
        results["timings_s"][mode] = time.perf_counter() - t0
    _deltas(results, items, cfg)
    t0 = time.perf_counter()
    if e.ppl_sequences and (rt.main or e.shard_weights):  # sharded weights: every rank joins every forward
        _perplexity_and_la_share(results, models, tokenizer, cfg, rt, held_text)
    results["timings_s"]["perplexity_and_la_share"] = time.perf_counter() - t0
    if rt.main:
        out_dir = rundir.eval_dir(cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out_dir / "table.md").write_text(report.table(results))
        report.plots(results, out_dir)
    runtime.barrier(rt)
    return results


class Requests:
    """Every task item as (context, continuation) requests, grouped by shared context for scoring."""

    def __init__(self, items: dict, tokenizer, max_len: int):
        self.items, requests, self.spans = items, [], {}
        for task, task_items in items.items():
            for j, item in enumerate(task_items):
                self.spans[(task, j)] = (len(requests), len(item.continuations))
                requests += item.requests()
        self.groups = loglik.make_groups(tokenizer, requests, max_len)
        self.lengths = {
            r: (len(g.context), len(c)) for g in self.groups for r, c in zip(g.requests, g.continuations, strict=True)
        }

    def beyond_window(self, window: int) -> dict:
        """Per task: its metric, n, and the share of scored tokens beyond the window (at `window`, 16 and 64)."""
        out = {}
        for task, task_items in self.items.items():
            spans = [self.spans[(task, j)] for j in range(len(task_items))]
            scored = [self.lengths[r] for start, n in spans for r in range(start, start + n)]
            total = sum(k for _, k in scored)
            beyond = {w: sum(max(0, c + k - max(c, w)) for c, k in scored) / total for w in sorted({window, *BEYOND})}
            out[task] = {"metric": benchmarks.REPORTED[task], "n": len(task_items), "beyond_window": beyond}
        return out

    def per_task(self, scores: dict[int, tuple[float, bool]]) -> dict:
        """Per task: the reported metric and its stderr, acc, acc_norm, per-item correctness and log-likelihoods."""
        per_task = {}
        for task, task_items in self.items.items():
            lls, acc, acc_norm = [], [], []
            for j, item in enumerate(task_items):
                start, n = self.spans[(task, j)]
                ll = [scores[r][0] for r in range(start, start + n)]
                c = benchmarks.correct(item, ll)
                lls.append(ll)
                acc.append(c["acc"])
                acc_norm.append(c["acc_norm"])
            per_item = acc if benchmarks.REPORTED[task] == "acc" else acc_norm
            value, stderr = benchmarks.mean_stderr(per_item)
            per_task[task] = {
                "metric": value,
                "stderr": stderr,
                "n": len(task_items),
                "acc": sum(acc) / len(acc),
                "acc_norm": sum(acc_norm) / len(acc_norm),
                "correct": per_item,
                "loglik": lls,
            }
        per_task["avg"] = sum(per_task[t]["metric"] for t in self.items) / len(self.items)
        return per_task


def _deltas(results: dict, items: dict, cfg) -> None:
    """Rec.% against the base, the paired-bootstrap deltas (hybrid - swa_only, la_only - none) and the verdict."""
    e, m = cfg.eval, results["modes"]
    if "base" in m:
        base_avg = m["base"]["avg"]
        for r in m.values():
            r["rec"] = 100.0 * r["avg"] / base_avg if base_avg else float("nan")

    def correct_of(mode):
        return {t: m[mode][t]["correct"] for t in items}

    if "hybrid" in m and "swa_only" in m:
        results["delta_swa"] = balance.paired_bootstrap(
            correct_of("hybrid"), correct_of("swa_only"), e.bootstrap, cfg.seed
        )
    if "la_only" in m and "none" in m:
        results["delta_la"] = balance.paired_bootstrap(correct_of("la_only"), correct_of("none"), e.bootstrap, cfg.seed)
        results["verdict"] = balance.verdict(results["delta_la"]["avg"], e.margin)


def _perplexity_and_la_share(results: dict, models: Models, tokenizer, cfg, rt, held_text) -> None:
    e = cfg.eval
    seqs = _heldout_sequences(tokenizer, cfg, held_text)
    buckets = [b for b in e.buckets if b < e.ppl_seq_len] + [e.ppl_seq_len]
    results["perplexity"] = {
        "seq_len": e.ppl_seq_len,
        "sequences": len(seqs),
        "by_mode": {mode: balance.perplexity_by_bucket(models.get(mode), seqs, buckets) for mode in e.modes},
    }
    if e.la_share_seq_len:
        ids = seqs[:1, : e.la_share_seq_len]
        share_buckets = [b for b in e.buckets if b < ids.shape[1]] + [ids.shape[1]]
        results["la_share"] = balance.la_share(models.get("hybrid"), ids.to(rt.device), share_buckets)
