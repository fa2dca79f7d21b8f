"""Step f, the report: Report, which holds every step's status and figures and writes them, after each step, as the
table gpu_check.md (its figures and tables by benchmarks/report_table.py) and as gpu_check.json (every figure) into
GPU_CHECK_OUT; its summary() is the one line the check ends with."""

from __future__ import annotations

import datetime
import json
import statistics
import threading
import traceback
from pathlib import Path

from benchmarks.report_table import fmt, skipped_row, table

from .settings import DECODE_TOL, MODES, TOL


class Report:
    def __init__(self, s: dict, out: Path, command: str):
        self.s, self.out, self.command = s, out, command
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.steps: dict[str, dict] = {}
        self.data: dict = {}
        self.compare: list[dict] = []
        self.checks: list[dict] = []
        self.lock = threading.Lock()

    def step(self, key: str, title: str, status: str, seconds: float, note: str = "") -> None:
        self.steps[key] = dict(title=title, status=status, seconds=seconds, note=note)

    def failures(self) -> list[str]:
        out = [f"step {k} ({v['title']})" for k, v in sorted(self.steps.items()) if v["status"] == "FAILED"]
        out += [r["figure"] for r in self.compare if r["status"] == "FAILED"]
        out += [r["check"] for r in self.checks if r["status"] == "FAILED"]
        return out

    def markdown(self) -> str:
        s, d = self.s, self.data
        info = d.get("build", {}).get("device_info") or d.get("attention", {}).get("device_info") or {}
        v = d.get("build", {}).get("versions", {})
        lines = [
            "# GPU check" + (" (CPU dry run, toy sizes)" if s["small"] else ""),
            "",
            f"- date: {self.started.strftime('%Y-%m-%d %H:%M UTC')}",
            f"- device: {s['device']} ({info.get('gpu') or info.get('cpu') or '?'}"
            + (f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else "")
            + f"), checked dtype {s['dtype']}; reference {s['ref_device']} {s['ref_dtype']}",
            f"- torch {v.get('torch', '?')} (CUDA {v.get('cuda')}), transformers {v.get('transformers')}, "
            f"peft {v.get('peft')}, deepspeed {v.get('deepspeed')}, datasets {v.get('datasets')}, "
            f"omegaconf {v.get('omegaconf')}, python {v.get('python')}; hybrid_scale from {v.get('hybrid_scale_from')}",
            f"- command: `{self.command}`",
            "",
            "| step | status | seconds | note |",
            "|---|---|---|---|",
        ]
        for k, r in sorted(self.steps.items()):
            lines.append(f"| {k}. {r['title']} | {r['status']} | {r['seconds']:.1f} | {r['note']} |")
        lines.append("")
        b = d.get("build")
        if b:
            lines += [
                "## a. Tiny model",
                "",
                f"Llama {json.dumps(s['tiny'])}, vocab {b['vocab']} (byte-level tokenizer built here), "
                f"{b['params']:,} parameters; pretrained {b['pretrain_steps']} steps on {s['device']} in float32 on "
                f"benchmarks/gpu_check/text.jsonl (loss {b['pretrain_loss_first']:.3f} -> "
                f"{b['pretrain_loss_last']:.3f}, {b['pretrain_s']:.1f} s); synthetic PIQA / ARC-Easy items for the "
                "evaluation.",
                "",
            ]
        if self.compare or self.checks or d.get("pipeline"):
            tag, ref = f"{s['device']} {s['dtype']}", f"{s['ref_device']} {s['ref_dtype']}"
            lines += [
                "## b. Pipeline: distill -> finetune -> evaluate -> export (CLI), checked vs reference",
                "",
                f"Budgets: {json.dumps(s['pipe'])}; recipe hedgecats stage 1, ssd stage 2; modes {', '.join(MODES)}.",
                "",
            ]
            timing = d.get("pipeline", {})
            if timing:
                lines += [f"| stage | {tag} s | {ref} s |", "|---|---|---|"]
                stages = list(dict.fromkeys([*timing.get("run", {}), *timing.get("ref", {})]))
                for st in stages:
                    a_, b_ = timing.get("run", {}).get(st), timing.get("ref", {}).get(st)
                    lines.append(f"| {st} | {fmt(a_, 3)} | {fmt(b_, 3)} |")
                lines.append("")
            if self.compare:
                rows = [[r["figure"], fmt(r["value"], 4), fmt(r["ref"], 4), fmt(r["rel"], 2), str(r["tol"]),
                         r["status"]] for r in self.compare]  # fmt: skip
                lines += table(["figure", tag, ref, "rel. diff", "tolerance", "status"], rows) + [""]
            if self.checks:
                rows = [[r["check"], fmt(r["value"], 3), str(r["limit"]), r["status"], r["note"]] for r in self.checks]
                lines += table(["check", "value", "limit", "status", "note"], rows) + [""]
            extra = d.get("pipeline_info")
            if extra:
                lines += [f"Task accuracy (info, {s['pipe']['limit']} synthetic items per task, random labels):", ""]
                lines += [f"| mode | {tag} | {ref} |", "|---|---|---|"]
                for mode in MODES:
                    lines.append(f"| {mode} | {fmt(extra['run'].get(mode), 3)} | {fmt(extra['ref'].get(mode), 3)} |")
                lines.append("")
        big = d.get("big")
        if big:
            layer = big["stage1_layer_s"]
            steps = big["stage2_step_s"]
            later = steps[1:] or steps
            bb = big["config"]
            lines += [
                "## c. 1B-shaped model (random weights), stage 1 layer and stage 2 step"
                + (" (toy shape in this dry run)" if s["small"] else ""),
                "",
                f"Llama hidden {bb['hidden']}, {bb['layers']} layers, {bb['heads']} heads, {bb['kv']} KV heads, "
                f"head_dim {bb['head_dim']}, intermediate {bb['inter']}, vocab 259 ({big['params']:,} parameters), "
                f"{s['dtype']} on {s['device']}; {bb['sequences']} sequences x {bb['seq_len']} tokens.",
                "",
                "| figure | value |",
                "|---|---|",
                f"| stage 1: s per layer ({big['stage1_layer_timing']}; {big['steps_per_layer']} steps of "
                f"{bb['distill_batch']} x {bb['seq_len']} tokens, first layer / median of the rest) | "
                f"{fmt(layer[0], 3)} / {fmt(statistics.median(layer[1:] or layer), 3)} |",
                f"| stage 1: s per training step (median layer / steps) | "
                f"{fmt(statistics.median(layer[1:] or layer) / big['steps_per_layer'], 3)} |",
                f"| stage 1: teacher pass s per layer (median) | "
                f"{fmt(statistics.median(big['stage1_teacher_s']), 3) if big['stage1_teacher_s'] else 'n/a'} |",
                f"| stage 1: whole stage s / peak GiB | {fmt(big['stage1_s'], 3)} / {fmt(big['stage1_peak_gib'], 3)} |",
                f"| stage 2: s per optimizer step ({bb['global_batch']} x {bb['seq_len']} tokens, micro-batch 1; "
                f"first / median of the rest) | {fmt(steps[0], 3) if steps else 'n/a'} / "
                f"{fmt(statistics.median(later), 3) if steps else 'n/a'} |",
                f"| stage 2: tokens per s (median step) | "
                f"{fmt(bb['global_batch'] * bb['seq_len'] / statistics.median(later), 4) if steps else 'n/a'} |",
                f"| stage 2: whole stage s (load, ZeRO-3 init, steps, save) / peak GiB | {fmt(big['stage2_s'], 3)} / "
                f"{fmt(big['stage2_peak_gib'], 3)} |",
                "",
            ]
        att = d.get("attention")
        if att:
            sh = att["shape"]
            lines += [
                "## d. Hybrid attention vs SDPA (hybrid mode)",
                "",
                f"batch 1, {sh['heads']} heads, {sh['kv_heads']} KV heads, head_dim {sh['head_dim']}, features "
                f"{sh['feature']}, window {sh['window']}, chunk {sh['chunk']}, {att['dtype']} on {s['device']}; median "
                f"of {s['attn']['repeats']} after {s['attn']['warmup']} warm-up; peak = max_memory_allocated above "
                f"the inputs. SDPA: is_causal, {att.get('sdpa', '?')}. Hybrid: phi inputs given (hedgehog-like "
                "features), the feature maps themselves not timed.",
                "",
            ]
            rows = []
            for r in att["rows"]:
                if "skipped" in r:
                    rows.append(skipped_row([r["T"], r["backend"]], r["skipped"]))
                    continue
                rows.append([r["T"], r["backend"], *(fmt(r[k], 4) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_peak_mib",
                             "fwd_bwd_peak_mib")), *(fmt(r.get(k), 3) for k in ("fwd_x_sdpa", "fwd_bwd_x_sdpa",
                             "mem_x_sdpa"))])  # fmt: skip
            lines += table(["T", "backend", "fwd ms", "fwd+bwd ms", "fwd peak MiB", "fwd+bwd peak MiB", "fwd x SDPA",
                            "fwd+bwd x SDPA", "mem x SDPA"], rows)  # fmt: skip
            lines.append("")
        kernel_md = self.out / "kernel_speed.md"
        if d.get("kernel_speed") and kernel_md.is_file():  # its own tables, under this report's heading
            lines += ["## e. Fused Triton kernels (benchmarks/attention/kernels.py)", ""]
            lines += [line for line in kernel_md.read_text().splitlines()[1:] if not line.startswith("Command:")]
        lines += ["", f"**Summary:** {self.summary()}", ""]
        return "\n".join(lines)

    def summary(self) -> str:
        failed = self.failures()
        n_checks = len(self.compare) + len(self.checks)
        n_ok = sum(r["status"] == "ok" for r in [*self.compare, *self.checks])  # failed steps are not figures
        steps = ", ".join(f"{k} {v['status']}" for k, v in sorted(self.steps.items()))
        total = (datetime.datetime.now(datetime.timezone.utc) - self.started).total_seconds()
        head = "gpu_check: PASSED" if not failed else f"gpu_check: FAILED ({len(failed)}: {'; '.join(failed[:6])})"
        return f"{head}; steps {steps}; {n_ok}/{n_checks} figure checks ok; {total:.0f} s"

    def write(self) -> None:
        with self.lock:
            self._write()

    def safe_markdown(self) -> str:
        """The table, or (a figure it did not expect) the traceback and the summary: the report is never lost."""
        try:
            return self.markdown()
        except Exception:
            tb = traceback.format_exc()
            return f"# GPU check\n\nThe table failed (the figures are in gpu_check.json):\n\n```\n{tb}```\n\n" + (
                f"**Summary:** {self.summary()}\n"
            )

    def _write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = dict(
            settings=self.s,
            command=self.command,
            date=self.started.isoformat(),
            steps=self.steps,
            compare=self.compare,
            checks=self.checks,
            tolerances=TOL,
            decode_tolerances=DECODE_TOL,
            **self.data,
        )
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(self.safe_markdown())
