"""The one settings module of the device harness (benchmarks/device/): where things are, and the sizes, budgets,
targets and tolerances of its two harnesses, each from its environment.

The speed benchmark (`speed`): FULL (the GPU, Llama-3-8B's attention shape) or DRY (the CPU dry run, toy shapes), its
parts in run order with their budgets, issue 51's and 67's targets; the environment that changes them:

  DEVICE_SPEED_PARTS="grad,prefill"        the parts run, in SPEED_PARTS' order (default: DEFAULT_PARTS on a GPU,
                                           every part in the dry run)
  DEVICE_SPEED_BUDGETS="decode=60"         a budget in seconds (nothing of its part starts after it)
  DEVICE_SPEED_DEADLINE=285                seconds from device.sh's start after which no part or row starts
  DEVICE_SPEED_TILES="a:warps=8,stages=2;b@90:dchunk=64"  tile variants of the chunked prefill (part tiles, which
                                           then has to be named in DEVICE_SPEED_PARTS; unset: DEFAULT_TILES; empty:
                                           none)
  DEVICE_SPEED_FLA_CONFIGS=2               configs each of fla's autotuned kernels keeps (0: fla's own autotuning)

The budgets of the parts that run, with STARTUP, must add up to at most the deadline; speed_settings refuses settings
that break this, with one error that names the sum and each budget, before any device time is spent (a budget clipped
without a word would cut a part the caller asked for; refusing makes the caller choose what to leave out).

The pipeline check (`check`): the tolerances of the checked run against the reference, and check_settings(): every
size and budget of its parts from the GPU_CHECK_* variables (benchmarks/device/__init__.py lists them; toy sizes in the
dry run or with GPU_CHECK_SMALL=1); plus the two number helpers its checks share.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "benchmarks" / "device" / "text.jsonl"  # the pipeline check's text (make_text.py writes it)
COLLECTIVES = ROOT / "tests" / "collectives"  # sitecustomize.py: records torch.distributed calls (and off-device ones)

# --- the speed benchmark -------------------------------------------------------------------------------------------

PEAK_TFLOPS = 989.0  # dense bf16 of an H100 / H200 SXM (MFU's denominator)
LOLCATS_A100_HOURS = 6.5  # LoLCATs' Llama-3-8B conversion, as issue 51 quotes it
# key -> title, in the order the parts run (issue 67: correctness first, then prefill, decode, one profiler pass)
SPEED_PARTS = {
    "grad": "1a. bf16 gradients: triton_hybrid_attention vs the fp32 chunked path",
    "delta": "1b. fla's gated delta rule vs the torch form",
    "prefill": "2. prefill vs SDPA and fla",
    "tiles": "2b. tile variants (DEVICE_SPEED_TILES)",
    "decode": "3. decode throughput, a batch of sequences, CUDA graphs",
    "profile": "4. profiler: hybrid fwd+bwd and one decode step, one pass",
    "tests": "5. gpu-marked tests, chunked path first",
    "generate": "6. generate, compiled, whole model",
    "big": "7. 8B-shaped stage 1 and stage 2",
}
# what a GPU run does unless DEVICE_SPEED_PARTS says otherwise: what fits the deadline. Left out, each runnable when
# named (alone or with a few others): tiles (only with DEVICE_SPEED_TILES), generate (compiling two 8B-shaped models
# took its whole 70 s at 1k context, and decode measures the serving case without compiling), big (the 8B stages in a
# child: building and saving the model, DeepSpeed's start and both stages do not fit in what the others leave)
DEFAULT_PARTS = ("grad", "delta", "prefill", "decode", "profile", "tests")
# the budgets each part spends (prefill: its warm-up, then its rows)
PART_BUDGETS = {"prefill": ("prefill_warm", "prefill")}
MODEL_8B = dict(layers=4, hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256)
# seconds of a GPU run: estimates of what each part must do in its time, none measured yet (no GPU has run this
# script). The default parts' and `startup` add up to the deadline, 285 s (tests/unit/test_device_budgets.py)
FULL_BUDGETS = dict(
    grad=35,  # a pytest child: ~8 s to start, the chunked kernels compiled for two modes, fwd+bwd at T 4096
    delta=30,  # fla's gated delta-rule kernels compiled (fwd and bwd, their autotuners trimmed) and one comparison
    prefill_warm=40,  # every method compiled, autotuned and self-checked at T 1024 (the hybrid's kernels are already
    #                 in Triton's cache on disk from part grad's child); fla's chunk_simple_gla is most of it
    prefill=25,  # 4 methods x 2 lengths of CUDA-event timing, a few ms each after the warm-up
    decode=45,  # an 8B-shaped 4-layer model built, then converted; 3 steps graphed and timed; 2 largest batches tried
    profile=15,  # one torch.profiler pass over two functions, a few calls each
    tests=70,  # the gpu-marked tests in a child, cut at what is left (a cut run still names what passed): the rest
    tiles=60,  # (not by default) each variant compiles the chunked kernels anew
    generate=90,  # (not by default) two models compiled with CUDA graphs at 1k context
    big=240,  # (not by default) a 4-layer 8B-shaped model saved, stage 1 and stage 2 with DeepSpeed
)
FULL = dict(
    device="cuda",
    dtype="bfloat16",
    backend="triton",
    shape=dict(H=32, Hkv=8, D=128, F=256),  # F: phi's output, 2 x f with hedgehog's f = d
    window=64,
    sinks=8,
    warm_T=1024,  # every prefill method compiled, autotuned and self-checked here before its clock starts
    lengths=[4096, 16384],
    delta_T=1000,  # fla against the torch form: several chunks of 64 and a ragged last one
    profile_T=4096,
    tiles_T=4096,
    # decode: `batch` sequences at each context, the hybrid after `prompt` tokens (its state's size and its step's
    # work do not depend on the context past window + sinks); the largest batch at fit_context, with fit_margin_gib
    # of the free memory left for the allocator and the libraries' workspaces
    decode=dict(batch=32, contexts=[8192, 32768], prompt=128, fit_context=32768, fit_margin_gib=2.0),
    generate_contexts=[1024],
    model=MODEL_8B,
    new_tokens=32,
    warmup=2,
    repeats=5,
    replays=20,
    profile_steps=3,
    fla_configs=2,
    big=dict(MODEL_8B, tie=False, seq_len=1024, sequences=32, distill_batch=8, steps=3, global_batch=4, micro_batch=2),
    budgets=FULL_BUDGETS,
    startup=25,  # seconds before the first part: device.sh's wheels, Python's imports, CUDA's start (an allowance)
    deadline=285,
)
DRY = dict(
    device="cpu",
    dtype="float32",
    backend="torch",
    shape=dict(H=4, Hkv=2, D=16, F=32),
    window=16,
    sinks=4,
    warm_T=32,
    lengths=[64, 128],
    delta_T=40,
    profile_T=64,
    tiles_T=64,
    # (cpu_memory_mib: what stands in for the device's free memory, so that the largest batch is found and allocated)
    decode=dict(batch=4, contexts=[48, 96], prompt=32, fit_context=96, fit_margin_gib=0.0, cpu_memory_mib=24),
    generate_contexts=[48, 96],
    model=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=256),
    new_tokens=8,
    warmup=1,
    repeats=2,
    replays=3,
    profile_steps=2,
    fla_configs=2,
    big=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=300, tie=False, seq_len=64),
    budgets=dict(
        grad=60, delta=60, prefill_warm=60, prefill=60, tiles=60, decode=60, profile=60, tests=120, generate=60, big=240
    ),
    startup=20,
    deadline=900,
)
DRY["big"] |= dict(sequences=8, distill_batch=4, steps=3, global_batch=2, micro_batch=1)
# at most: issue 67's GPU targets for the prefill (they replace issue 51's 0.55 and 2.0 ms), issue 51's ratios, and
# issue 60's counts: (the figure's key in Run.data["ratios"]) -> at most
TARGETS = {
    "prefill fwd+bwd hybrid ms, T=4096": 0.8,
    "prefill fwd+bwd hybrid ms, T=16384": 3.0,
    "prefill fwd+bwd hybrid/sdpa, T=4096": 0.5,
    "prefill fwd+bwd hybrid/sdpa, T=16384": 1 / 7,
    "prefill fwd+bwd hybrid/fla, T=4096": 1.25,
    "prefill fwd+bwd hybrid/fla, T=16384": 1.25,
    "prefill fwd+bwd la_only/fla, T=4096": 1.0,
    "prefill fwd+bwd la_only/fla, T=16384": 1.0,
    "prefill fwd+bwd peak memory hybrid/sdpa, T=4096": 1.5,
    "prefill fwd+bwd peak memory hybrid/sdpa, T=16384": 1.5,
    "generate: dynamo recompiles after the first decode step (every row)": 0,
    "generate: CUDA-graph skips (every row)": 0,
}
# at least: issue 67's decode targets (the serving case, where the KV cache's reads dominate a step)
FLOORS = {
    "decode tokens/s hybrid/kv_cache, B=32, ctx=8192": 1.8,
    "decode tokens/s hybrid/kv_cache, B=32, ctx=32768": 4.0,
}


# The tile variants part tiles times when DEVICE_SPEED_TILES is unset, at head dim 128 on an H100 / H200 (each patches
# GPU_SETTINGS[(90, 128)]; kernels/hybrid_scale_kernels/settings.py says how sm_90's entry was chosen): sm_80's tiles
# where sm_90's differ (what sm_90's own gain), then the alternatives that also compiled with no spill, in the order
# they are worth the part's budget: whole-D and 3-stage q.k chunks, one query head a program (what the folding of a
# KV head's query heads gains), the forward scan's [64, 128] tiles in 8 warps (fewer bytes, more segments), and the
# reverse scan's former [64, 32] in 4 warps (two programs an SM, 3 segments at 4k; what its [64, 128] gain).
DEFAULT_TILES = (
    "sm80@90:dchunk=32,stages=1;wholeD@90:dchunk=128;stages3@90:stages=3;unfolded@90:fold=0;"
    "scan@90:block_dv=128,state_warps=8;rscan32@90:dstates_block_dv=32,dstates_warps=4"
)
TILE_ARCHS = (80, 90)  # the architectures with settings of their own (hybrid_scale_kernels.settings.ARCHS)


def parse_tiles(text: str) -> dict[str, dict[str, int]]:
    """DEVICE_SPEED_TILES ("a:warps=8,stages=2;b@90:dchunk=64") as {variant: {setting: int}}: a variant NAME@ARCH
    (`tile_arch`) patches sm_ARCH's entry and runs only on such a device, NAME alone patches the device's own; a
    clear SystemExit on a malformed one (before any device time is spent)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, body = item.partition(":")
        name = name.strip()
        base, at, arch = name.partition("@")
        if not sep or not base or base == "default" or (at and not arch.isdigit()):
            raise SystemExit(f"DEVICE_SPEED_TILES: '{item}' is not NAME:key=value,... or NAME@ARCH:key=value,... "
                             "(NAME not 'default')")  # fmt: skip
        if at and int(arch) not in TILE_ARCHS:
            raise SystemExit(f"DEVICE_SPEED_TILES: no settings for sm_{arch} in '{item}'; architectures: "
                             + ", ".join(f"sm_{a}" for a in TILE_ARCHS))  # fmt: skip
        values = {}
        for pair in filter(None, (p.strip() for p in body.split(","))):
            key, _, value = pair.partition("=")
            try:
                values[key.strip()] = int(value)
            except ValueError:
                raise SystemExit(f"DEVICE_SPEED_TILES: '{pair}' in '{item}' is not key=integer") from None
        if not values:
            raise SystemExit(f"DEVICE_SPEED_TILES: variant '{name}' changes nothing")
        out[name] = values
    return out


