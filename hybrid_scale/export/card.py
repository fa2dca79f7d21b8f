"""The model card of an export (its README.md): what it is, how to load it, the gamma report and the evaluation's
balance report when there is one."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import InputError
from ..evaluate.results import EvalResults


def balance_report(results: Path, source: Path, tmp: Path, log) -> str | None:
    """The run's evaluation table (in `results`, eval's out_dir), copied into the export only when it describes the
    exported checkpoint (its results.json names the same model); a table of another checkpoint is left out, and the
    log says so."""
    if not (results / "table.md").is_file() or not (results / "results.json").is_file():
        return None
    try:
        evaluated = Path(EvalResults.load(results / "results.json").model).resolve()
    except InputError:
        evaluated = None
    if evaluated != source.resolve():
        log(
            f"balance report in {results} describes {evaluated}, not the exported {source.resolve()}: left out of the "
            "model card (evaluate the export, or set eval.model, for its own report)"
        )
        return None
    (tmp / "balance").mkdir()
    for name in ("table.md", "results.json", *(p.name for p in sorted(results.glob("*.png")))):
        shutil.copy(results / name, tmp / "balance" / name)
    table = (results / "table.md").read_text()
    if (results / "long_context.png").is_file():  # the figure first: retrieval and perplexity past the window
        table = "![retrieval and perplexity past the window](balance/long_context.png)\n\n" + table
    return table


def model_card(out_name: str, config: dict, report: dict | None, balance: str | None, origin: str = "") -> str:
    h = config["hybrid"]
    lines = [
        f"# {out_name}: a hybrid sliding-window + linear-attention model (hybrid_scale export)",
        "",
        *([f"Exported from {origin}.", ""] if origin else []),
        f"Base architecture {config['architectures'][0]}; {len(h['layers'])} of {config['num_hidden_layers']} layers "
        f"converted: sliding window {h['window']}, feature map {h['feature_map']} (dim {h['feature_dim']}), mode "
        f"`{h['mode']}`, sinks {h['sinks']}{' (the hybrid keeps them too)' if h.get('hybrid_sinks') else ''}.",
        "",
        "## Load",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)",
        "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # a plain tokenizer: no remote code",
        'model.set_hybrid_mode("la_only")  # or hybrid / swa_only / swa_sinks / sinks_only / none, or {layer: mode}',
        "```",
        "",
        "Runs in Hugging Face transformers (>= 5, < 6) with `trust_remote_code=True`: the modeling code is in this "
        "directory (torch + transformers only). Not supported by vLLM or SGLang (they have no kernel for this "
        "attention). Without `trust_remote_code` loading fails, rather than silently giving a softmax model.",
        "",
        "The tokenizer is the base model's and needs no remote code; pass `trust_remote_code=False` (transformers 5's "
        "AutoTokenizer reads config.json, whose custom model type would otherwise make it ask).",
        "",
        "Decoding keeps a ring buffer of the last `window` keys plus the linear-attention state per layer: memory does "
        "not grow with the generated length.",
    ]
    if report:
        lines += ["", "## Inference-time gamma", "", f"{report['note']}"]
        if report.get("perplexity"):  # export.report_sequences > 0
            labels = list(next(iter(report["perplexity"].values())))
            lines += ["", "| held-out perplexity | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
            for name, row in report["perplexity"].items():
                lines.append(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in labels) + " |")
    if balance:
        lines += ["", f"## Balance report (component ablation of {origin or 'this checkpoint'})", "", balance]
    return "\n".join(lines) + "\n"
