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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from ..attention.hybrid import hybrid_layers
from ..data.batches import finetune_data, global_batch, rank_share
from ..distributed import requeue, runtime, tensor_parallel
from ..distributed.checkpoint import fault, throttle
from ..distributed.deepspeed import clear_gradients, import_deepspeed, quiet, train_config
from ..distributed.parallelize import parallelize
from ..distributed.replicated import ReplicatedEngine
from ..distributed.requeue import SignalFlag
from ..errors import ConfigError, FinetuneError
from ..models.convert import set_modes, set_window
from ..models.converted import base_dir, load_converted, load_tokenizer, read_hybrid_config
from ..plots import curves_png
from ..preflight.plan import preflight
from ..recipes import RECIPES
from ..recipes.early_stopping import EarlyStopping
from ..recipes.ssd import SSD
from ..run import lock
from ..run import sources as rundir
from .checkpoints import committed_steps, load_step, rotate, save_step, write_model

# settings that change what a resumed run computes: a checkpoint made under others is not resumed
RESULT_KEYS = (
    "recipe",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "train_feature_maps",
    "train_gamma",
    "train_decay",
    "lr",
    "weight_decay",
    "warmup_steps",
    "max_steps",
    "global_batch",
    "seq_len",
    "ssd_schedule",
    "ssd_windows",
    "ssd_granularity",
)


@dataclass
class Run:
    """Everything the training loop reads and advances."""

    cfg: object
    rt: runtime.Runtime
    stage2: Path
    source: Path
    meta: dict
    mode: str
    early: bool
    settings: dict
    train_ids: torch.Tensor
    held_ids: torch.Tensor
    accumulation: int
    model: object = None
    peft_model: object = None
    engine: object = None
    named: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)
    ssd: SSD | None = None
    step: int = 0
    dropped: int = 0  # layers running la_only in the last step (SSD)
    hf_ds: object = None  # transformers' HfDeepSpeedConfig: from_pretrained loads under ZeRO-3 init while it lives
    curves: dict = field(default_factory=lambda: dict(train=[], eval_steps=[], hybrid=[], la_only=[], window=[]))
    stopping: EarlyStopping = field(default_factory=EarlyStopping)

    def log(self, msg: str) -> None:
        if self.rt.main:
            with open(self.stage2 / "log.txt", "a") as fh:
                fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    def state_dict(self) -> dict:
        return {
            "settings": self.settings,
            "step": self.step,
            "curves": self.curves,
            "stopping": asdict(self.stopping),
            "ssd": self.ssd.state_dict() if self.ssd else None,
            "window": next(iter(self.layers.values())).window,
        }


def finetune(cfg) -> Path:
    """Run (or resume) stage 2; returns {run_dir}/stage2/output (a converted model with an adapter)."""
    f = cfg.finetune
    if early_stopping(cfg) and not f.eval_every:
        raise ConfigError("config key 'finetune.eval_every': early stopping needs held-out evaluations (set it > 0)")
    preflight(cfg, "finetune")  # inputs, architecture, tensor-parallel shape, memory, disk: before any work
    rt = runtime.init(cfg.model.device, cfg.launch.tensor_parallel, cfg.launch.timeout_min)
    with lock.for_stage(cfg, "finetune", rt):  # one writer per run dir (run/lock.py): taken before any write
        return _train(cfg)


