"""Export: a converted model (+ stage-2 LoRA adapter, trained phi/gamma) -> a self-contained Hugging Face directory.

Its loop is `export` here; the merged directory is merge.py, the gamma of inference-time hybridisation gamma.py,
the model card card.py, what it was made from identity.py.

- LoRA is merged into the base weights while the shards are streamed: tensors are read one by one from the input
  safetensors, the adapter's delta (B @ A * alpha / r) is added where it applies, and output shards of at most
  `export.max_shard_gb` are written (peak memory about one shard), with model.safetensors.index.json.
- phi and gamma go to their own shard (hybrid_params.safetensors), listed in the same index.
- config.json gets its own model_type and an auto_map to configuration_/modeling_hybrid_scale.py, copied with the
  package's attention files (the same code that trained it; torch + transformers only). Without
  trust_remote_code=True transformers refuses the unknown model_type instead of silently loading a softmax model.
- Inference-time hybridisation: export.mode=hybrid on an la_only conversion adds SWA; gamma fixed (export.gamma) or
  calibrated per layer and head (export.calibrate_gamma) so that the hybrid output matches full causal softmax over
  the merged q, k, v; held-out perplexity by position bucket before/after goes to the export's report.
- The directory is written as {out}.partial and moved into place after its COMMITTED marker; a failure leaves no
  directory that looks complete. It is also a converted model for hybrid_scale (hybrid_config.json, base ".").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..attention.layer import GAMMA_PARAMS
from ..config.schema import Config
from ..data import corpus
from ..entry import Entry, stage_entry
from ..errors import CorpusError, ExportError
from ..models import streaming
from ..models.cache_heads import default_prompts, retrieval_budgets
from ..models.converted import (
    ADAPTER_DIR,
    PARAMS_NAME,
    load_converted,
    load_tokenizer,
    lora_deltas,
)
from ..run.log import StageLog
from ..storage.commits import commit, is_export, remove_dir, replace_dir, start_partial
from .card import balance_report, model_card
from .gamma import check_gamma_export, export_texts, gamma_change
from .identity import IDENTITY_NAME, export_identity
from .inputs import INPUTS
from .merge import Draft, export_config, plan_shards, write_code_and_tokenizer, write_shards


def export(cfg: Config) -> Path:
    """The export, built in {out}.partial and moved into place after its COMMITTED marker: merged shards, config and
    attention code, tokenizer, phi/gamma (gamma fixed or calibrated on request), the model card."""
    t0 = time.perf_counter()
    # preflight (the input model, its adapter and base, the destination, architecture, free disk) and the run dir's
    # lock when it writes or reads in it (entry.py); on rank 0 alone
    with stage_entry(cfg, "export", INPUTS, ranks=False) as entry:
        return _export(entry, t0)


def _export(entry: Entry, t0: float) -> Path:
    """export's work, under the run dir's lock when it needs one."""
    cfg, model = entry.cfg, entry.model
    export_cfg, source, base, out = cfg.export, model.path, model.base, entry.layout.export
    settings = dict(model.hybrid_config["attention"])
    if export_cfg.mode:
        settings["mode"] = export_cfg.mode
        settings.pop("layer_modes", None)
    if export_cfg.window:
        settings["window"] = export_cfg.window
    # the cache of exact keys needs no training: the export keeps the run's attention.cache, whatever the converted
    # model was made with (a loaded export changes it with model.set_hybrid_cache)
    settings["cache"], settings["cache_select"] = cfg.attention.cache, cfg.attention.cache_select
    if export_cfg.gamma is not None or export_cfg.calibrate_gamma:
        check_gamma_export(export_cfg, settings)
    # the exported model runs the Triton kernels where they are installed (CUDA) and torch elsewhere, unless the run
    # asked for torch; it never demands the kernels
    settings["backend"] = "torch" if cfg.attention.backend == "torch" else "auto"
    dtype = getattr(torch, export_cfg.dtype) if export_cfg.dtype else None
    hybrid = load_file(source / PARAMS_NAME)
    adapter = source / ADAPTER_DIR
    deltas, scaling = lora_deltas(adapter) if adapter.is_dir() else ({}, 1.0)
    where = streaming.shard_map(base, "export.model")  # every shard present and readable before any write
    config = export_config(base, settings, export_cfg.dtype)
    texts = export_texts(cfg, base)  # (the calibration's and the report's, packed before anything is written)
    tmp = start_partial(out, "export.out_dir")
    log = StageLog(tmp / "export_log.txt", name="export.out")  # moves into place with the export

    try:
        plan = plan_shards(base, where, int(export_cfg.max_shard_gb * 1e9), dtype)
        draft = Draft(tmp, config, settings, write_shards(plan, deltas, scaling, tmp, log), log)
        log(f"merged {len(deltas)} LoRA deltas (scaling {scaling:g}) from {adapter if deltas else 'no adapter'}")
        write_code_and_tokenizer(tmp, base, config)
        if export_cfg.gamma is not None:
            logit = GAMMA_PARAMS[settings.get("gamma_param", "sigmoid")][1](export_cfg.gamma)
            hybrid = {k: (torch.full_like(v, logit) if k.endswith("gamma_logit") else v) for k, v in hybrid.items()}
        draft.write_hybrid(hybrid)
        report = None
        if export_cfg.calibrate_gamma or export_cfg.gamma is not None:
            report = gamma_change(draft, cfg, texts, source, hybrid)
        if settings["cache"] and cfg.attention.cache_heads == "retrieval":
            config = _cache_budgets(cfg, draft, base)
        balance = balance_report(entry.layout.eval, source, tmp, log)
        identity = export_identity(cfg, model, entry.layout.eval)
        (tmp / IDENTITY_NAME).write_text(json.dumps(identity, indent=1) + "\n")
        (tmp / "README.md").write_text(model_card(out.name, config, report, balance, model.describe()))
        log(f"export written in {time.perf_counter() - t0:.0f} s")
        log.close()  # (the file complete before its directory is committed and moved)
        commit(tmp)
        replace_dir(tmp, out, "export.out_dir", owned=is_export, what="an export written by hybrid_scale")
    except BaseException:
        log.close()
        remove_dir(tmp)
        raise
    return out


def _cache_budgets(cfg: Config, draft: Draft, base: Path) -> dict:
    """attention.cache_heads=retrieval: the draft's layers' cache slots shared out over their KV heads
    (models/cache_heads.py), calibrated on passkey prompts cut from the training text (the export's calibration
    text) and written into config.json's `hybrid` as cache_budgets {layer: [Hkv]}, which the remote code applies at
    load time (hybrid_config.json keeps the toolkit's settings). Returns the new config."""
    tmp, settings = draft.dir, draft.settings
    tokenizer = load_tokenizer(base)
    try:
        docs, _ = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction)
    except CorpusError as e:
        raise ExportError(f"the export's training text for attention.cache_heads=retrieval falls short: {e}") from None
    model = load_converted(tmp, torch.float32).eval()
    try:
        filler, prompts = tokenizer.encode("\n\n".join(docs)), default_prompts(model, cfg.seed)
        budgets = retrieval_budgets(model, tokenizer, filler, int(settings["cache"]), prompts,
                                    select=settings["cache_select"])  # fmt: skip
    except ValueError as e:
        raise ExportError(f"attention.cache_heads=retrieval: {e}") from None
    hybrid = {**draft.config["hybrid"], "cache_budgets": {str(i): b.tolist() for i, b in budgets.items()}}
    config = {**draft.config, "hybrid": hybrid}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    draft.config = config
    draft.log(f"cache budgets per KV head (attention.cache_heads=retrieval, {settings['cache']} keys on average): "
              + "; ".join(f"layer {i}: {b.tolist()}" for i, b in budgets.items()))  # fmt: skip
    return config
