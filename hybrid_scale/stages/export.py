"""Export: a converted model (+ stage-2 LoRA adapter, trained phi/gamma) -> a self-contained Hugging Face directory.

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
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..attention.hybrid import HybridAttention
from ..config import ConfigError
from ..distributed.checkpoint import commit, fault_enospc, remove_dir, replace_dir, start_partial
from ..models.convert import MODEL_TYPE
from ..models.converted import (
    ADAPTER_DIR,
    CLASS_PREFIX,
    CONFIG_NAME,
    PARAMS_NAME,
    base_config,
    base_dir,
    load_tokenizer,
    lora_deltas,
    merge,
    read_hybrid_config,
    write_converted,
)
from . import inputs
from .evaluate import output_dir as eval_dir
from .rundir import describe_origin, is_export, run_model

ATTENTION_DIR = Path(__file__).resolve().parents[1] / "attention"
REMOTE_FILES = (
    "configuration_hybrid_scale.py",
    "modeling_hybrid_scale.py",
    "hybrid.py",
    "chunked.py",
    "recurrent.py",
    "naive.py",
    "feature_maps.py",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ExportError(RuntimeError):
    pass


# --- reading the input -------------------------------------------------------------------------------------------


def output_dir(cfg) -> Path:
    return Path(cfg.export.out_dir) if cfg.export.out_dir else Path(cfg.run_dir) / "export"


def source_model(cfg) -> Path:
    """export.model, else the run's model (rundir.run_model: the same one `evaluate` scores)."""
    if cfg.export.model:
        path = Path(cfg.export.model)
        if not (path / CONFIG_NAME).is_file():
            raise ConfigError(f"config key 'export.model': {path} is not a converted model (no {CONFIG_NAME})")
        return path
    path = run_model(cfg.run_dir)
    if path is None:
        raise ConfigError(
            f"config key 'export.model': {cfg.run_dir} has no stage-2 or stage-1 model yet; run the stages or set "
            "export.model"
        )
    return path


