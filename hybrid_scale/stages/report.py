"""Human outputs: the evaluation's table.md in the paper's Table-1 layout and its PNG figures, and stage 2's
loss curves."""

from __future__ import annotations

from pathlib import Path

NAMES = {
    "piqa": "PIQA",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "hellaswag": "HS",
    "winogrande": "WG",
    "mmlu": "MMLU",
}


def _ci(d: dict) -> str:
    return f"{100 * d['delta']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def table(r: dict) -> str:
    tasks = list(r["tasks"])
    lines = [f"# Component ablation: {r['model']}", ""]
    if r.get("untrained_feature_maps"):
        lines += ["**Feature maps untrained** (a plain model converted on the fly): LA numbers are a baseline.", ""]
    head = ["mode"] + [f"{NAMES[t]} ({r['tasks'][t]['metric']})" for t in tasks] + ["AVG", "Rec.%"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, m in r["modes"].items():
        cells = [f"{100 * m[t]['metric']:.1f} ± {100 * m[t]['stderr']:.1f}" for t in tasks]
        rec = f"{m['rec']:.1f}" if "rec" in m else "-"
        lines.append("| " + " | ".join([mode, *cells, f"{100 * m['avg']:.1f}", rec]) + " |")
    n = {t: r["tasks"][t]["n"] for t in tasks}
    lines += ["", f"Items per task: {n}; window {r['window']}; {r['world_size']} rank(s)."]
    lines += ["", "Share of scored (continuation) tokens at positions >= window -- on the rest a hybrid *is* its SWA:"]
    for t in tasks:
        shares = ", ".join(f"w={w}: {100 * s:.1f}%" for w, s in r["tasks"][t]["beyond_window"].items())
        lines.append(f"- {NAMES[t]}: {shares}")
    if "delta_swa" in r or "delta_la" in r:
        lines += ["", "Paired bootstrap deltas, points, 95% CI (stratified by task):", ""]
        lines += ["| delta | " + " | ".join(NAMES[t] for t in tasks) + " | AVG |", "|" + "---|" * (len(tasks) + 2)]
        for key, name in (("delta_swa", "SWA = hybrid - swa_only"), ("delta_la", "LA = la_only - none")):
            if key in r:
                lines.append(f"| {name} | " + " | ".join(_ci(r[key][t]) for t in [*tasks, "avg"]) + " |")
    if "verdict" in r:
        margin = r["config"]["eval"]["margin"]
        lines += ["", f"**Verdict: {r['verdict']}** (delta LA on the task average, margin ±{100 * margin:.1f} points)"]
    if "perplexity" in r:
        p = r["perplexity"]
        labels = list(next(iter(p["by_mode"].values())))
        lines += [
            "",
            f"Perplexity by position bucket ({p['sequences']} held-out sequences of {p['seq_len']} tokens):",
            "",
        ]
        lines += ["| mode | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for mode, v in p["by_mode"].items():
            lines.append(f"| {mode} | " + " | ".join(f"{v[b]:.1f}" for b in labels) + " |")
    if "la_share" in r:
        s = r["la_share"]
        lines += ["", f"LA share of the normaliser in `hybrid` (mean over layers and heads, T={s['seq_len']}):", ""]
        labels = list(next(iter(s["share"].values())))
        lines += ["| | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for key, name in (("share", "LA share"), ("effect", "‖y_hybrid − y_swa_only‖ / ‖y_hybrid‖")):
            vals = [_mean_over(s[key], b) for b in labels]
            lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    t = r["timings_s"]
    lines += ["", "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()), ""]
    return "\n".join(lines)


def _mean_over(per_layer: dict, bucket: str) -> float:
    vals = [v for layer in per_layer.values() for v in layer.get(bucket, [])]
    return sum(vals) / len(vals) if vals else float("nan")


def plots(r: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(r["tasks"])
    modes = list(r["modes"])
    fig, ax = plt.subplots(figsize=(1.6 * (len(tasks) + 1) + 2, 4))
    width = 0.8 / len(modes)
    x = np.arange(len(tasks) + 1)
    for i, mode in enumerate(modes):
        vals = [100 * r["modes"][mode][t]["metric"] for t in tasks] + [100 * r["modes"][mode]["avg"]]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=mode)
    ax.set_xticks(x, [NAMES[t] for t in tasks] + ["AVG"])
    ax.set_ylabel("score (%)")
    ax.set_title(f"Component ablation (window {r['window']})")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out_dir / "ablation.png", dpi=120)
    plt.close(fig)
    if "la_share" in r:
        share = r["la_share"]["share"]
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


def curves_png(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curves["train"]) + 1), curves["train"], lw=0.8, alpha=0.6, label="train (mode in force)")
    for key in ("hybrid", "la_only"):
        if curves["eval_steps"]:
            ax.plot(curves["eval_steps"], curves[key], marker="o", label=f"held-out {key}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
