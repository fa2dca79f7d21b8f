"""The config's schema: one dataclass per section, each field with its default and a comment that says what it does.

config_reference.py generates docs/reference/config.md from the source of this file; validate.py checks the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from ..attention.settings import SETTINGS as ATTENTION_SETTINGS
from ..tasks import TABLE1, TASKS

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    path: str | None = None  # local HF model directory (or a converted model); None = the embedded default
    dtype: str = "float32"  # always explicit: transformers 5 would otherwise load checkpoints in their own dtype
    # where every stage but export computes: cpu | cuda (each rank its LOCAL_RANK's GPU) | auto (cuda when a GPU is
    # visible; plan and submit treat it as a GPU run)
    device: str = "cpu"
    # the architecture (HF config.json keys incl. model_type) for `plan` and meta-device checks before the weights
    # are on disk; a preset carries it, a real model.path overrides it
    arch: dict[str, Any] | None = None


# The attention section: one field per setting of attention/settings.py's record (its type, default and doc line;
# config_reference.py reads the doc lines from there). A new attention key is a Setting there, not a field here.
AttentionConfig = make_dataclass(
    "AttentionConfig",
    [(st.name, st.type, field(default=st.default)) for st in ATTENTION_SETTINGS],
    namespace={"__doc__": "The hybrid attention: attention/settings.py's record, one field per setting."},
)


@dataclass
class DataConfig:
    source: str | None = None  # .txt (documents split by blank lines), .jsonl, a datasets dir; None = embedded default
    text_field: str = "text"  # the text field of a .jsonl or datasets source
    seq_len: int = 512  # tokens per packed training sequence (stage 1, and stage 2 unless finetune.seq_len)
    num_sequences: int = 256  # packed training sequences for stage 1
    heldout_fraction: float = 0.05  # documents held out (user sources; the embedded default has its own split)


DEVICES = ("cpu", "cuda", "auto")  # auto: cuda when a GPU is visible


def on_gpus(device: str) -> bool:
    """Whether a run with this model.device is planned and submitted as a GPU run: cuda, and auto (which is cuda
    wherever a GPU is visible; a Slurm job sees only the GPUs it asks for)."""
    return device.startswith("cuda") or device == "auto"


# stage 1 objectives, in the order distill.objectives.unit_loss adds their terms (distill.step logs them so)
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
    warmup_steps: int = 10  # W: step k <= W uses lr k / W, then linear decay to 0 after max_steps (every step trains)
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


EVAL_MODES = ("base", "hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none")  # eval.modes' default
CACHE = "+cache"  # a mode's name with this suffix runs it with the cache of exact keys on (eval.cache); without, off
CACHED_MODES = ("hybrid", "swa_only", "swa_sinks")  # the modes that take it: the cache keeps keys the window let go
CACHE_ONLY = "cache_only"  # the softmax over the cache's keys alone: always with the cache on
EVAL_MODE_NAMES = (*EVAL_MODES, *(m + CACHE for m in CACHED_MODES), CACHE_ONLY)  # every name eval.modes accepts
EVAL_TASKS = tuple(TASKS)  # every task record (hybrid_scale/tasks.py); the default: the paper's Table 1


def eval_mode(name: str) -> tuple[str, bool]:
    """An eval mode's name as (the layers' mode, whether the cache is on): hybrid+cache -> (hybrid, True), hybrid ->
    (hybrid, False: the cache off, whatever attention.cache says), cache_only -> (cache_only, True)."""
    if name.endswith(CACHE):
        return name[: -len(CACHE)], True
    return name, name == CACHE_ONLY


def eval_cache(cfg) -> int:
    """The keys per KV head the cached eval modes run with: eval.cache, else attention.cache (a Config, or the plain
    config record results.json holds)."""
    keys = cfg["eval"].get("cache")
    return int(cfg["attention"].get("cache", 0) if keys is None else keys)


@dataclass
class EvalConfig:
    # HF dir or converted model; None = the run's stage2/output or stage1/converted, else model.path, else the
    # embedded default
    model: str | None = None
    # modes to score (base = the unconverted model); also hybrid+cache, swa_only+cache, swa_sinks+cache and cache_only
    # (eval.cache), which the default leaves out
    modes: list[str] = field(default_factory=lambda: list(EVAL_MODES))
    tasks: list[str] = field(
        default_factory=lambda: list(TABLE1)
    )  # Table 1's six; also openbookqa (hybrid_scale/tasks.py)
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
    # tokens of the first held-out perplexity sequence over which the LA share of the normaliser is measured (at
    # most eval.ppl_seq_len, that sequence's length; results.json records the length used; 0 = skip it)
    la_share_seq_len: int = 1024
    # passkey retrieval past the window: a key stated in one place, then filler (held-out text), then the question;
    # scored by answer log-likelihood and greedy exact match at each distance (tokens from the key to the answer)
    passkey_distances: list[int] = field(default_factory=lambda: [32, 128, 512, 1024, 2048])  # [] = no probe
    passkey_trials: int = 20  # prompts per distance (seeded keys and filler)
    # the modes the passkey probe scores; null = the evaluated modes (eval.modes)
    passkey_modes: list[str] | None = None
    # exact keys per KV head of the cache (attention.cache) in the modes named with `+cache` (hybrid+cache,
    # swa_only+cache, swa_sinks+cache) and in cache_only, chosen by attention.cache_select; the plain names run with
    # the cache off, so that eval.modes=[hybrid,hybrid+cache] compares one model without and with it (> 0 when such a
    # mode runs); null = attention.cache
    cache: int | None = None
    # the associative-recall probe beside the passkey (data/passkey.py: a line of this many key-value pairs, filler,
    # one key again; answer its value), at eval.passkey_distances x eval.passkey_trials for eval.passkey_modes;
    # 0 = no recall probe
    recall_pairs: int = 4
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
    # fix gamma of every head (inference-time hybridisation; the exported model must run hybrid): > 0, and < 1 when
    # the model's attention.gamma_param is sigmoid
    gamma: float | None = None
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
    # let the pipeline go on in a run_dir whose recorded training settings (named in the refusal) changed, for stage 1
    # or 2 not started yet; a started one is still refused (remove its directory, or use another run_dir)
    allow_config_change: bool = False
