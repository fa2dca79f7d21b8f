"""Issue 51's device benchmark: the converted attention against what it replaces, as ratios measured side by side in one
process on one GPU (bf16, Llama-3-8B attention shape: 32 heads, 8 KV heads, head dim 128, phi of 2 x 128 = 256
features (hedgehog, f = d), window 64, 8 sinks kept by the hybrid, LA decay on; batch 1). Sized for at most 5 minutes
of device time: every part has its own budget and the whole run a deadline (DEVICE_SPEED_DEADLINE, 285 s, counted from
device_speed.sh's start), after which nothing starts; what was measured is written after every part.

Parts, in the order they run:
  e. tests: `pytest -m gpu tests/unit/test_triton_kernels_bf16.py tests/unit/test_chunk_prefill.py` (the compiled
     kernels against the spec, the gamma gradient's fix and the chunked prefill included), cut at its budget;
  a. prefill: forward and forward+backward at T = 4096 and 16384 of the hybrid (`hybrid.attend(..., backend=
     "triton")`, modes hybrid and la_only) against SDPA (flash, causal, GQA) and fla-core's `chunk_simple_gla` on
     the same phi_q, phi_k (KV heads repeated to the query heads, [B, T, H, *], laid out before the clock starts), v
     and g = -rho per head (its gradient included; scale 1; fla has no normaliser); CUDA events, median of
     5 calls after 2 of warm-up; peak memory (max_memory_allocated above the inputs, reset between);
  b. decode, one layer, one token at context 1k, 8k, 32k: the hybrid step through a converted layer's HybridCache
     (phi_q and phi_k of the new token, gamma, rho, the fused decode kernel; after a prefill of the context) against a
     static KV cache step (the new k/v written into a preallocated [1, 8, ctx, 128] cache, SDPA of one query over
     it), both captured in CUDA graphs (torch.cuda.graph) and timed over 20 replays; and torch.profiler's
     kernel time per step (the `_decode` kernel's microseconds, and every kernel's);
  c. decode, whole model: `generate` of an 8B-shaped random model with a few layers (4; hidden 4096, intermediate
     14336, vocab 128256) against the same model converted (hybrid_scale.convert_model), each with a static cache
     (`cache_implementation="static"`; `past_key_values=HybridCache(model)`) and transformers' torch.compile
     (CompileConfig(fullgraph=True)); prompt ctx - 32 tokens, 32 new; ms per generated token = the median interval
     between the last 16 tokens (CUDA events recorded by a logits processor); a hybrid that cannot compile is run
     eagerly and the reason recorded;
  d. stage 1 and stage 2 of an 8B-shaped random model (benchmarks/gpu_check/big.py at the 8B shape, 4 layers,
     the preset's attention and sequence length; in a child process): tokens/s, MFU (model FLOPs / time / 989
     TFLOP/s, dense bf16 of an H100/H200 SXM), peak memory, and the GPU-hours of an 8B conversion at the presets'
     token budgets (configs/models/llama3-8b.yaml, configs/recipes/*.yaml) beside LoLCATs' 6.5 A100-hours.
Every ratio is printed as it is measured (a line starting `device_speed: RATIO`), with the issue's target beside it.

    here:            make gpu-wheels          (the device tool: run, carry [".whl"], timeout_s 400)
    on the device:   bash benchmarks/device_speed.sh
    on a CPU:        python -m benchmarks.device_speed --dry-run    (every part at toy shapes with the torch path: no
                     Triton, CUDA graphs, torch.compile or fla; seconds; tests/integration/test_device_speed.py)

Writes device_speed.md (the tables) and device_speed.json (every figure) into --out: $OUT when set, else docs/results
(the dry run: benchmarks/out/device_speed_dry), and the children's output into device_speed_children.log. Exit
status 0 when every part ran and the tests passed, else 1. DEVICE_SPEED_BUDGETS="tests=90,generate=120" changes the
parts' budgets (seconds), DEVICE_SPEED_PARTS="e,a,b,c,d" the parts run.

Why one file of over 500 lines: it is the one script a lent device runs (device_speed.sh copies it alone, with the
wheels, onto a bare machine), and its sections a-e share the Run, the timing helpers and the report. Its attention
inputs and Clock are benchmarks/registry.py's (issue 53).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_check.common import DEADLINE, Log, device_info, run_child, versions
from benchmarks.registry import Clock
from benchmarks.registry import inputs as attention_inputs

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # dense bf16 of an H100 / H200 SXM
LOLCATS_A100_HOURS = 6.5  # LoLCATs' Llama-3-8B conversion, as issue 51 quotes it
TEST_FILES = ["tests/unit/test_triton_kernels_bf16.py", "tests/unit/test_chunk_prefill.py"]  # (gpu-marked tests)
PARTS = {
    "e": "bf16 kernel tests",
    "a": "prefill vs SDPA and fla",
    "b": "decode per layer, CUDA graphs",
    "c": "decode, whole model (generate)",
    "d": "8B-shaped stage 1 and stage 2",
}
MODEL_8B = dict(layers=4, hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256)
FULL = dict(
    device="cuda",
    dtype="bfloat16",
    backend="triton",
    shape=dict(H=32, Hkv=8, D=128, F=256),  # F: phi's output, 2 x f with hedgehog's f = d
    window=64,
    sinks=8,
    lengths=[4096, 16384],
    contexts=[1024, 8192, 32768],
    model=MODEL_8B,
    new_tokens=32,
    warmup=2,
    repeats=5,
    replays=20,
    profile_steps=10,
    big=dict(MODEL_8B, tie=False, seq_len=1024, sequences=32, distill_batch=8, steps=3, global_batch=4, micro_batch=2),
    budgets=dict(tests=90, prefill=40, decode=20, generate=80, big=80),
    deadline=285,
)
DRY = dict(
    device="cpu",
    dtype="float32",
    backend="torch",
    shape=dict(H=4, Hkv=2, D=16, F=32),
    window=16,
    sinks=4,
    lengths=[64, 128],
    contexts=[48, 96],
    model=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=256),
    new_tokens=8,
    warmup=1,
    repeats=2,
    replays=3,
    profile_steps=2,
    big=dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=300, tie=False, seq_len=64),
    budgets=dict(tests=120, prefill=60, decode=60, generate=60, big=240),
    deadline=900,
)
DRY["big"] |= dict(sequences=8, distill_batch=4, steps=3, global_batch=2, micro_batch=1)
PREFILL_METHODS = ("sdpa", "hybrid", "la_only", "fla")
DECODE_METHODS = ("hybrid", "kv_cache")
GENERATE_MODELS = ("base", "hybrid")
# issue 51's targets (H200): (what, the figure's key in `ratios`, at most)
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
}


def one_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300].replace("|", "/")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def fmt(x, digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
    return str(x)


class Run:
    """The settings, the figures, the deadline; writes device_speed.md / .json after every part."""

    def __init__(self, cfg: dict, out: Path, dry: bool, command: str):
        self.cfg, self.out, self.dry, self.command = cfg, out, dry, command
        self.device, self.dtype = cfg["device"], getattr(torch, cfg["dtype"])
        self.cuda = torch.device(self.device).type == "cuda"
        self.data: dict = {"parts": {}, "ratios": {}, "settings": cfg, "dry_run": dry, "command": command}
        self.data["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.log = Log(out / "device_speed_children.log")

    def left(self) -> float:
        return DEADLINE[0] - time.monotonic()

    def part_deadline(self, name: str) -> float:
        return min(DEADLINE[0], time.monotonic() + self.cfg["budgets"][name])

    def ratio(self, key: str, value: float | None, note: str = "") -> None:
        """A figure with its target (TARGETS), printed at once."""
        target = TARGETS.get(key)
        met = None if value is None or target is None else bool(value <= target)
        self.data["ratios"][key] = dict(value=value, target=target, met=met, note=note)
        goal = "" if target is None else f" (target <= {target:.3g}: {'met' if met else 'MISSED'})"
        print(f"device_speed: RATIO {key}: {fmt(value)}{goal}{' ' + note if note else ''}", flush=True)

    def save(self) -> None:
        (self.out / "device_speed.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "device_speed.md").write_text(markdown(self.data))


# --- e. the bf16 kernel tests -------------------------------------------------------------------------------------


def part_tests(run: Run) -> dict:
    timeout = max(1, int(min(run.cfg["budgets"]["tests"], run.left() - 5)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rP", "-p", "no:cacheprovider", "-m", "gpu", *TEST_FILES]
    rc, out, err, seconds = run_child(cmd, "bf16 kernel tests", run.log, timeout)
    text = out + err
    tail = [line for line in text.strip().splitlines() if line.strip()][-30:]
    print("\n".join(tail), flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", text)}
    errors = [line for line in text.splitlines() if re.match(r"^\S+ w=\d+: max \|y - y_ref\|", line)]
    result = dict(command=" ".join(cmd[2:]), rc=rc, seconds=seconds, counts=counts, timeout=timeout, errors=errors)
    if rc == "timeout":
        raise RuntimeError(f"the bf16 kernel tests did not finish in {timeout} s ({counts or 'no summary'})")
    if rc not in (0, 5):  # 5: nothing collected (no test selected)
        result["failed"] = True
    return result


# --- a. prefill ---------------------------------------------------------------------------------------------------


def fla_simple_gla():
    """fla-core's chunk_simple_gla, or the one line why it is not there."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: PLC0415  (the baseline: optional)
    except Exception as e:  # noqa: BLE001  (not installed, or it does not import with this torch / triton)
        return None, one_line(e)
    return chunk_simple_gla, None


