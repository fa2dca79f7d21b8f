"""Figures more than one stage draws: stage 2's training curves."""

from __future__ import annotations

from pathlib import Path


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
