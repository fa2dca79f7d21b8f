"""The preflight's estimate of each stage: per-rank memory, disk, trainable state, collectives, tokens and FLOPs,
as simple formulas over the model's shape (shape.py). Each adds its rows (and what blocks or wastes) to the Plan and
returns the figures plan.py combines across stages (device fit, disk, requeue)."""

from __future__ import annotations

from pathlib import Path

from ..attention.kinds import kind_of
from ..config.schema import Config
from ..data import passkey
from ..data.batches import units_per_step
from ..measure import training_flops
from ..run.resolved import Resolved
from .report import Plan
from .shape import (
    CPU_FLOPS,
    DTYPE_BYTES,
    GB,
    MFU,
    READ_BYTES_PER_S,
    Shape,
    decay_params,
    free_at,
    gb,
    la_params,
    stored_bytes,
)


def stage1(p: Plan, cfg: Config, sh: Shape, r: Resolved) -> tuple[float, float, float, float]:
    """Stage 1: one layer (its heads and MLP columns split over tensor_parallel ranks) + a batch; the embedding only
    while building layer 0's inputs. The query blocks of a step are split over the data-parallel groups, and the
    ranks of a group hold the same sequences. (memory, buffer disk, flops, tokens)"""
    a, c, distill, ranks, tp = sh.a, sh.c, cfg.distill, sh.ranks, sh.tp
    dp = ranks // tp
    N, T = cfg.data.num_sequences, cfg.data.seq_len
    n_local = -(-N // dp)
    B = distill.batch_size
    blocks = -(-T // distill.query_block)
    units = units_per_step(B, T, distill.query_block)
    per_rank = -(-units // dp)
    touched = min(B, -(-per_rank // blocks) + 1)  # sequences a rank projects (its units are contiguous)
    batch = B * T * c["D"] * DTYPE_BYTES[distill.buffer_dtype]  # the step's whole batch, on every rank
    # hidden states, then this rank's q/k/v/features and teacher MLP columns
    acts = touched * T * (c["D"] * 2 + (c["D"] * 6 + a["intermediate_size"] * 3) / tp) * 4
    block = per_rank * c["H"] / tp * min(distill.query_block, T) * T * 4 * 6  # score blocks kept for the backward, fp32
    s1_mem = c["layer"] * sh.wbytes / tp + c["V"] * c["D"] * sh.wbytes + batch + acts + block
    s1_disk = 2 * n_local * T * c["D"] * DTYPE_BYTES[distill.buffer_dtype]
    weights = r.derived.objectives
    maps = la_params(cfg, c)
    trained = (maps if distill.train_feature_maps else 0) + (c["H"] if r.derived.train_gamma else 0)
    if weights.get("hybrid_output_mse") or weights.get("output_mse"):  # the LA's decay (distill.step.trainable)
        trained += decay_params(cfg, c)
    p.figures["stage 1"] = {  # per rank, one layer
        "layer_weights_bytes": c["layer"] * sh.wbytes / tp,
        "trainable_params": trained / tp,
        "optimizer_bytes": trained / tp * 8,
        "collectives_per_step": (B if dp > 1 else 0) + 1,  # the batch's broadcasts between groups, the gradients'
    }
    tokens1 = N * T * distill.epochs
    # per layer: feature maps, the T^2 score rows of the objective (forward + backward), the teacher layer's forward
    scores = 3 * 2 * N * T * T * c["H"] * (c["hd"] + sh.fdim) * distill.epochs
    flops1 = c["L"] * (6 * tokens1 * c["H"] * c["hd"] * sh.fdim + scores + 2 * N * T * c["layer"])
    p.rows += [
        (
            "stage 1",
            "per-rank memory",
            f"~{gb(s1_mem)} (one layer{f' / {tp}' if tp > 1 else ''} + embedding + batch of {B} x {T})",
        ),
        (
            "stage 1",
            "work per step",
            f"{units} query blocks ({B} seq x {blocks} of {min(distill.query_block, T)} rows) over {dp} "
            f"{'data-parallel groups' if tp > 1 else 'ranks'}: {per_rank} per {'group' if tp > 1 else 'rank'}"
            + (f", {c['H'] // tp} of {c['H']} heads per rank" if tp > 1 else ""),
        ),
        (
            "stage 1",
            f"hidden-state buffers per {'tensor-parallel group' if tp > 1 else 'rank'}",
            f"{gb(s1_disk)} (2 x {n_local} seq x {T} x {c['D']})",
        ),
    ]
    if units < dp:
        p.warnings.append(
            f"stage 1 leaves {(dp - units) * tp} of {ranks} ranks idle every step: a step has {units} query blocks "
            f"(distill.batch_size {B} x {blocks}); raise distill.batch_size or lower distill.query_block to at most "
            f"{max(1, T * B // dp)}"
        )
    return s1_mem, s1_disk, flops1, tokens1


def d_steps(cfg: Config) -> int:
    """Stage 1's optimizer steps per layer."""
    return cfg.distill.epochs * -(-cfg.data.num_sequences // cfg.distill.batch_size)


def stage2(p: Plan, cfg: Config, sh: Shape, r: Resolved) -> tuple[float, float, float, float]:
    """Stage 2: ZeRO-3 partitions weights, gradients and optimizer state of the trainable part over the ranks; at
    tensor_parallel > 1 the weights are split over the tensor-parallel ranks and the trainable state (fp32 weights,
    gradients, AdamW moments) is replicated. (memory, checkpoint size, flops, tokens)"""
    a, c, finetune, ranks, wbytes, tp = sh.a, sh.c, cfg.finetune, sh.ranks, sh.wbytes, sh.tp
    T2 = r.derived.stage2_seq_len
    D, qo, kv, inter = c["D"], c["H"] * c["hd"], c["K"] * c["hd"], a["intermediate_size"]
    shapes = {  # (in, out, split): a column-wise linear splits its out (LoRA's B), a row-wise one its in (LoRA's A)
        "q_proj": (D, qo, "out"),
        "k_proj": (D, kv, "out"),
        "v_proj": (D, kv, "out"),
        "o_proj": (qo, D, "in"),
        "gate_proj": (D, inter, "out"),
        "up_proj": (D, inter, "out"),
        "down_proj": (inter, D, "in"),
    }
    lora = lora_rank = 0
    for t in finetune.lora_targets:
        n_in, n_out, split = shapes.get(t, (D, D, "out"))
        lora += c["L"] * finetune.lora_r * (n_in + n_out)
        lora_rank += c["L"] * finetune.lora_r * ((n_in + n_out // tp) if split == "out" else (n_in // tp + n_out))
    phi = c["L"] * la_params(cfg, c)
    hybrid = (phi if finetune.train_feature_maps else 0) + (c["L"] * c["H"] if finetune.train_gamma else 0)
    hybrid += c["L"] * decay_params(cfg, c) if finetune.train_decay else 0
    trainable = lora + hybrid
    if tp > 1:  # (finetune.offload is refused with tensor parallelism)
        per_rank = lora_rank + hybrid // tp  # LoRA's whole factors replicated, the split ones and phi/gamma in parts
        weights, states = c["total"] * wbytes / tp, per_rank * (4 + 4 + 8)
        figures = {"weights_bytes": weights, "trainable_params": per_rank, "trainable_bytes": per_rank * 4}
        figures |= {"gradient_bytes": per_rank * 4, "optimizer_bytes": per_rank * 8}
        accumulation = finetune.global_batch // (finetune.micro_batch * sh.ranks // tp)
        # per micro-batch: forward 2 all-reduces per block, the embedding's, the loss-parallel cross-entropy's 3;
        # backward 2 per block, and with activation checkpointing the recomputed attention output's (the recompute
        # stops before the MLP's) and one more (as the dry run counts them); per optimizer step: the data-parallel
        # gradients' (dp > 1), LoRA's replicated factors', the clipping norm's
        backward = 3 * c["L"] + 1 if finetune.gradient_checkpointing else 2 * c["L"]
        per_micro = 2 * c["L"] + 1 + 3 + backward
        figures["collectives_per_step"] = accumulation * per_micro + (sh.ranks > tp) + (lora > 0) + 1
    else:
        weights = 0 if finetune.offload else c["total"] * wbytes / ranks
        states = 0 if finetune.offload else trainable * (4 + 8 + wbytes) / ranks
        part = trainable / ranks
        figures = {"weights_bytes": c["total"] * wbytes / ranks, "trainable_params": part}
        figures |= {"trainable_bytes": part * (4 + wbytes), "gradient_bytes": part * wbytes}
        figures["optimizer_bytes"] = part * 8
    act_layers = c["L"] if finetune.gradient_checkpointing else c["L"] * 12
    s2_acts = (
        finetune.micro_batch * T2 * c["D"] * wbytes * act_layers
        + finetune.micro_batch
        * T2
        * (c["D"] * 10 + (a["intermediate_size"] * 4 + c["V"]) / tp)
        * 4  # (MLP, logits split)
    )
    gathered = 2 * c["layer"] * wbytes if tp == 1 else 0  # ZeRO-3 gathers a layer (and prefetches the next)
    s2_mem = weights + states + s2_acts + gathered
    ckpt = trainable * (4 + 8)
    p.figures["stage 2"] = figures | {"checkpoint_bytes": ckpt}
    tokens2 = finetune.max_steps * finetune.global_batch * T2
    p.rows += [
        (
            "stage 2",
            "trainable parameters",
            f"{trainable / 1e6:.1f} M (LoRA r={finetune.lora_r} on {', '.join(finetune.lora_targets)})",
        ),
        (
            "stage 2",
            "per-rank memory",
            f"~{gb(s2_mem)} (weights/{ranks}, states, activations, 2 gathered layers)"
            if tp == 1
            else f"~{gb(s2_mem)} (weights/{tp} split by tensor parallelism, fp32 trainable state, activations)",
        ),
        ("stage 2", "checkpoint size", f"{gb(ckpt)} per step dir (fp32 weights + AdamW moments; no base)"),
        ("stage 2", "CPU offload", "on (weights and optimizer state in host memory)" if finetune.offload else "off"),
    ]
    return s2_mem, ckpt, training_flops(c["total"], tokens2), tokens2


def start_up_read(p: Plan, cfg: Config, sh: Shape, base: Path | None) -> None:
    """What stage 2 and evaluation read at start-up, per rank and per node, and how long that takes at
    READ_BYTES_PER_S per node (an assumed shared-filesystem rate): at tensor_parallel > 1 each rank reads only its
    part (all ranks at once); at 1 every rank reads the whole checkpoint (transformers' from_pretrained, then ZeRO-3
    keeps its partition)."""
    launch = cfg.launch
    stored = stored_bytes(base)[0] if base is not None else 0
    if not stored and cfg.model.path:
        stored = stored_bytes(Path(cfg.model.path))[0]
    whole = stored or sh.c["total"] * sh.wbytes
    rank = whole / sh.tp
    node = rank * launch.procs_per_node
    seconds = node / READ_BYTES_PER_S
    how = f"its 1/{sh.tp} of each weight" if sh.tp > 1 else "the whole checkpoint"
    p.rows.append(
        (
            "load",
            "read per rank (stage 2, evaluate)",
            f"{gb(rank)}: {how}; {gb(node)} per node, ~{seconds:,.0f} s at an assumed {READ_BYTES_PER_S / GB:g} GB/s "
            f"(launch.timeout_min = {launch.timeout_min:g} min)",
        )
    )
    if seconds > launch.timeout_min * 60 / 2:
        p.warnings.append(
            f"the start-up read (~{seconds / 60:,.0f} min per node at {READ_BYTES_PER_S / GB:g} GB/s) is over half of "
            f"launch.timeout_min = {launch.timeout_min:g}; raise launch.timeout_min"
        )


def passkey_estimate(cfg: Config, params: int, lead: int = passkey.LEAD) -> str:
    """The passkey probe's modes, prompts, tokens and rough time (a forward of 2 x params FLOPs per token, at
    launch.gpu_tflops x MFU per rank on a GPU, else an assumed CPU_FLOPS); "" when it does not run."""
    evaluation_cfg = cfg.eval
    modes = passkey.probe_modes(evaluation_cfg)
    if not modes:
        return ""
    probes = 2 if evaluation_cfg.recall_pairs else 1  # the passkey and the recall probe read about as many tokens
    tokens = passkey.probe_tokens(list(evaluation_cfg.passkey_distances), evaluation_cfg.passkey_trials, lead)
    tokens *= len(modes) * probes
    gpu = cfg.model.device != "cpu" and cfg.launch.gpu_tflops
    rate = cfg.launch.gpu_tflops * 1e12 * MFU if gpu else CPU_FLOPS
    minutes = 2 * params * tokens / rate / 60
    why = " (eval.passkey_modes unset: the evaluated modes)" if evaluation_cfg.passkey_modes is None else ""
    prompts = len(evaluation_cfg.passkey_distances) * evaluation_cfg.passkey_trials * probes
    recall = " (with the recall probe's)" if probes == 2 else ""
    return (
        f"{prompts} prompts{recall} x {len(modes)} mode(s){why}: {', '.join(modes)}; {tokens / 1e3:,.0f} k tokens, "
        f"~{minutes:.1f} min at {'launch.gpu_tflops x ' + str(MFU) if gpu else f'an assumed {CPU_FLOPS:.0e} FLOP/s'}"
    )


def evaluation(p: Plan, cfg: Config, sh: Shape) -> float:
    """The whole model on every rank (or partitioned with eval.shard_weights; loaded partitioned too), the base and
    the converted model both (when `base` is among the modes), one perplexity forward."""
    a, c, evaluation_cfg, ranks = sh.a, sh.c, cfg.eval, sh.ranks
    copies = 2 if "base" in evaluation_cfg.modes and len(set(evaluation_cfg.modes)) > 1 else 1
    parts = ranks if evaluation_cfg.shard_weights else sh.tp
    eval_weights = copies * c["total"] * sh.wbytes / parts
    eval_acts = evaluation_cfg.ppl_seq_len * (c["D"] * 12 + a["intermediate_size"] * 3 + c["V"] * 2) * 4
    eval_mem = eval_weights + eval_acts + (2 * c["layer"] * sh.wbytes if evaluation_cfg.shard_weights else 0)
    p.figures["evaluate"] = {"weights_bytes": c["total"] * sh.wbytes / parts}  # one model
    if sh.tp > 1:  # 2 all-reduces per block, the embedding's, the logits' gather
        p.figures["evaluate"]["collectives_per_forward"] = 2 * c["L"] + 2
    how = f"{copies} model(s)" + (f" / {ranks} ranks" if evaluation_cfg.shard_weights else "")
    how += f" / {sh.tp} (tensor parallel)" if sh.tp > 1 else ""
    p.rows.append(
        ("evaluate", "per-rank memory", f"~{gb(eval_mem)} ({how}, a {evaluation_cfg.ppl_seq_len}-token forward)")
    )
    if probe := passkey_estimate(cfg, c["total"], max(passkey.LEAD, cfg.attention.sinks)):
        p.rows.append(("evaluate", "passkey probe", probe))
    decode_memory(p, cfg, sh)
    return eval_mem


DECODE_CONTEXT = 32768  # the context at which plan compares the decode state with a softmax model's KV cache


def decode_memory(p: Plan, cfg: Config, sh: Shape) -> None:
    """The decode state of one sequence (attention/window/recurrent.py, attention/cache/): per converted layer and
    KV head a ring of w keys, the S sinks and the cache's C keys (each key, value and LA key in the model's dtype,
    the cache's score and position beside it, the gated delta rule's gates per key, the ring's attention sums for
    cache_select=attention), the LA state in fp32 (Hedgehog: F x (Dv + 1); gated delta: D x D), and
    with cache_select=self_recall a second such state (the score's); constant in the length. Against it: the base's KV
    cache at DECODE_CONTEXT tokens."""
    a_cfg, c = cfg.attention, sh.c
    layers = len(a_cfg.layers) if a_cfg.layers is not None else c["L"]
    K, hd, F = c["K"] / sh.tp, c["hd"], sh.fdim
    per_key = (2 * hd + F) * sh.wbytes
    state = F * (hd + 1) * 4
    keys = a_cfg.window + a_cfg.sinks + a_cfg.cache
    gates = 4 * kind_of(a_cfg).ring_gates  # the kind's gates in fp32 per ring and cached key (gated delta: beta, log a)
    cache_meta = a_cfg.cache * (12 + gates)  # fp32 score + int64 position
    ring_sums = a_cfg.window * 4 if a_cfg.cache and a_cfg.cache_select == "attention" else 0  # fp32 per ring key
    shadow = state if a_cfg.cache and a_cfg.cache_select == "self_recall" else 0
    one = layers * K * (keys * per_key + a_cfg.window * gates + cache_meta + ring_sums + state + shadow)
    kv = c["L"] * K * 2 * hd * sh.wbytes * DECODE_CONTEXT
    what = f"ring {a_cfg.window} + sinks {a_cfg.sinks} + cache {a_cfg.cache} keys per KV head, LA state"
    what += " and the score's" if shadow else ""
    p.figures["decode"] = {"state_bytes_per_sequence": one, "kv_cache_bytes_at_32k": kv}
    text = f"{one / 2**20:.1f} MiB ({what}; constant in the length) vs the base's KV cache {gb(kv)} at {DECODE_CONTEXT}"
    p.rows.append(("generate", "decode state per sequence", text + " tokens"))


def export(p: Plan, cfg: Config, sh: Shape, base: Path | None, r: Resolved) -> None:
    """The merged model, shard by shard, in export.dtype (else the input checkpoint's dtype)."""
    c, export_cfg = sh.c, cfg.export
    out = r.layout.export
    stored, per = stored_bytes(base) if base is not None else (0, 0)
    if stored:
        size = stored * DTYPE_BYTES[export_cfg.dtype] / per if export_cfg.dtype else stored
    else:
        size = c["total"] * DTYPE_BYTES[export_cfg.dtype or cfg.model.dtype]
    probe, free = free_at(out.parent)
    p.rows.append(("export", "merged model", f"{gb(size)} at {out} ({gb(free)} free at {probe})"))
    if size > free:
        smaller = " or export.dtype=bfloat16" if size / c["total"] > 2 else ""
        p.block(
            f"{probe} has {gb(free)} free but the export needs ~{gb(size)}: set export.out_dir to a larger disk"
            + smaller,
            "export",
        )
    if (export_cfg.gamma is not None or export_cfg.calibrate_gamma) and export_cfg.report_sequences:
        p.rows.append(
            (
                "export",
                "gamma report memory",
                f"~{gb(c['total'] * 4)} host RAM (the whole model in fp32 on CPU for the before/after perplexity; "
                "export.report_sequences=0 skips it)",
            )
        )
