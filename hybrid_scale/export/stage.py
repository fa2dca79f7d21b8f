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

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..attention.architectures import ARCHITECTURES
from ..attention.hybrid import GAMMA_PARAMS, HybridAttention, check_gamma
from ..attention.naive import EPS
from ..data import corpus
from ..entry import Entry, stage_entry
from ..errors import CorpusError, ExportError
from ..measure import perplexity_by_bucket
from ..models import streaming
from ..models.convert import components
from ..models.converted import (
    ADAPTER_DIR,
    PARAMS_NAME,
    base_config,
    load_converted,
    load_tokenizer,
    lora_deltas,
    merge,
    write_converted,
)
from ..run.log import StageLog
from ..run.settings import data_settings
from ..run.sources import ModelSource
from ..storage.commits import commit, is_export, remove_dir, replace_dir, save_tensors, start_partial
from ..storage.faults import fault_enospc

ATTENTION_DIR = Path(__file__).resolve().parents[1] / "attention"


def remote_files() -> list[str]:
    """Every module of the attention folder (they import only torch, transformers and each other, in the
    `from .sibling import name` form, so they work copied flat next to each other); not its package __init__.py."""
    return sorted(p.name for p in ATTENTION_DIR.glob("*.py") if p.name != "__init__.py")


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