def input_shards(base: Path) -> dict[str, str]:
    """tensor name -> shard file of the base checkpoint; every shard must be present and readable."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    elif (base / "model.safetensors").is_file():
        where = None
    else:
        raise ExportError(f"{base} has no model.safetensors(.index.json): export streams safetensors checkpoints")
    files = sorted(set(where.values())) if where else ["model.safetensors"]
    missing = [f for f in files if not (base / f).is_file()]
    if missing:
        raise ExportError(f"input shard(s) missing in {base}: {', '.join(missing)}; restore them and export again")
    out = {}
    for file in files:
        try:
            with safe_open(base / file, "pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise ExportError(f"input shard {base / file} is unreadable ({e}); restore it and export again") from None
        out.update(dict.fromkeys(names, file) if where is None else {n: file for n in names if where.get(n) == file})
    return out


# --- writing -----------------------------------------------------------------------------------------------------


def plan_shards(base: Path, where: dict[str, str], max_bytes: int, dtype: torch.dtype | None) -> list[list[str]]:
    """Tensor names grouped into output shards: one per input shard, split where it exceeds max_bytes (a larger
    single tensor gets its own), so that writing never holds more than about one input shard."""
    shards = []
    for file in sorted(set(where.values())):
        current, size = [], 0
        with safe_open(base / file, "pt") as f:
            for name in [n for n in f.keys() if where.get(n) == file]:
                s = f.get_slice(name)
                numel = 1
                for d in s.get_shape():
                    numel *= d
                nbytes = numel * (torch.empty((), dtype=dtype).element_size() if dtype else DTYPE_BYTES[s.get_dtype()])
                if current and size + nbytes > max_bytes:
                    shards.append(current)
                    current, size = [], 0
                current.append(name)
                size += nbytes
        if current:
            shards.append(current)
    return shards


def write_shards(base: Path, where, shards, deltas, scaling, dtype, out: Path, log) -> dict[str, str]:
    weight_map = {}
    merged = 0
    for n, names in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            try:
                with safe_open(base / where[name], "pt") as f:
                    t = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ExportError(
                    f"input shard {base / where[name]} is corrupt ({e}); restore it and export again"
                ) from None
            if name in deltas:
                t = merge(t, *deltas[name], scaling)
                merged += 1
            tensors[name] = (t.to(dtype) if dtype and t.is_floating_point() else t).contiguous()
        fault_enospc("export")
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        log(f"wrote {file} ({len(names)} tensors)")
        del tensors
    if merged != len(deltas):
        missing = sorted(set(deltas) - set(weight_map))[:3]
        raise ExportError(f"the adapter names weights the base checkpoint lacks: {missing}")
    return weight_map


def export_config(base: Path, settings: dict, dtype_name: str | None) -> dict:
    config = json.loads((base / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in MODEL_TYPE:
        raise ExportError(f"export supports {', '.join(MODEL_TYPE)}; {base} is {arch}")
    prefix = CLASS_PREFIX[MODEL_TYPE[arch]]
    config.pop("quantization_config", None)
    config.update(
        model_type=f"hybrid_scale_{MODEL_TYPE[arch]}",
        architectures=[f"HybridScale{prefix}ForCausalLM"],
        auto_map={
            "AutoConfig": f"configuration_hybrid_scale.HybridScale{prefix}Config",
            "AutoModelForCausalLM": f"modeling_hybrid_scale.HybridScale{prefix}ForCausalLM",
        },
        hybrid=settings,
    )
    if dtype_name:
        config["dtype"] = dtype_name
    return config


# --- gamma: fixed or calibrated ------------------------------------------------------------------------------------


def fit_gamma(m: HybridAttention, q, k, v, fq, fk, target, steps: int) -> tuple[torch.Tensor, float, float]:
    """gamma logits per head minimising the MSE of the hybrid output to `target`; with the MSE before and after."""
    from ..attention.chunked import hybrid_attention

    logit = m.gamma_logit.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([logit], lr=0.1)

    def mse():
        y = hybrid_attention(
            q, k, v, fq, fk, torch.sigmoid(logit), m.window, "hybrid", m.sinks, None, m.scaling, m.chunk_size
        )
        return (y - target).pow(2).mean()

    with torch.no_grad():
        before = mse().item()
    for _ in range(steps):
        opt.zero_grad()
        loss = mse()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = mse().item()
    return logit.detach(), before, after


def calibrate_gamma(
    out: Path, tokenizer_dir: Path, settings: dict, hybrid: dict, cfg, log
) -> tuple[dict[str, torch.Tensor], dict]:
    """Per layer (streamed, as stage 1): fit gamma per head so that the hybrid output matches full causal softmax
    over the same (merged) q, k, v on a few training sequences; the teacher layer produces the next inputs."""
    from ..data import corpus
    from .distill import ShardedCheckpoint, build_layer, rotary, teacher_output

    x = cfg.export
    config = base_config(out)
    config._attn_implementation = "sdpa"
    tokenizer = load_tokenizer(tokenizer_dir)
    docs, _ = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction)
    ids = corpus.pack(tokenizer, docs, x.calibration_seq_len, x.calibration_sequences, cfg.seed)
    ckpt = ShardedCheckpoint(out)
    rope = rotary(config, x.calibration_seq_len, torch.float32)
    h = ckpt.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()[ids]
    new, errors = dict(hybrid), {}
    for i in range(config.num_hidden_layers):
        layer = build_layer(config, ckpt, i, torch.float32)
        if i in settings["layers"]:
            m = HybridAttention.from_softmax(layer.self_attn, config, i, {**settings, "mode": "hybrid"})
            prefix = f"model.layers.{i}.self_attn."
            m.load_state_dict(
                {k[len(prefix) :]: v.float() for k, v in hybrid.items() if k.startswith(prefix)}, strict=False
            )
            with torch.no_grad():
                q, k, v, fq, fk = m.project(layer.input_layernorm(h), rope)
                target = teacher_output(q, k, v, m.scaling)
            logit, before, after = fit_gamma(m, q, k, v, fq, fk, target, x.calibration_steps)
            key = prefix + "gamma_logit"
            new[key] = logit.detach().to(hybrid[key].dtype)
            errors[str(i)] = [before, after]
            g0, g1 = torch.sigmoid(hybrid[key].float()).mean(), torch.sigmoid(logit).mean()
            log(f"layer {i}: mean gamma {g0:.3f} -> {g1:.3f}, output mse {before:.3g} -> {after:.3g}")
        with torch.no_grad():
            out_h = layer(h, position_embeddings=rope, attention_mask=None)
            h = out_h[0] if isinstance(out_h, tuple) else out_h
    return new, errors


def perplexity_report(out: Path, tokenizer_dir: Path, cfg, gammas: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Held-out perplexity by position bucket in hybrid for each gamma setting (plus swa_only and la_only)."""
    from ..data import corpus
    from ..models.convert import components
    from ..models.converted import load_converted
    from .balance import perplexity_by_bucket

    x = cfg.export
    tokenizer = load_tokenizer(tokenizer_dir)
    _, held = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction, "report")
    seqs = corpus.pack(tokenizer, held, x.report_seq_len, x.report_sequences, cfg.seed)
    buckets = sorted({b for b in cfg.eval.buckets if b < x.report_seq_len} | {0, x.report_seq_len})
    model = load_converted(out, dtype=torch.float32)
    report = {"seq_len": x.report_seq_len, "sequences": len(seqs), "perplexity": {}}
    for mode in ("swa_only", "la_only"):
        with components(model, mode):
            report["perplexity"][mode] = perplexity_by_bucket(model, seqs, buckets)
    for name, params in gammas.items():
        model.load_state_dict({k: v for k, v in params.items() if k.endswith("gamma_logit")}, strict=False)
        with components(model, "hybrid"):
            report["perplexity"][f"hybrid ({name})"] = perplexity_by_bucket(model, seqs, buckets)
    return report


