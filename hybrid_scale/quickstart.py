"""`make quickstart` -> `hybrid-scale quickstart`: the whole pipeline on the embedded default (SmolLM2-135M-Instruct)
on CPU: assets -> stage 1 (LoLCATs' hybrid-output transfer, window 16) -> stage 2 (LoRA) -> evaluation (base and
five modes: perplexity by position on held-out text, passkey retrieval, PIQA and ARC-Easy items; the verdict on the
tokens beyond the window) -> export. Budgets come from configs/quickstart.yaml (about 10 minutes from a fresh clone on
2 cores, docs/results/quickstart.md); `make reproduce` compares the recipes at a larger budget.
"""

from __future__ import annotations

import time
from pathlib import Path

from .config import load_config
from .config.schema import CACHE, eval_mode
from .data import assets
from .evaluate.results import EvalResults, Probe
from .pipeline import pipeline
from .run.layout import RunLayout
from .run.metrics import tensorboard_on


def main(run_dir: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    t0 = time.perf_counter()
    print(
        "hybrid_scale quickstart: SmolLM2-135M -> hybrid (SWA + linear attention) on CPU, small budgets (configs/"
        "quickstart.yaml)"
    )
    extra = [*([f"run_dir={run_dir}"] if run_dir else []), *overrides]
    cfg = load_config("quickstart.yaml", extra)
    if cfg.model.path is None:
        assets.prepare()  # converts and caches the embedded default once (about a minute)
    layout = RunLayout.of(cfg)
    if tensorboard_on(cfg):  # each stage writes its events under its directory: one logdir shows them all
        print(f"TensorBoard (while it runs, from another shell): tensorboard --logdir {layout.run_dir.resolve()}")
    timings = pipeline(cfg)
    eval_dir = layout.eval
    results = EvalResults.load(eval_dir / "results.json")
    print("\n" + (eval_dir / "table.md").read_text())
    print(summary(results))
    if (eval_dir / "long_context.png").is_file():
        print(f"Figure (retrieval and perplexity past the window): {(eval_dir / 'long_context.png').resolve()}")
    print("Stage times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    print(f"Total {(time.perf_counter() - t0) / 60:.1f} min. Run directory: {layout.run_dir.resolve()}")
    print(f"Export (load with trust_remote_code=True): {layout.export.resolve()}")
    print(CAVEAT.format(sequences=cfg.data.num_sequences, steps=cfg.finetune.max_steps))
    return 0


CAVEAT = """\
Scale of this run: {sequences} training sequences for stage 1 and {steps} LoRA steps, on CPU. The verdict rests on
the held-out text beyond the window, where a hybrid can differ from its sliding window; the task accuracies rest on a
few items each and their CIs are wide. The comparison of recipes at a larger budget is `make reproduce`."""


def summary(r: EvalResults) -> str:
    """The verdict with the figures it rests on, and the passkey retrieval beyond the window, in a few lines."""
    lines = [f"Verdict on the linear attention: {r.verdict if r.verdict is not None else 'n/a'}"]
    b = r.beyond_window
    if b:
        ppl = b.perplexity
        vs = [m for m in ("swa_only", b.against, "swa_sinks") if m in ppl and m != "hybrid"]
        lines.append(
            f"  beyond the window ({b.tokens} held-out tokens at positions >= {b.window}): perplexity hybrid "
            f"{ppl['hybrid']:.1f}, " + ", ".join(f"{m} {ppl[m]:.1f}" for m in dict.fromkeys(vs))
        )
        if r.hybrid_sinks:
            lines.append(f"  (the hybrid keeps the first {r.sinks} tokens: its swa_only is swa_sinks)")
        rows = [("swa_only", b.swa_only)] if b.swa_only else []
        rows += [(b.against, b)] if b.against != "swa_only" else []
        for name, c in rows:
            lines.append(
                f"  hybrid vs {name}: {c.ratio:.2f}x its perplexity, NLL gain {c.delta:+.3f} nats/token "
                f"[{c.lo:+.3f}, {c.hi:+.3f}] (95% CI)"
            )
    elif r.verdict_tasks is not None:
        lines.append("  on the tasks (la_only - none); no held-out perplexity was measured")
    probes = {probe: p for probe, p in (("passkey", r.passkey), ("recall", r.recall)) if p}
    if any(eval_mode(m)[1] for p in probes.values() for m in p.by_mode):
        lines += retrieval_with_cache(r, probes)
    else:
        for probe, p in probes.items():
            far = [d for d in p.distances if d >= r.window]
            if far:
                cells = ", ".join(f"{m} {v:.0f}%" for m, v in beyond(p, far).items())
                lines.append(f"  {probe} exact match at distances {far} (beyond the window): {cells}")
    for probe, p in probes.items():
        for problem in p.sanity:
            lines.append(f"  {probe} probe check failed: {problem}")
    return "\n".join(lines)


def beyond(p: Probe, far: list[int]) -> dict[str, float]:
    """Each mode's exact match of probe `p` (%), averaged over the distances `far`."""
    return {m: 100 * sum(by_d[str(d)].exact for d in far) / len(far) for m, by_d in p.by_mode.items()}


def retrieval_with_cache(r: EvalResults, probes: dict[str, Probe]) -> list[str]:
    """The probes' exact match beyond the window, one line per mode: without and with the cache of exact keys side by
    side (`hybrid+cache` on hybrid's line; cache_only has no value without it; a mode run one way only, one value)."""
    far = [d for d in next(iter(probes.values())).distances if d >= r.window]
    if not far:
        return []
    keys, select = r.cache()
    exact = {probe: beyond(p, far) for probe, p in probes.items()}
    rows = dict.fromkeys(m.removesuffix(CACHE) for p in probes.values() for m in p.by_mode)
    lines = [
        f"  {' and '.join(probes)} exact match at distances {far} (beyond the window), without / with the cache "
        f"({keys} keys per KV head, chosen by {select}):"
    ]
    for mode in rows:
        cells = []
        for probe, e in exact.items():
            off, on = (None, e.get(mode)) if eval_mode(mode)[1] else (e.get(mode), e.get(mode + CACHE))
            pair = [f"{v:.0f}%" if v is not None else "-" for v in (off, on)]
            cells.append(f"{probe} {pair[0] if on is None else ' / '.join(pair)}")
        lines.append(f"    {mode}: {', '.join(cells)}")
    return lines
