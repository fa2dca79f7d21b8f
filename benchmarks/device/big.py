"""Part 7, big (named in DEVICE_SPEED_PARTS only; it does not fit beside the default parts): stage 1 and stage 2 of
an 8B-shaped random model (benchmarks/device/stages.py at the 8B shape, 4 layers, the preset's attention and sequence
length; in a child process, cut at the part's budget): tokens/s, MFU
(model FLOPs / time / 989 TFLOP/s, dense bf16 of an H100/H200 SXM), peak memory, and the GPU-hours of an 8B
conversion at the presets' token budgets (configs/models/llama3-8b.yaml, configs/recipes/*.yaml) beside LoLCATs' 6.5
A100-hours. The FLOP counts are stage1_flops_per_sequence and stage2_flops_per_token."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.device.run import Run, child_part
from benchmarks.device.settings import LOLCATS_A100_HOURS, PEAK_TFLOPS, ROOT
from benchmarks.device.stages import part_stages
from benchmarks.report_table import fmt, table


def layer_params(m: dict) -> int:
    hd = m["head_dim"]
    return m["hidden"] * hd * (2 * m["heads"] + 2 * m["kv"]) + 3 * m["hidden"] * m["inter"]


def preset_tokens() -> dict:
    """Stage 1's and stage 2's tokens at the 8B preset (configs/models/llama3-8b.yaml) under each recipe."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    from hybrid_scale.config import load_config  # noqa: PLC0415

    preset = load_config("models/llama3-8b.yaml")
    out = {}
    for path in sorted((ROOT / "configs" / "recipes").glob("*.yaml")):
        c = OmegaConf.merge(preset, OmegaConf.load(path))
        seq, ft_seq = c.data.seq_len, c.finetune.seq_len or c.data.seq_len
        out[path.stem] = dict(
            stage1_tokens_per_layer=c.data.num_sequences * seq * c.distill.epochs,  # trained on, per layer
            stage1_teacher_tokens=c.data.num_sequences * seq,  # the teacher's pass per layer
            stage2_tokens=c.finetune.max_steps
            * c.finetune.global_batch
            * ft_seq,  # (hedgecats: at most, it stops early)
            layers=preset.model.arch.num_hidden_layers,
            seq_len=seq,
            stage2_seq_len=ft_seq,
        )
    return out


def attention_flops_per_token(m: dict, window: int) -> float:
    """The hybrid's forward per token and layer, as benchmarks/attention/kernels.py counts it (window q.k and p.v, the
    state read, the block states), with phi's output 2 x head_dim (hedgehog, f = d)."""
    H, Hkv, D = m["heads"], m["kv"], m["head_dim"]
    Fout = 2 * D
    return 4 * H * D * window + 2 * H * Fout * D + 2 * Hkv * Fout * D


def stage1_flops_per_sequence(m: dict, T: int) -> tuple[float, float]:
    """(training a layer's feature maps on one sequence, the teacher layer's pass over it), weights_xent's work:
    q/k/v projections (forward), phi_q and phi_k (D x f per head; forward and backward = 3x), the teacher's causal
    score rows (forward only) and the LA's rows phi_q . phi_k (3x), each over the causal half of T x T; the teacher
    pass: every matmul of the layer (2 x its weights per token) and causal attention (2 x 2 x H x D x T^2 / 2)."""
    H, Hkv, D, hid = m["heads"], m["kv"], m["head_dim"], m["hidden"]
    f, Fout = D, 2 * D
    proj = 2 * T * hid * (H + 2 * Hkv) * D
    maps = 3 * 2 * T * D * f * (H + Hkv)
    rows = 2 * H * D * T * T / 2 + 3 * 2 * H * Fout * T * T / 2
    teacher = 2 * T * layer_params(m) + 2 * H * D * T * T
    return proj + maps + rows, teacher


def stage2_flops_per_token(m: dict, layers: int, window: int) -> float:
    """LoRA fine-tuning: 4 x the matmul weights per token (forward, and the backward's input gradients: the frozen base
    gets no weight gradients; LoRA's own and gradient checkpointing's recomputation not counted) plus the hybrid
    attention, forward+backward = 3.5 x its forward (kernel_speed's convention)."""
    return 4 * (layers * layer_params(m) + m["hidden"] * m["vocab"]) + layers * 3.5 * attention_flops_per_token(
        m, window
    )


def part_big(run: Run) -> dict:
    timeout = max(1, int(min(run.cfg["budgets"]["big"], run.left() - 3)))
    return summarise_big(run, child_part(run, "big", timeout))