def sdpa_prefill(run: Run):
    """SDPA, causal, GQA: the flash kernel with KV heads as they are on CUDA (if this torch has it), else as torch
    chooses with KV heads repeated."""

    def flash(x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)

    def plain(x):
        rep = x["q"].shape[1] // x["k"].shape[1]
        k, v = x["k"].repeat_interleave(rep, 1), x["v"].repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(x["q"], k, v, is_causal=True)

    if not run.cuda:
        return plain, "k/v repeated, backend chosen by torch (CPU)"
    try:
        s = run.cfg["shape"]
        probe = attention_inputs(s, 256, run.device, run.dtype)
        probe = {n: t.requires_grad_(n in ("q", "k", "v")) for n, t in probe.items()}
        flash(probe).sum().backward()
        return flash, "flash kernel, is_causal, enable_gqa (KV heads not repeated)"
    except RuntimeError as e:
        return plain, f"k/v repeated, backend chosen by torch (flash with enable_gqa: {one_line(e)})"


def prefill_method(run: Run, name: str, sdpa, chunk_simple_gla):
    """(the function of the inputs that `name` times, the inputs it differentiates)."""
    from hybrid_scale.attention import hybrid

    if name == "sdpa":
        return sdpa, ("q", "k", "v")
    if name == "fla":  # its inputs in its own layout: [B, T, H, *], g = -rho per head
        return (lambda z: chunk_simple_gla(z["fq"], z["fk"], z["v"], g=z["g"], scale=1.0)[0]), ("fq", "fk", "v", "g")
    opts = dict(window=run.cfg["window"], sinks=run.cfg["sinks"], hybrid_sinks=True, backend=run.cfg["backend"])

    def fn(z):
        return hybrid.attend(
            z["q"], z["k"], z["v"], z["fq"], z["fk"], gamma=z["gamma"], la_decay=z["rho"], mode=name, **opts
        )

    return fn, ("q", "k", "v", "fq", "fk", "gamma", "rho")


