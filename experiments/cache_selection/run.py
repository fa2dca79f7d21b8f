"""Issue 66's exploration: which keys should the cache of exact keys keep, and how many per KV head?

On the quickstart's converted + fine-tuned model (configs/quickstart.yaml: Hedgehog, window 16, 8 sinks; stage 1 + 2
only), evaluation only, no training with the cache, teacher-forced forwards (use_cache=False):

* passkey and associative recall (data/passkey.py, evaluate/retrieval.py: needles inside the held-out report text,
  greedy exact match) at distances 2, 4, 8, 16 windows (32, 64, 128, 256 tokens), `--trials` prompts per distance;
* perplexity on the held-out report text, tokens at positions >= the window, with a paired bootstrap CI (16-token
  blocks, evaluate/balance.py's unit) of the NLL difference to the hybrid without a cache.

Configurations (same budget C keys per KV head): the shipped selections (attention, self_recall, recency) in hybrid and
swa_sinks, no cache, cache_only, the base model, and two selections not in the shipped code, patched in here:

* `combo`: attention x self_recall, the product of the two scores' ranks within each (sequence, KV head) (a key kept
  for being both attended and badly predicted by the LA state; rank product, so that neither score's scale matters);
* `perhead`: per-KV-head budgets with the attention score: on calibration passkey prompts that the probes never use
  (another seed, distances 48 / 96 / 192), the full causal softmax of the converted layer's own q, k from the answer
  rows to the needle's tokens gives each KV head a retrieval mass; each layer's 3 C slots are shared as
  C_h = floor + (3 C - 3 floor) * mass_h / sum(mass) (floor C / 4; rounding keeps the layer's total at 3 C).
  select.drop_times takes the [Hkv] budget (attend.drop_times and attend.soft_terms are wrapped to pass it).

LoLA's self-recall *with rescoring* (scores recomputed against the evolving state) has no parallel form: rescore.py
measures it in a token loop.

    PYTHONPATH=.:kernels .venv/bin/python -m experiments.cache_selection.run --run-dir runs/qs [--trials 40]
        [--budgets 8 16 32 64] [--only NAME ...] [--out experiments/cache_selection/out]
    ... run --render          # results.md's table from out/results.json
Each configuration's result is saved as it finishes (out/results.json); a rerun skips the finished ones.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from hybrid_scale.attention.cache import attend
from hybrid_scale.attention.layer import hybrid_layers
from hybrid_scale.config import load_config
from hybrid_scale.data import corpus, passkey
from hybrid_scale.evaluate import balance, retrieval
from hybrid_scale.measure import token_nll
from hybrid_scale.models.convert import set_cache, set_modes
from hybrid_scale.models.converted import load_base_model, load_converted, load_tokenizer
from hybrid_scale.run.layout import RunLayout
from hybrid_scale.run.sources import probe as probe_source
from hybrid_scale.run.sources import run_model

HERE = Path(__file__).parent

# ---------------------------------------------------------------- the patched selections (module doc)
STATE = {"variant": None, "layer": None, "budgets": None, "calib": None}
_scores, _drop_times, _soft_terms = attend.scores, attend.drop_times, attend.soft_terms


def _ranks(p: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim, in (0, 1] (1 = the highest score)."""
    r = p.argsort(-1).argsort(-1).float() + 1
    return r / p.shape[-1]


def scores(part, x, opts, first, *, impl, dense):
    if STATE["calib"] is not None:
        _calibrate(x)
    if STATE["variant"] == "combo":
        a = _scores(part, x, replace(opts, cache_select="attention"), first, impl=impl, dense=dense)
        s = _scores(part, x, replace(opts, cache_select="self_recall"), first, impl=impl, dense=dense)
        return _ranks(a) * _ranks(s)
    return _scores(part, x, opts, first, impl=impl, dense=dense)


def _layer_budget(budget):
    if STATE["variant"] in ("perhead", "fullheads") and not (isinstance(budget, int) and budget == 0):
        return STATE["budgets"][STATE["layer"]]
    return budget


def drop_times(prio, budget, **kw):
    return _drop_times(prio, _layer_budget(budget), **kw)


def soft_terms(q, k, v, drop, budget, **kw):
    return _soft_terms(q, k, v, drop, _layer_budget(budget), **kw)