def budgets_of(cfg: dict) -> dict[str, float]:
    """The budgets the parts that run spend (each part's own, and prefill's warm-up), in seconds."""
    names = [name for part in cfg["parts"] for name in PART_BUDGETS.get(part, (part,))]
    return {name: cfg["budgets"][name] for name in names}


def check_budgets(cfg: dict) -> None:
    """A clear SystemExit when the parts' budgets and the startup allowance add up to more than the deadline."""
    spent = budgets_of(cfg)
    total = cfg["startup"] + sum(spent.values())
    if total > cfg["deadline"]:
        each = ", ".join(f"{k}={v:g}" for k, v in spent.items())
        raise SystemExit(
            f"device_speed: the budgets add up to {total:g} s (startup {cfg['startup']:g} + {each}), over the "
            f"deadline of {cfg['deadline']:g} s: lower some with DEVICE_SPEED_BUDGETS, or run fewer parts with "
            "DEVICE_SPEED_PARTS"
        )


def tile_arch(variant: str) -> int | None:
    """The architecture a tile variant's name (NAME@ARCH) is for, None when it names none."""
    _, at, arch = variant.partition("@")
    return int(arch) if at else None


def speed_settings(dry: bool) -> dict:
    """FULL or DRY with the environment's changes (the module docstring's variables), refused when they do not fit
    the deadline."""
    cfg = copy.deepcopy(DRY if dry else FULL)
    for item in filter(None, os.environ.get("DEVICE_SPEED_BUDGETS", "").split(",")):
        name, _, seconds = item.partition("=")
        if name not in cfg["budgets"]:
            raise SystemExit(f"DEVICE_SPEED_BUDGETS: unknown part '{name}'; parts: {', '.join(cfg['budgets'])}")
        cfg["budgets"][name] = float(seconds)
    if os.environ.get("DEVICE_SPEED_DEADLINE"):
        cfg["deadline"] = float(os.environ["DEVICE_SPEED_DEADLINE"])
    if os.environ.get("DEVICE_SPEED_FLA_CONFIGS"):
        cfg["fla_configs"] = int(os.environ["DEVICE_SPEED_FLA_CONFIGS"])
    given = os.environ.get("DEVICE_SPEED_TILES")  # (None: unset)
    cfg["tiles"] = parse_tiles(DEFAULT_TILES if given is None else given)
    default = ",".join(SPEED_PARTS if dry else DEFAULT_PARTS)
    named = [p.strip() for p in os.environ.get("DEVICE_SPEED_PARTS", default).split(",") if p.strip()]
    unknown = [p for p in named if p not in SPEED_PARTS]
    if unknown:
        raise SystemExit(f"DEVICE_SPEED_PARTS: unknown part {', '.join(unknown)}; parts: {', '.join(SPEED_PARTS)}")
    if given and "tiles" not in named:
        raise SystemExit("DEVICE_SPEED_TILES is set but part tiles does not run: name it in DEVICE_SPEED_PARTS "
                         "(e.g. DEVICE_SPEED_PARTS=prefill,tiles; the default parts leave it no time)")  # fmt: skip
    cfg["parts"], cfg["dry"] = [p for p in SPEED_PARTS if p in named], dry
    check_budgets(cfg)
    return cfg


