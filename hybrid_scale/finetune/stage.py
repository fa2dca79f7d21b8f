"""Stage 2: LoRA fine-tuning of a converted model under DeepSpeed ZeRO-3, with SSD and HedgeCATs early stopping.

The base model is loaded through `from_pretrained` under ZeRO-3 init (partitioned over the ranks as it loads), the
stage-1 feature maps and gamma are added, PEFT wraps q/k/v/o_proj with LoRA, and DeepSpeed (config generated from
`finetune`) runs AdamW with warmup + linear decay, clipping and gradient accumulation (distributed.parallelize: AC,
then LoRA, then ZeRO-3). One process, or N under torchrun / the deepspeed launcher (gloo on CPU, nccl on GPU).

Run directory (finetune/checkpoints.py writes it):
  stage2/step_XXXXXXXX/  trainable state only, whole tensors (resumes on any number of ranks); newest K kept
  stage2/best/           the model with the best held-out hybrid loss, when early stopping is on
  stage2/final/          the model at the end of training
  stage2/output -> best or final: the run's model (a converted model + adapter/)
  stage2/curves.json, curves.png, log.txt
Signals (distributed/requeue.py): USR1/TERM only set a flag; at the next step boundary the ranks agree, save, and
the stage raises Requeue (the CLI exits with EXIT_REQUEUE).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedModel

from ..attention.hybrid import hybrid_layers
from ..config.schema import Config
from ..data.batches import finetune_data, global_batch, rank_share
from ..distributed import requeue, runtime, tensor_parallel
from ..distributed.deepspeed import clear_gradients, import_deepspeed, init_comm, is_partitioned, train_config
from ..distributed.parallelize import parallelize
from ..distributed.replicated import ReplicatedEngine
from ..entry import Entry, stage_entry
from ..errors import ConfigError, FinetuneError
from ..measure import peak_memory, training_flops
from ..models.convert import set_modes, set_window
from ..models.converted import load_converted, load_tokenizer
from ..plots import curves_png
from ..recipes.early_stopping import EarlyStopping
from ..recipes.ssd import SSD
from ..recipes.ssd import at as ssd_probability
from ..run.identity import differing
from ..run.layout import RunLayout
from ..run.log import StageLog
from ..run.metrics import Metrics, duration
from ..run.settings import stage2_settings
from ..run.sources import ModelSource
from ..storage.faults import fault, throttle
from .checkpoints import committed_steps, load_step, rotate, save_step, write_model
from .schedule import schedule_for

if TYPE_CHECKING:  # (DeepSpeed and PEFT are imported where the stage builds them)
    from deepspeed import DeepSpeedEngine
    from peft import PeftModel
    from transformers.integrations import HfDeepSpeedConfig

    Engine = DeepSpeedEngine | ReplicatedEngine


@dataclass
class Stage2:
    """Everything the training loop reads and advances."""

    cfg: Config  # the run's config (a structured DictConfig of config/schema.py's Config)
    rt: runtime.Runtime
    log: StageLog  # stage2/log.txt, rank 0
    layout: RunLayout
    source: ModelSource  # the converted model it fine-tunes, its hybrid_config.json read once
    mode: str
    early: bool
    settings: dict
    train_ids: torch.Tensor
    held_ids: torch.Tensor
    accumulation: int
    model: PreTrainedModel | None = None  # the converted model
    peft_model: PeftModel | None = None  # the same with LoRA (PEFT)
    engine: Engine | None = None  # DeepSpeed's ZeRO-3 engine, or the replicated one under tensor parallelism
    named: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)
    ssd: SSD | None = None
    step: int = 0
    dropped: list[int] = field(default_factory=list)  # the layers SSD ran in la_only in the last step
    ssd_p: float | None = None  # SSD's drop probability in the last step
    lr: float | None = None  # the learning rate of the last step
    metrics: Metrics | None = None  # metrics.jsonl, TensorBoard, W&B (rank 0)
    flops_per_step: float = 0.0  # measure.training_flops of one optimizer step
    step_s: float | None = None  # a step's wall time, averaged (exponentially) over the steps of this run
    hf_ds: HfDeepSpeedConfig | None = None  # from_pretrained loads under ZeRO-3 init while it lives
    curves: dict = field(default_factory=lambda: dict(train=[], eval_steps=[], hybrid=[], la_only=[], window=[]))
    stopping: EarlyStopping = field(default_factory=EarlyStopping)

    @property
    def stage2(self) -> Path:
        return self.layout.stage2

    def state_dict(self) -> dict:
        return {
            "settings": self.settings,
            "step": self.step,
            "curves": self.curves,
            "stopping": asdict(self.stopping),
            "ssd": self.ssd.state_dict() if self.ssd else None,
            "window": next(iter(self.layers.values())).window,
        }


def finetune(cfg: Config) -> Path:
    """Run (or resume) stage 2; returns {run_dir}/stage2/output (a converted model with an adapter)."""
    with stage_entry(cfg, "finetune") as entry:  # preflight, runtime, lock, signal flag (entry.py)
        return _train(entry)


def _train(entry: Entry) -> Path:
    """finetune's work, under the run dir's lock: start or resume, the steps, the checkpoints, the output."""
    f = entry.cfg.finetune
    s = start(entry)
    bar = tqdm(
        total=f.max_steps,
        initial=s.step,
        desc="stage 2",
        disable=not (f.progress and s.rt.main),
        dynamic_ncols=True,
    )
    s.engine.module.train()
    with bar, s.metrics:
        while s.step < f.max_steps and s.stopping.reason is None:
            t0 = time.perf_counter()
            stop = train_step(s, entry.signal.raised)
            step_metrics(s, time.perf_counter() - t0)
            bar.update()
            dropped = {"la_only_layers": len(s.dropped)} if s.ssd else {}
            bar.set_postfix(loss=f"{s.curves['train'][-1]:.4f}", **dropped)
            fault(f"step:{s.step}", s.rt.rank)
            throttle()
            if f.eval_every and s.step % f.eval_every == 0:
                evaluate_heldout(s)
            if stop or s.step % f.save_every == 0 or s.step == f.max_steps or s.stopping.reason:
                t0 = time.perf_counter()
                checkpoint = save(s)
                if stop:
                    s.log(f"signal: saved {checkpoint.name} in {time.perf_counter() - t0:.1f} s, exiting for a requeue")
                    raise requeue.request(entry.layout.run_dir, s.step, checkpoint, s.rt)
    return finish(s)


def save(s: Stage2) -> Path:
    """A committed step checkpoint, then the rotation (the newest finetune.keep stay)."""
    checkpoint = save_step(s.stage2 / f"step_{s.step:08d}", s.engine, s.named, s.state_dict(), s.rt)
    if s.rt.main:
        rotate(s.stage2, s.cfg.finetune.keep)
    fault(f"saved:{s.step}")
    return checkpoint


def start(entry: Entry) -> Stage2:
    """The process group, the data, the model with LoRA under ZeRO-3, and the newest committed checkpoint."""
    cfg, rt, source = entry.cfg, entry.rt, entry.model
    f, recipe, T = cfg.finetune, entry.derived.recipe, entry.derived.stage2_seq_len
    runtime.join_group(rt)
    init_comm(runtime.backend(rt.device))  # joined above: no new group
    stage2 = entry.layout.stage2
    train_ids, held_ids = finetune_data(cfg, load_tokenizer(source.base), T)
    try:
        ds_config = train_config(f, getattr(torch, cfg.model.dtype), rt.dp)
    except ValueError as e:
        raise ConfigError(f"config key 'finetune.global_batch': {e}") from None
    settings = stage2_settings(cfg, entry.derived, source.path)
    s = Stage2(
        cfg,
        rt,
        entry.log,
        entry.layout,
        source,
        recipe.stage2_mode,
        entry.derived.early_stopping,
        settings,
        train_ids,
        held_ids,
        ds_config["gradient_accumulation_steps"],
    )
    stage2.mkdir(parents=True, exist_ok=True)
    committed = committed_steps(stage2)
    resume = committed[-1] if committed else None
    state = json.loads((resume / "state.json").read_text()) if resume else None
    if state and (changed := differing(state["settings"], settings)):
        raise ConfigError(
            f"{stage2} holds a stage 2 run made with other settings ({', '.join(changed)}); use another run_dir, "
            "restore those keys, or delete the stage2 directory"
        )
    build_model(s, ds_config)
    if rt.tp > 1:
        s.log(tensor_parallel.split_report(s.peft_model, rt))
    if recipe.ssd:
        s.ssd = SSD(list(f.ssd_schedule), f.ssd_granularity, sorted(s.layers), cfg.seed, f.ssd_windows)
    if resume:
        state = load_step(resume, s.engine, s.named, rt, cfg.seed)
        s.step, s.curves, s.stopping = state["step"], state["curves"], EarlyStopping(**state["stopping"])
        if s.ssd:
            s.ssd.load_state_dict(state["ssd"])
        s.log(f"resumed from {resume.name} (step {s.step}, saved by {state['world']} ranks, now {rt.world})")
    else:
        s.log(
            f"start: recipe {recipe.name} (trains in {s.mode}), {len(s.named)} trainable tensors, {rt.world} ranks "
            f"(data {rt.dp} x tensor {rt.tp})"
        )
    params = sum(getattr(p, "ds_numel", p.numel()) for p in s.model.parameters())
    s.flops_per_step = training_flops(params, f.global_batch * T)
    # the records up to the step resumed (its checkpoint) stay; those after it went with the work they described
    s.metrics = Metrics(cfg, "finetune", stage2, rt.main, resumed=s.step, log=s.log)
    return s


def build_model(s: Stage2, ds_config: dict) -> None:
    """The converted model loaded partitioned, phi/gamma trainable as asked, then (parallelize) activation
    checkpointing, LoRA, then ZeRO-3 -- or, at launch.tensor_parallel > 1, the heads split over the tensor-parallel
    ranks and the trainable state (fp32) replicated over the data-parallel ones."""
    from transformers.integrations import HfDeepSpeedConfig

    if s.rt.tp == 1:
        s.hf_ds = HfDeepSpeedConfig(ds_config)  # while alive (the whole stage), transformers knows ZeRO-3 is on
    _build(s, ds_config)


def _build(s: Stage2, ds_config: dict) -> None:
    cfg = s.cfg
    # at tp > 1 each rank reads only its part of each weight (the LoRA factors PEFT adds are split by parallelize)
    dtype, source = getattr(torch, cfg.model.dtype), s.source
    model = load_converted(source.path, dtype, s.rt.device, cfg.attention.backend, s.rt, source.hybrid_config)
    s.engine, s.peft_model, s.layers = prepare(model, cfg, s.rt, ds_config)
    s.model = model
    s.named = [(n, p) for n, p in s.peft_model.named_parameters() if p.requires_grad]


_CURRENT = {}  # a model class -> its subclass of the same name whose is_gradient_checkpointing is not deprecated


def current_alias(model: nn.Module) -> nn.Module:
    """The model, its class swapped for a subclass of the same name and module where is_gradient_checkpointing (that
    get_peft_model reads, PEFT 0.21) returns is_activation_checkpointing without transformers 5's FutureWarning about
    the deprecated alias; nothing else changes (state dict, config, isinstance, save_pretrained's architecture)."""
    cls = type(model)
    if not isinstance(getattr(cls, "is_activation_checkpointing", None), property) or cls in _CURRENT.values():
        return model
    if cls not in _CURRENT:
        alias = property(lambda self: self.is_activation_checkpointing, doc="is_activation_checkpointing")
        _CURRENT[cls] = type(cls.__name__, (cls,), {"is_gradient_checkpointing": alias, "__module__": cls.__module__})
    model.__class__ = _CURRENT[cls]
    return model


def prepare(model, cfg: Config, rt, ds_config: dict):
    """A converted model made ready to train as stage 2 configures it: phi/gamma trainable as asked, then
    (parallelize) activation checkpointing, LoRA, and ZeRO-3 or the tensor-parallel split. Returns (engine, the
    PEFT model, the hybrid layers). The dry run (dry_run.py) calls it with a model on the meta device."""
    from peft import LoraConfig, get_peft_model

    f, split = cfg.finetune, rt.tp > 1
    model.config.use_cache = False
    layers = hybrid_layers(model)
    for m in layers.values():
        for name, p in m.hybrid_parameters():
            trained = {"gamma_logit": f.train_gamma, "la_decay_rho": f.train_decay}
            p.requires_grad_(trained.get(name, f.train_feature_maps))
            if split and p.requires_grad:
                p.data = p.data.float()  # the replicated engine's masters are the parameters themselves
    trained_hybrid = {id(p) for m in layers.values() for _, p in m.hybrid_parameters() if p.requires_grad}
    lora = LoraConfig(
        r=f.lora_r,
        lora_alpha=f.lora_alpha,
        lora_dropout=f.lora_dropout,
        target_modules=list(f.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )

    def add_lora(m):
        # DeepSpeed keeps fp32 masters of the adapters; the replicated engine trains them in fp32 themselves
        peft_model = get_peft_model(current_alias(m), lora, autocast_adapter_dtype=split)
        for layer in layers.values():  # PEFT froze everything but LoRA
            for _, p in layer.hybrid_parameters():
                p.requires_grad_(id(p) in trained_hybrid)
        if not any("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad):
            raise ConfigError(f"config key 'finetune.lora_targets': {list(f.lora_targets)} matched no module")
        return peft_model

    torch.manual_seed(cfg.seed)  # LoRA's initialisation
    engine, peft_model = parallelize(
        model,
        activation_checkpointing=f.gradient_checkpointing,
        adapt=add_lora,
        zero3=ds_config,
        train=True,
        rt=rt,
        schedule=schedule_for(f),
    )
    return engine, peft_model, layers


def train_step(s: Stage2, signalled: bool) -> bool:
    """One optimizer step over this rank's share of the global batch, in the modes SSD (or the recipe) sets; the
    loss and the signal flag are agreed over the ranks. Returns whether a signal asks the ranks to save and stop."""
    f, rt = s.cfg.finetune, s.rt
    modes = dict.fromkeys(s.layers, s.mode)
    if s.ssd:
        window = s.ssd.window(s.step, f.max_steps)
        if window:
            set_window(s.model, window)
        modes.update({i: "la_only" for i, drop in s.ssd.drops(s.step, f.max_steps).items() if drop})
        s.ssd_p = ssd_probability(s.ssd.schedule, s.step / f.max_steps)
    set_modes(s.model, modes)
    s.dropped = sorted(i for i, m in modes.items() if m == "la_only" and s.mode != "la_only")
    batch = global_batch(s.step, len(s.train_ids), f.global_batch, s.cfg.seed)
    mine = rank_share(batch, rt.dp_rank, rt.dp)  # the ranks of a tensor-parallel group share their micro-batches
    flag = torch.zeros(2, dtype=torch.float64, device=rt.device)  # [loss, signal], summed over the ranks
    s.lr = float(s.engine.get_lr()[0])  # the rate this step's update uses (the schedule moves after it)
    clear_gradients(s.engine)
    for a in range(s.accumulation):
        ids = s.train_ids[mine[a * f.micro_batch : (a + 1) * f.micro_batch]].to(rt.device)
        loss = s.engine(input_ids=ids, labels=ids).loss
        s.engine.backward(loss)
        s.engine.step()
        flag[0] += loss.detach().double() / s.accumulation
    flag[1] = float(signalled)
    loss, signals = runtime.all_reduce(rt, flag).tolist()  # each data-parallel share counted tp times: / world
    if not math.isfinite(loss):  # all-reduced: every rank sees it and stops at this step
        _non_finite(s, loss / rt.world)
    s.step += 1
    s.curves["train"].append(loss / rt.world)
    s.curves["window"].append(next(iter(s.layers.values())).window)
    return signals > 0


def step_metrics(s: Stage2, step_s: float) -> None:
    """The step's record (loss, lr, gradient norm, SSD, gamma and rho per layer, tokens/s, TFLOP/s and MFU, peak
    memory, step time) and, every log.every_s seconds, a progress line with the ETA. Collective (gamma and rho are
    gathered on every rank); rank 0 writes."""
    f, rt = s.cfg.finetune, s.rt
    tokens = f.global_batch * len(s.train_ids[0])
    s.step_s = step_s if s.step_s is None else 0.9 * s.step_s + 0.1 * step_s
    norm = s.engine.get_global_grad_norm()
    values = {
        "loss": s.curves["train"][-1],
        "lr": s.lr,
        "grad_norm": None if norm is None else float(norm),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops": s.flops_per_step / step_s / 1e12,
        "steps_total": f.max_steps,
        "eta_s": s.step_s * (f.max_steps - s.step),
    }
    if rt.device.type == "cuda" and s.cfg.launch.gpu_tflops:  # against launch.gpu_tflops per rank, as `plan` assumes
        values["mfu"] = s.flops_per_step / step_s / (rt.world * s.cfg.launch.gpu_tflops * 1e12)
    values |= peak_memory(rt.device)
    if s.ssd:
        values |= {"ssd_p": s.ssd_p, "ssd_dropped": s.dropped}
    values |= hybrid_values(s)
    s.metrics.log(s.step, values)
    memory = f", {values['device_peak_gb']:.1f} GB device peak" if "device_peak_gb" in values else ""
    s.metrics.progress(
        f"step {s.step}/{f.max_steps}: loss {values['loss']:.4f}, {values['tokens_per_s']:.0f} tokens/s, "
        f"{values['host_peak_gb']:.1f} GB host peak{memory}, ETA {duration(values['eta_s'])}",
        force=s.step == f.max_steps,
    )


def hybrid_values(s: Stage2) -> dict[str, list[float]]:
    """gamma (and rho, with a decaying LA) of every hybrid layer, averaged over its heads: gathered under ZeRO-3, the
    tensor-parallel group's heads averaged. Collective."""
    layers = [m for _, m in sorted(s.layers.items())]
    own = [p for m in layers for n, p in m.hybrid_parameters() if n in ("gamma_logit", "la_decay_rho")]
    partitioned = [p for p in own if is_partitioned(p)]
    whole = import_deepspeed().zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()
    with whole, torch.no_grad():
        gamma = [tensor_parallel.local(m.gamma).float().mean() for m in layers]
        rho = [tensor_parallel.local(m.la_decay).float().mean() for m in layers if m.la_decay is not None]
        values = torch.stack(gamma + rho).to(s.rt.device)
    if s.rt.tp > 1:  # each rank holds as many heads: the mean of the ranks' means
        runtime.all_reduce(s.rt, values, group=tensor_parallel.tp_group(s.rt), size=s.rt.tp)
        values /= s.rt.tp
    values = values.tolist()
    return {"gamma": values[: len(gamma)], **({"rho": values[len(gamma) :]} if rho else {})}


def _non_finite(s: Stage2, loss: float) -> None:
    f = s.cfg.finetune
    kept = committed_steps(s.stage2)
    newest = f"stage2/{kept[-1].name}" if kept else "none yet"
    check = f"check the weights of {s.source.path} (and of its base model) for nan/inf"
    if s.step == 0:  # before any update: the model, not the learning rate
        fix = f"it is not finite before any update: {check}"
    else:
        fix = f"lower finetune.lr (now {f.lr}) in another run_dir (a changed lr does not resume), or {check}"
    if s.cfg.model.dtype == "float16":
        fix += ", or set model.dtype=bfloat16 (float16 overflows)"
    msg = (
        f"stage 2: the training loss is {loss} at step {s.step + 1} of {f.max_steps}; nothing of that step is "
        f"saved, the newest committed checkpoint is {newest} (kept); {fix}"
    )
    s.log(msg)
    raise FinetuneError(msg)


def evaluate_heldout(s: Stage2) -> None:
    """Held-out losses in hybrid and la_only; with early stopping, best/ on a better hybrid loss and the verdict."""
    f, step = s.cfg.finetune, s.step
    if isinstance(s.engine, ReplicatedEngine):  # its copies on every rank must not have drifted apart
        s.engine.check_replicas()
    h = heldout_loss(s.engine, s.model, s.held_ids, "hybrid", f.micro_batch, s.rt)
    la = heldout_loss(s.engine, s.model, s.held_ids, "la_only", f.micro_batch, s.rt)
    s.curves["eval_steps"].append(step)
    s.curves["hybrid"].append(h)
    s.curves["la_only"].append(la)
    s.log(f"step {step}: held-out loss hybrid {h:.4f}, la_only {la:.4f}")
    improved = s.stopping.update(step, h, la)
    if improved and s.early:  # best/ is early stopping's choice; without it the output is final/
        write_model(s.stage2 / "best", s.peft_model, s.model, s.source.hybrid_config, s.mode, s.rt, step)
    if s.early and s.stopping.reason is None:
        s.stopping.reason = s.stopping.verdict(f.patience, f.la_margin)
        if s.stopping.reason:
            s.log(f"early stop at step {step}: {s.stopping.reason}")
    stopping = {k: v for k, v in asdict(s.stopping).items() if v is not None}
    s.metrics.log(step, {"hybrid": h, "la_only": la, "improved": improved, **stopping}, kind="heldout")


def best_step(best: Path) -> int | None:
    """The step best/ was written at (its hybrid_config.json's origin), None without one. best/ is the run's output
    only when it is the early-stopping state's best step: one left by an attempt this run did not resume from (a
    run stopped before its first checkpoint, or the redone steps of a resume) is not."""
    try:
        return json.loads((best / "hybrid_config.json").read_text())["origin"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finish(s: Stage2) -> Path:
    """final/, curves, and the `output` link to the run's model (best/ when early stopping chose it)."""
    stage2, rt = s.stage2, s.rt
    if s.ssd and rt.main:
        s.log("ssd realised drop rate per phase: " + json.dumps(s.ssd.realised()))
    write_model(stage2 / "final", s.peft_model, s.model, s.source.hybrid_config, s.mode, rt, s.step)
    kept = s.stopping.best_step
    chosen = "best" if s.early and kept is not None and best_step(stage2 / "best") == kept else "final"
    if rt.main:
        realised = s.ssd.realised() if s.ssd else None
        (stage2 / "curves.json").write_text(
            json.dumps({**s.curves, "stopping": asdict(s.stopping), "ssd": realised, "output": chosen})
        )
        curves_png(s.curves, stage2 / "curves.png")
        link = s.layout.stage2_output
        if link.exists() and not link.is_symlink():
            kind = "directory" if link.is_dir() else "file"
            raise FinetuneError(f"{link} is a {kind}, not the link stage 2 writes; move it away and run again")
        if link.is_symlink():
            link.unlink()
        link.symlink_to(chosen)
        s.log(f"done at step {s.step}; output -> {chosen}")
    runtime.barrier(rt)
    return s.layout.stage2_output


@torch.no_grad()
def heldout_loss(engine, model, held: torch.Tensor, mode: str, micro: int, rt) -> float:
    """Mean next-token loss over the held-out sequences with every hybrid layer in `mode`. Every rank runs the same
    number of forwards (ZeRO-3 gathers weights collectively); a rank short of sequences repeats one at weight 0.
    The ranks of a tensor-parallel group score the same sequences (their sums count tp times, in both totals)."""
    set_modes(model, mode)
    engine.module.eval()
    mine = list(range(rt.dp_rank, len(held), rt.dp))
    rounds = math.ceil(math.ceil(len(held) / rt.dp) / micro)
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # [loss x tokens, tokens], summed over the ranks
    for r in range(rounds):
        idx = mine[r * micro : (r + 1) * micro]
        weight = 1.0 if idx else 0.0
        ids = held[idx or [0]].to(rt.device)
        out = engine(input_ids=ids, labels=ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total[0] += out.loss.detach().double() * n * weight
        total[1] += n * weight
    loss, tokens = runtime.all_reduce(rt, total).tolist()
    engine.module.train()
    return loss / tokens
