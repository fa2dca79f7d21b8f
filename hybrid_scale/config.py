"""The config core: one structured omegaconf config with a section per stage.

`load_config(path, overrides)` reads YAML, applies `key=value` overrides and validates. Any wrong key, type or value
raises one `ConfigError` naming the key and what is allowed. Later stages add fields to their own section.
config_reference.py generates docs/reference/config.md from the source of these dataclasses and the comments on
their fields; the validation below checks the same keys.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .attention.choices import BACKENDS as BACKEND_CHOICES
from .attention.choices import FEATURE_MAPS, MODES
from .errors import ConfigError
from .recipes import RECIPES
from .resources import data_dir

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    path: str | None = None  # local HF model directory (or a converted model); None = the embedded default
    dtype: str = "float32"  # always explicit: transformers 5 would otherwise load checkpoints in their own dtype
    device: str = "cpu"  # where every stage but export computes: cpu | cuda (each rank its LOCAL_RANK's GPU) | auto
    # the architecture (HF config.json keys incl. model_type) for `plan` and meta-device checks before the weights
    # are on disk; a preset carries it, a real model.path overrides it
    arch: dict[str, Any] | None = None


@dataclass
class AttentionConfig:
    window: int = 64  # sliding-window size in real tokens
    feature_map: str = "hedgehog"  # phi of the linear attention: hedgehog | exp | relu | elu1 | t2r
    feature_dim: int | None = None  # None = head_dim (hedgehog then outputs 2 * head_dim)
    gamma_init: float = 0.1  # initial window weight gamma of every head
    # gamma = f(a learnable logit) per head: sigmoid (LoLCATs: gamma in (0, 1), the window never outweighs the LA's
    # per-key weight) | exp (gamma in (0, inf): the window can outweigh a weak LA)
    gamma_param: str = "sigmoid"
    sinks: int = 8  # S, the first real tokens that swa_sinks and sinks_only attend to besides the window
    # the hybrid's softmax also covers those S sinks and its LA leaves them out (false: LoLCATs' hybrid, window only);
    # its no-LA ablation swa_only is then the window plus the same S sinks
    hybrid_sinks: bool = False
    # the LA's keys decay past the window: a key that left it counts alpha_h^(its distance past the window), alpha_h =
    # exp(-rho_h) per KV head, rho_h >= 0 learnt from 0 (the formula without decay) in stage 1 and stage 2
    la_decay: bool = False
    # component mode of a converted model: hybrid | swa_only | swa_sinks | la_only | sinks_only | none
    mode: str = "hybrid"
    layers: list[int] | None = None  # layers to convert; None = all (the others keep softmax)
    chunk_size: int = 64  # query block of the torch path (the Triton kernels pick their own tile)
    # what computes the attention in every stage: auto = the fused Triton kernels (kernels/, `pip install
    # hybrid_scale[triton]`) for CUDA tensors when installed, the chunked torch path elsewhere; torch; triton (CUDA)
    backend: str = "auto"


@dataclass
class DataConfig:
    source: str | None = None  # .txt (documents split by blank lines), .jsonl, a datasets dir; None = embedded default
    text_field: str = "text"  # the text field of a .jsonl or datasets source
    seq_len: int = 512  # tokens per packed training sequence (stage 1, and stage 2 unless finetune.seq_len)
    num_sequences: int = 256  # packed training sequences for stage 1
    heldout_fraction: float = 0.05  # documents held out (user sources; the embedded default has its own split)


DEVICES = ("cpu", "cuda", "auto")  # auto: cuda when a GPU is visible
OBJECTIVES = ("weights_xent", "output_mse", "hybrid_output_mse")


@dataclass
class DistillConfig:
    recipe: str = "hedgecats"  # lolcats = hybrid_output_mse; hedgecats / ssd / la_only = weights_xent
    objectives: dict[str, float] | None = None  # explicit weights, e.g. {weights_xent: 1, output_mse: 0.5}
    train_feature_maps: bool = True  # train phi_q / phi_k (false: only gamma, with a hybrid objective)
    train_gamma: bool | None = None  # None = only when a hybrid objective is used (gamma has no effect on LA-only)
    lr: float = 1e-2  # AdamW, as LoLCATs
    weight_decay: float = 0.0  # AdamW weight decay of phi / gamma
    epochs: int = 2  # passes over the training sequences per layer
    batch_size: int = 8  # global batch of sequences per step (split over ranks)
    query_block: int = 128  # weights_xent rows per block: memory O(block * T)
    buffer_dir: str | None = None  # hidden-state buffers; None = {run_dir}/stage1/buffers (may be a shared disk)
    buffer_dtype: str = "float32"  # dtype of the hidden-state buffers on disk: float32 | bfloat16 | float16
    progress: bool = True  # a progress bar per layer


SSD_GRANULARITY = ("step", "layer")


@dataclass
class FinetuneConfig:
    model: str | None = None  # converted model to fine-tune; None = {run_dir}/stage1/converted
    recipe: str | None = None  # None = distill.recipe; lolcats/hedgecats/ssd train in hybrid, la_only in la_only
    lora_r: int = 8  # LoRA rank (PEFT)
    lora_alpha: int = 16  # LoRA scaling numerator (PEFT: the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # modules by name
    train_feature_maps: bool = False  # also train phi (saved with the stage's output)
    train_gamma: bool = False  # also train gamma
    train_decay: bool = True  # also train the LA's decay rho when the model has one (attention.la_decay)
    lr: float = 1e-4  # peak AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 10  # linear warmup, then linear decay to 0 at max_steps
    max_steps: int = 200  # optimizer steps
    global_batch: int = 8  # sequences per optimizer step over all ranks (accumulation = global / (micro * ranks))
    micro_batch: int = 1  # sequences per forward on one rank
    clip: float = 1.0  # gradient-norm clipping (0 = off)
    seq_len: int | None = None  # None = data.seq_len
    heldout_sequences: int = 8  # held-out packed sequences for the early-stopping losses
    gradient_checkpointing: bool = True  # non-reentrant
    offload: bool = False  # ZeRO-3 parameter and optimizer offload to CPU (launch.tensor_parallel = 1 only)
    eval_every: int = 20  # steps between held-out losses in hybrid and la_only (0 = never)
    early_stopping: bool | None = None  # None = only for recipe hedgecats
    patience: int = 3  # evaluations without a better hybrid loss before stopping
    la_margin: float = 0.05  # stop when the la_only held-out loss rises this far (nats) above its best
    save_every: int = 20  # steps between committed checkpoints
    keep: int = 2  # committed step checkpoints kept (best/ is outside the rotation)
    # SSD (recipe ssd): (fraction of training, probability that a layer drops its SWA and runs la_only) steps
    ssd_schedule: list[list[float]] = field(default_factory=lambda: [[0.0, 0.9], [1 / 3, 0.75], [2 / 3, 0.5]])
    ssd_windows: list[list[float]] | None = None  # optional (fraction, window) steps, e.g. [[0, 16], [0.5, 64]]
    ssd_granularity: str = "step"  # step: all layers drop SWA together; layer: each layer independently
    progress: bool = True  # a progress bar over the steps


EVAL_MODES = ("base", "hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none")
EVAL_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu")


@dataclass
class EvalConfig:
    # HF dir or converted model; None = the run's stage2/output or stage1/converted, else model.path, else the
    # embedded default
    model: str | None = None
    modes: list[str] = field(default_factory=lambda: list(EVAL_MODES))  # modes to score (base = the unconverted model)
    tasks: list[str] = field(default_factory=lambda: list(EVAL_TASKS))  # piqa, arc_easy, arc_challenge, hellaswag, ...
    limit: int | None = 100  # items per task (MMLU: in total, stratified over subjects); None = all
    batch_size: int = 16  # items per batch (their contexts are prefilled together)
    window: int | None = None  # evaluate at another window than the model's (the diagnostic at smaller windows)
    data_dir: str | None = None  # task datasets; None = the embedded default's cache
    out_dir: str | None = None  # None = {run_dir}/eval
    bootstrap: int = 1000  # paired bootstrap resamples for the ablation deltas
    margin: float = 0.01  # tasks: |delta LA| (la_only - none, CI) inside +-margin means "LA bypassed"
    # the main verdict: NLL beyond the window, hybrid vs the strongest mode without LA (nats/token, CI) inside
    # +-ppl_margin means "LA bypassed", above it "LA used" (needs ppl_sequences > 0 and such a mode in eval.modes)
    ppl_margin: float = 0.02
    ppl_text: str | None = None  # long held-out text for perplexity / LA share; None = the embedded default's
    ppl_seq_len: int = 2048  # tokens per held-out sequence for perplexity by position
    ppl_sequences: int = 4  # held-out sequences for perplexity, the beyond-window verdict and LA share (0 = none)
    buckets: list[int] = field(default_factory=lambda: [0, 64, 256, 1024, 2048])  # position bucket edges
    la_share_seq_len: int = 1024  # tokens per sequence for the LA share of the normaliser (0 = skip it)
    # passkey retrieval past the window: a key stated in one place, then filler (held-out text), then the question;
    # scored by answer log-likelihood and greedy exact match at each distance (tokens from the key to the answer)
    passkey_distances: list[int] = field(default_factory=lambda: [32, 128, 512, 1024, 2048])  # [] = no probe
    passkey_trials: int = 20  # prompts per distance (seeded keys and filler)
    # the modes the passkey probe scores; null = the evaluated modes (eval.modes)
    passkey_modes: list[str] | None = None
    # ZeRO-3: weights partitioned over the ranks (a model too large for one device); with launch.tensor_parallel > 1
    # the tensor-parallel split does this instead, and setting both is refused
    shard_weights: bool = False
    progress: bool = True  # progress bars over batches


@dataclass
class ExportConfig:
    model: str | None = None  # None = the run's model: {run_dir}/stage2/output, else stage1/converted
    out_dir: str | None = None  # None = {run_dir}/export
    mode: str | None = None  # mode the export runs in; None = as trained (la_only + mode=hybrid: inference-time SWA)
    window: int | None = None  # None = as trained
    gamma: float | None = None  # fix gamma of every head (inference-time hybridisation)
    calibrate_gamma: bool = False  # fit gamma per layer and head so hybrid matches full softmax on a few batches
    calibration_sequences: int = 8  # training sequences the gamma calibration fits on
    calibration_seq_len: int = 512  # their length in tokens
    calibration_steps: int = 60  # Adam steps of the gamma fit per layer
    report_sequences: int = 4  # held-out sequences for the before/after perplexity of a gamma change (0 = skip)
    report_seq_len: int = 512  # their length in tokens
    max_shard_gb: float = 5.0  # largest output safetensors shard
    dtype: str | None = None  # None = as the base checkpoint's tensors


@dataclass
class LogConfig:
    # TensorBoard event files in each stage's directory (tensorboard/); null = on when the tensorboard package is
    # installed, true = required (refused by the preflight without it)
    tensorboard: bool | None = None
    wandb: str | None = None  # a Weights & Biases project: one W&B run per stage (WANDB_MODE=offline: no network)
    every_s: float = 60.0  # seconds between progress lines (tokens/s, memory, ETA) in a stage's log.txt and stderr


STAGES = ("distill", "finetune", "evaluate", "export")  # the pipeline's stages, in order
JOBS = (*STAGES, "pipeline")  # what `launch` starts and `submit` turns into Slurm jobs
LAUNCHERS = ("torchrun", "deepspeed", "srun")


@dataclass
class LaunchConfig:
    nodes: int = 1  # nodes of the job (several: one launcher per node, rendezvous from the Slurm environment)
    procs_per_node: int = 1  # ranks per node (GPUs per node on a cluster)
    launcher: str = "torchrun"  # torchrun | deepspeed | srun (one task per rank)
    # attention heads, MLP columns and vocabulary split over this many consecutive ranks of a node, in stages 1, 2
    # and evaluation (KV heads must divide by it); the rest of the ranks split the data
    tensor_parallel: int = 1
    # the process group's timeout: how long a collective waits for the slowest rank (e.g. one still reading its part
    # of a 70B checkpoint from a slow filesystem; `plan` prints the expected read time per rank)
    timeout_min: float = 60.0
    master_port: int = 29500  # rendezvous port base (+ SLURM_JOB_ID mod 1000 under Slurm)
    gpu_memory_gb: float = 80.0  # per device, for `plan`
    gpu_tflops: float = 300.0  # sustained bf16 per device, for `plan`'s rough times


@dataclass
class SlurmConfig:
    partition: str | None = None  # #SBATCH --partition (None: the cluster's default)
    account: str | None = None  # #SBATCH --account
    time: str = "24:00:00"  # time limit of each stage's job (Slurm format; slurm.times overrides it per stage)
    cpus_per_task: int = 8  # #SBATCH --cpus-per-task
    mem: str | None = None  # e.g. 0 (whole node) or 200G
    job_name: str = "hybrid_scale"  # job name prefix (the stage is appended)
    signal_lead_s: int = 120  # USR1 this long before the time limit: save and requeue
    max_restarts: int = 5  # requeues after "saved, please requeue", capped via SLURM_RESTART_COUNT
    extra: list[str] = field(default_factory=list)  # more #SBATCH lines, e.g. ["--qos=high"]
    times: dict[str, str] = field(default_factory=dict)  # per-stage time limits, e.g. {export: "02:00:00"}
    setup: list[str] = field(default_factory=list)  # shell lines before the stage, e.g. ["module load cuda/12.4"]
    template_dir: str | None = None  # own sbatch templates (<stage>.sbatch or stage.sbatch); None = slurm/


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the base model
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # the hybrid attention
    data: DataConfig = field(default_factory=DataConfig)  # training text
    distill: DistillConfig = field(default_factory=DistillConfig)  # stage 1
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)  # stage 2
    eval: EvalConfig = field(default_factory=EvalConfig)  # the component-ablation evaluation
    export: ExportConfig = field(default_factory=ExportConfig)  # the merged export
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # ranks, nodes, tensor parallelism
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # sbatch scripts
    log: LogConfig = field(default_factory=LogConfig)  # metrics while a stage runs: metrics.jsonl, TensorBoard, W&B
    run_dir: str = "runs/default"  # where every stage writes (one directory per conversion)
    seed: int = 0  # seeds data selection, initialisation, SSD decisions, bootstrap and the passkey prompts
    allow_config_change: bool = False  # rerun a run_dir with settings that change results (named in the refusal)


def _choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}': '{value}' is not allowed; choose one of: {', '.join(allowed)}")


def _positive(key: str, value, minimum=1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"config key '{key}': must be >= {minimum}, got {value}")


def validate(cfg: DictConfig) -> DictConfig:
    """Every key's value on its own and the combinations that cannot run, section by section: one ConfigError
    naming the key and the fix."""
    _validate_attention(cfg.attention)
    _validate_model(cfg.model)
    _validate_eval(cfg.eval)
    _validate_distill(cfg.distill)
    _validate_data(cfg.data)
    _validate_finetune(cfg.finetune)
    _validate_launch(cfg)
    _validate_slurm(cfg)
    _validate_export(cfg.export)
    _validate_log(cfg.log)
    return cfg


def _validate_attention(a) -> None:
    _positive("attention.window", a.window)
    _positive("attention.sinks", a.sinks)
    _positive("attention.feature_dim", a.feature_dim)
    _positive("attention.chunk_size", a.chunk_size)
    _choice("attention.feature_map", a.feature_map, sorted(FEATURE_MAPS))
    _choice("attention.mode", a.mode, MODES)
    _choice("attention.backend", a.backend, BACKEND_CHOICES)
    _choice("attention.gamma_param", a.gamma_param, ("sigmoid", "exp"))
    if not (0.0 < a.gamma_init < 1.0 if a.gamma_param == "sigmoid" else a.gamma_init > 0.0):
        bound = "in (0, 1) with attention.gamma_param=sigmoid" if a.gamma_param == "sigmoid" else "> 0"
        raise ConfigError(f"config key 'attention.gamma_init': must be {bound}, got {a.gamma_init}")
    if a.layers is not None and any(i < 0 for i in a.layers):
        raise ConfigError(f"config key 'attention.layers': layer indices must be >= 0, got {list(a.layers)}")


def _validate_model(m) -> None:
    _choice("model.dtype", m.dtype, DTYPES)
    _choice("model.device", m.device, DEVICES)


def _validate_eval(e) -> None:
    for mode in e.modes:
        _choice("eval.modes", mode, EVAL_MODES)
    for task in e.tasks:
        _choice("eval.tasks", task, EVAL_TASKS)
    _positive("eval.limit", e.limit)
    _positive("eval.batch_size", e.batch_size)
    _positive("eval.window", e.window)
    _positive("eval.bootstrap", e.bootstrap, 0)
    _positive("eval.ppl_seq_len", e.ppl_seq_len, 2)
    _positive("eval.ppl_sequences", e.ppl_sequences, 0)
    _positive("eval.la_share_seq_len", e.la_share_seq_len, 0)
    _positive("eval.passkey_trials", e.passkey_trials, 0)
    for mode in e.passkey_modes or []:
        _choice("eval.passkey_modes", mode, EVAL_MODES)
    for d in e.passkey_distances:
        _positive("eval.passkey_distances", d)
    if e.ppl_margin < 0:
        raise ConfigError(f"config key 'eval.ppl_margin': must be >= 0, got {e.ppl_margin}")
    if list(e.buckets) != sorted(set(e.buckets)) or len(e.buckets) < 2 or e.buckets[0] != 0:
        raise ConfigError(f"config key 'eval.buckets': must start at 0 and increase strictly, got {list(e.buckets)}")


def _validate_distill(d) -> None:
    _choice("distill.recipe", d.recipe, list(RECIPES))
    for name, weight in (d.objectives or {}).items():
        _choice("distill.objectives", name, OBJECTIVES)
        if weight < 0:
            raise ConfigError(f"config key 'distill.objectives.{name}': weight must be >= 0, got {weight}")
    if d.objectives is not None and not any(w > 0 for w in d.objectives.values()):
        raise ConfigError("config key 'distill.objectives': at least one weight must be > 0")
    _choice("distill.buffer_dtype", d.buffer_dtype, DTYPES)
    _positive("distill.epochs", d.epochs)
    _positive("distill.batch_size", d.batch_size)
    _positive("distill.query_block", d.query_block)


def _validate_data(data) -> None:
    _positive("data.seq_len", data.seq_len, 2)
    _positive("data.num_sequences", data.num_sequences)
    if not 0 <= data.heldout_fraction < 1:
        raise ConfigError(f"config key 'data.heldout_fraction': must be in [0, 1), got {data.heldout_fraction}")


def _validate_launch(cfg) -> None:
    """launch's values, and what the tensor-parallel split cannot combine with (other sections' keys)."""
    lc = cfg.launch
    _choice("launch.launcher", lc.launcher, LAUNCHERS)
    for key in ("nodes", "procs_per_node", "tensor_parallel"):
        _positive(f"launch.{key}", lc[key])
    if not lc.timeout_min > 0:
        raise ConfigError(f"config key 'launch.timeout_min': must be > 0 minutes, got {lc.timeout_min}")
    if lc.tensor_parallel > 1 and cfg.model.dtype == "float16":
        raise ConfigError(
            "config keys 'model.dtype' and 'launch.tensor_parallel': float16 needs DeepSpeed's loss scaling, which "
            "the tensor-parallel path does not use: set model.dtype=bfloat16 (or float32)"
        )
    if lc.tensor_parallel > 1 and cfg.finetune.offload:
        raise ConfigError(
            "config keys 'finetune.offload' and 'launch.tensor_parallel': CPU offload is ZeRO-3's; with the "
            f"tensor-parallel split ({lc.tensor_parallel}) the weights are divided over the GPUs instead: set "
            "finetune.offload=false (or launch.tensor_parallel=1)"
        )
    if lc.tensor_parallel > 1 and cfg.eval.shard_weights:
        raise ConfigError(
            "config keys 'eval.shard_weights' and 'launch.tensor_parallel': ZeRO-3 partitioning and the "
            f"tensor-parallel split ({lc.tensor_parallel}) do not combine; the split already divides the weights: set "
            "eval.shard_weights=false (or launch.tensor_parallel=1)"
        )
    if lc.procs_per_node % lc.tensor_parallel:
        raise ConfigError(
            f"config key 'launch.tensor_parallel': {lc.tensor_parallel} does not divide launch.procs_per_node = "
            f"{lc.procs_per_node}; a tensor-parallel group stays inside a node: choose a divisor of it"
        )


def _validate_export(x) -> None:
    if x.mode is not None:
        _choice("export.mode", x.mode, MODES)
    if x.dtype is not None:
        _choice("export.dtype", x.dtype, DTYPES)
    _positive("export.window", x.window)
    for key in ("calibration_sequences", "calibration_seq_len", "calibration_steps"):
        _positive(f"export.{key}", x[key])
    _positive("export.report_sequences", x.report_sequences, 0)
    _positive("export.report_seq_len", x.report_seq_len, 2)
    if x.gamma is not None and not 0.0 < x.gamma < 1.0:
        raise ConfigError(f"config key 'export.gamma': must be in (0, 1), got {x.gamma}")
    if x.gamma is not None and x.calibrate_gamma:
        raise ConfigError("config keys 'export.gamma' and 'export.calibrate_gamma': choose one (fixed or calibrated)")
    if x.max_shard_gb <= 0:
        raise ConfigError(f"config key 'export.max_shard_gb': must be > 0, got {x.max_shard_gb}")


def _validate_log(g) -> None:
    if g.wandb is not None and (not g.wandb.strip() or any(c in g.wandb for c in "/\\#?%:\n\r\0")):
        raise ConfigError(
            f"config key 'log.wandb': {g.wandb!r} is not a W&B project name (no / \\ # ? % : or line break); set a "
            "plain name such as hybrid-scale, or leave it unset"
        )
    if g.every_s <= 0:
        raise ConfigError(f"config key 'log.every_s': must be > 0, got {g.every_s}")


def _schedule(key: str, steps, lo, hi) -> None:
    if not steps or any(len(s) != 2 for s in steps):
        raise ConfigError(f"config key '{key}': a non-empty list of [fraction, value] pairs, got {steps}")
    fractions = [s[0] for s in steps]
    if fractions[0] != 0 or fractions != sorted(set(fractions)) or fractions[-1] >= 1:
        raise ConfigError(
            f"config key '{key}': fractions of training must start at 0, increase strictly and stay below 1, "
            f"got {fractions}"
        )
    for _, value in steps:
        if not lo <= value <= hi:
            raise ConfigError(f"config key '{key}': values must be in [{lo}, {hi}], got {value}")


def _validate_finetune(f) -> None:
    if f.recipe is not None:
        _choice("finetune.recipe", f.recipe, list(RECIPES))
    for key in ("lora_r", "max_steps", "global_batch", "micro_batch", "heldout_sequences", "save_every"):
        _positive(f"finetune.{key}", getattr(f, key))
    _positive("finetune.seq_len", f.seq_len, 2)
    _positive("finetune.keep", f.keep, 2)
    _positive("finetune.warmup_steps", f.warmup_steps, 0)
    _positive("finetune.eval_every", f.eval_every, 0)
    _positive("finetune.patience", f.patience)
    if f.global_batch % f.micro_batch:
        raise ConfigError(
            f"config key 'finetune.global_batch': {f.global_batch} is not a multiple of finetune.micro_batch "
            f"({f.micro_batch})"
        )
    if not 0 <= f.lora_dropout < 1:
        raise ConfigError(f"config key 'finetune.lora_dropout': must be in [0, 1), got {f.lora_dropout}")
    if not f.lora_targets:
        raise ConfigError("config key 'finetune.lora_targets': name at least one module (e.g. [q_proj, v_proj])")
    _schedule("finetune.ssd_schedule", f.ssd_schedule, 0.0, 1.0)
    if f.ssd_windows is not None:
        _schedule("finetune.ssd_windows", f.ssd_windows, 1, float("inf"))
    _choice("finetune.ssd_granularity", f.ssd_granularity, SSD_GRANULARITY)


# Slurm's --time formats (sbatch(1); src/common/parse_time.c time_str2secs): minutes, minutes:seconds,
# hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds; UNLIMITED or INFINITE
SLURM_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|(?i:unlimited|infinite)")
SLURM_MEM = re.compile(r"[0-9]+[KMGTkmgt]?")  # --mem: mebibytes, or a K/M/G/T suffix; 0 = all of a node's memory
SLURM_NAME_BAD = re.compile(r"[\s'\"#$`;&|<>\\]")  # what sbatch or the shell would split, quote or run


def _one_line(key: str, value, fix: str = "remove it") -> None:
    """A value written onto one line of the sbatch script: a line break would start a new shell command."""
    if value is not None and any(c in str(value) for c in "\n\r\0"):
        raise ConfigError(
            f"config key '{key}': {value!r} contains a line break or NUL, which would end its line of the sbatch "
            f"script and run the rest as a command; {fix}"
        )


def _slurm_time(key: str, value) -> None:
    _one_line(key, value)
    if not SLURM_TIME.fullmatch(str(value)):
        raise ConfigError(
            f"config key '{key}': {value!r} is not a Slurm time limit; use minutes, minutes:seconds, "
            "hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds (e.g. 90, "
            "24:00:00, 2-00:00:00), or UNLIMITED"
        )


def _validate_slurm(cfg) -> None:
    """The values written into the sbatch scripts' #SBATCH lines and shell body (dist/slurm.py render)."""
    s = cfg.slurm
    _positive("slurm.signal_lead_s", s.signal_lead_s, 0)
    _positive("slurm.max_restarts", s.max_restarts, 0)
    _positive("slurm.cpus_per_task", s.cpus_per_task)
    if not s.job_name:
        raise ConfigError("config key 'slurm.job_name': must not be empty (the jobs are named <job_name>-<stage>)")
    _one_line("run_dir", cfg.run_dir)
    _one_line("slurm.template_dir", s.template_dir)
    for key in ("job_name", "partition", "account"):
        value = s[key]
        _one_line(f"slurm.{key}", value)
        bad = SLURM_NAME_BAD.search(str(value or ""))
        if bad:
            lists = " (a comma-separated list for several, e.g. gpu,gpu-long)" if key != "job_name" else ""
            raise ConfigError(
                f"config key 'slurm.{key}': {value!r} contains {bad.group()!r}; use a plain name{lists} without "
                "whitespace, quotes or any of # $ ` ; & | < > \\"
            )
    _slurm_time("slurm.time", s.time)
    unknown = sorted(set(s.times) - set(JOBS))
    if unknown:
        raise ConfigError(f"config key 'slurm.times': unknown stage(s) {', '.join(unknown)}; use {', '.join(JOBS)}")
    for stage, value in s.times.items():
        _slurm_time(f"slurm.times.{stage}", value)
    if s.mem not in (None, ""):
        _one_line("slurm.mem", s.mem)
        if not SLURM_MEM.fullmatch(str(s.mem)):
            raise ConfigError(
                f"config key 'slurm.mem': {s.mem!r} is not a Slurm memory size; use an integer with an optional "
                "unit K, M, G or T (e.g. 200G; mebibytes without a unit; 0 = all of a node's memory)"
            )
    for i, item in enumerate(s.extra):
        _one_line(f"slurm.extra[{i}]", item, "give each sbatch option as its own item")
        if not str(item).startswith("-"):
            raise ConfigError(
                f"config key 'slurm.extra[{i}]': {item!r} is not an sbatch option; give one option per item, "
                "starting with - (e.g. --qos=high)"
            )
    for i, line in enumerate(s.setup):
        _one_line(f"slurm.setup[{i}]", line, "give each shell line as its own item")