# --- the stage -----------------------------------------------------------------------------------------------------


def balance_report(cfg, source: Path, tmp: Path, log) -> str | None:
    """The run's evaluation table, copied into the export only when it describes the exported checkpoint (its
    results.json names the same model); a table of another checkpoint is left out, and the log says so."""
    results = eval_dir(cfg)
    if not (results / "table.md").is_file() or not (results / "results.json").is_file():
        return None
    try:
        evaluated = Path(json.loads((results / "results.json").read_text())["model"]).resolve()
    except (OSError, ValueError, KeyError):
        evaluated = None
    if evaluated != source.resolve():
        log(
            f"balance report in {results} describes {evaluated}, not the exported {source.resolve()}: left out of the "
            "model card (evaluate the export, or set eval.model, for its own report)"
        )
        return None
    (tmp / "balance").mkdir()
    for name in ("table.md", "results.json"):
        shutil.copy(results / name, tmp / "balance" / name)
    return (results / "table.md").read_text()


def model_card(out_name: str, config: dict, report: dict | None, balance: str | None, origin: str = "") -> str:
    h = config["hybrid"]
    lines = [
        f"# {out_name}: a hybrid sliding-window + linear-attention model (hybrid_scale export)",
        "",
        *([f"Exported from {origin}.", ""] if origin else []),
        f"Base architecture {config['architectures'][0]}; {len(h['layers'])} of {config['num_hidden_layers']} layers "
        f"converted: sliding window {h['window']}, feature map {h['feature_map']} (dim {h['feature_dim']}), mode "
        f"`{h['mode']}`, sinks {h['sinks']}.",
        "",
        "## Load",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)",
        "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # a plain tokenizer: no remote code",
        'model.set_hybrid_mode("la_only")  # or hybrid / swa_only / sinks_only / none, or {layer: mode}',
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


