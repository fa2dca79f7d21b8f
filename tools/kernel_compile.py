"""The kernels compiled for sm_80 and sm_90 on this machine (no GPU): every kernel x mode x dtype x preset head shape.

For each model preset (configs/models/*.yaml: its heads, KV heads, head dim, feature dim, window and sinks), each
attention mode the kernels take and each of bf16 / fp16 / fp32, the wrappers are called as training and generation
call them -- the forward and its backward through autograd on meta tensors at the preset's training length, the
forward without gradients (a prefill: the chunked prefill kernels and the fused forward), one fused decode step on a
ring of `window` keys -- with the tiles the kernels choose on a GPU. Every launch they make is recorded (nothing
runs) and compiled for both architectures by Triton and the wheel's ptxas (hybrid_scale_kernels.compile_check);
equal launches compile once.

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
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hybrid_scale_kernels import chunk_scan, compile_check, hybrid_attention
from hybrid_scale_kernels.decode import triton_decode_step
from hybrid_scale_kernels.hybrid_attention import triton_hybrid_attention
from hybrid_scale_kernels.jit_helpers import MODE_PARTS

from hybrid_scale.attention.feature_maps import make_feature_map
from hybrid_scale.attention.recurrent import DecodeState
from hybrid_scale.attention.shape import Shape as CallShape
from hybrid_scale.config import PRESETS, load_config

# Bytes of spill stores + loads a kernel may have, per dtype: none in bf16 and fp16 (what the presets train in); in
# fp32 (IEEE dots on FMAs, no tensor cores) 128, for the window launch of _bwd_dkv at head dim 128, which spills
# 44-72 bytes with every tile setting tried since the packed GQA tiles (tools/kernel_compile.py --tune fp32,128,16)
SPILL_BUDGET = {"bf16": 0, "fp16": 0, "fp32": 128}
# every mode the kernels compute ("none" launches nothing), and the hybrid with its sinks (attention.hybrid_sinks);
# each also with the LA's decay (attention.la_decay, "+decay"): the modes with an LA decay it, and the decode step
# carries a decayed state on in every mode
HYBRID_SINKS = "hybrid+sinks"
DECAY = "+decay"
MODES = (*MODE_PARTS, HYBRID_SINKS)
MODES = (*MODES, *(m + DECAY for m in MODES))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# kernels whose half-precision products must be wgmma on sm_90 (64-row tiles: chunk_prefill.py's prefill and its
# backward)
WGMMA = ("_chunk_states", "_chunk_output", "_chunk_bwd_dq", "_chunk_dstates", "_chunk_bwd_dkv", "_chunk_bwd_dfk")


@dataclass(frozen=True)
class Shape:
    preset: str
    heads: int
    kv_heads: int
    head_dim: int
    features: int
    window: int
    sinks: int
    length: int  # the preset's training length (T of the training kernels)


def preset_shapes(names: list[str] | None = None) -> list[Shape]:
    """The attention shapes of every model preset, from its YAML file."""
    shapes = []
    for path in sorted((PRESETS / "models").glob("*.yaml")):
        if names and path.stem not in names:
            continue
        cfg = load_config(f"models/{path.name}")
        arch, a = cfg.model.arch, cfg.attention
        d = arch.head_dim or arch.hidden_size // arch.num_attention_heads
        f = make_feature_map(a.feature_map, 1, d, a.feature_dim).out_dim
        shapes.append(
            Shape(path.stem, arch.num_attention_heads, arch.num_key_value_heads, d, f, a.window, a.sinks,
                  cfg.finetune.seq_len)
        )  # fmt: skip
    return shapes


LONG = 16384  # tokens of a prefill whose state scan a GPU splits (chunk_scan.plan; the presets' lengths are not)
SMS = 132  # an H100's / H200's SMs: the state scan is split as on such a GPU (chunk_scan.plan)


@contextlib.contextmanager
def _as_on_a_gpu():
    """The state scan planned for SMS SMs, as on a GPU (off a GPU it is never split)."""
    before = chunk_scan.SMS_OFF_GPU
    chunk_scan.SMS_OFF_GPU = SMS
    try:
        yield
    finally:
        chunk_scan.SMS_OFF_GPU = before


@contextlib.contextmanager
def _fused_only():
    """triton_hybrid_attention without its chunked path: the fused kernels, as a padded batch runs them."""
    before = hybrid_attention.chunked_path
    hybrid_attention.chunked_path = lambda *args, **kwargs: None
    try:
        yield
    finally:
        hybrid_attention.chunked_path = before


def launches(shape: Shape, mode: str, dtype: torch.dtype) -> list[compile_check.Launch]:
    """The launches of one forward + backward (meta tensors, batch 1: the chunked kernels where they take the case,
    and the fused ones, which a padded batch trains with), forwards without gradients (a prefill: chunk_prefill.py's
    kernels at the preset's length and at LONG tokens, whose state scan is split as on an H100/H200; and the
    fused forward they fall back to, its output written in the inputs' dtype, not fp32) and one decode step (a ring
    of `window`)."""
    b, h, hkv, t, d, f = 1, shape.heads, shape.kv_heads, shape.length, shape.head_dim, shape.features

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=dtype, requires_grad=True)

    q, k, v, fq, fk = meta(b, h, t, d), meta(b, hkv, t, d), meta(b, hkv, t, d), meta(b, h, t, f), meta(b, hkv, t, f)
    gamma = torch.empty(h, device="meta", requires_grad=True)
    decay = mode.endswith(DECAY)
    mode = mode.removesuffix(DECAY)
    options = dict(window=shape.window, mode=mode, sinks=shape.sinks)
    if mode == HYBRID_SINKS:
        options |= dict(mode="hybrid", hybrid_sinks=True)
    rho = torch.empty(hkv, device="meta", requires_grad=True)
    with compile_check.record_launches() as recorded, _as_on_a_gpu():
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, **options, **({"la_decay": rho} if decay else {}))
        y.backward(torch.empty_like(y))  # the chunked backward where it takes the case
        with _fused_only():  # the fused forward and backward, which train where the chunked path does not (padding)
            y = triton_hybrid_attention(q, k, v, fq, fk, gamma, **options, **({"la_decay": rho} if decay else {}))
            y.backward(torch.empty_like(y))
        plain = [t.detach() for t in (q, k, v, fq, fk, gamma)]  # generation's prefill: no gradient, y in q's dtype
        extra = {"la_decay": rho.detach()} if decay else {}
        triton_hybrid_attention(*plain, **options, **extra)  # chunk_prefill.py's kernels where it takes the case
        long = [x.new_empty(*x.shape[:2], LONG, x.shape[3]) if x.dim() == 4 else x for x in plain]
        triton_hybrid_attention(*long, **options, **extra)  # a state scan split over the sequence, as on a GPU
        triton_hybrid_attention(*plain, **options, **extra, return_denominators=True)  # the fused one it falls back to
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
                           one(b, hkv, 1, f), torch.ones(h), **options,
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
                    if shape.preset not in row.presets:  # (the forward's states are launched again in the backward)
                        row.presets.append(shape.preset)
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


CANDIDATES = ((8, 32, None), (4, 32, None), (8, 16, None), (4, 16, None), (8, 64, None), (4, 64, None),
              (8, 32, 255), (4, 32, 255), (16, 32, None), (2, 32, None))  # (warps, feature chunk, maxnreg)  # fmt: skip


def tune(kind: str, head_dim: int, block: int) -> str:
    """For the presets with this head dim, each kernel's first launch setting in CANDIDATES that compiles without
    spills and within shared memory on both architectures in every mode (or its least-spilling one): the
    GPU_TILES entry to paste, and what each kernel spills with it."""
    from hybrid_scale_kernels import hybrid_attention as ha

    shapes = [s for s in preset_shapes() if (64 if s.head_dim <= 64 else 128) == head_dim]
    shapes = list({(s.head_dim, s.features, s.kv_heads == s.heads): s for s in shapes}.values())
    dtype = DTYPES["bf16" if kind == "half" else "fp32"]
    cache = compile_check.Cache()
    best: dict[str, tuple] = {}
    for cand in CANDIDATES:
        warps, fchunk, maxnreg = cand
        names = {"_states_fwd", "_fwd", "_bwd_dq", "_bwd_dfq", "_states_bwd", "_bwd_dkv", "_bwd_dfk", "_bwd_sinks"}
        ha.GPU_TILES[kind, head_dim] = ha.Tiles(block, per_kernel=tuple((n, warps, fchunk, maxnreg) for n in names))
        worst: dict[str, int] = {}
        for shape in shapes:
            for mode in MODES:
                for launch in launches(shape, mode, dtype):
                    if launch.name == "_decode" or best.get(launch.name, (None, 1))[1] == 0:
                        continue
                    for arch in compile_check.ARCHS:
                        c = cache(launch, arch)
                        bad = c.spills + (1 << 20 if not c.shared_ok else 0)
                        worst[launch.name] = max(worst.get(launch.name, 0), bad)
        for name, bad in worst.items():
            if name not in best or bad < best[name][1]:
                best[name] = (cand, bad)
        print(f"tune {kind} {head_dim} {cand}: {worst}", file=sys.stderr, flush=True)
        if all(b == 0 for _, b in best.values()) and best:
            break
    entries = ", ".join(f'("{n}", {c[0]}, {c[1]}, {c[2]})' for n, (c, _) in sorted(best.items()))
    spills = {n: b for n, (_, b) in best.items() if b}
    return f'("{kind}", {head_dim}): Tiles({block}, per_kernel=({entries},)),  # spills left: {spills or "none"}'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--presets", default="", help="comma-separated preset names (default: every preset)")
    parser.add_argument("--tune", default="", help="KIND,HEAD_DIM,BLOCK (e.g. half,128,32): search the tiles")
    parser.add_argument(
        "--tiles", default="", help="KIND,HEAD_DIM,BLOCK,WARPS (e.g. half,128,64,8): compile with these tiles instead "
        "of GPU_TILES' entry (every kernel alike; fails where they spill), to see what another tile size gives",
    )  # fmt: skip
    parser.add_argument(
        "--reuse", type=Path, default=None,
        help="a JSON this script wrote: results whose key (kernel source, launch, Triton version) it holds are "
             "taken from it, the rest compiled",
    )  # fmt: skip
    parser.add_argument("--verify", type=int, default=0, help="with --reuse: compile this many reused ones again")
    args = parser.parse_args(argv)
    if args.tune:
        kind, head_dim, block = args.tune.split(",")
        print(tune(kind, int(head_dim), int(block)))
        return 0
    if args.tiles:
        from hybrid_scale_kernels import hybrid_attention as ha

        kind, head_dim, block, warps = args.tiles.split(",")
        ha.GPU_TILES[kind, int(head_dim)] = ha.Tiles(int(block), int(warps))
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
