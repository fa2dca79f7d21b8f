"""Inference-time hybridisation at export: export.mode=hybrid on an la_only conversion adds SWA with gamma fixed
(export.gamma) or calibrated per layer and head (export.calibrate_gamma) so that the hybrid output matches full
causal softmax over the merged q, k, v; the held-out perplexity by position bucket before and after is its report."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..attention.layer import GAMMA_PARAMS, HybridAttention, Projections
from ..attention.settings import by_name
from ..attention.window.naive import EPS
from ..config.schema import Config
from ..data import corpus
from ..errors import CorpusError, ExportError
from ..measure import perplexity_by_bucket
from ..models import streaming
from ..models.convert import components
from ..models.converted import (
    PARAMS_NAME,
    base_config,
    load_converted,
    load_tokenizer,
)
from .merge import Draft


def gamma_parts(m: HybridAttention, x: Projections) -> tuple[torch.Tensor, ...]:
    """The hybrid output as a function of gamma, from one pass at the layer's own gamma g0: the shared normaliser
    gives y(gamma) = (r * num_soft + num_lin) / (r * den_soft + den_lin + EPS) with r = gamma / g0 per head, where
    num_soft, den_soft are the window part at g0 and num_lin, den_lin the LA part (which gamma does not touch).
    Where the kind's gamma weighs the LA (kinds.Kind.gamma_scales: the gated delta rule) gamma is its mass instead:
    r scales the LA part
    (y = (num_soft + r num_lin) / (den_soft + r den_lin)); its la_combine=mix has no gamma to fit.
    Returns (g0 [H], num_soft, num_lin [B,H,T,D], den_soft, den_lin [B,H,T,1], whether gamma scales the LA part), the
    tensors fp32."""
    if (why := m.part.gamma_fit_problem(m)) is not None:
        raise ValueError(why)
    with torch.no_grad():
        g0 = m.gamma.detach().float()
        y, soft, lin = m.attend(*x[:5], gates=x.gates, gamma=g0, mode="hybrid", return_denominators=True)
        y_soft = m.attend(*x[:5], gates=x.gates, gamma=g0, mode="swa_only")
        soft, lin = soft.float()[..., None], lin.float()[..., None]
        num_soft = y_soft.float() * (soft + EPS)
        num_lin = y.float() * (soft + lin + EPS) - num_soft
    return g0, num_soft, num_lin, soft, lin, m.part.kind.gamma_scales == "la"


def hybrid_at(gamma: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The hybrid output at `gamma` [H] from gamma_parts (differentiable in gamma)."""
    g0, num_soft, num_lin, soft, lin, scales_la = parts
    r = (gamma / g0).view(1, -1, 1, 1)
    if scales_la:
        return (num_soft + r * num_lin) / (soft + r * lin + EPS)
    return (r * num_soft + num_lin) / (r * soft + lin + EPS)


def fit_gamma(m: HybridAttention, x: Projections, target, steps: int) -> tuple[torch.Tensor, float, float]:
    """gamma logits per head minimising the MSE of the hybrid output on the projections `x` to `target`; with the MSE
    before and after. The attention runs once (gamma_parts); every Adam step is then elementwise."""
    logit = m.gamma_logit.detach().clone().float().requires_grad_(True)
    opt = torch.optim.Adam([logit], lr=0.1)
    parts = gamma_parts(m, x)
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


def check_gamma_export(export, settings: dict) -> None:
    """export.gamma / calibrate_gamma need a model that runs hybrid (somewhere), and a fixed gamma its own
    parametrisation can reach; refused before anything is written."""
    modes = {settings.get("mode"), *(settings.get("layer_modes") or {}).values()}
    if "hybrid" not in modes:
        raise ExportError(
            f"export.{'gamma' if export.gamma is not None else 'calibrate_gamma'} is set but the exported model runs "
            f"{', '.join(sorted(m for m in modes if m))}, where gamma has no effect: set export.mode=hybrid"
        )
    if export.gamma is not None:
        why = by_name()["gamma_init"].check(export.gamma, {"gamma_param": settings.get("gamma_param", "sigmoid")})
        if why is not None:  # (the record's check of a gamma against its parametrisation)
            raise ExportError(f"config key 'export.gamma': {why} (the model's attention.gamma_param)")