def export(cfg) -> Path:
    from .plan import preflight

    x = cfg.export
    t0 = time.perf_counter()
    preflight(cfg, "export")  # the input model, its architecture, free disk for the merged copy
    source = source_model(cfg)
    meta = read_hybrid_config(source)
    base = base_dir(source)
    out = inputs.export_output(cfg, source, base)
    settings = dict(meta["attention"])
    if x.mode:
        settings["mode"] = x.mode
        settings.pop("layer_modes", None)
    if x.window:
        settings["window"] = x.window
    dtype = getattr(torch, x.dtype) if x.dtype else None
    inputs.converted(source, "export.model")  # the run's model too: readable, its base present, the adapter fits it
    hybrid = load_file(source / PARAMS_NAME)
    adapter = source / ADAPTER_DIR
    deltas, scaling = lora_deltas(adapter) if adapter.is_dir() else ({}, 1.0)
    where = input_shards(base)  # all present and readable before anything is written
    config = export_config(base, settings, x.dtype)

    tmp = start_partial(out, "export.out_dir")
    log_lines: list[str] = []

    def log(msg: str) -> None:
        log_lines.append(f"{time.strftime('%H:%M:%S')} {msg}")

    try:
        shards = plan_shards(base, where, int(x.max_shard_gb * 1e9), dtype)
        weight_map = write_shards(base, where, shards, deltas, scaling, dtype, tmp, log)
        log(f"merged {len(deltas)} LoRA deltas (scaling {scaling:g}) from {adapter if deltas else 'no adapter'}")
        if x.gamma is not None:
            hybrid = {
                k: (torch.full_like(v, float(torch.logit(torch.tensor(x.gamma)))) if k.endswith("gamma_logit") else v)
                for k, v in hybrid.items()
            }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in REMOTE_FILES:
            shutil.copy(ATTENTION_DIR / name, tmp / name)
        for name in TOKENIZER_FILES:
            if (base / name).is_file():
                shutil.copy(base / name, tmp / name)

        def write_hybrid(params):  # the phi/gamma shard + hybrid_config.json, then the index that lists the shard
            write_converted(tmp, config["architectures"][0].replace("HybridScale", ""), ".", settings, params)
            index = {**weight_map, **dict.fromkeys(params, PARAMS_NAME)}
            total = sum((tmp / f).stat().st_size for f in set(index.values()))
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1) + "\n"
            )

        write_hybrid(hybrid)
        report = None
        if x.calibrate_gamma or x.gamma is not None:
            gammas = {"as trained": load_file(source / PARAMS_NAME)}
            if x.calibrate_gamma:
                hybrid, errors = calibrate_gamma(tmp, base, settings, hybrid, cfg, log)
                write_hybrid(hybrid)
                gammas["calibrated"] = hybrid
                note = (
                    f"gamma calibrated per layer and head on {x.calibration_sequences} sequences of "
                    f"{x.calibration_seq_len} tokens: hybrid output fit to full causal softmax over the merged q, k, v."
                )
            else:
                gammas[f"fixed {x.gamma}"] = hybrid
                note = f"gamma fixed at {x.gamma} for every head."
            report = {"note": note, "calibration_mse": errors if x.calibrate_gamma else None}
            if x.report_sequences:
                report.update(perplexity_report(tmp, base, cfg, gammas))
            (tmp / "gamma_report.json").write_text(json.dumps(report, indent=1) + "\n")
        balance = balance_report(cfg, source, tmp, log)
        (tmp / "README.md").write_text(model_card(out.name, config, report, balance, describe_origin(source)))
        log(f"export written in {time.perf_counter() - t0:.0f} s")
        (tmp / "export_log.txt").write_text("\n".join(log_lines) + "\n")
        commit(tmp)
        replace_dir(tmp, out, "export.out_dir", owned=is_export, what="an export written by hybrid_scale")
    except BaseException:
        remove_dir(tmp)
        raise
    return out
