"""Human outputs: the evaluation's table.md in the paper's Table-1 layout and its PNG figures, and stage 2's
loss curves."""

from __future__ import annotations

from pathlib import Path

from ..config.schema import eval_mode
from ..tasks import TASKS
from .results import BeyondWindow, EvalResults, Interval, LaShare, Probe

NAMES = {name: t.display for name, t in TASKS.items()}  # each task's column


def _ci(d: Interval) -> str:
    return f"{100 * d.delta:+.1f} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]"


def table(r: EvalResults) -> str:
    tasks = list(r.tasks)
    lines = [f"# Component ablation: {r.model}", ""]
    if r.untrained_feature_maps:
        lines += ["**Feature maps untrained** (a plain model converted on the fly): LA numbers are a baseline.", ""]
    if tasks:
        head = ["mode"] + [f"{NAMES[t]} ({r.tasks[t].metric})" for t in tasks] + ["AVG", "Rec.%"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for mode, m in r.modes.items():
            cells = [f"{100 * m.tasks[t].metric:.1f} ± {100 * m.tasks[t].stderr:.1f}" for t in tasks]
            rec = f"{m.rec:.1f}" if m.rec is not None else "-"
            lines.append("| " + " | ".join([mode, *cells, f"{100 * m.avg:.1f}", rec]) + " |")
    n = {t: r.tasks[t].n for t in tasks}
    lines += ["", f"Items per task: {n or 'no tasks'}; window {r.window}; {r.world_size} rank(s)."]
    lines += ["", modes_line(r.window, r.sinks, r.hybrid_sinks, r.la_decay)]
    if r.cached_modes():
        lines += ["", cache_line(r)]
    lines += ["", "Share of scored (continuation) tokens at positions >= window -- on the rest a hybrid *is* its SWA:"]
    for t in tasks:
        shares = ", ".join(f"w={w}: {100 * s:.1f}%" for w, s in r.tasks[t].beyond_window.items())
        lines.append(f"- {NAMES[t]}: {shares}")
    if r.delta_swa is not None or r.delta_la is not None:
        lines += ["", "Paired bootstrap deltas, points, 95% CI (stratified by task):", ""]
        lines += ["| delta | " + " | ".join(NAMES[t] for t in tasks) + " | AVG |", "|" + "---|" * (len(tasks) + 2)]
        for d, name in ((r.delta_swa, "SWA = hybrid - swa_only"), (r.delta_la, "LA = la_only - none")):
            if d is not None:
                lines.append(f"| {name} | " + " | ".join(_ci(d[t]) for t in [*tasks, "avg"]) + " |")
    if r.verdict_tasks is not None:
        margin = r.config["eval"]["margin"]
        basis = "delta LA = la_only - none on the task average"
        lines += ["", f"Tasks: **{r.verdict_tasks}** ({basis}, margin ±{100 * margin:.1f} points)."]
    if r.perplexity is not None:
        p = r.perplexity
        labels = list(next(iter(p.by_mode.values())))
        lines += ["", f"Perplexity by position bucket ({p.sequences} held-out sequences of {p.seq_len} tokens):", ""]
        lines += ["| mode | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for mode, v in p.by_mode.items():
            lines.append(f"| {mode} | " + " | ".join(f"{v[b]:.1f}" for b in labels) + " |")
    if r.beyond_window:
        lines += ["", *beyond_window_lines(r.beyond_window, r.sinks if r.hybrid_sinks else None)]
    if r.passkey:
        lines += ["", *passkey_lines(r.passkey, r.window)]
    if r.recall:
        lines += ["", *passkey_lines(r.recall, r.window, recall=True)]
    if r.verdict is not None:
        basis = {"beyond_window": "held-out text beyond the window", "tasks": "tasks, la_only - none"}
        lines += ["", f"**Verdict: {r.verdict}** (on the {basis[r.verdict_basis]})"]
    if r.la_share is not None:
        s = r.la_share
        lines += ["", f"LA share of the normaliser in `hybrid` (mean over layers and heads, T={s.seq_len}):", ""]
        labels = list(next(iter(s.share.values())))
        lines += ["| | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for values, name in ((s.share, "LA share"), (s.effect, "‖y_hybrid − y_swa_only‖ / ‖y_hybrid‖")):
            vals = [_mean_over(values, b) for b in labels]
            lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
        lines += memory_lines(s)
        lines += horizon_lines(s)
    t = r.timings_s
    lines += ["", "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()), ""]
    return "\n".join(lines)


def memory_lines(s: LaShare) -> list[str]:
    """Each memory's share of the hybrid's output (window, sinks, cache, LA), mean over layers, heads and tokens per
    position bucket."""
    if not s.memories:
        return []
    labels = list(next(iter(s.memories.values())))
    lines = ["", "Each memory's share of the output in `hybrid` (mean over layers, heads and tokens):", ""]
    lines += ["| memory | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for name in ("window", "sinks", "cache", "la"):
        vals = [sum(m[b][name] for m in s.memories.values()) / len(s.memories) for b in labels]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return lines


def horizon_lines(s: LaShare) -> list[str]:
    """The LA's learned decay per layer and KV head as its horizon 1/rho: the tokens past the window over which a
    key's LA weight falls by a factor e (inf: no decay)."""
    by_layer = s.horizon
    if not by_layer:
        return []
    width = max(len(v) for v in by_layer.values())
    lines = ["", "LA horizon 1/rho per layer and KV head (tokens past the window; inf = no decay):", ""]
    lines += ["| layer | " + " | ".join(f"KV head {h}" for h in range(width)) + " |", "|---|" + "---:|" * width]
    for i, values in sorted(by_layer.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {i} | " + " | ".join("inf" if x is None else f"{x:.3g}" for x in values) + " |")
    return lines


def modes_line(w: int, s: int, hybrid_sinks: bool, la_decay: bool) -> str:
    """Which keys each mode's softmax sees at window `w` with `s` sinks (kept by the hybrid: `hybrid_sinks`), and what
    `swa_only` (the hybrid without its LA) is for this model; whether the LA decays."""
    if hybrid_sinks:
        hybrid = f"window {w} + the first {s} tokens (gamma-weighted), LA over the rest"
        ablation = f"window {w} + the same {s} sinks (= swa_sinks)"
    else:
        hybrid, ablation = f"window {w} (gamma-weighted), LA beyond it, no sinks", f"window {w} alone"
    line = (
        f"Softmax keys per mode: hybrid: {hybrid}; swa_only (the hybrid without its LA): {ablation}; swa_sinks: "
        f"window {w} + the first {s} tokens; sinks_only: the first {s} tokens; la_only: LA over every key."
    )
    if la_decay:
        line += (" The LA decays: in hybrid and la_only a key that has left the window counts alpha_h^(its distance "
                 "past it); keys inside the window (la_only) and the sinks are not decayed.")  # fmt: skip
    return line


def cache_line(r: EvalResults) -> str:
    """What the modes that ran with the cache of exact keys kept, and that the plain names ran without it."""
    keys, select = r.cache()
    return (
        f"With the cache ({', '.join(r.cached_modes())}): {keys} exact keys per KV head beside the window and the "
        f"sinks, chosen by {select} (attention.cache_select) among the keys that left the window; a mode named "
        "without `+cache` ran with the cache off; cache_only: the softmax over the cache's keys alone."
    )


def beyond_window_lines(b: BeyondWindow, own_sinks: int | None = None) -> list[str]:
    """The beyond-window comparisons the verdict rests on; own_sinks: the sinks the hybrid keeps (None: none), which
    name what swa_only is."""
    lines = [
        f"Beyond the window ({b.tokens} held-out tokens at positions >= {b.window}), perplexity: "
        + ", ".join(f"{m} {v:.1f}" for m, v in b.perplexity.items())
        + ". Hybrid against (NLL gain in nats/token, 95% CI, paired bootstrap over 16-token blocks; margin "
        + f"±{b.margin}):",
        "",
    ]
    own = f"its own window + {own_sinks} sinks" if own_sinks is not None else "its own window alone"
    rows = [("swa_only", f"{own}: is the LA used?", b.swa_only)]
    if b.against != "swa_only":
        rows.append((b.against, "the strongest mode without LA: is the LA worth it?", b))
    for mode, what, c in rows:
        if c:
            lines.append(f"- `{mode}`, {what} {c.ratio:.2f}x its perplexity, {c.delta:+.3f} [{c.lo:+.3f}, {c.hi:+.3f}]")
    return lines


def passkey_lines(p: Probe, window: int, recall: bool = False) -> list[str]:
    """The passkey table (or with recall the associative-recall probe's): greedy exact match and mean answer
    log-likelihood per mode and distance."""
    ds = [str(d) for d in p.distances]
    what = (
        f"Associative recall ({p.trials} seeded prompts per distance, a line of {p.pairs} word: "
        f"{p.digits}-digit pairs, then filler from the held-out text, then one of the words again; distance = "
        f"tokens from the line's end to the answer; window {window})"
        if recall
        else f"Passkey retrieval ({p.trials} seeded prompts per distance, a {p.digits}-digit key stated in one "
        f"place, then filler from the held-out text; distance = tokens from the key to the answer; window {window})"
    )
    lines = [
        f"{what}. Greedy exact match %, (mean log-likelihood of the answer, chance {p.chance['loglik']:.1f}):",
        "",
        "| mode | " + " | ".join(f"d={d}{' *' if int(d) >= window else ''}" for d in ds) + " |",
        "|---|" + "---:|" * len(ds),
    ]
    for mode, by_d in p.by_mode.items():
        lines.append(
            f"| {mode} | " + " | ".join(f"{100 * by_d[d].exact:.0f} ({by_d[d].loglik:.1f})" for d in ds) + " |"
        )
    lines += ["", "\\* beyond the window: only what crosses it can answer; base is the ceiling."]
    if p.sanity:
        lines += ["", "**Probe check failed:** " + "; ".join(p.sanity)]
    return lines


def _mean_over(per_layer: dict, bucket: str) -> float:
    vals = [v for layer in per_layer.values() for v in layer.get(bucket, [])]
    return sum(vals) / len(vals) if vals else float("nan")


def plots(r: EvalResults, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(r.tasks)
    modes = list(r.modes)
    if modes:  # (no task scored: no ablation chart)
        fig, ax = plt.subplots(figsize=(1.6 * (len(tasks) + 1) + 2, 4))
        width = 0.8 / len(modes)
        x = np.arange(len(tasks) + 1)
        for i, mode in enumerate(modes):
            vals = [100 * r.modes[mode].tasks[t].metric for t in tasks] + [100 * r.modes[mode].avg]
            ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=mode)
        ax.set_xticks(x, [NAMES[t] for t in tasks] + ["AVG"])
        ax.set_ylabel("score (%)")
        ax.set_title(f"Component ablation (window {r.window})")
        ax.legend(fontsize=8, ncol=3)
        fig.tight_layout()
        fig.savefig(out_dir / "ablation.png", dpi=120)
        plt.close(fig)
    if r.la_share is not None:
        share = r.la_share.share
        layers = sorted(share, key=int)
        labels = list(share[layers[0]])
        fig, axes = plt.subplots(1, len(labels), figsize=(3 * len(labels), 0.18 * len(layers) + 2), squeeze=False)
        for ax, b in zip(axes[0], labels, strict=True):
            grid = np.array([share[layer][b] for layer in layers])
            im = ax.imshow(grid, aspect="auto", vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"positions {b}", fontsize=9)
            ax.set_xlabel("head")
            ax.set_yticks(range(len(layers)), layers, fontsize=6)
        axes[0][0].set_ylabel("layer")
        fig.colorbar(im, ax=axes[0].tolist(), label="LA share of normaliser")
        fig.savefig(out_dir / "la_share.png", dpi=120)
        plt.close(fig)
    long_context_png(r, out_dir / "long_context.png")


def long_context_png(r: EvalResults, path: Path) -> bool:
    """Passkey retrieval by distance and perplexity by position bucket, one line per mode, the window marked: the
    figure to read first. False (nothing written) when neither was measured."""
    p, ppl = r.passkey, r.perplexity
    if not p and not ppl:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [x for x, measured in (("passkey", p), ("perplexity", ppl)) if measured]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "passkey":
            for mode, by_d in p.by_mode.items():
                ds = sorted(by_d, key=int)
                ax.plot([int(d) for d in ds], [100 * by_d[d].exact for d in ds], label=mode, **_style(mode))
            ax.set_xscale("log", base=2)
            ax.set_ylim(-3, 103)
            ax.set_xlabel("distance from the key to the answer (tokens)")
            ax.set_ylabel("passkey exact match (%)")
            ax.set_title(f"Retrieval ({p.trials} prompts per distance)")
        else:
            labels = list(next(iter(ppl.by_mode.values())))
            mids = [(int(a) + int(b)) / 2 for a, b in (x.split("-") for x in labels)]
            for mode, v in ppl.by_mode.items():
                if mode == "none":
                    continue  # orders of magnitude above the rest: it would flatten every other line
                ax.plot(mids, [v[x] for x in labels], label=mode, **_style(mode))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("position of the predicted token (bucket middle)")
            ax.set_ylabel("perplexity")
            ax.set_title(f"Held-out perplexity ({ppl.sequences} x {ppl.seq_len} tokens)")
        ax.axvline(r.window, color="grey", ls="--", lw=1)
        ax.text(r.window, ax.get_ylim()[1], f" window {r.window}", va="top", fontsize=8, color="grey")
        ax.legend(fontsize=8)
    if r.verdict:
        fig.suptitle(f"Verdict: {r.verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


MODE_COLORS = {
    "base": "black",
    "hybrid": "tab:red",
    "swa_only": "tab:blue",
    "swa_sinks": "tab:cyan",
    "la_only": "tab:green",
    "sinks_only": "tab:purple",
    "none": "tab:gray",
    "cache_only": "tab:orange",
}


def _style(mode: str) -> dict:
    """One colour per mode in every figure (a `+cache` mode its plain mode's, dotted, square markers); the hybrid
    drawn thickest, the base dashed (the ceiling)."""
    plain, cached = eval_mode(mode)
    cached = cached and plain != mode
    return {
        "color": MODE_COLORS.get(plain),
        "marker": "s" if cached else "o",
        "lw": 2.5 if plain == "hybrid" else 1.2,
        "ls": "--" if mode == "base" else ":" if cached else "-",
    }