def _train(cfg) -> Path:
    """finetune's work, under the run dir's lock: start or resume, the steps, the checkpoints, the output."""
    f = cfg.finetune
    run = start(cfg)
    bar = tqdm(
        total=f.max_steps,
        initial=run.step,
        desc="stage 2",
        disable=not (f.progress and run.rt.main),
        dynamic_ncols=True,
    )
    run.engine.module.train()
    with SignalFlag() as signal, bar:
        while run.step < f.max_steps and run.stopping.reason is None:
            stop = train_step(run, signal.raised)
            bar.update()
            dropped = {"la_only_layers": run.dropped} if run.ssd else {}
            bar.set_postfix(loss=f"{run.curves['train'][-1]:.4f}", **dropped)
            fault(f"step:{run.step}", run.rt.rank)
            throttle()
            if f.eval_every and run.step % f.eval_every == 0:
                evaluate_heldout(run)
            if stop or run.step % f.save_every == 0 or run.step == f.max_steps or run.stopping.reason:
                t0 = time.perf_counter()
                checkpoint = save(run)
                if stop:
                    run.log(
                        f"signal: saved {checkpoint.name} in {time.perf_counter() - t0:.1f} s, exiting for a requeue"
                    )
                    raise requeue.request(cfg.run_dir, run.step, checkpoint, run.rt)
    return finish(run)


def save(run: Run) -> Path:
    """A committed step checkpoint, then the rotation (the newest finetune.keep stay)."""
    checkpoint = save_step(run.stage2 / f"step_{run.step:08d}", run.engine, run.named, run.state_dict(), run.rt)
    if run.rt.main:
        rotate(run.stage2, run.cfg.finetune.keep)
    fault(f"saved:{run.step}")
    return checkpoint


def start(cfg) -> Run:
    """The process group, the data, the model with LoRA under ZeRO-3, and the newest committed checkpoint."""
    f = cfg.finetune
    recipe = RECIPES[f.recipe or cfg.distill.recipe]
    early = early_stopping(cfg)
    rt = runtime.init(cfg.model.device, cfg.launch.tensor_parallel, cfg.launch.timeout_min)
    runtime.join_group(rt)
    import_deepspeed().init_distributed(dist_backend=runtime.backend(rt.device))  # joined above: no new group
    stage2, source = rundir.stage2_dir(cfg), rundir.finetune_source(cfg)
    T = f.seq_len or cfg.data.seq_len
    train_ids, held_ids = finetune_data(cfg, load_tokenizer(base_dir(source)), T)
    try:
        ds_config = train_config(f, getattr(torch, cfg.model.dtype), rt.dp)
    except ValueError as e:
        raise ConfigError(f"config key 'finetune.global_batch': {e}") from None
    settings = OmegaConf.to_container(f, resolve=True)
    settings = {k: settings[k] for k in RESULT_KEYS} | {"recipe": recipe.name, "seq_len": T, "seed": cfg.seed}
    settings["model"] = str(source.resolve())
    run = Run(
        cfg,
        rt,
        stage2,
        source,
        read_hybrid_config(source),
        recipe.stage2_mode,
        early,
        settings,
        train_ids,
        held_ids,
        ds_config["gradient_accumulation_steps"],
    )
    stage2.mkdir(parents=True, exist_ok=True)
    if rt.main:
        requeue.clear_request(cfg.run_dir)
    done = committed_steps(stage2)
    resume = done[-1] if done else None
    state = json.loads((resume / "state.json").read_text()) if resume else None
    if state and state["settings"] != settings:
        changed = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        raise ConfigError(
            f"{stage2} holds a stage 2 run made with other settings ({', '.join(changed)}); use another run_dir, "
            "restore those keys, or delete the stage2 directory"
        )
    build_model(run, ds_config)
    if rt.tp > 1:
        run.log(tensor_parallel.split_report(run.peft_model, rt))
    if recipe.ssd:
        run.ssd = SSD(list(f.ssd_schedule), f.ssd_granularity, sorted(run.layers), cfg.seed, f.ssd_windows)
    if resume:
        state = load_step(resume, run.engine, run.named, rt, cfg.seed)
        run.step, run.curves, run.stopping = state["step"], state["curves"], EarlyStopping(**state["stopping"])
        if run.ssd:
            run.ssd.load_state_dict(state["ssd"])
        run.log(f"resumed from {resume.name} (step {run.step}, saved by {state['world']} ranks, now {rt.world})")
    else:
        run.log(
            f"start: recipe {recipe.name} (trains in {run.mode}), {len(run.named)} trainable tensors, {rt.world} ranks "
            f"(data {rt.dp} x tensor {rt.tp})"
        )
    return run


