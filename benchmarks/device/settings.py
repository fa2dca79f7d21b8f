"""The device run's sizes (FULL: the GPU, Llama-3-8B's attention shape; DRY: the CPU dry run, toy shapes), its parts
in run order with their budgets, issue 51's targets, and the environment that changes them:

  DEVICE_SPEED_PARTS="grad,prefill"        the parts run (default: every one, in PARTS' order)
  DEVICE_SPEED_BUDGETS="generate=90"       a part's budget in seconds (nothing of it starts after)
  DEVICE_SPEED_DEADLINE=285                seconds from device_speed.sh's start after which no part or row starts
  DEVICE_SPEED_TILES="a:warps=8,stages=2;b:dchunk=64"   tile variants of the chunked prefill (part tiles)
  DEVICE_SPEED_FLA_CONFIGS=2               configs each of fla's autotuned kernels keeps (0: fla's own autotuning)
"""

from __future__ import annotations

import copy
import os

PEAK_TFLOPS = 989.0  # dense bf16 of an H100 / H200 SXM (MFU's denominator)
LOLCATS_A100_HOURS = 6.5  # LoLCATs' Llama-3-8B conversion, as issue 51 quotes it
# key -> title, in the order the parts run (issue 60: the gradient test first, the pytest part last)
PARTS = {
    "grad": "1. bf16 gradients: triton_hybrid_attention vs the fp32 chunked path",
    "prefill": "2. prefill vs SDPA and fla",
    "profile": "2b. profiler: hybrid fwd+bwd and one decode step",
    "tiles": "2c. tile variants (DEVICE_SPEED_TILES)",
    "decode": "3. decode per layer, CUDA graphs",
    "generate": "4. decode, whole model (generate)",
    "big": "5. 8B-shaped stage 1 and stage 2",
    "tests": "6. gpu-marked tests, chunked path first",
}
MODEL_8B = dict(layers=4, hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256)
FULL = dict(
    device="cuda",
    dtype="bfloat16",
    backend="triton",
    shape=dict(H=32, Hkv=8, D=128, F=256),  # F: phi's output, 2 x f with hedgehog's f = d
    window=64,
    sinks=8,
    grad_T=4096,
    warm_T=1024,  # every prefill method compiled, autotuned and self-checked here before its clock starts
    lengths=[4096, 16384],
    profile_T=4096,
    profile_context=8192,
    tiles_T=4096,
    contexts=[1024, 8192, 32768],
    model=MODEL_8B,
    new_tokens=32,
    warmup=2,
    repeats=5,
    replays=20,
    profile_steps=3,
    fla_configs=2,
    big=dict(MODEL_8B, tie=False, seq_len=1024, sequences=32, distill_batch=8, steps=3, global_batch=4, micro_batch=2),
    # seconds; prefill_warm: the prefill's compile, autotune and self-check, outside its rows' own budget `prefill`
    budgets=dict(grad=35, prefill_warm=50, prefill=25, profile=10, tiles=60, decode=20, generate=70, big=70, tests=60),
    deadline=285,
)
DRY = dict(
    device="cpu",
    dtype="float32",
    backend="torch",
    shape=dict(H=4, Hkv=2, D=16, F=32),
    window=16,
    sinks=4,
    grad_T=96,
    warm_T=32,
    lengths=[64, 128],
    profile_T=64,
    profile_context=48,
    tiles_T=64,
    contexts=[48, 96],
    model=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=256),
    new_tokens=8,
    warmup=1,
    repeats=2,
    replays=3,
    profile_steps=2,
    fla_configs=2,
    big=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=300, tie=False, seq_len=64),
    budgets=dict(
        grad=60, prefill_warm=60, prefill=60, profile=60, tiles=60, decode=60, generate=60, big=240, tests=120
    ),
    deadline=900,
)
DRY["big"] |= dict(sequences=8, distill_batch=4, steps=3, global_batch=2, micro_batch=1)
# issue 51's targets (H200), and issue 60's counts: (the figure's key in Run.data["ratios"]) -> at most
TARGETS = {
    "prefill fwd+bwd hybrid ms, T=4096": 0.55,
    "prefill fwd+bwd hybrid ms, T=16384": 2.0,
    "prefill fwd+bwd hybrid/sdpa, T=4096": 0.5,
    "prefill fwd+bwd hybrid/sdpa, T=16384": 1 / 7,
    "prefill fwd+bwd hybrid/fla, T=4096": 1.25,
    "prefill fwd+bwd hybrid/fla, T=16384": 1.25,
    "prefill fwd+bwd la_only/fla, T=4096": 1.0,
    "prefill fwd+bwd la_only/fla, T=16384": 1.0,
    "prefill fwd+bwd peak memory hybrid/sdpa, T=4096": 1.5,
    "prefill fwd+bwd peak memory hybrid/sdpa, T=16384": 1.5,
    "decode kernel us per layer, ctx=1024": 4.0,
    "decode kernel us per layer, ctx=8192": 4.0,
    "decode kernel us per layer, ctx=32768": 4.0,
    "generate ms/token hybrid/base, ctx=1024": 1.1,
    "generate ms/token hybrid/base, ctx=8192": 0.5,
    "generate ms/token hybrid/base, ctx=32768": 1 / 6,
    "generate: dynamo recompiles after the first decode step (every row)": 0,
    "generate: CUDA-graph skips (every row)": 0,
}


def parse_tiles(text: str) -> dict[str, dict[str, int]]:
    """DEVICE_SPEED_TILES ("a:warps=8,stages=2;b:dchunk=64") as {variant: {setting: int}}; a clear SystemExit on a
    malformed one (before any device time is spent)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, body = item.partition(":")
        if not sep or not name.strip() or name.strip() == "default":
            raise SystemExit(f"DEVICE_SPEED_TILES: '{item}' is not NAME:key=value,... (NAME not 'default')")
        values = {}
        for pair in filter(None, (p.strip() for p in body.split(","))):
            key, _, value = pair.partition("=")
            try:
                values[key.strip()] = int(value)
            except ValueError:
                raise SystemExit(f"DEVICE_SPEED_TILES: '{pair}' in '{item}' is not key=integer") from None
        if not values:
            raise SystemExit(f"DEVICE_SPEED_TILES: variant '{name}' changes nothing")
        out[name.strip()] = values
    return out


def settings(dry: bool) -> dict:
    """FULL or DRY with the environment's changes (the module docstring's variables)."""
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
    cfg["tiles"] = parse_tiles(os.environ.get("DEVICE_SPEED_TILES", ""))
    parts = [p.strip() for p in os.environ.get("DEVICE_SPEED_PARTS", ",".join(PARTS)).split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"DEVICE_SPEED_PARTS: unknown part {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    cfg["parts"] = parts
    return cfg