# --- the pipeline check -------------------------------------------------------------------------------------------

# key -> title, in the order the parts run (GPU_CHECK_STEPS picks them; the gpu-marked tests first, as issue 60 has it)
CHECK_PARTS = {
    "tests": "gpu-marked tests: the compiled kernels against the spec",
    "a": "build the tiny model, tokenizer and task data",
    "b": "pipeline via the CLI, checked vs reference",
    "c": "1B-shaped stage-1 layer and stage-2 step",
    "d": "hybrid attention vs SDPA",
    "e": "Triton kernels vs SDPA: prefill and decode",
}
HELDOUT_FRACTION = 0.1
MODES = ["base", "hybrid", "swa_only", "swa_sinks", "la_only", "sinks_only", "none"]
# relative tolerances of the checked run against the reference (bf16 against fp32 by default): bf16 keeps 8 bits of
# mantissa (0.4 % per rounding), and stages 1 and 2 train a few steps on top of it. Measured at the full step-b sizes
# on CPU, bf16 vs fp32 (60 pretraining steps): stage-1 losses within 0.07 %, stage-2 losses 0.04 %, perplexities
# 0.45 %, task log-likelihoods 0.13 %, the export's loss 0.003 % -- so these leave a factor 5-10 for the GPU's kernels
TOL = {
    "stage1_loss": 0.03,
    "stage2_train_loss": 0.02,
    "stage2_heldout_loss": 0.02,
    "perplexity": 0.03,
    "task_loglik": 0.02,
    "export_loss": 0.02,
}
DECODE_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # cached decode vs full forward, max|d|/max|logit|


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def check_settings(dry: bool) -> dict:
    """The pipeline check's sizes and budgets: toy ones on the CPU in the dry run (or with GPU_CHECK_SMALL=1)."""
    small = dry or env("GPU_CHECK_SMALL", "0") == "1"
    s = {
        "small": small,
        "dry": dry,
        "device": env("GPU_CHECK_DEVICE", "cpu" if dry else "cuda"),
        "dtype": env("GPU_CHECK_DTYPE", "bfloat16"),
        "ref_device": env("GPU_CHECK_REF_DEVICE", "cpu"),
        "ref_dtype": env("GPU_CHECK_REF_DTYPE", "float32"),
        "steps": [x.strip() for x in env("GPU_CHECK_STEPS", ",".join(CHECK_PARTS)).split(",") if x.strip()],
        "kernel_budget": int(env("GPU_CHECK_KERNEL_BUDGET", "100")),
        "timeout": int(env("GPU_CHECK_TIMEOUT", "240")),
        "deadline": int(env("GPU_CHECK_DEADLINE", "450")),
        "cli": env("GPU_CHECK_CLI", "pipeline" if small else "stages"),
        "parallel": env("GPU_CHECK_PARALLEL", "1" if small else "0") == "1",
    }
    if small:
        s["tiny"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        s["tiny"] |= dict(num_key_value_heads=2, head_dim=16)
        s["pretrain"] = dict(steps=10, seq_len=64, batch=4, lr=3e-3)
        s["pipe"] = dict(window=16, seq_len=64, num_sequences=8, epochs=1, distill_batch=4, steps=4, global_batch=2)
        s["pipe"] |= dict(micro_batch=1, eval_every=2, heldout=2, limit=4, ppl_seq_len=128, ppl_sequences=1)
        s["pipe"] |= dict(buckets=[0, 16, 64, 128], la_share=64, decode_steps=4, passkey=[20, 40], passkey_trials=2)
        s["big"] = dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, seq_len=64, sequences=8)
        s["big"] |= dict(distill_batch=4, steps=3, global_batch=2)
        s["attn"] = dict(lengths=[256, 512], heads=4, kv=2, head_dim=16, feature=32, naive_max=512, window=16)
        s["attn"] |= dict(warmup=1, repeats=2)
    else:
        s["tiny"] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
        s["tiny"] |= dict(num_key_value_heads=2, head_dim=64)
        s["pretrain"] = dict(steps=300, seq_len=256, batch=16, lr=3e-3)
        s["pipe"] = dict(window=64, seq_len=256, num_sequences=32, epochs=2, distill_batch=8, steps=8, global_batch=4)
        s["pipe"] |= dict(micro_batch=2, eval_every=4, heldout=4, limit=16, ppl_seq_len=512, ppl_sequences=2)
        s["pipe"] |= dict(buckets=[0, 64, 256, 512], la_share=256, decode_steps=8, passkey=[32, 128, 512])
        s["pipe"] |= dict(passkey_trials=8)
        s["big"] = dict(layers=4, hidden=2048, heads=32, kv=8, head_dim=64, inter=8192, seq_len=2048, sequences=16)
        s["big"] |= dict(distill_batch=4, steps=4, global_batch=4)
        s["attn"] = dict(lengths=[4096, 16384], heads=32, kv=8, head_dim=64, feature=128)
        s["attn"] |= dict(naive_max=8192, window=64, warmup=2, repeats=5)
    unknown = [x for x in s["steps"] if x not in CHECK_PARTS]
    if unknown:
        raise SystemExit(f"GPU_CHECK_STEPS: unknown part {', '.join(unknown)}; parts: {', '.join(CHECK_PARTS)}")
    if "GPU_CHECK_LENGTHS" in os.environ:
        s["attn"]["lengths"] = [int(x) for x in os.environ["GPU_CHECK_LENGTHS"].split(",")]
    if "GPU_CHECK_NAIVE_MAX" in os.environ:
        s["attn"]["naive_max"] = int(os.environ["GPU_CHECK_NAIVE_MAX"])
    if "GPU_CHECK_PRETRAIN_STEPS" in os.environ:
        s["pretrain"]["steps"] = int(os.environ["GPU_CHECK_PRETRAIN_STEPS"])
    if "GPU_CHECK_BIG_LAYERS" in os.environ:
        s["big"]["layers"] = int(os.environ["GPU_CHECK_BIG_LAYERS"])
    return s


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