attend.scores, attend.drop_times, attend.soft_terms = scores, drop_times, soft_terms


def _calibrate(x):
    """Accumulate, per KV head of the current layer, the full causal softmax mass from the answer rows to the
    needle (STATE['calib']: spans [(needle start, end, first answer row, last answer row)] per prompt)."""
    c = STATE["calib"]
    q, k = x[0].float(), x[1].float()
    B, H, T, D = q.shape
    K = k.shape[1]
    kk = k.repeat_interleave(H // K, 1)
    a = (q @ kk.transpose(-1, -2)) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = a.masked_fill(~causal, float("-inf")).softmax(-1)  # [B,H,T,T]
    mass = torch.zeros(K)
    for b, (s0, s1, r0, r1) in enumerate(c["spans"]):
        m = p[b, :, r0:r1, s0:s1].sum(-1).mean(-1)  # [H]
        mass += m.view(K, H // K).mean(-1)
    c["mass"].setdefault(STATE["layer"], torch.zeros(K))
    c["mass"][STATE["layer"]] += mass


def hook_layers(model):
    def pre(mod, args, kwargs=None):
        STATE["layer"] = mod.layer_idx

    for m in hybrid_layers(model).values():
        m.register_forward_pre_hook(pre)


def retrieval_budgets(mass: dict[int, torch.Tensor], C: int) -> dict[int, torch.Tensor]:
    out = {}
    for i, m in mass.items():
        K = m.numel()
        total, floor = K * C, max(1, C // 4)
        share = m / m.sum()
        raw = floor + (total - K * floor) * share
        b = raw.floor().long()
        rest = total - int(b.sum())
        b[(raw - b).argsort(descending=True)[:rest]] += 1
        out[i] = b
    return out


def full_heads(mass: dict[int, torch.Tensor], C: int, length: int) -> tuple[dict[int, torch.Tensor], list]:
    """The ceiling (issue 66 item 5): the C x Hkv x layers keys of a C-key cache spent instead on full attention in
    the k = total // length KV heads of the whole model with the most retrieval mass (calibrate's): budget `length`
    (>= every prompt's length: every key that leaves the window stays exact) there, 0 (plain hybrid) elsewhere."""
    heads = [(float(m[h]), i, h) for i, m in mass.items() for h in range(m.numel())]
    k = (C * len(heads)) // length
    top = sorted(heads, reverse=True)[:k]
    out = {i: torch.zeros(m.numel(), dtype=torch.long) for i, m in mass.items()}
    for _, i, h in top:
        out[i][h] = length
    return out, [(i, h) for _, i, h in top]


def calibrate(model, tok, filler, lead, seed, C, trials):
    """Per-layer retrieval mass per KV head (module doc) from passkey prompts the probes never use."""
    items = passkey.probes(tok, filler, [48, 96, 192], trials, seed + 12345, lead)
    needle_len = len(tok.encode(passkey.NEEDLE.format(key="00000"), add_special_tokens=False)) + 1
    STATE["calib"] = {"mass": {}}
    set_modes(model, "hybrid")
    set_cache(model, C, "attention")
    by_len = {}
    for p in items:
        by_len.setdefault(len(p.ids), []).append(p)
    with torch.no_grad():
        for length, group in by_len.items():
            spans = [(lead, lead + needle_len, length - p.answer - 1, length - 1) for p in group]
            STATE["calib"]["spans"] = spans
            model(torch.tensor([p.ids for p in group]), use_cache=False, logits_to_keep=1)
    mass = STATE["calib"]["mass"]
    STATE["calib"] = None
    return mass


# ---------------------------------------------------------------- the configurations
def configs(budgets: list[int]) -> list[dict]:
    rows = [dict(name="base", model="base"), dict(name="hybrid", mode="hybrid", cache=0),
            dict(name="swa_sinks", mode="swa_sinks", cache=0)]  # fmt: skip
    for C in budgets:
        rows += [
            dict(name=f"hybrid+attention@{C}", mode="hybrid", cache=C, select="attention"),
            dict(name=f"hybrid+self_recall@{C}", mode="hybrid", cache=C, select="self_recall"),
            dict(name=f"hybrid+combo@{C}", mode="hybrid", cache=C, select="attention", variant="combo"),
            dict(name=f"swa_sinks+attention@{C}", mode="swa_sinks", cache=C, select="attention"),
            dict(name=f"hybrid+recency@{C}", mode="hybrid", cache=C, select="recency"),
            dict(name=f"hybrid+perhead@{C}", mode="hybrid", cache=C, select="attention", variant="perhead"),
            dict(name=f"cache_only+attention@{C}", mode="cache_only", cache=C, select="attention"),
            dict(name=f"hybrid+fullheads@{C}", mode="hybrid", cache=C, select="attention", variant="fullheads"),
        ]
    return rows


def order(rows, budgets):
    """32 (the target) first, then the rest, so that a cut-short run has the target's row."""
    first = [r for r in rows if r.get("cache", 0) in (0, 32)]
    return first + [r for r in rows if r not in first]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default="runs/qs")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--distances", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--recall-distances", type=int, nargs="+", default=None, help="default: --distances")
    ap.add_argument("--calib-trials", type=int, default=8, help="calibration prompts per distance (perhead)")
    ap.add_argument("--no-recall", action="store_true", help="passkey only (the budget sweep)")
    ap.add_argument("--ppl-only", nargs="*", default=[], help="configurations scored on perplexity alone")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--ppl-sequences", type=int, default=4)
    ap.add_argument("--ppl-budgets", type=int, nargs="+", default=[32], help="budgets whose rows get perplexity")
    ap.add_argument("--only", nargs="*", help="configuration names (default all)")
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if res_path.is_file() else {}
    if args.render:
        print(render(results, args))
        return
    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = load_config("quickstart.yaml", [f"run_dir={args.run_dir}", f"eval.ppl_sequences={args.ppl_sequences}"])
    path = run_model(RunLayout.of(cfg))
    assert path is not None, f"no converted model in {args.run_dir}"
    src = probe_source(path, "eval.model")
    tok = load_tokenizer(src.base)
    model = load_converted(path, torch.float32, "cpu").eval()
    hook_layers(model)
    att = src.hybrid_config["attention"]
    window, sinks = int(att["window"]), int(att["sinks"])
    lead = max(passkey.LEAD, sinks)
    text = corpus.report_text(cfg)[0]
    filler = tok.encode(text)
    pk = passkey.probes(tok, filler, args.distances, args.trials, cfg.seed, lead)
    rc = passkey.recall_probes(tok, filler, args.recall_distances or args.distances, args.trials, cfg.seed,
                               passkey.Recall(cfg.eval.recall_pairs, lead))  # fmt: skip
    ids = tok.encode(text)
    L = cfg.eval.ppl_seq_len
    n = min(args.ppl_sequences, len(ids) // L)
    seqs = torch.tensor(ids[: n * L]).view(n, L)
    meta = {"path": str(path), "window": window, "sinks": sinks, "lead": lead, "trials": args.trials,
            "distances": args.distances, "recall_distances": args.recall_distances or args.distances, "ppl": [n, L],
            "text_tokens": len(filler)}  # fmt: skip
    results["_meta"] = meta
    print(meta, flush=True)
    budgets_cache = {}
    base = None
    rows = {r["name"]: r for r in configs(args.budgets)}
    todo = [rows[n] for n in args.only] if args.only else order(list(rows.values()), args.budgets)
    for row in todo:
        name = row["name"]
        if name in results:
            continue
        t0 = time.perf_counter()
        STATE["variant"] = row.get("variant")
        if row.get("model") == "base":
            if base is None:
                base = load_base_model(src.base, torch.float32).eval()
            m = base
        else:
            m = model
            set_modes(m, row["mode"])
            set_cache(m, row["cache"], row.get("select"))
            if row.get("variant") == "fullheads":
                C = row["cache"]
                saved = results.get("_perhead", {}).get(str(C), {}).get("mass")
                if saved is not None:  # the same calibration as perhead's (same seed, prompts, C)
                    mass = {int(i): torch.tensor(v) for i, v in saved.items()}
                else:
                    STATE["variant"] = None
                    mass = calibrate(model, tok, filler, lead, cfg.seed, C, args.calib_trials)
                    STATE["variant"] = "fullheads"
                    set_modes(m, row["mode"])
                    set_cache(m, row["cache"], row.get("select"))
                length = max(len(p.ids) for p in pk)
                STATE["budgets"], top = full_heads(mass, C, length)
                results.setdefault("_fullheads", {})[str(C)] = {
                    "length": length,
                    "k": len(top),
                    "heads": top,
                    "total_keys": C * sum(v.numel() for v in mass.values()),
                }
                print("fullheads", results["_fullheads"][str(C)], flush=True)
            if row.get("variant") == "perhead":
                C = row["cache"]
                if C not in budgets_cache:
                    STATE["variant"] = None
                    mass = calibrate(model, tok, filler, lead, cfg.seed, C, args.calib_trials)
                    budgets_cache[C] = retrieval_budgets(mass, C)
                    results.setdefault("_perhead", {})[str(C)] = {
                        "mass": {str(i): v.tolist() for i, v in sorted(mass.items())},
                        "budgets": {str(i): v.tolist() for i, v in sorted(budgets_cache[C].items())},
                    }
                    STATE["variant"] = "perhead"
                    set_modes(m, row["mode"])
                    set_cache(m, row["cache"], row.get("select"))
                STATE["budgets"] = budgets_cache[C]
        if name in args.ppl_only:
            r = {"passkey": {}, "recall": {}}
        else:
            r = {
                "passkey": retrieval.score_probes(m, pk, "cpu", 8192),
                "recall": {} if args.no_recall else retrieval.score_probes(m, rc, "cpu", 8192),
            }
        for probe in ("passkey", "recall"):
            for d in r[probe].values():
                d["per_trial"] = [e for _, e in d["per_trial"]]
        if row.get("cache", 0) in [0, *args.ppl_budgets] or row.get("model") == "base":
            with torch.no_grad():
                nll = token_nll(m, seqs)
            r["blocks"] = balance.blocks_beyond(nll, window)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        STATE["variant"] = None
        results[name] = r
        res_path.write_text(json.dumps(results))
        cells = " ".join(f"{d}:{100 * v['exact']:.0f}" for d, v in r["passkey"].items())
        cells2 = " ".join(f"{d}:{100 * v['exact']:.0f}" for d, v in r["recall"].items())
        print(f"{name:28s} passkey {cells} | recall {cells2} | {r['seconds']} s", flush=True)
    print(render(results, args))


# ---------------------------------------------------------------- the table
def ppl_cell(results, name, ref="hybrid", resamples=2000, seed=0):
    r = results.get(name, {})
    if "blocks" not in r:
        return "", ""
    t = torch.tensor(r["blocks"], dtype=torch.float64)
    ppl = math.exp(t[:, 0].sum() / t[:, 1].sum())
    if name == ref or ref not in results:
        return f"{ppl:.2f}", ""
    h = torch.tensor(results[ref]["blocks"], dtype=torch.float64)
    diff, count = t[:, 0] - h[:, 0], t[:, 1]
    idx = torch.randint(0, len(count), (resamples, len(count)), generator=torch.Generator().manual_seed(seed))
    s = balance._summary((diff.sum() / count.sum()).item(), diff[idx].sum(1) / count[idx].sum(1))
    return f"{ppl:.2f}", f"{s['delta']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}]"


def render(results, args) -> str:
    meta = results.get("_meta", {})
    ds = [str(d) for d in meta.get("distances", args.distances)]
    rs = [str(d) for d in meta.get("recall_distances", ds)]
    head = ("| configuration | " + " | ".join(f"passkey {d}" for d in ds) + " | "
            + " | ".join(f"recall {d}" for d in rs) + " | ppl past w | ΔNLL vs hybrid [95% CI] | s |")  # fmt: skip
    lines = [head, "|" + "---|" * (len(ds) + len(rs) + 4)]
    names = [r["name"] for r in configs(args.budgets)]
    names += [n for n in results if not n.startswith("_") and n not in names]
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        pk = [f"{100 * r['passkey'][d]['exact']:.0f}" if d in r["passkey"] else "–" for d in ds]
        rc = [f"{100 * r['recall'][d]['exact']:.0f}" if d in r["recall"] else "–" for d in rs]
        ppl, delta = ppl_cell(results, name)
        lines.append(f"| {name} | " + " | ".join(pk + rc) + f" | {ppl} | {delta} | {r.get('seconds', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