# --- reading the input -------------------------------------------------------------------------------------------


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
                nbytes = numel * (
                    torch.empty((), dtype=dtype).element_size() if dtype else streaming.SAFETENSORS_BYTES[s.get_dtype()]
                )
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
        save_tensors(tensors, out / file, metadata={"format": "pt"})
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
    if arch not in ARCHITECTURES:
        raise ExportError(f"export supports {', '.join(ARCHITECTURES)}; {base} is {arch}")
    prefix = ARCHITECTURES[arch].prefix
    config.pop("quantization_config", None)
    config.update(
        model_type=ARCHITECTURES[arch].export_type,
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


def gamma_parts(m: HybridAttention, q, k, v, fq, fk) -> tuple[torch.Tensor, ...]:
    """The hybrid output as a function of gamma, from one pass at the layer's own gamma g0: the shared normaliser
    gives y(gamma) = (r * num_soft + num_lin) / (r * den_soft + den_lin + EPS) with r = gamma / g0 per head, where
    num_soft, den_soft are the window part at g0 and num_lin, den_lin the LA part (which gamma does not touch).
    Returns (g0 [H], num_soft, num_lin [B,H,T,D], den_soft, den_lin [B,H,T,1]), all fp32."""
    with torch.no_grad():
        g0 = m.gamma.detach().float()
        y, soft, lin = m.attend(q, k, v, fq, fk, gamma=g0, mode="hybrid", return_denominators=True)
        y_soft = m.attend(q, k, v, fq, fk, gamma=g0, mode="swa_only")
        soft, lin = soft.float()[..., None], lin.float()[..., None]
        num_soft = y_soft.float() * (soft + EPS)
        num_lin = y.float() * (soft + lin + EPS) - num_soft
    return g0, num_soft, num_lin, soft, lin


def hybrid_at(gamma: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The hybrid output at `gamma` [H] from gamma_parts (differentiable in gamma)."""
    g0, num_soft, num_lin, soft, lin = parts
    r = (gamma / g0).view(1, -1, 1, 1)
    return (r * num_soft + num_lin) / (r * soft + lin + EPS)


def fit_gamma(m: HybridAttention, q, k, v, fq, fk, target, steps: int) -> tuple[torch.Tensor, float, float]:
    """gamma logits per head minimising the MSE of the hybrid output to `target`; with the MSE before and after. The
    attention runs once (gamma_parts); every Adam step is then elementwise."""
    logit = m.gamma_logit.detach().clone().float().requires_grad_(True)
    opt = torch.optim.Adam([logit], lr=0.1)
    parts = gamma_parts(m, q, k, v, fq, fk)
    target = target.float()

    to_gamma = GAMMA_PARAMS[m.gamma_param][0]

    def mse():
        return (hybrid_at(to_gamma(logit), parts) - target).pow(2).mean()

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


def check_gamma_export(x, settings: dict) -> None:
    """export.gamma / calibrate_gamma need a model that runs hybrid (somewhere), and a fixed gamma its own
    parametrisation can reach; refused before anything is written."""
    modes = {settings.get("mode"), *(settings.get("layer_modes") or {}).values()}
    if "hybrid" not in modes:
        raise ExportError(
            f"export.{'gamma' if x.gamma is not None else 'calibrate_gamma'} is set but the exported model runs "
            f"{', '.join(sorted(m for m in modes if m))}, where gamma has no effect: set export.mode=hybrid"
        )
    if x.gamma is not None:
        try:
            check_gamma(x.gamma, settings.get("gamma_param", "sigmoid"), "config key 'export.gamma'")
        except ValueError as e:
            raise ExportError(f"{e} (the model's attention.gamma_param)") from None


def export_texts(cfg, tokenizer_dir: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The token ids a gamma calibration (training text) and its perplexity report (held-out text) read, packed
    before any shard is written: too little text is one clear error before the export writes a byte."""
    x = cfg.export
    if not (x.calibrate_gamma or x.gamma is not None):
        return None, None
    tokenizer = load_tokenizer(tokenizer_dir)
    data, calibration, report = cfg.data, None, None
    try:
        what = "export.calibration_sequences x export.calibration_seq_len (training text)"
        if x.calibrate_gamma:
            docs, _ = corpus.train_and_heldout(data.source, data.text_field, data.heldout_fraction)
            calibration = corpus.pack(tokenizer, docs, x.calibration_seq_len, x.calibration_sequences, cfg.seed)
        what = "export.report_sequences x export.report_seq_len (held-out text; export.report_sequences=0 skips it)"
        if x.report_sequences:
            held = corpus.heldout_documents(data.source, data.text_field, data.heldout_fraction, "report")
            report = corpus.pack(tokenizer, held, x.report_seq_len, x.report_sequences, cfg.seed)
    except CorpusError as e:
        raise ExportError(f"the export's text for {what} falls short: {e}") from None
    return calibration, report


def calibrate_gamma(
    out: Path, ids: torch.Tensor, settings: dict, hybrid: dict, cfg, log
) -> tuple[dict[str, torch.Tensor], dict]:
    """Per layer (streamed, as stage 1): fit gamma per head so that the hybrid output matches full causal softmax
    over the same (merged) q, k, v on a few training sequences (`ids`); the teacher layer produces the next inputs."""
    x = cfg.export
    config = base_config(out)
    config._attn_implementation = "sdpa"
    ckpt = streaming.ShardedCheckpoint(out, "export.out_dir")
    rope = streaming.rotary(config, x.calibration_seq_len, torch.float32)
    h = streaming.embedding(ckpt, torch.float32)[ids]
    new, errors = dict(hybrid), {}
    for i, layer in streaming.layers(config, ckpt, torch.float32):
        if i in settings["layers"]:
            m = HybridAttention.from_softmax(layer.self_attn, config, i, {**settings, "mode": "hybrid"})
            prefix = f"model.layers.{i}.self_attn."
            m.load_state_dict(
                {k[len(prefix) :]: v.float() for k, v in hybrid.items() if k.startswith(prefix)}, strict=False
            )
            with torch.no_grad():
                q, k, v, fq, fk = m.project(layer.input_layernorm(h), rope)
                target = streaming.teacher_output(q, k, v, m.scaling)
            logit, before, after = fit_gamma(m, q, k, v, fq, fk, target, x.calibration_steps)
            key = prefix + "gamma_logit"
            new[key] = logit.detach().to(hybrid[key].dtype)
            errors[str(i)] = [before, after]
            to_gamma = GAMMA_PARAMS[m.gamma_param][0]
            g0, g1 = to_gamma(hybrid[key].float()).mean(), to_gamma(logit).mean()
            log(f"layer {i}: mean gamma {g0:.3f} -> {g1:.3f}, output mse {before:.3g} -> {after:.3g}")
        h = streaming.teacher(layer, h, rope)
    return new, errors


def perplexity_report(out: Path, seqs: torch.Tensor, cfg, gammas: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Held-out perplexity by position bucket (`seqs`) in hybrid for each gamma setting (plus swa_only and la_only)."""
    x = cfg.export
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


def balance_report(results: Path, source: Path, tmp: Path, log) -> str | None:
    """The run's evaluation table (in `results`, eval's out_dir), copied into the export only when it describes the
    exported checkpoint (its results.json names the same model); a table of another checkpoint is left out, and the
    log says so."""
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


def export(cfg) -> Path:
    """The export, built in {out}.partial and moved into place after its COMMITTED marker: merged shards, config and
    attention code, tokenizer, phi/gamma (gamma fixed or calibrated on request), the model card."""
    t0 = time.perf_counter()
    # preflight (the input model, its adapter and base, the destination, architecture, free disk) and the run dir's
    # lock when it writes or reads in it (entry.py); on rank 0 alone
    with stage_entry(cfg, "export", ranks=False) as entry:
        return _export(entry, t0)


def _export(entry: Entry, t0: float) -> Path:
    """export's work, under the run dir's lock when it needs one."""
    cfg, model = entry.cfg, entry.model
    x, source, base, out = cfg.export, model.path, model.base, entry.layout.export
    settings = dict(model.hybrid_config["attention"])
    if x.mode:
        settings["mode"] = x.mode
        settings.pop("layer_modes", None)
    if x.window:
        settings["window"] = x.window
    if x.gamma is not None or x.calibrate_gamma:
        check_gamma_export(x, settings)
    # the exported model runs the Triton kernels where they are installed (CUDA) and torch elsewhere, unless the run
    # asked for torch; it never demands the kernels
    settings["backend"] = "torch" if cfg.attention.backend == "torch" else "auto"
    dtype = getattr(torch, x.dtype) if x.dtype else None
    hybrid = load_file(source / PARAMS_NAME)
    adapter = source / ADAPTER_DIR
    deltas, scaling = lora_deltas(adapter) if adapter.is_dir() else ({}, 1.0)
    where = streaming.shard_map(base, "export.model")  # every shard present and readable before any write
    config = export_config(base, settings, x.dtype)
    texts = export_texts(cfg, base)  # (the calibration's and the report's, packed before anything is written)
    tmp = start_partial(out, "export.out_dir")
    log = StageLog(tmp / "export_log.txt", name="export.out")  # moves into place with the export

    try:
        shards = plan_shards(base, where, int(x.max_shard_gb * 1e9), dtype)
        weight_map = write_shards(base, where, shards, deltas, scaling, dtype, tmp, log)
        log(f"merged {len(deltas)} LoRA deltas (scaling {scaling:g}) from {adapter if deltas else 'no adapter'}")
        write_code_and_tokenizer(tmp, base, config)
        if x.gamma is not None:
            logit = GAMMA_PARAMS[settings.get("gamma_param", "sigmoid")][1](x.gamma)
            hybrid = {k: (torch.full_like(v, logit) if k.endswith("gamma_logit") else v) for k, v in hybrid.items()}
        write_hybrid(tmp, config, settings, hybrid, weight_map)
        report = None
        if x.calibrate_gamma or x.gamma is not None:
            report = gamma_change(tmp, texts, source, settings, hybrid, weight_map, config, cfg, log)
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


IDENTITY_NAME = "identity.json"  # in an export: what it was made from (export_identity)


def export_identity(cfg, model: ModelSource, eval_dir: Path) -> dict:
    """What an export was made from: the export.* settings, the input model's files (and its base's), whether it runs
    on torch only, the text a calibration or report reads, the seed, and the evaluation its card may carry. The
    pipeline exports again when this changed."""
    x = {k: v for k, v in OmegaConf.to_container(cfg.export, resolve=True).items() if k not in ("out_dir", "model")}
    results = eval_dir / "results.json"
    identity = {
        "export": x,
        "torch_only": cfg.attention.backend == "torch",
        "model": hashlib.sha256(json.dumps(model.files()).encode()).hexdigest(),
        "evaluation": hashlib.sha256(results.read_bytes()).hexdigest() if results.is_file() else None,
        "seed": cfg.seed,
        **data_settings(cfg),
    }
    return json.loads(json.dumps(identity))


def write_code_and_tokenizer(tmp: Path, base: Path, config: dict) -> None:
    """config.json, the attention package's modules (the remote code), the base model's tokenizer files."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in remote_files():
        shutil.copy(ATTENTION_DIR / name, tmp / name)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, tmp / name)


