"""Stage 2: LoRA fine-tuning of a converted model under DeepSpeed ZeRO-3, with SSD and HedgeCATs early stopping.

The base model is loaded through `from_pretrained` under ZeRO-3 init (partitioned over the ranks as it loads), the
stage-1 feature maps and gamma are added, PEFT wraps q/k/v/o_proj with LoRA, and DeepSpeed (config generated from
`finetune`) runs AdamW with warmup + linear decay, clipping and gradient accumulation. One process, or N under
torchrun / the deepspeed launcher (gloo on CPU, nccl on GPU).

Run directory:
  stage2/step_XXXXXXXX/  trainable state only (LoRA, phi/gamma if trained, AdamW moments, scheduler, step, SSD
                         tallies, curves, RNG), each tensor gathered whole from the ZeRO-3 partitions, so a resume
                         works on any number of ranks; COMMITTED (hashes) written last after a barrier; newest K kept
  stage2/best/           the model with the best held-out hybrid loss (early stopping), outside the rotation
  stage2/final/          the model at the end of training
  stage2/output -> best or final: a converted model (hybrid_config.json, hybrid_params.safetensors) + adapter/
  stage2/curves.json, curves.png, log.txt
Signals: SIGUSR1/SIGTERM only set a flag; at the next step boundary the ranks agree, save, and the stage raises
Requeue (the CLI exits with EXIT_REQUEUE).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..attention.hybrid import HybridAttention, hybrid_layers
from ..config import FINETUNE_MODE, ConfigError
from ..data import corpus
from ..distributed import runtime
from ..distributed.checkpoint import (
    MARKER,
    REQUEUE_MARKER,
    atomic_write,
    commit,
    fault,
    fault_enospc,
    is_committed,
    remove_dir,
    replace_dir,
    sibling,
    start_partial,
    throttle,
)
from ..distributed.deepspeed import _import_deepspeed, train_config
from ..models.convert import set_modes
from ..models.converted import (
    ADAPTER_DIR,
    CONFIG_NAME,
    base_dir,
    describe,
    load_converted,
    load_tokenizer,
    read_hybrid_config,
    write_converted,
)
from .ssd import SSD

EXIT_REQUEUE = 75  # "saved, please requeue" (EX_TEMPFAIL); the Slurm scripts requeue on it
# settings that change what a resumed run computes: a checkpoint made under others is not resumed
RESULT_KEYS = (
    "recipe",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "train_feature_maps",
    "train_gamma",
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


class FinetuneError(RuntimeError):
    pass


class Requeue(Exception):  # noqa: N818 -- not an error: the stage saved and asks to be started again
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped by a signal after step {step}; saved {checkpoint}; run again to resume")
        self.step, self.checkpoint = step, checkpoint


_signalled = {"flag": False}


def _on_signal(signum, frame) -> None:  # only a flag: the training loop acts at the next step boundary
    _signalled["flag"] = True


def _join_group(rt: runtime.Runtime) -> None:
    """DeepSpeed wants a process group even for one process."""
    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("nccl" if rt.device.type == "cuda" else "gloo")


# --- data ------------------------------------------------------------------------------------------------------------


def _data(cfg, tokenizer, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    f = cfg.finetune
    train_docs, held_docs = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction)
    train = corpus.pack(tokenizer, train_docs, T, None, cfg.seed)
    held = corpus.pack(tokenizer, held_docs, T, None, cfg.seed)
    if len(held) < f.heldout_sequences:
        raise corpus.CorpusError(
            f"the held-out text yields {len(held)} sequences of {T} tokens; finetune.heldout_sequences asks for "
            f"{f.heldout_sequences}: lower it or finetune.seq_len, or give more held-out text"
        )
    return train, held[: f.heldout_sequences]


def global_batch(step: int, n: int, size: int, seed: int) -> list[int]:
    """Indices of the training sequences of optimizer step `step`: epochs of seeded permutations, in order."""
    perms: dict[int, list[int]] = {}  # one permutation per epoch the batch touches (at most two)
    out = []
    for idx in range(step * size, (step + 1) * size):
        epoch, j = divmod(idx, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7_919 + epoch)).tolist()
        out.append(perms[epoch][j])
    return out


# --- gathering whole tensors out of ZeRO-3 partitions (collective: every rank calls in the same order) ------------


def _full(params: list[tuple[str, torch.nn.Parameter]], group: int = 64) -> dict[str, torch.Tensor]:
    deepspeed = _import_deepspeed()
    out = {}
    for a in range(0, len(params), group):
        chunk = params[a : a + group]
        with deepspeed.zero.GatheredParameters([p for _, p in chunk]):
            for name, p in chunk:
                out[name] = p.detach().to("cpu", copy=True).contiguous()
    return out


def _trainable_state(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[dict, dict]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, moments = {}, {}
    for name, p in named:
        weights[name] = safe_get_full_fp32_param(p).detach().cpu().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            moments[f"{name}::{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().contiguous()
    return weights, moments


def _restore_trainable(engine, named, weights: dict, moments: dict, step: int) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    deepspeed = _import_deepspeed()
    opt = engine.optimizer
    for flat in opt.fp32_partitioned_groups_flat:  # AdamW state is created lazily by its first step
        opt.optimizer.state[flat] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    for name, p in named:
        value = weights[name]
        safe_set_full_fp32_param(p, value.float())
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(value.view(p.shape).to(p.dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(p, moments[f"{name}::{key}"], key)


# --- checkpoints ---------------------------------------------------------------------------------------------------


def committed_steps(stage2: Path) -> list[Path]:
    steps = sorted(p for p in stage2.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    return [p for p in steps if is_committed(p)]


def _save(dest: Path, engine, named, state: dict, rt) -> Path:
    weights, moments = _trainable_state(named)
    tmp = sibling(dest, "partial")
    if rt.main:
        start_partial(dest, "run_dir")
        fault_enospc(f"save:{dest.name}")
        save_file(weights, tmp / "trainable.safetensors")
        save_file(moments, tmp / "optimizer.safetensors")
        state = {**state, "scheduler": engine.lr_scheduler.state_dict(), "world": rt.world}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
    runtime.barrier(rt)
    save_file({"rng": torch.get_rng_state()}, tmp / f"rng_rank{rt.rank}.safetensors")
    runtime.barrier(rt)  # every rank's files are on disk before the marker
    if rt.main:
        fault("save:before_commit")
        commit(tmp)
        replace_dir(tmp, dest, "run_dir")
    runtime.barrier(rt)
    return dest


def _rotate(stage2: Path, keep: int) -> None:
    done = committed_steps(stage2)
    for old in done[:-keep]:
        remove_dir(old)
    newest = done[-1].name if done else ""
    for partial in stage2.glob("step_*.partial"):  # left by a run killed while saving (tagged as the toolkit's)
        if partial.name < newest:
            remove_dir(partial)


def _write_model(dest: Path, peft_model, model, source_meta: dict, mode: str, rt, step: int) -> None:
    """The model form of stage 2's output: converted model (phi/gamma as trained, every layer in the recipe's
    `mode`, the window in force) + PEFT adapter. Collective."""
    set_modes(model, mode)  # not the modes SSD or a held-out evaluation left behind
    hybrid_names = {
        f"{prefix}.{n}"
        for prefix, m in model.named_modules()
        if isinstance(m, HybridAttention)
        for n, _ in m.hybrid_parameters()
    }
    params = [(n, p) for n, p in model.named_parameters() if n in hybrid_names]
    hybrid = _full(params)
    lora = _full([(n, p) for n, p in peft_model.named_parameters() if "lora_" in n])
    if rt.main:
        tmp = start_partial(dest, "run_dir")
        settings = describe(model)
        origin = {"stage": "stage2", "checkpoint": dest.name, "step": step}
        write_converted(tmp, source_meta["architecture"], source_meta["base_model"], settings, hybrid, origin)
        peft_model.save_pretrained(tmp / ADAPTER_DIR, state_dict=lora)
        commit(tmp)
        replace_dir(tmp, dest, "run_dir")
    runtime.barrier(rt)


@dataclass
class EarlyStopping:
    """HedgeCATs early stopping on held-out losses: keep the best hybrid loss; stop after `patience` evaluations
    without a better one, or as soon as the la_only loss rises more than `margin` above its best (the LA path is
    being abandoned)."""

    best_hybrid: float | None = None
    best_la: float | None = None
    best_step: int | None = None
    last_la: float | None = None
    bad_evals: int = 0
    reason: str | None = None

    def update(self, step: int, hybrid: float, la_only: float) -> bool:
        """Record one evaluation; True when the hybrid loss is the best so far."""
        self.last_la = la_only
        if self.best_la is None or la_only < self.best_la:
            self.best_la = la_only
        if self.best_hybrid is None or hybrid < self.best_hybrid:
            self.best_hybrid, self.best_step, self.bad_evals = hybrid, step, 0
            return True
        self.bad_evals += 1
        return False

    def verdict(self, patience: int, margin: float) -> str | None:
        if self.last_la is not None and self.last_la > self.best_la + margin:
            return (
                f"la_only loss {self.last_la:.4f} rose more than {margin} above its best {self.best_la:.4f} "
                "(the LA path is being abandoned)"
            )
        if self.bad_evals >= patience:
            return f"patience: no better hybrid loss in {patience} evaluations"
        return None


# --- the stage -------------------------------------------------------------------------------------------------------


def _curves_png(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curves["train"]) + 1), curves["train"], lw=0.8, alpha=0.6, label="train (mode in force)")
    for key in ("hybrid", "la_only"):
        if curves["eval_steps"]:
            ax.plot(curves["eval_steps"], curves[key], marker="o", label=f"held-out {key}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@torch.no_grad()
def heldout_loss(engine, model, held: torch.Tensor, mode: str, micro: int, rt) -> float:
    """Mean next-token loss over the held-out sequences with every hybrid layer in `mode`. Every rank runs the same
    number of forwards (ZeRO-3 gathers weights collectively); a rank short of sequences repeats one at weight 0."""
    set_modes(model, mode)
    engine.module.eval()
    mine = list(range(rt.rank, len(held), rt.world))
    rounds = math.ceil(math.ceil(len(held) / rt.world) / micro)
    total = torch.zeros(2, dtype=torch.float64)
    for r in range(rounds):
        idx = mine[r * micro : (r + 1) * micro]
        weight = 1.0 if idx else 0.0
        ids = held[idx or [0]].to(rt.device)
        out = engine(input_ids=ids, labels=ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += torch.tensor([out.loss.double().item() * n * weight, n * weight], dtype=torch.float64)
    if rt.distributed:
        dist.all_reduce(total)
    engine.module.train()
    return (total[0] / total[1]).item()


def _not_before_started(record: logging.LogRecord) -> bool:
    return "scheduler before it has started" not in record.getMessage()


def finetune(cfg) -> Path:
    """Run (or resume) stage 2; returns {run_dir}/stage2/output (a converted model with an adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers.integrations import HfDeepSpeedConfig

    f = cfg.finetune
    recipe = f.recipe or cfg.distill.recipe
    mode = FINETUNE_MODE[recipe]
    early = recipe == "hedgecats" if f.early_stopping is None else f.early_stopping
    if early and not f.eval_every:
        raise ConfigError("config key 'finetune.eval_every': early stopping needs held-out evaluations (set it > 0)")
    from .plan import preflight as plan_preflight

    plan_preflight(cfg, "finetune")  # architecture, tensor-parallel shape, memory, disk: before any work
    rt = runtime.init(cfg.model.device)
    _join_group(rt)
    deepspeed = _import_deepspeed()
    deepspeed.init_distributed(dist_backend="nccl" if rt.device.type == "cuda" else "gloo")
    run_dir = Path(cfg.run_dir)
    stage2 = run_dir / "stage2"
    source = Path(f.model) if f.model else run_dir / "stage1" / "converted"
    if not (source / CONFIG_NAME).is_file():
        raise ConfigError(
            f"config key 'finetune.model': {source} is not a converted model; run stage 1 first (hybrid-scale "
            "distill) or point finetune.model at a converted model"
        )
    if (source / ADAPTER_DIR).exists():
        raise ConfigError(
            f"config key 'finetune.model': {source} already carries a LoRA adapter; export it (merged) first and "
            "fine-tune the export"
        )
    meta = read_hybrid_config(source)
    base_path = base_dir(source)
    dtype = getattr(torch, cfg.model.dtype)
    T = f.seq_len or cfg.data.seq_len
    tokenizer = load_tokenizer(base_path)
    train_ids, held_ids = _data(cfg, tokenizer, T)
    try:
        ds_config = train_config(f, dtype, rt.world)
    except ValueError as e:
        raise ConfigError(f"config key 'finetune.global_batch': {e}") from None
    accumulation = ds_config["gradient_accumulation_steps"]
    settings = OmegaConf.to_container(f, resolve=True)
    settings = {k: settings[k] for k in RESULT_KEYS} | {"recipe": recipe, "seq_len": T, "seed": cfg.seed}
    settings["model"] = str(source.resolve())

    stage2.mkdir(parents=True, exist_ok=True)
    if rt.main:
        (run_dir / REQUEUE_MARKER).unlink(missing_ok=True)
    done = committed_steps(stage2)
    resume = done[-1] if done else None
    state = json.loads((resume / "state.json").read_text()) if resume else None
    if state and state["settings"] != settings:
        changed = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        raise ConfigError(
            f"{stage2} holds a stage 2 run made with other settings ({', '.join(changed)}); use another run_dir, "
            "restore those keys, or delete the stage2 directory"
        )

    def log(msg: str) -> None:
        if rt.main:
            with open(stage2 / "log.txt", "a") as fh:
                fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841 -- while alive, from_pretrained loads under ZeRO-3 init
    model = load_converted(source, dtype=dtype, device=rt.device)
    model.config.use_cache = False
    layers = hybrid_layers(model)
    for m in layers.values():
        for name, p in m.hybrid_parameters():
            p.requires_grad_(f.train_gamma if name == "gamma_logit" else f.train_feature_maps)
    if f.gradient_checkpointing:  # non-reentrant (works with PEFT); transformers 5.x renamed the method
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # DeepSpeed 0.19 calls a torch collective that torch 2.13 deprecates, once per step: not the user's concern
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated", category=FutureWarning)
    # ...and its WarmupDecayLR asks itself for a learning rate in its own constructor, logging a warning each run
    from deepspeed.utils import logger as ds_logger

    ds_logger.addFilter(_not_before_started)
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(
        r=f.lora_r,
        lora_alpha=f.lora_alpha,
        lora_dropout=f.lora_dropout,
        target_modules=list(f.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    trained_hybrid = {id(p) for m in layers.values() for _, p in m.hybrid_parameters() if p.requires_grad}
    peft_model = get_peft_model(model, lora)
    for m in layers.values():  # PEFT froze everything but LoRA
        for _, p in m.hybrid_parameters():
            p.requires_grad_(id(p) in trained_hybrid)
    named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    if not any("lora_" in n for n, _ in named):
        raise ConfigError(f"config key 'finetune.lora_targets': {list(f.lora_targets)} matched no module")
    engine, *_ = deepspeed.initialize(model=peft_model, model_parameters=[p for _, p in named], config=ds_config)

    ssd = None
    if recipe == "ssd":
        ssd = SSD(list(f.ssd_schedule), f.ssd_granularity, sorted(layers), cfg.seed, f.ssd_windows)
    curves = {"train": [], "eval_steps": [], "hybrid": [], "la_only": [], "window": []}
    stopping = EarlyStopping()
    step = 0
    if resume:
        _restore_trainable(
            engine,
            named,
            load_file(resume / "trainable.safetensors"),
            load_file(resume / "optimizer.safetensors"),
            state["step"],
        )
        engine.lr_scheduler.load_state_dict(state["scheduler"])
        engine.lr_scheduler.step(state["scheduler"]["last_batch_iteration"])  # puts that lr into the optimizer
        step, curves, stopping = state["step"], state["curves"], EarlyStopping(**state["stopping"])
        if ssd:
            ssd.load_state_dict(state["ssd"])
        rng = resume / f"rng_rank{rt.rank}.safetensors"
        if state["world"] == rt.world and rng.is_file():
            torch.set_rng_state(load_file(rng)["rng"])  # tensors only: no pickle is ever loaded
        else:  # another number of ranks: a fresh stream per rank, derived from the seed and the step
            torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + rt.rank)
        log(f"resumed from {resume.name} (step {step}, saved by {state['world']} ranks, now {rt.world})")
    else:
        log(f"start: recipe {recipe} (trains in {mode}), {len(named)} trainable tensors, {rt.world} ranks")

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGUSR1, signal.SIGTERM)}
    _signalled["flag"] = False
    n_train = len(train_ids)
    per_rank = f.global_batch // rt.world
    bar = tqdm(
        total=f.max_steps, initial=step, desc="stage 2", disable=not (f.progress and rt.main), dynamic_ncols=True
    )
    engine.module.train()

    def state_dict() -> dict:
        return {
            "settings": settings,
            "step": step,
            "curves": curves,
            "stopping": asdict(stopping),
            "ssd": ssd.state_dict() if ssd else None,
            "window": next(iter(layers.values())).window,
        }

    try:
        while step < f.max_steps and stopping.reason is None:
            modes = dict.fromkeys(layers, mode)
            if ssd:
                window = ssd.window(step, f.max_steps)
                if window:
                    for m in layers.values():
                        m.window = window
                modes.update({i: "la_only" for i, drop in ssd.drops(step, f.max_steps).items() if drop})
            set_modes(model, modes)
            batch = global_batch(step, n_train, f.global_batch, cfg.seed)
            mine = batch[rt.rank * per_rank : (rt.rank + 1) * per_rank]
            loss_sum = torch.zeros((), dtype=torch.float64)
            for a in range(accumulation):
                ids = train_ids[mine[a * f.micro_batch : (a + 1) * f.micro_batch]].to(rt.device)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().double().cpu() / accumulation
            flag = torch.tensor([loss_sum.item(), float(_signalled["flag"])], dtype=torch.float64)
            if rt.distributed:
                dist.all_reduce(flag)
            if not math.isfinite(flag[0].item()):  # all-reduced: every rank sees it and stops at this step
                kept = committed_steps(stage2)
                newest = f"stage2/{kept[-1].name}" if kept else "none yet"
                check = f"check the weights of {source} (and of its base model) for nan/inf"
                if step == 0:  # before any update: the model, not the learning rate
                    fix = f"it is not finite before any update: {check}"
                else:
                    fix = (
                        f"lower finetune.lr (now {f.lr}) in another run_dir (a changed lr does not resume), or {check}"
                    )
                if cfg.model.dtype == "float16":
                    fix += ", or set model.dtype=bfloat16 (float16 overflows)"
                msg = (
                    f"stage 2: the training loss is {flag[0].item() / rt.world} at step {step + 1} of {f.max_steps}; "
                    f"nothing of that step is saved, the newest committed checkpoint is {newest} (kept); {fix}"
                )
                log(msg)
                raise FinetuneError(msg)
            step += 1
            curves["train"].append(flag[0].item() / rt.world)
            curves["window"].append(next(iter(layers.values())).window)
            dropped = sum(m == "la_only" for m in modes.values()) if ssd else None
            bar.update()
            bar.set_postfix(loss=f"{curves['train'][-1]:.4f}", **({"la_only_layers": dropped} if ssd else {}))
            fault(f"step:{step}", rt.rank)
            throttle()
            if f.eval_every and step % f.eval_every == 0:
                h = heldout_loss(engine, model, held_ids, "hybrid", f.micro_batch, rt)
                la = heldout_loss(engine, model, held_ids, "la_only", f.micro_batch, rt)
                curves["eval_steps"].append(step)
                curves["hybrid"].append(h)
                curves["la_only"].append(la)
                log(f"step {step}: held-out loss hybrid {h:.4f}, la_only {la:.4f}")
                improved = stopping.update(step, h, la)
                if improved and early:  # best/ is early stopping's choice; without it the output is final/
                    _write_model(stage2 / "best", peft_model, model, meta, mode, rt, step)
                if early and stopping.reason is None:
                    stopping.reason = stopping.verdict(f.patience, f.la_margin)
                    if stopping.reason:
                        log(f"early stop at step {step}: {stopping.reason}")
            stop = flag[1].item() > 0
            if stop or step % f.save_every == 0 or step == f.max_steps or stopping.reason:
                t0 = time.perf_counter()
                ckpt = _save(stage2 / f"step_{step:08d}", engine, named, state_dict(), rt)
                if rt.main:
                    _rotate(stage2, f.keep)
                fault(f"saved:{step}")
                if stop:
                    log(f"signal: saved {ckpt.name} in {time.perf_counter() - t0:.1f} s, exiting for a requeue")
                    if rt.main:  # for batch scripts under torchrun, which does not pass the exit code on
                        atomic_write(run_dir / REQUEUE_MARKER, f"{step}\n")
                    raise Requeue(step, ckpt)
    finally:
        bar.close()
        for s, handler in previous.items():
            signal.signal(s, handler)

    if ssd and rt.main:
        log("ssd realised drop rate per phase: " + json.dumps(ssd.realised()))
    _write_model(stage2 / "final", peft_model, model, meta, mode, rt, step)
    chosen = "best" if early and (stage2 / "best").is_dir() else "final"
    if rt.main:
        (stage2 / "curves.json").write_text(
            json.dumps(
                {**curves, "stopping": asdict(stopping), "ssd": ssd.realised() if ssd else None, "output": chosen}
            )
        )
        _curves_png(curves, stage2 / "curves.png")
        link = stage2 / "output"
        if link.exists() and not link.is_symlink():
            kind = "directory" if link.is_dir() else "file"
            raise FinetuneError(f"{link} is a {kind}, not the link stage 2 writes; move it away and run again")
        if link.is_symlink():
            link.unlink()
        link.symlink_to(chosen)
        log(f"done at step {step}; output -> {chosen}")
    runtime.barrier(rt)
    return stage2 / "output"


__all__ = ["EXIT_REQUEUE", "MARKER", "Requeue", "finetune", "FinetuneError"]
