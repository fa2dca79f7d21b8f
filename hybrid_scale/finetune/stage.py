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

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..attention.layer import hybrid_layers
from ..config.schema import Config
from ..data.batches import finetune_data, global_batch, rank_share
from ..distributed import requeue, runtime, tensor_parallel
from ..distributed.deepspeed import clear_gradients, init_comm, train_config
from ..distributed.parallelize import Zero3, parallelize
from ..entry import Entry, stage_entry
from ..errors import ConfigError, FinetuneError
from ..measure import training_flops
from ..models.convert import set_cache, set_modes, set_window
from ..models.converted import load_converted, load_tokenizer
from ..plots import curves_png
from ..recipes.early_stopping import EarlyStopping
from ..recipes.ssd import SSD
from ..recipes.ssd import at as ssd_probability
from ..run.identity import differing
from ..run.metrics import Metrics
from ..run.settings import stage2_settings
from ..storage.faults import fault, throttle
from .checkpoints import committed_steps, load_step, rotate, save_step, write_model
from .inputs import INPUTS
from .monitor import best_step, evaluate_heldout, step_metrics, stop_non_finite
from .schedule import schedule_for
from .state import Stage2


def finetune(cfg: Config) -> Path:
    """Run (or resume) stage 2; returns {run_dir}/stage2/output (a converted model with an adapter)."""
    with stage_entry(cfg, "finetune", INPUTS) as entry:  # preflight, runtime, lock, signal flag (entry.py)
        return _train(entry)


def _train(entry: Entry) -> Path:
    """finetune's work, under the run dir's lock: start or resume, the steps, the checkpoints, the output."""
    finetune_cfg = entry.cfg.finetune
    stage = start(entry)
    bar = tqdm(
        total=finetune_cfg.max_steps,
        initial=stage.step,
        desc="stage 2",
        disable=not (finetune_cfg.progress and stage.rt.main),
        dynamic_ncols=True,
    )
    stage.engine.module.train()
    with bar, stage.metrics:
        while stage.step < finetune_cfg.max_steps and stage.stopping.reason is None:
            t0 = time.perf_counter()
            stop = train_step(stage, entry.signal.raised)
            step_metrics(stage, time.perf_counter() - t0)
            bar.update()
            dropped = {"la_only_layers": len(stage.dropped)} if stage.ssd else {}
            bar.set_postfix(loss=f"{stage.curves['train'][-1]:.4f}", **dropped)
            fault(f"step:{stage.step}", stage.rt.rank)
            throttle()
            if finetune_cfg.eval_every and stage.step % finetune_cfg.eval_every == 0:
                evaluate_heldout(stage)
            if (
                stop
                or stage.step % finetune_cfg.save_every == 0
                or stage.step == finetune_cfg.max_steps
                or stage.stopping.reason
            ):
                t0 = time.perf_counter()
                checkpoint = save(stage)
                if stop:
                    stage.log(
                        f"signal: saved {checkpoint.name} in {time.perf_counter() - t0:.1f} s, exiting for a requeue"
                    )
                    raise requeue.request(entry.layout.run_dir, stage.step, checkpoint, stage.rt)
    return finish(stage)


def save(stage: Stage2) -> Path:
    """A committed step checkpoint, then the rotation (the newest finetune.keep stay)."""
    checkpoint = save_step(
        stage.stage2 / f"step_{stage.step:08d}", stage.engine, stage.named, stage.state_dict(), stage.rt
    )
    if stage.rt.main:
        rotate(stage.stage2, stage.cfg.finetune.keep)
    fault(f"saved:{stage.step}")
    return checkpoint