def _explain(e: OmegaConfBaseException, schema) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if type(e).__name__ == "ConfigKeyError":
        parent = key.rsplit(".", 1)[0] if "." in key else None
        node = OmegaConf.select(schema, parent) if parent else schema
        allowed = ", ".join(node.keys()) if isinstance(node, DictConfig) and len(node) else "(none yet)"
        return ConfigError(f"config key '{key}' is not known; allowed here: {allowed}")
    return ConfigError(f"config key '{key}': {msg}")


def _structured(schema, data) -> DictConfig:
    try:
        return OmegaConf.merge(schema, data)
    except OmegaConfBaseException as e:
        raise _explain(e, schema) from None


PRESETS = data_dir("configs")  # the repository's configs/ (in a wheel install, its copy in the package)


def _find(name: str, including: Path | None) -> Path:
    """A file named in `defaults`: relative to the including file, else to the presets directory."""
    candidates = [including.parent / name] if including else [Path(name)]
    candidates.append(PRESETS / name)
    for c in candidates:
        if c.is_file():
            return c
    where = f"in {including}" if including else "on the command line"
    raise ConfigError(
        f"config file {name} named {where} does not exist (looked in {', '.join(str(c.parent) for c in candidates)})"
    )


def _slurm_times_as_written(data: DictConfig, raw) -> None:
    """YAML 1.1 reads an unquoted 24:00:00 as the base-60 integer 86400, which Slurm would take as minutes: keep
    slurm.time and slurm.times values as they are written in the file."""
    slurm = (raw or {}).get("slurm") if isinstance(raw, dict) else None
    if not isinstance(slurm, dict) or "slurm" not in data:
        return
    if isinstance(slurm.get("time"), str):
        data.slurm.time = slurm["time"]
    if isinstance(slurm.get("times"), dict):
        for stage, value in slurm["times"].items():
            if isinstance(value, str):
                data.slurm.times[stage] = value