def early_stopping(cfg) -> bool:
    """finetune.early_stopping, else the recipe's default (hedgecats)."""
    f = cfg.finetune
    return RECIPES[f.recipe or cfg.distill.recipe].early_stopping if f.early_stopping is None else f.early_stopping


def build_model(run: Run, ds_config: dict) -> None:
    """The converted model loaded partitioned, phi/gamma trainable as asked, then (parallelize) activation
    checkpointing, LoRA, then ZeRO-3 -- or, at launch.tensor_parallel > 1, the heads split over the tensor-parallel
    ranks and the trainable state (fp32) replicated over the data-parallel ones."""
    from transformers.integrations import HfDeepSpeedConfig

    if run.rt.tp == 1:
        run.hf_ds = HfDeepSpeedConfig(ds_config)  # while alive (the whole stage), transformers knows ZeRO-3 is on
    _build(run, ds_config)


def _build(run: Run, ds_config: dict) -> None:
    cfg = run.cfg
    # at tp > 1 each rank reads only its part of each weight (the LoRA factors PEFT adds are split by parallelize)
    model = load_converted(run.source, getattr(torch, cfg.model.dtype), run.rt.device, cfg.attention.backend, run.rt)
    run.engine, run.peft_model, run.layers = prepare(model, cfg, run.rt, ds_config)
    run.model = model
    run.named = [(n, p) for n, p in run.peft_model.named_parameters() if p.requires_grad]


