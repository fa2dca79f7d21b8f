"""The quickstart's conversion, varied: which recipe settings give a hybrid that beats the window + sinks (swa_sinks)
past the window on the embedded default (issue 27's table in docs/results/quickstart.md; issue 39's, the LA's length
terms read out to 1024 tokens with `--long`, in experiments/la_length/la_length.md).

Each variant is configs/quickstart.yaml plus its overrides, run through the real stages (`hybrid-scale distill`,
`finetune`, `evaluate`) in its own run directory, evaluated on the held-out text only (no tasks, no passkey): the
perplexity of hybrid, swa_only (the hybrid without its LA) and swa_sinks per position bucket, the beyond-window
verdict with its paired CI, and the stage times. Runs are kept and a finished variant is not run again.

    .venv/bin/python -m experiments.quickstart_variants.run --out runs/variants [--only NAME ...]
    .venv/bin/python -m experiments.quickstart_variants.run --long --out runs/la_length --only today decay mass ...

With --long each variant is also read on held-out sequences of 1024 tokens (buckets to 1024, the LA share to 1024,
passkey at 64 / 256 / 768 for the hybrid and swa_sinks): the quickstart trains at 256 tokens, so the buckets past 256
are lengths it never saw.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hybrid_scale.evaluate.results import EvalResults, Probe

# name -> (what it changes, overrides of configs/quickstart.yaml)
SINKS = ["attention.hybrid_sinks=true"]
EXP = ["attention.gamma_param=exp", "attention.gamma_init=1.0"]
# configs/quickstart.yaml before issue 39 (commit 7d991b3): what the issue-39 variants change
BEFORE_39 = [
    "attention.la_decay=false",
    "data.seq_len=256",
    "data.num_sequences=32",
    "distill.epochs=1",
    "distill.batch_size=4",
    "distill.query_block=128",
    "finetune.seq_len=256",
    "finetune.global_batch=2",
]
DECAY_1024_E4 = [  # decay_1024b1e4: the decay; stage 1 on 8 x 1024 tokens, one a step, 4 epochs; stage 2 on 1 x 1024
    *BEFORE_39,
    "attention.la_decay=true",
    "data.seq_len=1024",
    "data.num_sequences=8",
    "distill.query_block=1024",
    "distill.batch_size=1",
    "distill.epochs=4",
    "finetune.seq_len=1024",
    "finetune.global_batch=1",
]
DELTA = [  # issue 59: the quickstart with the gated delta-rule LA in place of Hedgehog + decay
    "attention.la_kind=gated_delta",
    "attention.la_decay=false",
    "attention.la_decay_max_horizon=0",
    "attention.gamma_init=1.0",
    "attention.la_combine=normaliser",  # (the variants name the mix where they take it)
]
VARIANTS = {
    # configs/quickstart.yaml as it is now (window 16, the hybrid's sinks, exp gamma from 30, the LA's decay, 1024-token
    # training); issue 27's variants below were written against the quickstart of their time (no sinks, sigmoid gamma):
    # on today's they change less than their labels say (experiments/quickstart_variants/README.md)
    "lolcats": ("today's quickstart (configs/quickstart.yaml, no overrides)", []),
    "sinks": ("+ the hybrid keeps the 8 sinks (trained with them)", SINKS),
    "sinks_exp": ("+ sinks, gamma = exp(theta) (unbounded), init 1", SINKS + EXP),
    "sinks_exp_g2": ("+ sinks, exp gamma, and stage 2 trains gamma", [*SINKS, *EXP, "finetune.train_gamma=true"]),
    "sinks_exp_512": (
        "+ sinks, exp gamma, gamma trained in stage 2, stage 2 at 512 tokens (the evaluated length)",
        [*SINKS, *EXP, "finetune.train_gamma=true", "finetune.seq_len=512"],
    ),
    "sinks_exp_all_512": (
        "+ sinks, exp gamma trained in stage 2, stage 1 and 2 at 512 tokens (16 x 512 in stage 1: the same tokens)",
        [
            *SINKS,
            *EXP,
            "finetune.train_gamma=true",
            "finetune.seq_len=512",
            "data.seq_len=512",
            "data.num_sequences=16",
        ],
    ),
    "sinks_exp10": (
        "+ sinks, gamma = exp(theta) initialised at 10 (the window first; training lowers it)",
        [*SINKS, "attention.gamma_param=exp", "attention.gamma_init=10.0"],
    ),
    "sinks_exp30": (
        "+ sinks, gamma = exp(theta) initialised at 30",
        [*SINKS, "attention.gamma_param=exp", "attention.gamma_init=30.0"],
    ),
    # issue 39: the LA's decay, on the quickstart as it was before it (BEFORE_39); "quickstart": configs/quickstart.yaml
    "today": ("the quickstart before issue 39 (8 sinks, exp gamma from 30, trained at 256)", [*BEFORE_39]),
    "decay": ("+ attention.la_decay (rho per KV head, from 0)", [*BEFORE_39, "attention.la_decay=true"]),
    "decay_512": (
        "+ la_decay, stage 1 and 2 at 512 tokens (16 x 512 in stage 1: the same tokens)",
        [*BEFORE_39, "attention.la_decay=true", "data.seq_len=512", "data.num_sequences=16", "finetune.seq_len=512"],
    ),
    "decay_1024": (
        "+ la_decay, stage 1 on 8 x 1024 tokens (one query block), stage 2 on 1 x 1024 per step",
        [
            *BEFORE_39,
            "attention.la_decay=true",
            "data.seq_len=1024",
            "data.num_sequences=8",
            "distill.query_block=1024",
            "finetune.seq_len=1024",
            "finetune.global_batch=1",
        ],
    ),
    "decay_1024b1": (
        "+ la_decay, stage 1 on 8 x 1024 tokens one sequence per step (8 steps per layer), stage 2 on 1 x 1024",
        [
            *BEFORE_39,
            "attention.la_decay=true",
            "data.seq_len=1024",
            "data.num_sequences=8",
            "distill.query_block=1024",
            "distill.batch_size=1",
            "finetune.seq_len=1024",
            "finetune.global_batch=1",
        ],
    ),
    "decay_1024b1e2": (
        "+ la_decay, stage 1 on 8 x 1024 tokens, one per step, 2 epochs (16 steps a layer), stage 2 on 1 x 1024",
        [
            *BEFORE_39,
            "attention.la_decay=true",
            "data.seq_len=1024",
            "data.num_sequences=8",
            "distill.query_block=1024",
            "distill.batch_size=1",
            "distill.epochs=2",
            "finetune.seq_len=1024",
            "finetune.global_batch=1",
        ],
    ),
    "decay_1024b1e4": (
        "+ la_decay, stage 1 on 8 x 1024 tokens, one per step, 4 epochs (32 steps a layer), stage 2 on 1 x 1024",
        DECAY_1024_E4,
    ),
    "decay_1024b1e4_g2": (
        "decay_1024b1e4, and stage 2 trains gamma too",
        [
            *DECAY_1024_E4,
            "finetune.train_gamma=true",
        ],
    ),
    "decay_1024b1e4_s8": (
        "decay_1024b1e4 with 8 LoRA steps (twice the quickstart's)",
        [
            *DECAY_1024_E4,
            "finetune.max_steps=8",
            "finetune.eval_every=8",
            "finetune.save_every=8",
        ],
    ),
    "decay_512b1": (
        "+ la_decay, stage 1 on 16 x 512 tokens one sequence per step (16 steps per layer), stage 2 on 1 x 512: read "
        "to 2x its training length",
        [
            *BEFORE_39,
            "attention.la_decay=true",
            "data.seq_len=512",
            "data.num_sequences=16",
            "distill.query_block=512",
            "distill.batch_size=1",
            "finetune.seq_len=512",
            "finetune.global_batch=1",
        ],
    ),
    "today_1024": (
        "today's settings, stage 1 on 8 x 1024 tokens (one query block), stage 2 on 1 x 1024 per step",
        [
            *BEFORE_39,
            "data.seq_len=1024",
            "data.num_sequences=8",
            "distill.query_block=1024",
            "finetune.seq_len=1024",
            "finetune.global_batch=1",
        ],
    ),
    "quickstart": ("configs/quickstart.yaml as it is (the decay, stage 1 and 2 on 1024-token sequences)", []),
    "quickstart_h256": (
        "the quickstart with a decay every head starts with: rho = 1/256 at conversion (issue 52)",
        ["attention.la_decay_horizon=256"],
    ),
    "quickstart_h64": (
        "the quickstart with a decay every head starts with: rho = 1/64 at conversion (issue 52)",
        ["attention.la_decay_horizon=64"],
    ),
    "quickstart_max256": (
        "the quickstart with a minimum horizon: every head's rho >= 1/256 (attention.la_decay_max_horizon; issue 52)",
        ["attention.la_decay_max_horizon=256"],
    ),
    "quickstart_max128": (
        "the quickstart with a minimum horizon: every head's rho >= 1/128 (attention.la_decay_max_horizon; issue 52)",
        ["attention.la_decay_max_horizon=128"],
    ),
    "quickstart_max64": (
        "the quickstart with a minimum horizon: every head's rho >= 1/64 (attention.la_decay_max_horizon; issue 52)",
        ["attention.la_decay_max_horizon=64"],
    ),
    "quickstart_h1024": (
        "the quickstart with a decay every head starts with: rho = 1/1024 at conversion (issue 52)",
        ["attention.la_decay_horizon=1024"],
    ),
    # issue 59: the gated delta rule as the linear part (attention/gated_delta/hybrid.py), on the quickstart's schedule
    "delta": (
        "la_kind gated_delta (normaliser: its read-out counts as gamma = exp(theta) keys' worth, from 1), no Hedgehog "
        "decay, hybrid-output transfer",
        DELTA,
    ),
    "delta_mix": (
        "gated_delta as a gated mix of the window's softmax and the LA (mix gate from 0.1)",
        [*DELTA, "attention.la_combine=mix"],
    ),  # fmt: skip
    "delta_conv": (
        "gated_delta (normaliser) with a 4-tap short convolution on q and k",
        [*DELTA, "attention.la_conv=4"],
    ),
    "delta_g01": ("gated_delta (normaliser), gamma from 0.1: the window first", [*DELTA, "attention.gamma_init=0.1"]),
    "delta_out": (
        "gated_delta (normaliser), stage 1 on the LA alone (output_mse: the delta rule matches the teacher's output)",
        [*DELTA, "distill.objectives={output_mse: 1.0}"],
    ),
    "delta_map_out": (
        "gated_delta (normaliser) with a learned q/k map per head (la_qk_map), stage 1 on the LA alone (output_mse)",
        [*DELTA, "attention.la_qk_map=true", "distill.objectives={output_mse: 1.0}"],
    ),
    "delta_map_out_conv": (
        "delta_map_out with a 4-tap convolution on q and k",
        [*DELTA, "attention.la_qk_map=true", "attention.la_conv=4", "distill.objectives={output_mse: 1.0}"],
    ),
    "delta_mix_map": (
        "gated_delta as a gated mix, with a learned q/k map per head (la_qk_map)",
        [*DELTA, "attention.la_combine=mix", "attention.la_qk_map=true"],
    ),
    "delta_mix_conv": (
        "gated_delta as a gated mix, with a 4-tap convolution on q and k",
        [*DELTA, "attention.la_combine=mix", "attention.la_conv=4"],
    ),  # fmt: skip
    "delta_out_mix": (
        "gated_delta as a gated mix, stage 1 on the LA alone (output_mse)",
        [*DELTA, "attention.la_combine=mix", "distill.objectives={output_mse: 1.0}"],
    ),
}
LONG = [  # --long: read to 1024 tokens, 4x the training length
    "eval.ppl_seq_len=1024",
    "eval.buckets=[0,16,64,256,512,768]",
    "eval.la_share_seq_len=1024",
    "eval.passkey_distances=[64,256,768]",
    "eval.passkey_modes=[hybrid,swa_sinks]",
    "eval.modes=[base,hybrid,swa_only,swa_sinks]",
]
RETRIEVAL = [  # --retrieval (issue 59): passkey and associative recall at 1-4 and 8 windows (16) and at 256, every mode
    "eval.passkey_distances=[16,32,48,64,128,256]",
    "eval.passkey_trials=10",
    "eval.passkey_modes=[hybrid,swa_sinks,la_only]",  # (base: the same model in every variant, measured once)
    "eval.modes=[base,hybrid,swa_only,swa_sinks,la_only]",
]
EVAL = [
    "eval.tasks=[]",
    "eval.passkey_distances=[]",
    "eval.modes=[hybrid,swa_only,swa_sinks]",
    "eval.la_share_seq_len=512",
]


def run_variant(name: str, overrides: list[str], out: Path, long: bool = False, retrieval: bool = False) -> dict:
    run = out / name
    done = run / "variant.json"
    if done.is_file():
        return json.loads(done.read_text())
    common = ["quickstart.yaml", f"run_dir={run}", *overrides]
    times = {}
    for stage, extra in (
        ("distill", []),
        ("finetune", []),
        ("evaluate", EVAL + (LONG if long else []) + (RETRIEVAL if retrieval else [])),
    ):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "hybrid_scale", stage, *common, *extra], text=True,
                              capture_output=True)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"{name}: {stage} failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        times[stage] = time.perf_counter() - t0
    r = EvalResults.load(run / "eval" / "results.json")
    b = r.beyond_window

    def exact(probe: Probe | None) -> dict:
        return {m: {d: c.exact for d, c in by.items()} for m, by in probe.by_mode.items()} if probe else {}

    result = {
        "name": name,
        "buckets": r.perplexity.by_mode,
        "beyond": b.perplexity,
        "verdict": r.verdict,
        "vs_swa_only": {k: getattr(b.swa_only, k) for k in ("delta", "lo", "hi", "ratio")} if b.swa_only else None,
        "vs_against": {k: getattr(b, k) for k in ("delta", "lo", "hi", "ratio")} | {"against": b.against},
        "la_share": r.la_share.share if r.la_share else None,
        "passkey": exact(r.passkey),
        "recall": exact(r.recall),
        "times_s": times,
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    labels = [b for b in next(iter(results[0]["buckets"].values())) if not b.startswith("0-")]
    head = ["variant", "what", *(f"hybrid {b}" for b in labels), "hybrid", "swa_only", "swa_sinks",
            "hybrid / swa_sinks, NLL gain [95% CI]", "verdict", "stage 1 / 2 / eval (min)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        a = r["vs_against"]
        vs = f"{a['ratio']:.2f}x, {a['delta']:+.3f} [{a['lo']:+.3f}, {a['hi']:+.3f}]"
        if a["against"] != "swa_sinks":
            vs += f" (vs {a['against']})"
        t = r["times_s"]
        cells = [r["name"], VARIANTS[r["name"]][0], *(f"{r['buckets']['hybrid'][b]:.1f}" for b in labels),
                 *(f"{r['beyond'].get(m, float('nan')):.1f}" for m in ("hybrid", "swa_only", "swa_sinks")), vs,
                 str(r["verdict"]),
                 f"{t['distill'] / 60:.1f} / {t['finetune'] / 60:.1f} / {t['evaluate'] / 60:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_table(results: list[dict]) -> str:
    """--long: per variant, the hybrid's and swa_sinks' perplexity by bucket to 1024, the LA share by bucket, the
    hybrid against swa_sinks past the window, passkey exact match at 64 / 256 / 768, and the stage times."""
    labels = [b for b in next(iter(results[0]["buckets"].values())) if not b.startswith("0-")]
    head = ["variant", "mode", *labels, "past the window: x swa_sinks, NLL gain [95% CI]", "passkey 64/256/768 %",
            "stage 1 / 2 / eval (min)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        a, t = r["vs_against"], r["times_s"]
        vs = f"{a['ratio']:.2f}x, {a['delta']:+.3f} [{a['lo']:+.3f}, {a['hi']:+.3f}]"
        share = r.get("la_share") or {}
        mean = {b: sum(h for layer in share.values() for h in layer.get(b, [])) for b in labels}
        count = {b: sum(len(layer.get(b, [])) for layer in share.values()) for b in labels}
        times = f"{t['distill'] / 60:.1f} / {t['finetune'] / 60:.1f} / {t['evaluate'] / 60:.1f}"
        for mode in ("hybrid", "swa_sinks"):
            cells = [f"{r['buckets'][mode][b]:.1f}" for b in labels]
            keys = r.get("passkey", {}).get(mode, {})
            passkey = "/".join(f"{100 * keys[d]:.0f}" for d in ("64", "256", "768") if d in keys)
            first = [r["name"], mode] if mode == "hybrid" else ["", mode]
            lines.append("| " + " | ".join([*first, *cells, vs if mode == "hybrid" else "", passkey,
                                            times if mode == "hybrid" else ""]) + " |")  # fmt: skip
        shares = [f"{mean[b] / count[b]:.3f}" if count[b] else "" for b in labels]
        lines.append("| | LA share | " + " | ".join(shares) + " | | | |")
    return "\n".join(lines)


def retrieval_table(results: list[dict]) -> str:
    """--retrieval: exact match (%) of the passkey and the associative-recall probe per mode and distance."""
    lines = []
    for r in results:
        for probe in ("passkey", "recall"):
            by = r.get(probe) or {}
            if not by:
                continue
            distances = sorted({int(d) for m in by.values() for d in m})
            head = "| mode | " + " | ".join(map(str, distances)) + " |"
            lines += [f"\n{r['name']}: {probe} exact match (%)", "", head, "|---|" + "---|" * len(distances)]
            for mode, cells in by.items():
                lines.append(f"| {mode} | " + " | ".join(f"{100 * cells[str(d)]:.0f}" for d in distances) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/variants", help="where each variant's run directory goes")
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run only these variants")
    p.add_argument("--long", action="store_true", help="read each variant to 1024 tokens (and passkey to 768)")
    p.add_argument("--retrieval", action="store_true",
                   help="passkey and recall at 16-64, 128 and 256 tokens for every mode (issue 59)")  # fmt: skip
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.only or VARIANTS:
        results.append(run_variant(name, VARIANTS[name][1], out, a.long, a.retrieval))
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(long_table(results) if a.long else table(results))
    if a.retrieval:
        print(retrieval_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