def start(entry: Entry) -> Stage2:
    """The process group, the data, the model with LoRA under ZeRO-3, and the newest committed checkpoint."""
    cfg, rt, source = entry.cfg, entry.rt, entry.model
    finetune_cfg, recipe, T = cfg.finetune, entry.derived.recipe, entry.derived.stage2_seq_len
    runtime.join_group(rt)
    init_comm(runtime.backend(rt.device))  # joined above: no new group
    stage2 = entry.layout.stage2
    train_ids, held_ids = finetune_data(cfg, load_tokenizer(source.base), T)
    try:
        ds_config = train_config(finetune_cfg, getattr(torch, cfg.model.dtype), rt.dp)
    except ValueError as e:
        raise ConfigError(f"config key 'finetune.global_batch': {e}") from None
    settings = stage2_settings(cfg, entry.derived, source.path)
    stage = Stage2(
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
    build_model(stage, ds_config)
    if rt.tp > 1:
        stage.log(tensor_parallel.split_report(stage.peft_model, rt))
    if recipe.ssd:
        stage.ssd = SSD(
            list(finetune_cfg.ssd_schedule),
            finetune_cfg.ssd_granularity,
            sorted(stage.layers),
            cfg.seed,
            finetune_cfg.ssd_windows,
        )
    if resume:
        state = load_step(resume, stage.engine, stage.named, rt, cfg.seed)
        stage.step, stage.curves, stage.stopping = state["step"], state["curves"], EarlyStopping(**state["stopping"])
        if stage.ssd:
            stage.ssd.load_state_dict(state["ssd"])
        stage.log(f"resumed from {resume.name} (step {stage.step}, saved by {state['world']} ranks, now {rt.world})")
    else:
        stage.log(
            f"start: recipe {recipe.name} (trains in {stage.mode}), {len(stage.named)} trainable tensors, "
            f"{rt.world} ranks (data {rt.dp} x tensor {rt.tp})"
        )
    params = sum(getattr(p, "ds_numel", p.numel()) for p in stage.model.parameters())
    stage.flops_per_step = training_flops(params, finetune_cfg.global_batch * T)
    # the records up to the step resumed (its checkpoint) stay; those after it went with the work they described
    stage.metrics = Metrics(cfg, "finetune", stage2, rt.main, resumed=stage.step, log=stage.log)
    return stage


def build_model(stage: Stage2, ds_config: dict) -> None:
    """The converted model loaded partitioned, phi/gamma trainable as asked, then (parallelize) activation
    checkpointing, LoRA, then ZeRO-3 -- or, at launch.tensor_parallel > 1, the heads split over the tensor-parallel
    ranks and the trainable state (fp32) replicated over the data-parallel ones."""
    from transformers.integrations import HfDeepSpeedConfig

    if stage.rt.tp == 1:
        stage.hf_ds = HfDeepSpeedConfig(ds_config)  # while alive (the whole stage), transformers knows ZeRO-3 is on
    _build(stage, ds_config)


def _build(stage: Stage2, ds_config: dict) -> None:
    cfg = stage.cfg
    # at tp > 1 each rank reads only its part of each weight (the LoRA factors PEFT adds are split by parallelize)
    dtype, source = getattr(torch, cfg.model.dtype), stage.source
    model = load_converted(source.path, dtype, stage.rt.device, cfg.attention.backend, stage.rt, source.hybrid_config)
    # the cache of exact keys: the run's, trained with only if attention.cache_train (else it joins after training)
    set_cache(model, cfg.attention.cache if cfg.attention.cache_train else 0, cfg.attention.cache_select)
    stage.engine, stage.peft_model, stage.layers = prepare(model, cfg, stage.rt, ds_config)
    stage.model = model
    stage.named = [(n, p) for n, p in stage.peft_model.named_parameters() if p.requires_grad]


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

    finetune_cfg, split = cfg.finetune, rt.tp > 1
    model.config.use_cache = False
    layers = hybrid_layers(model)
    for m in layers.values():
        for name, p in m.hybrid_parameters():
            trained = {"gamma_logit": finetune_cfg.train_gamma, "la_decay_rho": finetune_cfg.train_decay}
            p.requires_grad_(trained.get(name, finetune_cfg.train_feature_maps))
            if split and p.requires_grad:
                p.data = p.data.float()  # the replicated engine's masters are the parameters themselves
    trained_hybrid = {id(p) for m in layers.values() for _, p in m.hybrid_parameters() if p.requires_grad}
    lora = LoraConfig(
        r=finetune_cfg.lora_r,
        lora_alpha=finetune_cfg.lora_alpha,
        lora_dropout=finetune_cfg.lora_dropout,
        target_modules=list(finetune_cfg.lora_targets),
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
            raise ConfigError(
                f"config key 'finetune.lora_targets': {list(finetune_cfg.lora_targets)} matched no module"
            )
        return peft_model

    torch.manual_seed(cfg.seed)  # LoRA's initialisation
    engine, peft_model = parallelize(
        model,
        activation_checkpointing=finetune_cfg.gradient_checkpointing,
        adapt=add_lora,
        zero3=Zero3(ds_config, train=True, schedule=schedule_for(finetune_cfg)),
        rt=rt,
    )
    return engine, peft_model, layers


def train_step(stage: Stage2, signalled: bool) -> bool:
    """One optimizer step over this rank's share of the global batch, in the modes SSD (or the recipe) sets; the
    loss and the signal flag are agreed over the ranks. Returns whether a signal asks the ranks to save and stop."""
    finetune_cfg, rt = stage.cfg.finetune, stage.rt
    modes = dict.fromkeys(stage.layers, stage.mode)
    if stage.ssd:
        window = stage.ssd.window(stage.step, finetune_cfg.max_steps)
        if window:
            set_window(stage.model, window)
        modes.update({i: "la_only" for i, drop in stage.ssd.drops(stage.step, finetune_cfg.max_steps).items() if drop})
        stage.ssd_p = ssd_probability(stage.ssd.schedule, stage.step / finetune_cfg.max_steps)
    set_modes(stage.model, modes)
    stage.dropped = sorted(i for i, m in modes.items() if m == "la_only" and stage.mode != "la_only")
    batch = global_batch(stage.step, len(stage.train_ids), finetune_cfg.global_batch, stage.cfg.seed)
    mine = rank_share(batch, rt.dp_rank, rt.dp)  # the ranks of a tensor-parallel group share their micro-batches
    flag = torch.zeros(2, dtype=torch.float64, device=rt.device)  # [loss, signal], summed over the ranks
    stage.lr = float(stage.engine.get_lr()[0])  # the rate this step's update uses (the schedule moves after it)
    clear_gradients(stage.engine)
    for a in range(stage.accumulation):
        ids = stage.train_ids[mine[a * finetune_cfg.micro_batch : (a + 1) * finetune_cfg.micro_batch]].to(rt.device)
        loss = stage.engine(input_ids=ids, labels=ids).loss
        stage.engine.backward(loss)
        stage.engine.step()
        flag[0] += loss.detach().double() / stage.accumulation
    flag[1] = float(signalled)
    loss, signals = runtime.all_reduce(rt, flag).tolist()  # each data-parallel share counted tp times: / world
    if not math.isfinite(loss):  # all-reduced: every rank sees it and stops at this step
        stop_non_finite(stage, loss / rt.world)
    stage.step += 1
    stage.curves["train"].append(loss / rt.world)
    stage.curves["window"].append(next(iter(stage.layers.values())).window)
    return signals > 0


def finish(stage: Stage2) -> Path:
    """final/, curves, and the `output` link to the run's model (best/ when early stopping chose it)."""
    stage2, rt = stage.stage2, stage.rt
    if stage.ssd and rt.main:
        stage.log("ssd realised drop rate per phase: " + json.dumps(stage.ssd.realised()))
    write_model(stage, stage2 / "final", stage.step)
    kept = stage.stopping.best_step
    chosen = "best" if stage.early and kept is not None and best_step(stage2 / "best") == kept else "final"
    if rt.main:
        realised = stage.ssd.realised() if stage.ssd else None
        (stage2 / "curves.json").write_text(
            json.dumps({**stage.curves, "stopping": asdict(stage.stopping), "ssd": realised, "output": chosen})
        )
        curves_png(stage.curves, stage2 / "curves.png")
        link = stage.layout.stage2_output
        if link.exists() and not link.is_symlink():
            kind = "directory" if link.is_dir() else "file"
            raise FinetuneError(f"{link} is a {kind}, not the link stage 2 writes; move it away and run again")
        if link.is_symlink():
            link.unlink()
        link.symlink_to(chosen)
        stage.log(f"done at step {stage.step}; output -> {chosen}")
    runtime.barrier(rt)
    return stage.layout.stage2_output
