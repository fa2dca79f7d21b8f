"""Step b, the pipeline: distill -> finetune -> evaluate -> export through the CLI for one run (run_pipeline, under
the collective checker), the figures it leaves on disk (collect), the export loaded as a user would and its cached
decode (the part `export_check`, run in its own process), and the checks: the checked run against the reference
(compare_pipelines, within TOL) and each run on its own (own_checks); `section`, its part of the report. The check's
step_pipeline (check.py) joins them."""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

from benchmarks.device.run import Log, run_child
from benchmarks.device.settings import COLLECTIVES, DECODE_TOL, HELDOUT_FRACTION, MODES, TEXT, TOL, finite, rel_diff
from benchmarks.report_table import fmt, table

EXPORT_CHECK_RESERVE = 30  # s before the deadline by which the stages end: the export check runs after them


def pipeline_overrides(s: dict, model: str, tasks: str, run_dir: Path, device: str, dtype: str) -> list[str]:
    p = s["pipe"]
    return [
        f"model.path={model}",
        f"model.device={device}",
        f"model.dtype={dtype}",
        f"run_dir={run_dir}",
        f"data.source={TEXT}",
        "data.text_field=text",
        f"data.seq_len={p['seq_len']}",
        f"data.num_sequences={p['num_sequences']}",
        f"data.heldout_fraction={HELDOUT_FRACTION}",
        f"attention.window={p['window']}",
        f"distill.epochs={p['epochs']}",
        f"distill.batch_size={p['distill_batch']}",
        "distill.progress=false",
        "finetune.recipe=ssd",
        f"finetune.max_steps={p['steps']}",
        f"finetune.global_batch={p['global_batch']}",
        f"finetune.micro_batch={p['micro_batch']}",
        f"finetune.eval_every={p['eval_every']}",
        f"finetune.save_every={p['eval_every']}",
        f"finetune.heldout_sequences={p['heldout']}",
        "finetune.lr=0.001",
        "finetune.warmup_steps=2",
        "finetune.progress=false",
        "eval.tasks=[piqa,arc_easy]",
        f"eval.data_dir={tasks}",
        f"eval.limit={p['limit']}",
        f"eval.modes=[{','.join(MODES)}]",
        f"eval.ppl_seq_len={p['ppl_seq_len']}",
        f"eval.ppl_sequences={p['ppl_sequences']}",
        f"eval.buckets=[{','.join(map(str, p['buckets']))}]",
        f"eval.la_share_seq_len={p['la_share']}",
        f"eval.passkey_distances=[{','.join(map(str, p['passkey']))}]",
        f"eval.passkey_trials={p['passkey_trials']}",
        "eval.bootstrap=100",
        "eval.batch_size=8",
        "eval.progress=false",
    ]