def export_texts(cfg: Config, tokenizer_dir: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The token ids a gamma calibration (training text) and its perplexity report (held-out text) read, packed
    before any shard is written: too little text is one clear error before the export writes a byte."""
    export = cfg.export
    if not (export.calibrate_gamma or export.gamma is not None):
        return None, None
    tokenizer = load_tokenizer(tokenizer_dir)
    data, calibration, report = cfg.data, None, None
    try:
        what = "export.calibration_sequences x export.calibration_seq_len (training text)"
        if export.calibrate_gamma:
            docs, _ = corpus.train_and_heldout(data.source, data.text_field, data.heldout_fraction)
            calibration = corpus.pack(
                tokenizer, docs, export.calibration_seq_len, export.calibration_sequences, cfg.seed
            )
        what = "export.report_sequences x export.report_seq_len (held-out text; export.report_sequences=0 skips it)"
        if export.report_sequences:
            held = corpus.heldout_documents(data.source, data.text_field, data.heldout_fraction, "report")
            report = corpus.pack(tokenizer, held, export.report_seq_len, export.report_sequences, cfg.seed)
    except CorpusError as e:
        raise ExportError(f"the export's text for {what} falls short: {e}") from None
    return calibration, report


def calibrate_gamma(
    out: Path, ids: torch.Tensor, settings: dict, hybrid: dict, cfg: Config, log
) -> tuple[dict[str, torch.Tensor], dict]:
    """Per layer (streamed, as stage 1): fit gamma per head so that the hybrid output matches full causal softmax
    over the same (merged) q, k, v on a few training sequences (`ids`); the teacher layer produces the next inputs."""
    export = cfg.export
    config = base_config(out)
    config._attn_implementation = "sdpa"
    ckpt = streaming.ShardedCheckpoint(out, "export.out_dir")
    rope = streaming.rotary(config, export.calibration_seq_len, torch.float32)
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
                p = m.project(layer.input_layernorm(h), rope)
                target = streaming.teacher_output(p.q, p.k, p.v, m.scaling)
            logit, before, after = fit_gamma(m, p, target, export.calibration_steps)
            key = prefix + "gamma_logit"
            new[key] = logit.detach().to(hybrid[key].dtype)
            errors[str(i)] = [before, after]
            to_gamma = GAMMA_PARAMS[m.gamma_param][0]
            g0, g1 = to_gamma(hybrid[key].float()).mean(), to_gamma(logit).mean()
            log(f"layer {i}: mean gamma {g0:.3f} -> {g1:.3f}, output mse {before:.3g} -> {after:.3g}")
        h = streaming.teacher(layer, h, rope)
    return new, errors


def perplexity_report(out: Path, seqs: torch.Tensor, cfg: Config, gammas: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Held-out perplexity by position bucket (`seqs`) in hybrid for each gamma setting (plus swa_only and la_only)."""
    export = cfg.export
    buckets = sorted({b for b in cfg.eval.buckets if b < export.report_seq_len} | {0, export.report_seq_len})
    model = load_converted(out, dtype=torch.float32)
    report = {"seq_len": export.report_seq_len, "sequences": len(seqs), "perplexity": {}}
    for mode in ("swa_only", "la_only"):
        with components(model, mode):
            report["perplexity"][mode] = perplexity_by_bucket(model, seqs, buckets)
    for name, params in gammas.items():
        model.load_state_dict({k: v for k, v in params.items() if k.endswith("gamma_logit")}, strict=False)
        with components(model, "hybrid"):
            report["perplexity"][f"hybrid ({name})"] = perplexity_by_bucket(model, seqs, buckets)
    return report


# --- the export's gamma step ------------------------------------------------------------------------------------------


def gamma_change(draft: Draft, cfg: Config, texts: tuple, source: Path, hybrid: dict) -> dict:
    """Inference-time hybridisation: gamma fixed (already written in `hybrid`) or calibrated per layer and head
    (rewritten), and the held-out perplexity by position bucket before / after on `texts` (export_texts), into
    gamma_report.json; `source` is the converted model the export reads (its gamma: "as trained")."""
    export, tmp = cfg.export, draft.dir
    gammas = {"as trained": load_file(source / PARAMS_NAME)}
    errors = None
    if export.calibrate_gamma:
        hybrid, errors = calibrate_gamma(tmp, texts[0], draft.settings, hybrid, cfg, draft.log)
        draft.write_hybrid(hybrid)
        gammas["calibrated"] = hybrid
        note = (
            f"gamma calibrated per layer and head on {export.calibration_sequences} sequences of "
            f"{export.calibration_seq_len} tokens: hybrid output fit to full causal softmax over the merged q, k, v."
        )
    else:
        gammas[f"fixed {export.gamma}"] = hybrid
        note = f"gamma fixed at {export.gamma} for every head."
    report = {"note": note, "calibration_mse": errors}
    if export.report_sequences:
        report.update(perplexity_report(tmp, texts[1], cfg, gammas))
    (tmp / "gamma_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