def steady(xs: list[float]) -> float:
    """The median after the first (which compiles and warms up), or the only one."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def summarise_big(run: Run, raw: dict) -> dict:
    b, w = run.cfg["big"], run.cfg["window"]
    T, L = b["seq_len"], b["layers"]
    peak = PEAK_TFLOPS * 1e12
    layer_s = steady(raw["stage1_layer_s"])
    teacher_s = steady(raw["stage1_teacher_s"]) if raw.get("stage1_teacher_s") else None
    train_tokens = b["sequences"] * T  # one epoch
    train_flops, teacher_flops = (b["sequences"] * x for x in stage1_flops_per_sequence(b, T))
    step_s = steady(raw["stage2_step_s"])
    step_tokens = b["global_batch"] * T
    flops2 = stage2_flops_per_token(b, L, w)
    fig = dict(
        params=raw["params"],
        stage1_layer_s=layer_s,
        stage1_tokens_per_s=train_tokens / layer_s,
        stage1_mfu=train_flops / layer_s / peak,
        stage1_teacher_s=teacher_s,
        stage1_teacher_tokens_per_s=train_tokens / teacher_s if teacher_s else None,
        stage1_teacher_mfu=teacher_flops / teacher_s / peak if teacher_s else None,
        stage1_peak_gib=raw.get("stage1_peak_gib"),
        stage2_step_s=step_s,
        stage2_tokens_per_s=step_tokens / step_s,
        stage2_mfu=flops2 * step_tokens / step_s / peak,
        stage2_peak_gib=raw.get("stage2_peak_gib"),
        raw=raw,
    )
    for key in ("stage1_mfu", "stage2_mfu", "stage1_tokens_per_s", "stage2_tokens_per_s"):
        print(f"device_speed: big {key} = {fmt(fig[key])}", flush=True)
    # the 8B conversion at each recipe's budget, on this GPU: stage 1 per layer as measured (same shape and length),
    # times the preset's layers; stage 2 as measured, scaled by the FLOPs of the preset's depth (same MFU)
    projection = {}
    for recipe, p in preset_tokens().items():
        s1 = p["layers"] * (p["stage1_tokens_per_layer"] * layer_s / train_tokens)
        s1 += p["layers"] * (p["stage1_teacher_tokens"] * (teacher_s or 0.0) / train_tokens)
        scale = stage2_flops_per_token(b, p["layers"], w) / flops2
        s2 = p["stage2_tokens"] * step_s / step_tokens * scale
        projection[recipe] = dict(p, stage1_gpu_hours=s1 / 3600, stage2_gpu_hours=s2 / 3600, total=(s1 + s2) / 3600)
        run.ratio(f"8B conversion GPU-hours ({recipe}) / LoLCATs' A100-hours", (s1 + s2) / 3600 / LOLCATS_A100_HOURS)
    fig["projection"] = projection
    fig["projection_note"] = (
        "stage 1: the measured s per layer (feature maps trained on one epoch, and the teacher pass) per token, times "
        "the preset's tokens and its 32 layers; stage 2: the measured s per token scaled by the FLOPs of 32 layers "
        "against the measured depth (same MFU); one GPU (the preset's 8 share it); evaluation and export not counted"
    )
    return fig


def child_big(cfg: dict, work: Path) -> dict:
    """(In the child process) stages.py's stage 1 and stage 2 at the 8B shape, with the preset's attention."""
    b = dict(cfg["big"])
    b["overrides"] = [f"attention.window={cfg['window']}", f"attention.sinks={cfg['sinks']}",
                      "attention.hybrid_sinks=true", "attention.la_decay=true",
                      "finetune.gradient_checkpointing=true"]  # fmt: skip
    if cfg["dry"]:
        b["overrides"].append("attention.backend=torch")
    return part_stages({"big": b, "device": cfg["device"], "dtype": cfg["dtype"]}, work)


def section(d: dict) -> list[str]:
    """The report's section of part big (none when it did not run or measured nothing)."""
    big = d.get("big")
    if not big or "stage1_layer_s" not in big:
        return []
    bc = d["settings"]["big"]
    lines = ["", "## 7. 8B-shaped stage 1 and stage 2 (random weights)", "",
             f"Llama, {bc['layers']} layers, hidden {bc['hidden']}, {bc['heads']} heads, {bc['kv']} KV heads, head dim "
             f"{bc['head_dim']}, intermediate {bc['inter']}, vocab {bc['vocab']} ({big['params']:,} parameters); "
             f"{bc['sequences']} sequences x {bc['seq_len']} tokens; stage 1 batch {bc['distill_batch']}, stage 2 "
             f"{bc['global_batch']} sequences per step (micro-batch {bc['micro_batch']}, gradient checkpointing). MFU "
             f"= model FLOPs / time / {PEAK_TFLOPS:g} TFLOP/s (the counts: benchmarks/device/big.py, "
             "stage1_flops_per_sequence and stage2_flops_per_token).", ""]  # fmt: skip
    lines += table(["figure", "value"], [
        ["stage 1: s per layer (one epoch; median after the first layer)", fmt(big["stage1_layer_s"])],
        ["stage 1: tokens/s (feature-map training) / MFU",
         f"{fmt(big['stage1_tokens_per_s'])} / {fmt(big['stage1_mfu'])}"],
        ["stage 1: teacher pass tokens/s / MFU",
         f"{fmt(big['stage1_teacher_tokens_per_s'])} / {fmt(big['stage1_teacher_mfu'])}"],
        ["stage 1: peak GiB", fmt(big["stage1_peak_gib"])],
        ["stage 2: s per step (median after the first)", fmt(big["stage2_step_s"])],
        ["stage 2: tokens/s / MFU", f"{fmt(big['stage2_tokens_per_s'])} / {fmt(big['stage2_mfu'])}"],
        ["stage 2: peak GiB", fmt(big["stage2_peak_gib"])],
    ])  # fmt: skip
    lines += ["", f"Projected GPU-hours of an 8B conversion on this GPU ({big['projection_note']}), beside LoLCATs' "
              f"{LOLCATS_A100_HOURS} A100-hours:", ""]  # fmt: skip
    rows = [[recipe, f"{p['stage1_tokens_per_layer']:,}", f"{p['stage2_tokens']:,}", fmt(p["stage1_gpu_hours"]),
             fmt(p["stage2_gpu_hours"]), fmt(p["total"]), fmt(p["total"] / LOLCATS_A100_HOURS)]
            for recipe, p in big["projection"].items()]  # fmt: skip
    head = ["recipe", "stage 1 tokens per layer", "stage 2 tokens", "stage 1 GPU-h", "stage 2 GPU-h", "total GPU-h",
            "x LoLCATs"]  # fmt: skip
    return lines + table(head, rows)