def _quote_slurm_time(override: str) -> str:
    """`slurm.time=24:00:00` / `slurm.times={export: 2:00:00}` on the command line: the times as written (see
    _slurm_times_as_written), not YAML's base-60 integers."""
    key, _, value = override.partition("=")
    if key.strip() == "slurm.time" or key.strip().startswith("slurm.times."):
        raw = yaml.load(value, Loader=yaml.BaseLoader) if value.strip() else value
        return f"{key}={json.dumps(raw)}" if isinstance(raw, str) else override
    if key.strip() == "slurm.times":
        raw = yaml.load(value, Loader=yaml.BaseLoader)
        return f"{key}={json.dumps(raw)}" if isinstance(raw, dict) else override
    return override


def _compose(path: Path, chain: tuple[Path, ...] = ()) -> list[DictConfig]:
    """The YAML layers of `path`: its `defaults` (in order, recursively), then its own keys."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config files include each other: {' -> '.join(str(p) for p in (*chain, path))}")
    try:
        data = OmegaConf.load(path)
    except Exception as e:  # yaml errors
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, attention:, ...)")
    _slurm_times_as_written(data, yaml.load(path.read_text(), Loader=yaml.BaseLoader))
    layers = []
    defaults = data.pop("defaults", None) or []
    if isinstance(defaults, str) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"config file {path}: 'defaults' must be a list of YAML file names, got {defaults}")
    for name in defaults:
        layers += _compose(_find(name, path), (*chain, path))
    return [*layers, data]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Defaults <- YAML file (after the files its `defaults:` list names, in order) <- `key=value` overrides,
    validated. A file is looked up as given, else in the presets directory (`configs/`)."""
    schema = OmegaConf.structured(Config)
    cfg = schema
    if path is not None:
        path = Path(path)
        if not path.is_file():
            if not (PRESETS / path).is_file():
                raise ConfigError(
                    f"config file {path} does not exist (nor in {PRESETS}): give the path of a YAML file or a preset "
                    "name such as models/llama3-8b.yaml"
                )
            path = PRESETS / path
        for layer in _compose(path):
            cfg = _structured(cfg, layer)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. attention.window=32)")
        try:
            dot = OmegaConf.from_dotlist([_quote_slurm_time(o) for o in overrides])
        except OmegaConfBaseException as e:
            raise ConfigError(f"overrides {list(overrides)} could not be parsed: {e}") from None
        cfg = _structured(cfg, dot)
    return validate(cfg)


def attention_settings(attention: Any) -> DictConfig:
    """A dict or an attention config section -> a validated AttentionConfig."""
    if isinstance(attention, DictConfig) and "attention" in attention:
        attention = attention.attention
    data = OmegaConf.to_container(attention) if isinstance(attention, DictConfig) else dict(attention or {})
    cfg = _structured(OmegaConf.structured(Config), {"attention": data})
    return validate(cfg).attention