def run_pipeline(s: dict, tag: str, device: str, dtype: str, built: dict, work: Path, log: Log, extra_env) -> dict:
    """The four stages through the CLI: one process per stage (`hybrid-scale distill ...` etc., each timed), or with
    GPU_CHECK_CLI=pipeline one `hybrid-scale pipeline` process (fewer interpreter starts: the CPU dry run)."""
    run_dir = work / f"run_{tag}"
    overrides = pipeline_overrides(s, built["model"], built["tasks"], run_dir, device, dtype)
    result = {"device": device, "dtype": dtype, "run_dir": str(run_dir), "stage_s": {}, "failed": None}
    prefix = work / f"collectives_{tag}"
    if (COLLECTIVES / "sitecustomize.py").is_file():  # every collective of the stages recorded; one whose tensor is
        # not on the run's device is reported by own_checks (recorded, not refused: the run's other figures survive)
        kind = "cuda" if device.startswith("cuda") else "cpu"
        extra_env = {
            **extra_env,
            "HYBRID_SCALE_COLLECTIVES": str(prefix),
            "HYBRID_SCALE_COLLECTIVES_DEVICE": kind,
            "HYBRID_SCALE_COLLECTIVES_REFUSE": "0",
        }
        result["collectives_file"] = str(prefix) + ".rank0"
    commands = ["pipeline"] if s["cli"] == "pipeline" else ["distill", "finetune", "evaluate", "export"]
    for stage in commands:
        cmd = [sys.executable, "-m", "hybrid_scale.cli", stage, *overrides]
        rc, _, err, seconds = run_child(cmd, f"{tag}: {stage}", log, s["timeout"], extra_env, EXPORT_CHECK_RESERVE)
        result["stage_s"][stage] = seconds
        if rc != 0:
            result["failed"] = f"{stage} (exit {rc}): {err.strip()[-1500:]}"
            return result
    if s["cli"] == "pipeline":  # the stages' own timings, as the pipeline records them
        result["stage_s"] |= json.loads((run_dir / "timings.json").read_text())
    if result.get("collectives_file"):
        path = Path(result["collectives_file"])
        calls = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        result["collectives"] = {
            "calls": len(calls),
            "devices": sorted({d for c in calls for d in c["device"]}),
            "ops": dict(collections.Counter(c["op"] for c in calls)),
        }
    return result | collect(run_dir)


def collect(run_dir: Path) -> dict:
    """The figures a run left on disk: stage-1 final losses, stage-2 curves, evaluation results."""
    from safetensors import safe_open

    from hybrid_scale.evaluate.results import EvalResults

    stage1 = {}
    for f in sorted((run_dir / "stage1").glob("layer_*.safetensors")):
        with safe_open(str(f), "pt") as h:
            losses = json.loads((h.metadata() or {}).get("losses", "[]"))
        if losses:
            stage1[int(f.stem.split("_")[1])] = losses[-1]
    curves = json.loads((run_dir / "stage2" / "curves.json").read_text())
    results = EvalResults.load(run_dir / "eval" / "results.json")
    logliks = {
        mode: [ll for r in per.tasks.values() for item in r.loglik for ll in item]
        for mode, per in results.modes.items()
    }
    return {
        "stage1_final_loss": stage1,
        "stage2_train_loss": curves["train"][-1],
        "stage2_heldout_hybrid": curves["hybrid"][-1],
        "stage2_heldout_la_only": curves["la_only"][-1],
        "perplexity": results.perplexity.by_mode,
        "task_avg": {mode: per.avg for mode, per in results.modes.items()},
        "logliks": logliks,
        "la_share_layers": len(results.la_share.share) if results.la_share else 0,
        "verdict": results.verdict,
    }


def part_export_check(s: dict, work: Path) -> dict:
    """Both runs' exports (work/export_check_runs.json: [[run_dir, device, dtype], ...]), each checked by
    export_check."""
    runs = json.loads((work / "export_check_runs.json").read_text())
    return {run_dir: export_check(s, Path(run_dir), device, dtype) for run_dir, device, dtype in runs}