def part_prefill(run: Run) -> dict:
    cfg, s = run.cfg, run.cfg["shape"]
    deadline = run.part_deadline("prefill")
    clock = Clock(run.device, cfg["warmup"], cfg["repeats"])
    sdpa, sdpa_kind = sdpa_prefill(run)
    chunk_simple_gla, fla_why = fla_simple_gla() if run.cuda else (None, "dry run: fla's kernels need CUDA")
    if fla_why:
        print(f"device_speed: fla not measured: {fla_why}", flush=True)
    G = s["H"] // s["Hkv"]
    rows = []
    for T in cfg["lengths"]:
        x = attention_inputs(s, T, run.device, run.dtype, seed=T)
        x["rho"] = torch.linspace(0.01, 0.1, s["Hkv"], device=run.device)
        gy = torch.randn_like(x["q"])
        lay = {}  # fla's own layout, made before the clock starts: [B, T, H, *], KV heads repeated, g = -rho
        if chunk_simple_gla is not None:
            for n in ("fq", "fk", "v"):
                t = x[n].repeat_interleave(G, 1) if x[n].shape[1] != s["H"] else x[n]
                lay[n] = t.transpose(1, 2).contiguous()
            lay["g"] = (-x["rho"].repeat_interleave(G))[None, None, :].expand(1, T, s["H"]).contiguous()

        for name in PREFILL_METHODS:
            row = dict(T=T, method=name)
            if name == "fla" and chunk_simple_gla is None:
                rows.append(row | {"skipped": f"fla: {fla_why}"})
                continue
            if time.monotonic() > deadline:
                rows.append(row | {"skipped": "budget reached"})
                continue
            fn, grads = prefill_method(run, name, sdpa, chunk_simple_gla)
            src = lay if name == "fla" else x
            xg = {n: t.detach().requires_grad_(n in grads and t.is_floating_point()) for n, t in src.items()}
            out_grad = gy.transpose(1, 2).contiguous() if name == "fla" else gy

            def fwd(fn=fn, src=src):
                with torch.no_grad():
                    return fn(src)

            def fwd_bwd(fn=fn, xg=xg, out_grad=out_grad):
                for t in xg.values():
                    t.grad = None
                fn(xg).backward(out_grad)

            try:
                row["finite"] = bool(torch.isfinite(fwd()).all())
                row["fwd_ms"] = clock.ms(fwd)
                row["fwd_peak_mib"] = clock.peak_mib(fwd)
                row["fwd_bwd_ms"] = clock.ms(fwd_bwd)
                for t in xg.values():
                    t.grad = None
                row["fwd_bwd_peak_mib"] = clock.peak_mib(fwd_bwd)
            except torch.cuda.OutOfMemoryError:
                row["skipped"] = "out of memory"
            except Exception as e:  # noqa: BLE001  (one method failing must not lose the others)
                row["skipped"] = row["error"] = one_line(e)
            for t in xg.values():
                t.grad = None
            if run.cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"device_speed: prefill {json.dumps(row)}", flush=True)
        at = {r["method"]: r for r in rows if r["T"] == T and "fwd_bwd_ms" in r}
        if "hybrid" in at:
            run.ratio(f"prefill fwd+bwd hybrid ms, T={T}", at["hybrid"]["fwd_bwd_ms"])
        for a, b in (("hybrid", "sdpa"), ("la_only", "sdpa"), ("hybrid", "fla"), ("la_only", "fla")):
            if a in at and b in at:
                run.ratio(f"prefill fwd {a}/{b}, T={T}", at[a]["fwd_ms"] / at[b]["fwd_ms"])
                run.ratio(f"prefill fwd+bwd {a}/{b}, T={T}", at[a]["fwd_bwd_ms"] / at[b]["fwd_bwd_ms"])
        if "hybrid" in at and "sdpa" in at and at["sdpa"].get("fwd_bwd_peak_mib"):
            mem = at["hybrid"]["fwd_bwd_peak_mib"] / at["sdpa"]["fwd_bwd_peak_mib"]
            run.ratio(f"prefill fwd+bwd peak memory hybrid/sdpa, T={T}", mem)
        del x, lay
    return dict(rows=rows, sdpa=sdpa_kind, fla=fla_why or "chunk_simple_gla", fla_version=package_version("fla-core"))