def write_hybrid(tmp: Path, config: dict, settings: dict, params: dict, weight_map: dict) -> None:
    """The phi/gamma shard + hybrid_config.json, then the index that lists every shard."""
    write_converted(tmp, config["architectures"][0].replace("HybridScale", ""), ".", settings, params)
    index = {**weight_map, **dict.fromkeys(params, PARAMS_NAME)}
    total = sum((tmp / f).stat().st_size for f in set(index.values()))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1) + "\n"
    )


def gamma_change(tmp, texts, source, settings, hybrid, weight_map, config, cfg, log) -> dict:
    """Inference-time hybridisation: gamma fixed (already written) or calibrated per layer and head (rewritten),
    and the held-out perplexity by position bucket before / after, into gamma_report.json."""
    x = cfg.export
    gammas = {"as trained": load_file(source / PARAMS_NAME)}
    errors = None
    if x.calibrate_gamma:
        hybrid, errors = calibrate_gamma(tmp, texts[0], settings, hybrid, cfg, log)
        write_hybrid(tmp, config, settings, hybrid, weight_map)
        gammas["calibrated"] = hybrid
        note = (
            f"gamma calibrated per layer and head on {x.calibration_sequences} sequences of "
            f"{x.calibration_seq_len} tokens: hybrid output fit to full causal softmax over the merged q, k, v."
        )
    else:
        gammas[f"fixed {x.gamma}"] = hybrid
        note = f"gamma fixed at {x.gamma} for every head."
    report = {"note": note, "calibration_mse": errors}
    if x.report_sequences:
        report.update(perplexity_report(tmp, texts[1], cfg, gammas))
    (tmp / "gamma_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