def export_check(s: dict, run_dir: Path, device: str, dtype_name: str) -> dict:
    """The export loaded as a user would (trust_remote_code) on the run's device and dtype: held-out loss, cached decode
    vs the full forward; and every tensor the run wrote is finite."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybrid_scale.data import corpus
    from hybrid_scale.models.converted import load_tokenizer

    p = s["pipe"]
    dtype = getattr(torch, dtype_name)
    export = run_dir / "export"
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    tok = load_tokenizer(export)  # the export's tokenizer without its remote code, as the toolkit reads it
    docs = corpus.heldout_documents(str(TEXT), "text", HELDOUT_FRACTION, "report")
    L, k = p["ppl_seq_len"], p["decode_steps"]
    ids = torch.tensor([tok.encode("\n\n".join(docs))[:L]], device=device)
    with torch.no_grad():
        full = model(ids, labels=ids, use_cache=False)
        out = model(ids[:, : L - k], use_cache=True)
        for j in range(L - k, L):
            out = model(ids[:, j : j + 1], past_key_values=out.past_key_values, use_cache=True)
    a, b = full.logits[0, -1].float(), out.logits[0, -1].float()
    decode_rel = ((a - b).abs().max() / a.abs().max()).item()
    bad, scanned = [], 0
    for f in sorted(run_dir.rglob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            scanned += 1
            if t.is_floating_point() and not torch.isfinite(t).all():
                bad.append(f"{f.relative_to(run_dir)}:{name}")
    return {
        "export_loss": full.loss.item(),
        "export_logits_finite": bool(torch.isfinite(full.logits).all()),
        "decode_rel_diff": decode_rel,
        "decode_steps": k,
        "tensors_scanned": scanned,
        "nonfinite_tensors": bad,
    }


def compare_pipelines(run: dict, ref: dict) -> list[dict]:
    """Rows (figure, value, reference, relative difference, tolerance, status)."""
    rows = []

    def add(figure, value, reference, tol_key):
        tol = TOL[tol_key]
        ok = finite(value) and finite(reference) and rel_diff(value, reference) <= tol
        d = rel_diff(value, reference) if finite(value) and finite(reference) else float("nan")
        rows.append(dict(figure=figure, value=value, ref=reference, rel=d, tol=tol, status="ok" if ok else "FAILED"))

    if not run["stage1_final_loss"] or not ref["stage1_final_loss"]:  # the layer files no longer carry their losses
        rows.append(
            dict(
                figure="stage 1 final losses (metadata 'losses' of stage1/layer_*.safetensors)",
                value=float("nan"),
                ref=float("nan"),
                rel=float("nan"),
                tol=TOL["stage1_loss"],
                status="FAILED",
            )
        )
    for layer in sorted(set(run["stage1_final_loss"]) | set(ref["stage1_final_loss"]), key=int):
        add(
            f"stage 1 final loss, layer {layer}",
            run["stage1_final_loss"].get(layer, float("nan")),
            ref["stage1_final_loss"].get(layer, float("nan")),
            "stage1_loss",
        )
    add("stage 2 last training loss", run["stage2_train_loss"], ref["stage2_train_loss"], "stage2_train_loss")
    add(
        "stage 2 held-out loss, hybrid",
        run["stage2_heldout_hybrid"],
        ref["stage2_heldout_hybrid"],
        "stage2_heldout_loss",
    )
    add(
        "stage 2 held-out loss, la_only",
        run["stage2_heldout_la_only"],
        ref["stage2_heldout_la_only"],
        "stage2_heldout_loss",
    )
    for mode in MODES:
        for bucket, value in run["perplexity"].get(mode, {}).items():
            add(
                f"perplexity {mode} {bucket}",
                value,
                ref["perplexity"].get(mode, {}).get(bucket, float("nan")),
                "perplexity",
            )
    for mode in MODES:
        a, b = run["logliks"].get(mode, []), ref["logliks"].get(mode, [])
        if a and len(a) == len(b):
            mean_abs = statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))
            scale = statistics.fmean(abs(y) for y in b)
            rows.append(
                dict(
                    figure=f"task log-likelihoods {mode}: mean abs diff / mean abs ll ({len(a)} requests)",
                    value=mean_abs,
                    ref=scale,
                    rel=mean_abs / scale,
                    tol=TOL["task_loglik"],
                    status="ok" if mean_abs / scale <= TOL["task_loglik"] else "FAILED",
                )
            )
    add("export held-out loss (trust_remote_code load)", run["export_loss"], ref["export_loss"], "export_loss")
    return rows


def own_checks(run: dict, tag: str) -> list[dict]:
    """Checks of one run on its own: finiteness, decode vs full forward."""
    rows = []
    bad = run["nonfinite_tensors"]
    rows.append(
        dict(
            check=f"{tag}: every tensor written is finite ({run['tensors_scanned']} tensors)",
            value=len(bad),
            limit=0,
            status="ok" if not bad else "FAILED",
            note=", ".join(bad[:5]),
        )
    )
    figures = [
        run["stage2_train_loss"],
        run["stage2_heldout_hybrid"],
        run["stage2_heldout_la_only"],
        run["export_loss"],
    ]
    figures += list(run["stage1_final_loss"].values()) + [x for m in run["perplexity"].values() for x in m.values()]
    figures += [x for m in run["logliks"].values() for x in m]
    nonfinite = sum(not finite(x) for x in figures)
    rows.append(
        dict(
            check=f"{tag}: every loss, perplexity and log-likelihood is finite ({len(figures)} figures)",
            value=nonfinite,
            limit=0,
            status="ok" if nonfinite == 0 and run["export_logits_finite"] else "FAILED",
            note="",
        )
    )
    if "collectives" in run:
        c = run["collectives"]
        kind = "cuda" if run["device"].startswith("cuda") else "cpu"
        wrong = [d for d in c["devices"] if not d.startswith(kind)]
        ops = ", ".join(f"{op} {n}" for op, n in sorted(c["ops"].items()))
        rows.append(
            dict(
                check=f"{tag}: torch.distributed collectives of the four stages on the run's device "
                "(tests/collectives checker)",
                value=c["calls"],
                limit=f"all on {kind}",
                status="ok" if not wrong else "FAILED",
                note=(f"off-device: {', '.join(wrong)}; " if wrong else "") + (ops or "none made"),
            )
        )
    tol = DECODE_TOL.get(run["dtype"], 3e-2)
    rows.append(
        dict(
            check=f"{tag}: export's cached decode ({run['decode_steps']} steps) vs full forward, "
            "max abs diff / max abs logit",
            value=run["decode_rel_diff"],
            limit=tol,
            status="ok" if finite(run["decode_rel_diff"]) and run["decode_rel_diff"] <= tol else "FAILED",
            note="",
        )
    )
    return rows


def section(d: dict) -> list[str]:
    """Part b in the report: each stage's seconds, the figures against the reference, each run's own checks."""
    s, timing, compare, checks = d["settings"], d.get("pipeline", {}), d.get("compare"), d.get("checks")
    if not (compare or checks or timing):
        return []
    tag, ref = f"{s['device']} {s['dtype']}", f"{s['ref_device']} {s['ref_dtype']}"
    lines = ["## b. Pipeline: distill -> finetune -> evaluate -> export (CLI), checked vs reference", "",
             f"Budgets: {json.dumps(s['pipe'])}; recipe hedgecats stage 1, ssd stage 2; modes {', '.join(MODES)}.",
             ""]  # fmt: skip
    if timing:
        stages = list(dict.fromkeys([*timing.get("run", {}), *timing.get("ref", {})]))
        rows = [[st, fmt(timing.get("run", {}).get(st), 3), fmt(timing.get("ref", {}).get(st), 3)] for st in stages]
        lines += table(["stage", f"{tag} s", f"{ref} s"], rows) + [""]
    if compare:
        rows = [[r["figure"], fmt(r["value"], 4), fmt(r["ref"], 4), fmt(r["rel"], 2), str(r["tol"]), r["status"]]
                for r in compare]  # fmt: skip
        lines += table(["figure", tag, ref, "rel. diff", "tolerance", "status"], rows) + [""]
    if checks:
        rows = [[r["check"], fmt(r["value"], 3), str(r["limit"]), r["status"], r["note"]] for r in checks]
        lines += table(["check", "value", "limit", "status", "note"], rows) + [""]
    extra = d.get("pipeline_info")
    if extra:
        lines += [f"Task accuracy (info, {s['pipe']['limit']} synthetic items per task, random labels):", ""]
        rows = [[mode, fmt(extra["run"].get(mode), 3), fmt(extra["ref"].get(mode), 3)] for mode in MODES]
        lines += table(["mode", tag, ref], rows) + [""]
    return lines