def prepare(model, cfg, rt, ds_config: dict):
    """A converted model made ready to train as stage 2 configures it: phi/gamma trainable as asked, then
    (parallelize) activation checkpointing, LoRA, and ZeRO-3 or the tensor-parallel split. Returns (engine, the
    PEFT model, the hybrid layers). The dry run (preflight/dry_run.py) calls it with a model on the meta device."""
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
        peft_model = get_peft_model(m, lora, autocast_adapter_dtype=split)
        for layer in layers.values():  # PEFT froze everything but LoRA
            for _, p in layer.hybrid_parameters():
                p.requires_grad_(id(p) in trained_hybrid)
        if not any("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad):
            raise ConfigError(f"config key 'finetune.lora_targets': {list(f.lora_targets)} matched no module")
        return peft_model

    quiet()
    torch.manual_seed(cfg.seed)  # LoRA's initialisation
    engine, peft_model = parallelize(
        model,
        activation_checkpointing=f.gradient_checkpointing,
        adapt=add_lora,
        zero3=ds_config,
        train=True,
        rt=rt,
    )
    return engine, peft_model, layers


def train_step(run: Run, signalled: bool) -> bool:
    """One optimizer step over this rank's share of the global batch, in the modes SSD (or the recipe) sets; the
    loss and the signal flag are agreed over the ranks. Returns whether a signal asks the ranks to save and stop."""
    f, rt = run.cfg.finetune, run.rt
    modes = dict.fromkeys(run.layers, run.mode)
    if run.ssd:
        window = run.ssd.window(run.step, f.max_steps)
        if window:
            set_window(run.model, window)
        modes.update({i: "la_only" for i, drop in run.ssd.drops(run.step, f.max_steps).items() if drop})
    set_modes(run.model, modes)
    run.dropped = sum(m == "la_only" for m in modes.values())
    batch = global_batch(run.step, len(run.train_ids), f.global_batch, run.cfg.seed)
    mine = rank_share(batch, rt.dp_rank, rt.dp)  # the ranks of a tensor-parallel group share their micro-batches
    flag = torch.zeros(2, dtype=torch.float64, device=rt.device)  # [loss, signal], summed over the ranks
    clear_gradients(run.engine)
    for a in range(run.accumulation):
        ids = run.train_ids[mine[a * f.micro_batch : (a + 1) * f.micro_batch]].to(rt.device)
        loss = run.engine(input_ids=ids, labels=ids).loss
        run.engine.backward(loss)
        run.engine.step()
        flag[0] += loss.detach().double() / run.accumulation
    flag[1] = float(signalled)
    loss, signals = runtime.all_reduce(rt, flag).tolist()  # each data-parallel share counted tp times: / world
    if not math.isfinite(loss):  # all-reduced: every rank sees it and stops at this step
        _non_finite(run, loss / rt.world)
    run.step += 1
    run.curves["train"].append(loss / rt.world)
    run.curves["window"].append(next(iter(run.layers.values())).window)
    return signals > 0


def _non_finite(run: Run, loss: float) -> None:
    f = run.cfg.finetune
    kept = committed_steps(run.stage2)
    newest = f"stage2/{kept[-1].name}" if kept else "none yet"
    check = f"check the weights of {run.source} (and of its base model) for nan/inf"
    if run.step == 0:  # before any update: the model, not the learning rate
        fix = f"it is not finite before any update: {check}"
    else:
        fix = f"lower finetune.lr (now {f.lr}) in another run_dir (a changed lr does not resume), or {check}"
    if run.cfg.model.dtype == "float16":
        fix += ", or set model.dtype=bfloat16 (float16 overflows)"
    msg = (
        f"stage 2: the training loss is {loss} at step {run.step + 1} of {f.max_steps}; nothing of that step is "
        f"saved, the newest committed checkpoint is {newest} (kept); {fix}"
    )
    run.log(msg)
    raise FinetuneError(msg)


def evaluate_heldout(run: Run) -> None:
    """Held-out losses in hybrid and la_only; with early stopping, best/ on a better hybrid loss and the verdict."""
    f, step = run.cfg.finetune, run.step
    if isinstance(run.engine, ReplicatedEngine):  # its copies on every rank must not have drifted apart
        run.engine.check_replicas()
    h = heldout_loss(run.engine, run.model, run.held_ids, "hybrid", f.micro_batch, run.rt)
    la = heldout_loss(run.engine, run.model, run.held_ids, "la_only", f.micro_batch, run.rt)
    run.curves["eval_steps"].append(step)
    run.curves["hybrid"].append(h)
    run.curves["la_only"].append(la)
    run.log(f"step {step}: held-out loss hybrid {h:.4f}, la_only {la:.4f}")
    improved = run.stopping.update(step, h, la)
    if improved and run.early:  # best/ is early stopping's choice; without it the output is final/
        write_model(run.stage2 / "best", run.peft_model, run.model, run.meta, run.mode, run.rt, step)
    if run.early and run.stopping.reason is None:
        run.stopping.reason = run.stopping.verdict(f.patience, f.la_margin)
        if run.stopping.reason:
            run.log(f"early stop at step {step}: {run.stopping.reason}")


def finish(run: Run) -> Path:
    """final/, curves, and the `output` link to the run's model (best/ when early stopping chose it)."""
    stage2, rt = run.stage2, run.rt
    if run.ssd and rt.main:
        run.log("ssd realised drop rate per phase: " + json.dumps(run.ssd.realised()))
    write_model(stage2 / "final", run.peft_model, run.model, run.meta, run.mode, rt, run.step)
    chosen = "best" if run.early and (stage2 / "best").is_dir() else "final"
    if rt.main:
        realised = run.ssd.realised() if run.ssd else None
        (stage2 / "curves.json").write_text(
            json.dumps({**run.curves, "stopping": asdict(run.stopping), "ssd": realised, "output": chosen})
        )
        curves_png(run.curves, stage2 / "curves.png")
        link = stage2 / "output"
        if link.exists() and not link.is_symlink():
            kind = "directory" if link.is_dir() else "file"
            raise FinetuneError(f"{link} is a {kind}, not the link stage 2 writes; move it away and run again")
        if link.is_symlink():
            link.unlink()
        link.symlink_to(chosen)
        run.log(f"done at step {run.step}; output -> {chosen}")
    runtime.barrier(rt)
    return stage2 / "output"


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
