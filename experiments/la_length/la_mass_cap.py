"""Issue 39 item 1: is the LA's growing mass what makes a hybrid trained at 256 tokens lose past them?

Evaluation only, on a trained run (the quickstart's by default): perplexity by position bucket on held-out sequences of
1024 tokens for base, hybrid, the same hybrid with its LA mass capped at its trained maximum (both LA sums times min(1,
n_train / n_L), n_L the query's LA keys and n_train the most any query had in training), and swa_sinks (the window plus
the sinks, the same model without its LA). If the cap helps past the training length, the mechanism is the one the
formula implies (the LA sums grow with every key past the window). The cap is computed from the chunked path's two parts
of the shared normaliser (hybrid with them, and the same with phi_k = 0 for the window part alone).

    .venv/bin/python -m experiments.la_length.la_mass_cap --run runs/quickstart \
        [--out experiments/la_length/la_mass_cap.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hybrid_scale import measure
from hybrid_scale.attention import backends
from hybrid_scale.attention.hedgehog.chunk import chunk_hybrid_attention
from hybrid_scale.attention.window.naive import EPS
from hybrid_scale.config import load_config
from hybrid_scale.entry import Resolved
from hybrid_scale.evaluate import balance
from hybrid_scale.evaluate.stage import _heldout_sequences
from hybrid_scale.models.convert import set_modes
from hybrid_scale.models.converted import load_base_model, load_converted, load_tokenizer

BUCKETS = [0, 16, 64, 256, 512, 768, 1024]


def la_keys(n: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """n_L: how many LA keys query n (real-token index) of the hybrid has, |P(n) minus S(n)| (sinks: the hybrid's)."""
    return (n - window + 1 - sinks).clamp(min=0)


def capped_backend(n_train: int):
    """The chunked path with both LA sums of the hybrid times min(1, n_train / n_L) (an evaluation-only probe)."""

    def capped(q, k, v, fq, fk, gamma, *, mode, window, sinks, hybrid_sinks=False, **kw):
        kw = {**kw, "window": window, "sinks": sinks, "hybrid_sinks": hybrid_sinks}
        if mode != "hybrid" or kw.get("attention_mask") is not None:
            return chunk_hybrid_attention(q, k, v, fq, fk, gamma, mode=mode, **kw)
        kw.pop("return_denominators", None)
        y, d_e, d_l = chunk_hybrid_attention(q, k, v, fq, fk, gamma, mode=mode, return_denominators=True, **kw)
        y_e = chunk_hybrid_attention(q, k, v, fq, torch.zeros_like(fk), gamma, mode=mode, **kw).float()
        d_e, d_l = d_e[..., None].float(), d_l[..., None].float()
        n_e = y_e * d_e
        n_l = y.float() * (d_e + d_l + EPS) - n_e
        n = torch.arange(q.shape[2], device=q.device)
        cap = (n_train / la_keys(n, window, sinks if hybrid_sinks else 0).clamp(min=1).float()).clamp(max=1.0)
        cap = cap.view(1, 1, -1, 1)
        return ((n_e + cap * n_l) / (d_e + cap * d_l + EPS)).to(q.dtype)

    return capped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/quickstart", help="a trained run directory (its config.yaml and model)")
    p.add_argument("--sequences", type=int, default=2, help="held-out sequences of --length tokens")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--out", default=None, help="write the table (markdown) and its JSON beside it")
    a = p.parse_args(argv)
    run = Path(a.run)
    cfg = load_config(str((run / "config.yaml").resolve()), [f"eval.ppl_sequences={a.sequences}",
                                                             f"eval.ppl_seq_len={a.length}"])  # fmt: skip
    r = Resolved.of(cfg, "evaluate")  # the model `evaluate` reads
    source = r.model
    path, converted = source.path, source.converted
    if not converted:
        raise SystemExit(f"{run}: no trained converted model to read (run the pipeline first)")
    window, sinks, own = cfg.attention.window, cfg.attention.sinks, cfg.attention.hybrid_sinks
    train_len = r.derived.stage2_seq_len
    n_train = int(la_keys(torch.tensor(train_len - 1), window, sinks if own else 0))
    tokenizer = load_tokenizer(source.base)
    seqs = _heldout_sequences(tokenizer, cfg)
    backends.register_backend("capped", capped_backend(n_train))
    nll, times = {}, {}
    base = load_base_model(source.base, torch.float32)
    t0 = time.perf_counter()
    nll["base"] = measure.token_nll(base, seqs)
    times["base"] = time.perf_counter() - t0
    del base
    model = load_converted(path, torch.float32, "cpu", "torch", meta=source.hybrid_config)
    for name, mode, backend in (("hybrid", "hybrid", "torch"), ("hybrid, LA mass capped", "hybrid", "capped"),
                                ("swa_sinks", "swa_sinks", "torch")):  # fmt: skip
        set_modes(model, mode)
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        t0 = time.perf_counter()
        nll[name] = measure.token_nll(model, seqs)
        times[name] = time.perf_counter() - t0
        print(f"{name}: {times[name]:.0f} s", file=sys.stderr, flush=True)
    labels = measure.bucket_labels(BUCKETS)[1:]
    rows = {name: measure.by_bucket(x, BUCKETS) for name, x in nll.items()}
    blocks = {name: balance.blocks_beyond(x, 256) for name, x in nll.items()}
    vs = {}
    for name in ("hybrid", "hybrid, LA mass capped"):
        both = {"hybrid": blocks[name], "swa_sinks": blocks["swa_sinks"]}
        vs[name] = balance.beyond_window(both, 256, 0.02, 1000, cfg.seed)
    head = f"| mode | {' | '.join(labels)} | past 256: vs swa_sinks, NLL gain [95% CI] |"
    lines = [
        f"Run `{run}` (window {window}, {sinks} sinks{' kept by the hybrid' if own else ''}, trained at {train_len} "
        f"tokens: at most {n_train} LA keys per query), {len(seqs)} held-out sequences of {a.length} tokens; "
        "perplexity by position bucket.",
        "",
        head,
        "|" + "---|" * (len(labels) + 2),
    ]
    for name, row in rows.items():
        c = vs.get(name)
        cell = f"{c['ratio']:.2f}x, {c['delta']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]" if c else ""
        lines.append(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in labels) + f" | {cell} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        command = "    .venv/bin/python -m experiments.la_length.la_mass_cap " + " ".join(argv or sys.argv[1:])
        out.write_text(f"# The LA's mass, capped at its trained maximum (issue 39 item 1)\n\n{command}\n\n{table}\n")
        record = {"buckets": rows, "vs_swa_sinks_past_256": vs, "n_train": n_train, "times_s": times}
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
