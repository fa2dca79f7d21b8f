"""The kernels compiled for sm_80 and sm_90 on this machine (no GPU): every launch the wrappers make, as a model
makes them.

For each model preset (configs/models/*.yaml: its heads, KV heads, head dim, feature dim, window and sinks) at its
own window and training length, and again at every other window a shipped config uses (configs/**.yaml: the
quickstart's 16) and at lengths that are not a multiple of the chunk (96: one state, which Triton specialises as the
constant 1; 100: not a multiple of 16), each attention mode and each of bf16 / fp16 / fp32, the wrappers are called
as training and generation call them -- the forward and its backward through autograd on meta tensors (the meta
device stands for a GPU: fp32 runs the kernels in bf16), the forward without gradients (a prefill; at 16k tokens,
training's too, where both state scans are split as on an H100), with an initial state (stage 1), with the
denominators (the balance report; a padding mask launches what an unpadded batch
launches: the rows are packed on the host), one fused decode step on a ring of
`window` keys -- with the settings the kernels choose on a GPU. Every launch they make is recorded (nothing runs) and
compiled for both architectures by Triton and the wheel's ptxas (tools/compile_check.py); equal launches compile
once.

The same gate runs under the device image's Triton (3.6: `make kernel-compile-triton36`, its wheel put in
.triton36/ ahead of the project's on the path), where the register allocation differs.

    python -m tools.kernel_compile [--out docs/results/kernel_compile.md] [--presets llama3-8b,...]
        [--reuse docs/results/kernel_compile.json --verify 8]

--out also writes the results as JSON beside the table (kernel_compile.json), keyed by what determines a compile:
the kernel's source and the jit functions it calls, the launch's signature, constexprs and options, the target and
Triton's version. --reuse takes the results of unchanged keys from such a file and compiles the rest; --verify N
compiles N of the reused ones again and fails if any differs (the test suite does this: a change to a kernel is
compiled, an unchanged one costs nothing).

Prints one line per failing compile and exits 1 when a kernel does not compile, uses more shared memory than the
architecture allows, spills more than SPILL_BUDGET bytes, or is one of WGMMA and has no wgmma on sm_90 in bf16 or
fp16. `make kernel-compile` writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hybrid_scale_kernels import chunk_h, settings
from hybrid_scale_kernels.chunk import triton_hybrid_attention
from hybrid_scale_kernels.decode import triton_decode_step
from hybrid_scale_kernels.utils import MODE_PARTS

from hybrid_scale.attention.hedgehog.feature_maps import make_feature_map
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.shape import Shape as CallShape
from hybrid_scale.attention.window.recurrent import DecodeState
from hybrid_scale.config import PRESETS, load_config
from tools import compile_check

# Bytes of spill stores + loads a kernel may have: none (fp32 calls run the chunked kernels in bf16 on a GPU; the
# decode step's fp32 launch is the one fp32 compile)
SPILL_BUDGET = {"bf16": 0, "fp16": 0, "fp32": 0}
# every mode the kernels compute ("none" launches nothing), and the hybrid with its sinks (attention.hybrid_sinks);
# each also with the LA's decay (attention.la_decay, "+decay"): the modes with an LA decay it, and the decode step
# carries a decayed state on in every mode
HYBRID_SINKS = "hybrid+sinks"
DECAY = "+decay"
MODES = (*MODE_PARTS, HYBRID_SINKS)
MODES = (*MODES, *(m + DECAY for m in MODES))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# kernels whose half-precision products must be wgmma on sm_90 (the chunked kernels' 64-row tiles)
WGMMA = ("_chunk_states", "_chunk_output", "_chunk_bwd_dq", "_chunk_dstates", "_chunk_bwd_dkv")


@dataclass(frozen=True)
class Shape:
    preset: str
    heads: int
    kv_heads: int
    head_dim: int
    features: int
    window: int
    sinks: int
    length: int  # T of the training kernels: the preset's training length, or one that is not a multiple of the chunk
    label: str = ""  # the table's name for a shape other than the preset's own: preset@w<window>@T<length>

    @property
    def name(self) -> str:
        return self.label or self.preset


ODD_LENGTHS = (96, 100)  # not a multiple of the chunk: one state (Triton specialises NS = 1), and not a multiple of 16


def shipped_windows() -> set[int]:
    """Every attention window a shipped config sets (configs/**/*.yaml)."""
    import yaml

    found = set()
    for path in PRESETS.rglob("*.yaml"):
        attention = (yaml.safe_load(path.read_text()) or {}).get("attention") or {}
        if isinstance(attention.get("window"), int):
            found.add(attention["window"])
    return found


def preset_shapes(names: list[str] | None = None) -> list[Shape]:
    """The attention shapes of every model preset, from its YAML file: at its window and training length, then at
    every other shipped window and the odd lengths."""
    shapes = []
    windows = shipped_windows()
    for path in sorted((PRESETS / "models").glob("*.yaml")):
        if names and path.stem not in names:
            continue
        cfg = load_config(f"models/{path.name}")
        arch, a = cfg.model.arch, cfg.attention
        d = arch.head_dim or arch.hidden_size // arch.num_attention_heads
        f = make_feature_map(a.feature_map, 1, d, a.feature_dim).out_dim
        own = Shape(path.stem, arch.num_attention_heads, arch.num_key_value_heads, d, f, a.window, a.sinks,
                    cfg.finetune.seq_len)  # fmt: skip
        shapes.append(own)
        for window in sorted(windows - {a.window}):
            label = f"{path.stem}@w{window}@T{ODD_LENGTHS[0]}"
            shapes.append(dataclasses.replace(own, window=window, length=ODD_LENGTHS[0], label=label))
        shapes += [dataclasses.replace(own, length=t, label=f"{path.stem}@T{t}") for t in ODD_LENGTHS]
    return shapes


LONG = 16384  # tokens of a prefill (and a training step) whose state scans a GPU splits (chunk_h.plan; the presets'
# training lengths are not)
SMS = 132  # an H100's / H200's SMs: the state scan is split as on such a GPU (chunk_h.plan)


@contextlib.contextmanager
def _as_on_a_gpu():
    """The state scan planned for SMS SMs, as on a GPU (off a GPU it is never split)."""
    before = chunk_h.SMS_OFF_GPU
    chunk_h.SMS_OFF_GPU = SMS
    try:
        yield
    finally:
        chunk_h.SMS_OFF_GPU = before


def launches(shape: Shape, mode: str, dtype: torch.dtype) -> list[compile_check.Launch]:
    """The launches of one forward + backward (meta tensors, batch 1), the same with a padding mask and an initial
    state (stage 1's units), forwards without gradients (a prefill, at the shape's length and at LONG tokens, whose
    state scan is split as on an H100/H200; with the denominators), a forward + backward at LONG tokens (both scans
    split) and one decode step (a ring of `window`)."""
    b, h, hkv, t, d, f = 1, shape.heads, shape.kv_heads, shape.length, shape.head_dim, shape.features

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=dtype, requires_grad=True)

    q, k, v, fq, fk = meta(b, h, t, d), meta(b, hkv, t, d), meta(b, hkv, t, d), meta(b, h, t, f), meta(b, hkv, t, f)
    gamma = torch.empty(h, device="meta", requires_grad=True)
    decay = mode.endswith(DECAY)
    mode = mode.removesuffix(DECAY)
    own = mode == HYBRID_SINKS
    o = AttentionOptions(window=shape.window, mode="hybrid" if own else mode, sinks=shape.sinks, hybrid_sinks=own)
    rho = torch.empty(hkv, device="meta", requires_grad=True)
    init = (torch.empty(b, hkv, f, d, device="meta", requires_grad=True),
            torch.empty(b, hkv, f, device="meta", requires_grad=True))  # fmt: skip
    with compile_check.record_launches() as recorded, _as_on_a_gpu():
        extra = {"la_decay": rho} if decay else {}
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, **extra)
        y.backward(torch.empty_like(y))  # training
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, **extra, initial_state=init)
        y.backward(torch.empty_like(y))  # stage 1's units: an initial state
        plain = [t.detach() for t in (q, k, v, fq, fk, gamma)]  # generation's prefill: no gradient, y in q's dtype
        extra = {"la_decay": rho.detach()} if decay else {}
        triton_hybrid_attention(*plain, o, **extra)
        long = [x.new_empty(*x.shape[:2], LONG, x.shape[3]) if x.dim() == 4 else x for x in plain]
        triton_hybrid_attention(*long, o, **extra)  # a state scan split over the sequence, as on a GPU
        y = triton_hybrid_attention(*(x.requires_grad_() if x.dim() == 4 else x for x in long), o, **extra)
        y.backward(torch.empty_like(y))  # training at LONG: the reverse scan split too
        triton_hybrid_attention(*plain, dataclasses.replace(o, return_denominators=True), **extra)  # the balance report
        state = DecodeState.empty(
            CallShape(
                kv_heads=hkv, head_dim=d, value_dim=d, features=f, window=shape.window, sinks=shape.sinks, dtype=dtype
            ),
            b,
            shape.window,
            "cpu",
        )

        def one(*size):
            return torch.zeros(*size, dtype=dtype)

        triton_decode_step(state, one(b, h, 1, d), one(b, hkv, 1, d), one(b, hkv, 1, d), one(b, h, 1, f),
                           one(b, hkv, 1, f), torch.ones(h), o,
                           **({"la_decay": torch.zeros(hkv)} if decay else {}))  # fmt: skip
    return list(recorded)


@dataclass
class Row:
    kernel: str
    mode: str
    dtype: str
    presets: list[str]
    compiled: dict[int, compile_check.Compiled]


def compile_matrix(
    shapes: list[Shape], modes=MODES, dtypes=tuple(DTYPES), progress=None, cache: compile_check.Cache | None = None
) -> list[Row]:
    """Every launch of every (shape, mode, dtype) compiled for both architectures; one row per distinct compile of
    a (kernel, mode, dtype), with the presets that share it."""
    cache = cache if cache is not None else compile_check.Cache()
    rows: dict[tuple, Row] = {}
    for shape in shapes:
        for mode in modes:
            for name in dtypes:
                for launch in launches(shape, mode, DTYPES[name]):
                    done = {arch: cache(launch, arch) for arch in compile_check.ARCHS}
                    row_key = (launch.name, mode, name, compile_check.key(launch, 90))
                    row = rows.setdefault(row_key, Row(launch.name, mode, name, [], done))
                    if shape.name not in row.presets:  # (the forward's states are launched again in the backward)
                        row.presets.append(shape.name)
                    if progress:
                        progress(len(cache))
    return list(rows.values())


def failures(rows: list[Row]) -> list[str]:
    out = []
    for row in rows:
        for arch, c in row.compiled.items():
            what = f"{row.kernel} {row.mode} {row.dtype} sm_{arch} ({', '.join(row.presets)})"
            if c.error:
                out.append(f"{what}: does not compile: {c.error}")
                continue
            if arch == 90 and row.kernel in WGMMA and row.dtype != "fp32" and not c.wgmma:
                out.append(f"{what}: its products are {c.products}, not wgmma")
            if not c.shared_ok:
                out.append(f"{what}: {c.shared} bytes of shared memory, over the {compile_check.SHARED_LIMIT[arch]}")
            if c.spills > SPILL_BUDGET[row.dtype]:
                out.append(
                    f"{what}: {c.spills} bytes of spills (budget {SPILL_BUDGET[row.dtype]}), {c.registers} registers"
                )
    return out


def table(rows: list[Row]) -> str:
    lines = [
        "| kernel | mode | dtype | presets | tiles | sm_80: regs / spill B / shared KiB / products | "
        "sm_90: regs / spill B / shared KiB / products |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r.kernel, r.mode, r.dtype, r.presets)):
        cells = []
        for arch in compile_check.ARCHS:
            c = row.compiled[arch]
            cells.append(f"{c.registers} / {c.spills} / {c.shared / 1024:.0f} / {c.products}")
        c = row.compiled[90]
        tiles = ", ".join(x for x in c.constants.split(", ") if x.startswith("BLOCK")) + f", warps={c.num_warps}"
        lines.append(f"| `{row.kernel}` | {row.mode} | {row.dtype} | {', '.join(row.presets)} | {tiles} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def apply_settings(spec: str) -> None:
    """--settings HEAD_DIM:KEY=VALUE,... (e.g. 128:warps=8,stages=2): compile with these GPU settings instead of
    GPU_SETTINGS' (fails where they spill), to see what another tiling gives. Several specs are joined by ';'."""
    for part in filter(None, spec.split(";")):
        head_dim, pairs = part.split(":", 1)
        entry = settings.GPU_SETTINGS[int(head_dim)]
        for pair in pairs.split(","):
            key, value = pair.split("=")
            if key not in entry and not key.endswith("_maxnreg"):
                raise SystemExit(f"kernel_compile: no setting '{key}'; known: {', '.join(sorted(entry))}")
            entry[key] = int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--presets", default="", help="comma-separated preset names (default: every preset)")
    parser.add_argument("--settings", default="", help=apply_settings.__doc__.split(":", 1)[0] + " (see its doc)")
    parser.add_argument(
        "--reuse", type=Path, default=None,
        help="a JSON this script wrote: results whose key (kernel source, launch, Triton version) it holds are "
             "taken from it, the rest compiled",
    )  # fmt: skip
    parser.add_argument("--verify", type=int, default=0, help="with --reuse: compile this many reused ones again")
    args = parser.parse_args(argv)
    apply_settings(args.settings)
    shapes = preset_shapes([p for p in args.presets.split(",") if p] or None)
    t0 = time.time()
    known = json.loads(args.reuse.read_text())["results"] if args.reuse and args.reuse.is_file() else None
    cache = compile_check.Cache(known)
    rows = compile_matrix(shapes, progress=lambda n: print(f"\r{n} compiles", end="", file=sys.stderr), cache=cache)
    print(file=sys.stderr)
    differ = cache.verify(args.verify, random.Random()) if known else []
    seconds = time.time() - t0
    bad = failures(rows) + [f"recompiled, not as stored: {d}" for d in differ]
    for line in bad:
        print(f"kernel_compile: {line}")
    print(f"kernel_compile: {len(rows)} kernel configurations x 2 architectures ({cache.compiled} compiled, "
          f"{cache.reused} reused from {args.reuse}, {min(args.verify, cache.reused)} of those compiled again) in "
          f"{seconds:.0f} s; {len(bad)} over budget")  # fmt: skip
    if args.out:
        args.out.with_suffix(".json").write_text(
            json.dumps({"triton": __import__("triton").__version__, "results": cache.results()}, indent=1) + "\n"
        )
        args.out.write_text(
            "# The kernels compiled for sm_80 and sm_90 (no GPU)\n\n"
            "Made by `make kernel-compile` (`python -m tools.kernel_compile --out docs/results/kernel_compile.md`)"
            f" with triton {__import__('triton').__version__} and the ptxas its wheel ships. Each row is one compile "
            "of a kernel for a mode and dtype, at the head shapes of the presets listed (presets whose launches "
            "compile identically share a row). Registers and spill bytes (stores + loads) are `ptxas -v`'s; shared "
            "memory is what the kernel asks for (limits: sm_80 163 KiB, sm_90 227 KiB); products says whether the "
            f"matrix products became wgmma (sm_90), mma.sync or plain FMAs. Spill budget in bytes: "
            + ", ".join(f"{d} {b}" for d, b in SPILL_BUDGET.items())
            + ".\n\n"
            + table(rows)
            + "\n"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