def package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# --- b. decode, one layer -----------------------------------------------------------------------------------------


def attention_settings(run: Run) -> dict:
    """The converted layers' attention: the 8B preset's (window, the hybrid's own sinks, LA decay), hedgehog f = d."""
    return dict(window=run.cfg["window"], sinks=run.cfg["sinks"], hybrid_sinks=True, la_decay=True,
                feature_map="hedgehog", backend=run.cfg["backend"])  # fmt: skip


def llama(run: Run, m: dict, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        head_dim=m["head_dim"],
        max_position_embeddings=max(run.cfg["contexts"]) + 64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(run.device):
        return LlamaForCausalLM(config).to(run.dtype).eval()


def graphed(run: Run, fn):
    """fn captured in a CUDA graph (after warm-up on a side stream, as torch.cuda.graph asks), as a replay function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def per_call_ms(run: Run, fn, n: int) -> float:
    for _ in range(2):
        fn()
    if run.cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t0) / n


def kernel_us(run: Run, fn, n: int) -> dict:
    """torch.profiler over n eager calls: per call, the microseconds of the `_decode` kernel, of every kernel, the
    number of kernels, and the five longest kernels (name: us per call)."""
    from torch.profiler import ProfilerActivity, profile

    if not run.cuda:
        return dict(decode_kernel_us=None, kernels_us=None, kernels=None, note="no CUDA device: no kernel times")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    decode = sum(e.time_range.elapsed_us() for e in kernels if "_decode" in e.name)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.time_range.elapsed_us() / n
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:5])
    return dict(decode_kernel_us=decode / n, kernels_us=total / n, kernels=len(kernels) / n, top_kernels_us=top)


def part_decode(run: Run) -> dict:
    from hybrid_scale import HybridCache, convert_model
    from hybrid_scale.attention.hybrid import Projections, hybrid_layers

    cfg, s = run.cfg, run.cfg["shape"]
    deadline = run.part_deadline("decode")
    m = dict(cfg["model"], layers=1, vocab=256, inter=128)  # one layer; its MLP and vocabulary play no part
    model = convert_model(llama(run, m), attention_settings(run))
    module = hybrid_layers(model)[0]
    rows = []
    for ctx in cfg["contexts"]:
        x = attention_inputs(s, ctx, run.device, run.dtype, seed=ctx)
        rows_ctx = {}
        for name in DECODE_METHODS:
            row = dict(context=ctx, method=name)
            if time.monotonic() > deadline:
                rows.append(row | {"skipped": "budget reached"})
                continue
            try:
                with torch.no_grad():
                    q1, k1, v1 = (x[n][:, :, ctx - 1 :].clone() for n in "qkv")  # the step's token: the ctx-th
                    if name == "hybrid":
                        cache = HybridCache(model)
                        layer = cache.layers[0]
                        q, k, v = (x[n][:, :, : ctx - 1] for n in "qkv")
                        fq, fk = module.feature_map_q(q), module.feature_map_k(k)
                        layer.hybrid_attend(module, Projections(q, k, v, fq, fk), None)

                        def step(layer=layer, q1=q1, k1=k1, v1=v1):
                            fq, fk = module.feature_map_q(q1), module.feature_map_k(k1)
                            return layer.hybrid_attend(module, Projections(q1, k1, v1, fq, fk), None)

                        row["bytes_state"] = layer.nbytes
                    else:
                        kc = torch.zeros(1, s["Hkv"], ctx, s["D"], device=run.device, dtype=run.dtype)
                        vc = torch.zeros_like(kc)
                        kc[:, :, : ctx - 1], vc[:, :, : ctx - 1] = x["k"][:, :, : ctx - 1], x["v"][:, :, : ctx - 1]
                        pos = torch.tensor([ctx - 1], device=run.device)

                        def step(kc=kc, vc=vc, pos=pos, q1=q1, k1=k1, v1=v1):
                            kc.index_copy_(2, pos, k1)
                            vc.index_copy_(2, pos, v1)
                            return F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True)

                        row["bytes_state"] = 2 * kc.numel() * kc.element_size()
                    row["eager_ms"] = per_call_ms(run, step, cfg["replays"])
                    row.update(kernel_us(run, step, cfg["profile_steps"]))
                    if run.cuda:
                        try:
                            replay = graphed(run, step)
                            row["graph_ms"] = per_call_ms(run, replay, cfg["replays"])
                            row["timed"] = "CUDA graph replays"
                        except Exception as e:  # noqa: BLE001  (not capturable on the day: eager, and why)
                            row["graph_error"] = one_line(e)
                            row["timed"] = "eager (capture failed)"
                            print(f"device_speed: decode {name} at {ctx}: capture failed: {one_line(e)}", flush=True)
                    else:
                        row["timed"] = "eager (no CUDA: no graphs)"
                    row["ms"] = row.get("graph_ms", row["eager_ms"])
            except torch.cuda.OutOfMemoryError:
                row["skipped"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row["skipped"] = row["error"] = one_line(e)
            rows.append(row)
            rows_ctx[name] = row
            print(f"device_speed: decode {json.dumps(row)}", flush=True)
        h, kv = rows_ctx.get("hybrid", {}), rows_ctx.get("kv_cache", {})
        if "ms" in h and "ms" in kv:
            how = h["timed"] if h["timed"] == kv["timed"] else f"{h['timed']} hybrid / {kv['timed']} kv_cache"
            run.ratio(f"decode step per layer hybrid/kv_cache, ctx={ctx}", h["ms"] / kv["ms"], f"({how})")
        if h.get("decode_kernel_us") is not None:
            run.ratio(f"decode kernel us per layer, ctx={ctx}", h["decode_kernel_us"])
        if run.cuda:
            torch.cuda.empty_cache()
    return dict(rows=rows, timed="step = phi_q, phi_k of the new token + HybridCacheLayer.hybrid_attend (hybrid); "
                "index_copy_ of k/v + SDPA over the static cache (kv_cache)")  # fmt: skip


# --- c. decode, whole model (generate) ------------------------------------------------------------------------------


def stamps(run: Run):
    from transformers import LogitsProcessor

    class Stamp(LogitsProcessor):
        """A CUDA event (or a host time) at each generated token: the interval between two is one decode step."""

        def __init__(self):
            self.marks = []

        def __call__(self, input_ids, scores):
            if run.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())
            return scores

        def intervals_ms(self) -> list[float]:
            if run.cuda:
                self.marks[-1].synchronize()
                return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
            return [1000 * (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]

    return Stamp()


def generate_once(run: Run, model, ctx: int, hybrid: bool, compile_: bool) -> dict:
    from transformers import LogitsProcessorList
    from transformers.generation.configuration_utils import CompileConfig

    from hybrid_scale import HybridCache

    n = run.cfg["new_tokens"]
    g = torch.Generator(device="cpu").manual_seed(ctx)
    ids = torch.randint(2, model.config.vocab_size, (1, ctx - n), generator=g).to(run.device)
    stamp = stamps(run)
    kw = dict(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([stamp]),
    )
    if compile_:
        kw["compile_config"] = CompileConfig(fullgraph=True)
    else:
        kw["disable_compile"] = True
    cache = None
    if hybrid:
        kw["past_key_values"] = cache = HybridCache(model)
    else:
        kw["cache_implementation"] = "static"
    counters = dynamo_graphs()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    intervals = stamp.intervals_ms()
    wall = time.perf_counter() - t0
    steady = intervals[len(intervals) // 2 :] or intervals
    row = dict(ms_per_token=statistics.median(steady), first_interval_ms=intervals[0] if intervals else None)
    row |= dict(new_tokens=out.shape[1] - ids.shape[1], prompt=ids.shape[1], generate_s=wall)
    row["dynamo_graphs"] = dynamo_graphs() - counters  # graphs compiled during this call
    # transformers runs its compiled forward when the cache is compileable (a static cache is; HybridCache when its
    # layers say so) on a GPU
    compileable = bool(getattr(cache, "is_compileable", False)) if hybrid else True
    row["compiled"] = bool(compile_ and compileable and getattr(model, "_compiled_call", None) is not None)
    if hybrid:
        row["cache_is_compileable"] = compileable
    return row


def dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


def part_generate(run: Run) -> dict:
    from hybrid_scale import convert_model

    cfg = run.cfg
    deadline = run.part_deadline("generate")
    base = llama(run, cfg["model"])
    hybrid = convert_model(copy.deepcopy(base), attention_settings(run))
    params = sum(p.numel() for p in base.parameters())
    rows, notes = [], []
    failed = {}  # model -> the compiled run's failure: that model runs eagerly from then on
    for ctx in cfg["contexts"]:
        at = {}
        for name in GENERATE_MODELS:
            model = base if name == "base" else hybrid
            row = dict(context=ctx, model=name)
            if time.monotonic() > deadline:
                rows.append(row | {"skipped": "budget reached"})
                continue
            compile_ = run.cuda and name not in failed
            if name in failed:
                row["compile_error"] = failed[name]
            try:
                try:
                    row |= generate_once(run, model, ctx, name == "hybrid", compile_)
                    if compile_ and not row["compiled"]:
                        why = "transformers did not compile it"
                        if name == "hybrid" and not row.get("cache_is_compileable"):
                            why += " (HybridCache.is_compileable is False: generate ran the decode eagerly)"
                        row["compile_note"] = why
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001  (cannot compile or capture on the day: eager, and why)
                    if not compile_:
                        raise
                    row["compile_error"] = failed[name] = f"compiled run failed at context {ctx}: {one_line(e)}"
                    print(f"device_speed: generate {name}: {failed[name]}; eager from now on", flush=True)
                    traceback.print_exc()
                    row |= generate_once(run, model, ctx, name == "hybrid", False)
                row["timed"] = "compiled" if row.get("compiled") else "eager"
                at[name] = row
            except torch.cuda.OutOfMemoryError:
                row["skipped"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row["skipped"] = row["error"] = one_line(e)
                traceback.print_exc()
            rows.append(row)
            print(f"device_speed: generate {json.dumps(row)}", flush=True)
            if run.cuda:
                torch.cuda.empty_cache()
        if "base" in at and "hybrid" in at:
            how = f"({at['hybrid']['timed']} hybrid / {at['base']['timed']} base)"
            run.ratio(
                f"generate ms/token hybrid/base, ctx={ctx}",
                at["hybrid"]["ms_per_token"] / at["base"]["ms_per_token"],
                how,
            )
    if not run.cuda:
        notes.append("dry run: no torch.compile, eager on CPU")
    return dict(rows=rows, params=params, model=cfg["model"], notes=notes)


# --- d. 8B-shaped stage 1 and stage 2 -------------------------------------------------------------------------------


def layer_params(m: dict) -> int:
    hd = m["head_dim"]
    return m["hidden"] * hd * (2 * m["heads"] + 2 * m["kv"]) + 3 * m["hidden"] * m["inter"]


def preset_tokens() -> dict:
    """Stage 1's and stage 2's tokens at the 8B preset (configs/models/llama3-8b.yaml) under each recipe."""
    from omegaconf import OmegaConf

    from hybrid_scale.config import load_config

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
    work = Path(tempfile.mkdtemp(prefix="device_speed_big_"))
    json_path = work / "big.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.device_speed",
        "--part",
        "big",
        "--work",
        str(work),
        "--json",
        str(json_path),
    ]
    cmd += ["--dry-run"] if run.dry else []
    timeout = max(1, int(min(run.cfg["budgets"]["big"], run.left() - 3)))
    try:
        rc, out, err, seconds = run_child(cmd, "8B-shaped stage 1 and stage 2", run.log, timeout)
        raw = json.loads(json_path.read_text()) if rc == 0 else None
    finally:
        shutil.rmtree(work, ignore_errors=True)  # (the 8B-shaped checkpoint: gigabytes)
    print(out[-3000:], end="", flush=True)
    if rc != 0:
        raise RuntimeError(f"the stage-1/stage-2 child failed (exit {rc}, {seconds:.0f} s); it ends with: "
                           + " / ".join((out + err).strip().splitlines()[-3:])[-600:])  # fmt: skip
    return summarise_big(run, raw)


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


def child_big(run: Run, work: Path) -> dict:
    from benchmarks.gpu_check.big import part_big as gpu_check_big

    b = dict(run.cfg["big"])
    b["overrides"] = [f"attention.window={run.cfg['window']}", f"attention.sinks={run.cfg['sinks']}",
                      "attention.hybrid_sinks=true", "attention.la_decay=true",
                      "finetune.gradient_checkpointing=true"]  # fmt: skip
    if run.dry:
        b["overrides"].append("attention.backend=torch")
    return gpu_check_big({"big": b, "device": run.device, "dtype": run.cfg["dtype"]}, work)


# --- the report -----------------------------------------------------------------------------------------------------


def markdown(d: dict) -> str:
    cfg, info, v = d["settings"], d.get("device_info", {}), d.get("versions", {})
    s = cfg["shape"]
    lines = [
        "# Device speed (issue 51)" + (" -- CPU dry run, toy shapes: the timings mean nothing" if d["dry_run"] else ""),
        "",
        f"- date: {d['date']}; command: `{d['command']}`",
        f"- device: {info.get('gpu') or info.get('cpu') or '?'}"
        + (f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else "")
        + f"; {cfg['dtype']}; attention backend {cfg['backend']}",
        f"- torch {v.get('torch')} (CUDA {v.get('cuda')}), triton {v.get('triton')}, transformers "
        f"{v.get('transformers')}, fla-core {d.get('fla_core')}",
        f"- shape: {s['H']} heads, {s['Hkv']} KV heads, head dim {s['D']}, phi {s['F']} features, window "
        f"{cfg['window']}, {cfg['sinks']} sinks (the hybrid's own), LA decay; batch 1",
        "",
        "| part | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for key, p in d["parts"].items():
        lines.append(f"| {key}. {p['title']} | {p['status']} | {p['seconds']:.1f} | {p['note']} |")
    lines += [
        "",
        "## Targets (issue 51, H200)",
        "",
        "| figure | measured | target (at most) | status |",
        "|---|---|---|---|",
    ]
    ratios = d["ratios"]
    for key, target in TARGETS.items():
        r = ratios.get(key)
        status = "not measured" if r is None else ("met" if r["met"] else "MISSED")
        lines.append(f"| {key} | {fmt(r['value']) if r else 'n/a'} | {target:.3g} | {status} |")
    others = [(k, r) for k, r in ratios.items() if k not in TARGETS]
    if others:
        lines += ["", "Other ratios:", "", "| figure | value | note |", "|---|---|---|"]
        lines += [f"| {k} | {fmt(r['value'])} | {r['note']} |" for k, r in others]
    t = d.get("tests")
    if t:
        lines += ["", "## e. bf16 kernel tests", "", f"`{t['command']}` (timeout {t['timeout']} s): exit {t['rc']}, "
                  + ", ".join(f"{n} {k}" for k, n in t["counts"].items()) + f", {t['seconds']:.0f} s"]  # fmt: skip
        if t["errors"]:
            lines += ["", "```", *t["errors"], "```"]
    a = d.get("prefill")
    if a:
        lines += [
            "",
            "## a. Prefill, forward and forward+backward",
            "",
            f"SDPA: {a['sdpa']}. fla: {a['fla']} (fla-core {a['fla_version']}). Peak: max_memory_allocated above the "
            "inputs (reset before each).",
            "",
            "| T | method | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd x SDPA | fwd+bwd x SDPA | "
            "fwd+bwd x fla | mem x SDPA |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in a["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['T']} | {r['method']} | skipped: {r['skipped']} | | | | | | | |")
                continue
            ref = {x["method"]: x for x in a["rows"] if x["T"] == r["T"] and "fwd_bwd_ms" in x}
            sd, fl = ref.get("sdpa"), ref.get("fla")

            def x(ref_row, key, r=r):
                return None if not ref_row or not ref_row.get(key) or r.get(key) is None else r[key] / ref_row[key]

            lines.append(
                f"| {r['T']} | {r['method']} | {fmt(r['fwd_ms'])} | {fmt(r['fwd_bwd_ms'])} | {fmt(r['fwd_peak_mib'])} "
                f"| {fmt(r['fwd_bwd_peak_mib'])} | {fmt(x(sd, 'fwd_ms'))} | {fmt(x(sd, 'fwd_bwd_ms'))} | "
                f"{fmt(x(fl, 'fwd_bwd_ms'))} | {fmt(x(sd, 'fwd_bwd_peak_mib'))} |"
            )
    b = d.get("decode")
    if b:
        lines += [
            "",
            "## b. Decode, one token, one layer",
            "",
            f"Step: {b['timed']}. Kernel times: torch.profiler over eager steps.",
            "",
            "| context | method | timed | ms per step | eager ms | `_decode` kernel us | all kernels us | kernels per "
            "step | state bytes | x kv_cache |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in b["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['context']} | {r['method']} | skipped: {r['skipped']} | | | | | | | |")
                continue
            kv = next((x for x in b["rows"] if x["context"] == r["context"] and x["method"] == "kv_cache"), {})
            rel = r["ms"] / kv["ms"] if kv.get("ms") else None
            lines.append(
                f"| {r['context']} | {r['method']} | {r['timed']} | {fmt(r['ms'])} | {fmt(r['eager_ms'])} | "
                f"{fmt(r.get('decode_kernel_us'))} | {fmt(r.get('kernels_us'))} | {fmt(r.get('kernels'))} | "
                f"{r['bytes_state']:,} | {fmt(rel)} |"
            )
        errors = [f"{r['method']} at {r['context']}: {r['graph_error']}" for r in b["rows"] if r.get("graph_error")]
        lines += [""] + [f"- capture failed, timed eagerly: {e}" for e in errors] if errors else []
    c = d.get("generate")
    if c:
        m = c["model"]
        lines += [
            "",
            "## c. Decode, whole model: `generate`",
            "",
            f"Llama, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, {m['kv']} KV heads, head dim "
            f"{m['head_dim']}, intermediate {m['inter']}, vocab {m['vocab']} ({c['params']:,} parameters), random "
            "weights; prompt = context - new tokens; ms per token = median interval over the last half of the new "
            "tokens. " + " ".join(c["notes"]),
            "",
            "| context | model | timed | ms per token | first interval ms | dynamo graphs | x base | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in c["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['context']} | {r['model']} | skipped: {r['skipped']} | | | | | |")
                continue
            base = next((x for x in c["rows"] if x["context"] == r["context"] and x["model"] == "base"), {})
            rel = r["ms_per_token"] / base["ms_per_token"] if base.get("ms_per_token") else None
            note = r.get("compile_error") or r.get("compile_note") or ""
            lines.append(
                f"| {r['context']} | {r['model']} | {r['timed']} | {fmt(r['ms_per_token'])} | "
                f"{fmt(r['first_interval_ms'])} | {r['dynamo_graphs']} | {fmt(rel)} | {note} |"
            )
    big = d.get("big")
    if big and "stage1_layer_s" in big:
        bc = cfg["big"]
        lines += [
            "",
            "## d. 8B-shaped stage 1 and stage 2 (random weights)",
            "",
            f"Llama, {bc['layers']} layers, hidden {bc['hidden']}, {bc['heads']} heads, {bc['kv']} KV heads, head dim "
            f"{bc['head_dim']}, intermediate {bc['inter']}, vocab {bc['vocab']} ({big['params']:,} parameters); "
            f"{bc['sequences']} sequences x {bc['seq_len']} tokens; stage 1 batch {bc['distill_batch']}, stage 2 "
            f"{bc['global_batch']} sequences per step (micro-batch {bc['micro_batch']}, gradient checkpointing). MFU "
            f"= model FLOPs / time / {PEAK_TFLOPS:g} TFLOP/s (the counts: benchmarks/device_speed.py, "
            "stage1_flops_per_sequence and stage2_flops_per_token).",
            "",
            "| figure | value |",
            "|---|---|",
            f"| stage 1: s per layer (one epoch; median after the first layer) | {fmt(big['stage1_layer_s'])} |",
            f"| stage 1: tokens/s (feature-map training) / MFU | {fmt(big['stage1_tokens_per_s'])} / "
            f"{fmt(big['stage1_mfu'])} |",
            f"| stage 1: teacher pass tokens/s / MFU | {fmt(big['stage1_teacher_tokens_per_s'])} / "
            f"{fmt(big['stage1_teacher_mfu'])} |",
            f"| stage 1: peak GiB | {fmt(big['stage1_peak_gib'])} |",
            f"| stage 2: s per step (median after the first) | {fmt(big['stage2_step_s'])} |",
            f"| stage 2: tokens/s / MFU | {fmt(big['stage2_tokens_per_s'])} / {fmt(big['stage2_mfu'])} |",
            f"| stage 2: peak GiB | {fmt(big['stage2_peak_gib'])} |",
            "",
            f"Projected GPU-hours of an 8B conversion on this GPU ({big['projection_note']}), beside LoLCATs' "
            f"{LOLCATS_A100_HOURS} A100-hours:",
            "",
            "| recipe | stage 1 tokens per layer | stage 2 tokens | stage 1 GPU-h | stage 2 GPU-h | total GPU-h | "
            "x LoLCATs |",
            "|---|---|---|---|---|---|---|",
        ]
        for recipe, p in big["projection"].items():
            lines.append(
                f"| {recipe} | {p['stage1_tokens_per_layer']:,} | {p['stage2_tokens']:,} | "
                f"{fmt(p['stage1_gpu_hours'])} | {fmt(p['stage2_gpu_hours'])} | {fmt(p['total'])} | "
                f"{fmt(p['total'] / LOLCATS_A100_HOURS)} |"
            )
    return "\n".join(lines) + "\n"


# --- the driver -----------------------------------------------------------------------------------------------------


def settings(dry: bool) -> dict:
    cfg = copy.deepcopy(DRY if dry else FULL)
    for item in filter(None, os.environ.get("DEVICE_SPEED_BUDGETS", "").split(",")):
        name, _, seconds = item.partition("=")
        if name not in cfg["budgets"]:
            raise SystemExit(f"DEVICE_SPEED_BUDGETS: unknown part '{name}'; parts: {', '.join(cfg['budgets'])}")
        cfg["budgets"][name] = float(seconds)
    if os.environ.get("DEVICE_SPEED_DEADLINE"):
        cfg["deadline"] = float(os.environ["DEVICE_SPEED_DEADLINE"])
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, the torch path (seconds)")
    parser.add_argument("--out", help="folder of device_speed.md/.json (default: $OUT, else docs/results)")
    parser.add_argument("--part", choices=["big"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cfg = settings(args.dry_run)
    if args.part:  # part d's child
        run = Run(cfg, Path(args.work), args.dry_run, "")
        Path(args.json).write_text(json.dumps(child_big(run, Path(args.work)), default=str))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("device_speed: no CUDA device here; the figures are measured on a GPU (--dry-run: the CPU check)")
        return 2
    default = ROOT / "benchmarks" / "out" / "device_speed_dry" if args.dry_run else ROOT / "docs" / "results"
    out = Path(args.out or os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    started = float(os.environ.get("DEVICE_SPEED_STARTED") or time.time())  # device_speed.sh's start (epoch s)
    DEADLINE[0] = time.monotonic() + cfg["deadline"] - max(0.0, time.time() - started)
    command = os.environ.get("DEVICE_SPEED_COMMAND") or "python " + " ".join(
        ["-m", "benchmarks.device_speed", *(argv if argv is not None else sys.argv[1:])]
    )
    run = Run(cfg, out, args.dry_run, command)
    run.data["versions"] = versions() | {"triton": package_version("triton")}
    run.data["fla_core"] = package_version("fla-core")
    run.data["device_info"] = device_info(run.device)
    print(f"device_speed: {json.dumps(run.data['device_info'])}; deadline in {run.left():.0f} s; results in {out}")
    wanted = os.environ.get("DEVICE_SPEED_PARTS", ",".join(PARTS)).split(",")
    steps = {"e": ("tests", part_tests), "a": ("prefill", part_prefill), "b": ("decode", part_decode),
             "c": ("generate", part_generate), "d": ("big", part_big)}  # fmt: skip
    for key, title in PARTS.items():
        if key not in wanted:
            continue
        name, fn = steps[key]
        t0 = time.perf_counter()
        if run.left() < 10:
            run.data["parts"][key] = dict(title=title, status="FAILED", seconds=0.0, note="not started: deadline")
            print(f"\n== part {key}: {title}: not started, the deadline is reached", flush=True)
            run.save()
            continue
        print(f"\n== part {key}: {title} ({run.left():.0f} s left)", flush=True)
        status, note = "ok", ""
        try:
            run.data[name] = result = fn(run)
            skipped = [r for r in result.get("rows", []) if "skipped" in r]
            if result.get("failed"):
                status, note = "FAILED", "tests failed"
            elif skipped:
                note = f"{len(skipped)} rows not measured: " + "; ".join(sorted({r["skipped"] for r in skipped}))[:300]
        except Exception as e:  # noqa: BLE001  (a part failing must not lose the others)
            traceback.print_exc()
            status, note = "FAILED", one_line(e)
        run.data["parts"][key] = dict(title=title, status=status, seconds=time.perf_counter() - t0, note=note)
        print(f"== part {key}: {status} ({time.perf_counter() - t0:.1f} s) {note}", flush=True)
        run.save()
        if run.cuda:
            torch.cuda.empty_cache()
    run.save()
    print("\n" + markdown(run.data))
    failed = [k for k, p in run.data["parts"].items() if p["status"] != "ok"]
    missed = [k for k, r in run.data["ratios"].items() if r["met"] is False]
    judged = sum(r["met"] is not None for r in run.data["ratios"].values())
    seconds = time.monotonic() - DEADLINE[0] + cfg["deadline"]
    head = f"FAILED parts {','.join(failed)}" if failed else "every part ran"
    print(f"device_speed: {head}; {len(missed)} of {judged} targets missed; {seconds:.0f} s; {out / 'device_speed.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
