"""Issue 66: LoLA's self-recall selection WITH rescoring, a token-loop prototype (evaluation only).

Definition (Hedgehog LA): per layer and KV head the decode keeps the window (w), the sinks, a cache of C keys and the
LA state S = sum phi_k(k) v^T, z = sum phi_k(k) over the keys folded so far (with the model's la_decay, as the
shipped decode keeps them). At each step the key leaving the window joins the cache; then EVERY cached key j (the new
one included) is rescored against the CURRENT state (which excludes the cached keys: they are not folded):
    err_j = || v_j - phi_k(k_j)^T S / (phi_k(k_j)^T z + EPS) ||
and, when the cache is over its budget, the lowest-error key is folded into S, z. The attention output is the
shipped hybrid's (one softmax over sinks + window + cache with the LA terms under one normaliser).

How: the whole model runs token by token through the shipped cache decode (cache/recurrent.py `step`, reached via
model(ids[:, t:t+1], cache=..., use_cache=True)) with attention.cache=C, cache_select=self_recall; `step` is wrapped
so that before each step the held cache slots' scores are recomputed against state.kv / state.ksum, and the side's
decode_recall scores the key leaving the window against the same state (instead of self_recall's shadow of every
earlier candidate). The step's own competition then folds the lowest. `--no-rescore` runs the same token loop with
the shipped self_recall (a check against run.py's parallel self_recall@C row). Scoring: evaluate/retrieval.py's
greedy exact match on the teacher-forced logits of the answer positions (here the decode's logits at those steps).

    PYTHONPATH=.:kernels .venv/bin/python -m experiments.cache_selection.rescore --run-dir runs/qs --trials 8 \
        --distances 64 256 --budget 32 [--no-rescore]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybrid_scale.attention.cache import recurrent as cache_rec
from hybrid_scale.attention.hedgehog import cached as hh_cached
from hybrid_scale.attention.hedgehog import part as hh_part
from hybrid_scale.attention.window.naive import EPS
from hybrid_scale.config import load_config
from hybrid_scale.data import corpus, passkey
from hybrid_scale.models.convert import set_cache, set_modes
from hybrid_scale.models.converted import load_converted, load_tokenizer
from hybrid_scale.run.layout import RunLayout
from hybrid_scale.run.sources import probe as probe_source
from hybrid_scale.run.sources import run_model

HERE = Path(__file__).parent
_step = cache_rec.step
RESCORE = {"on": True}
RUN_DISTANCES = [32, 64, 128, 256]  # run.py's: passkey.probes draws them in one seeded stream


def _readout_err(state, v, f):
    """|| v - f^T S / (f^T z + EPS) || against the current LA state; v [B,K,...,Dv], f [B,K,...,F]."""
    acc = state.kv.dtype
    f, v = f.to(acc), v.to(acc)
    if f.dim() == 3:
        num = torch.einsum("bkf,bkfv->bkv", f, state.kv)
        den = (f * state.ksum).sum(-1, keepdim=True)
    else:
        num = torch.einsum("bkcf,bkfv->bkcv", f, state.kv)
        den = (f * state.ksum[:, :, None]).sum(-1, keepdim=True)
    return (v - num / (den + EPS)).norm(dim=-1)


class RescoreSide(hh_cached.SIDE):
    @staticmethod
    def decode_recall(state, v, fk, gates, take):
        return _readout_err(state, v, fk)


def step(state, x, gamma, opts, *, side, attention_mask=None, la_decay=None):
    if RESCORE["on"] and state.cache_k.shape[2] and state.cache_select == "self_recall":
        held = state.cache_pos >= 0
        err = _readout_err(state, state.cache_v, state.cache_fk).float()
        state.cache_score.copy_(torch.where(held, err, state.cache_score))
        side = RescoreSide
    return _step(state, x, gamma, opts, side=side, attention_mask=attention_mask, la_decay=la_decay)


cache_rec.step = step  # extend's token loop
hh_part.cache_step = step  # the part's one-token decode


@torch.no_grad()
def score_loop(model, batch):
    """retrieval.score's (loglik, exact) from a token-by-token decode of the whole prompt."""
    ids = torch.tensor([p.ids for p in batch])
    n = batch[0].answer
    T = ids.shape[1]
    out = model(ids[:, :1], use_cache=True)
    cache, logits = out.cache, [out.logits[:, -1]]
    for t in range(1, T):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else cache
        logits.append(out.logits[:, -1])
    lg = torch.stack(logits, 1)[:, T - n - 1 : T - 1].float()
    target = ids[:, -n:]
    ll = torch.log_softmax(lg, -1).gather(-1, target[..., None])[..., 0].sum(-1)
    exact = (lg.argmax(-1) == target).all(-1)
    return list(zip(ll.tolist(), exact.tolist(), strict=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default="runs/qs")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--distances", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--no-rescore", action="store_true")
    ap.add_argument("--out", default=str(HERE / "out" / "rescore.json"))
    args = ap.parse_args()
    RESCORE["on"] = not args.no_rescore
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = load_config("quickstart.yaml", [f"run_dir={args.run_dir}"])
    path = run_model(RunLayout.of(cfg))
    src = probe_source(path, "eval.model")
    tok = load_tokenizer(src.base)
    model = load_converted(path, torch.float32, "cpu").eval()
    att = src.hybrid_config["attention"]
    lead = max(passkey.LEAD, int(att["sinks"]))
    filler = tok.encode(corpus.report_text(cfg)[0])
    set_modes(model, "hybrid")
    set_cache(model, args.budget, "self_recall")
    name = f"hybrid+self_recall{'' if args.no_rescore else '_rescore'}@{args.budget} (token loop)"
    res = {}
    for d in args.distances:  # one distance at a time: same prompts as run.py's passkey.probes(distances, ...)
        items = [p for p in passkey.probes(tok, filler, RUN_DISTANCES, args.trials, cfg.seed, lead)
                 if p.distance == d]  # fmt: skip
        t0 = time.perf_counter()
        by_len = {}
        for p in items:
            by_len.setdefault(len(p.ids), []).append(p)
        rs = [r for g in by_len.values() for r in score_loop(model, g)]
        res[str(d)] = {"exact": sum(e for _, e in rs) / len(rs), "trials": len(rs),
                       "per_trial": [[round(ll, 4), bool(e)] for ll, e in rs],
                       "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(name, d, res[str(d)], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    allr = json.loads(out.read_text()) if out.is_file() else {}
    allr[name] = res
    out.write_text(json.dumps(allr, indent=1))


if __name__ == "__main__":
    main()
