"""The kernels' cost model: each launch's FLOPs and HBM bytes, counted from its grid and its programs' tiles, on CPU.

One attention layer of Llama-3-8B as its preset trains it (32 heads, 8 KV heads, head dim 128, Hedgehog feature dim
256, window 64, its own 8 sinks, the LA's decay, bf16, batch 1) runs a forward and a backward through
`triton_hybrid_attention` on meta tensors at 4k and 16k tokens, with the state scan planned for an H100's 132 SMs
(chunk_h.SMS_OFF_GPU pinned to 132: the scan is split over the sequence, `_segment_fix` after it, as on the GPU).
Every Triton launch is recorded, not run (tools/compile_check.record_launches), and every torch op between them too
(a dispatch mode). Each launch's programs are then walked in grid order (axis 0 fastest), each through its kernel's
function in benchmarks/attention/kernel_tiles.py, written from the kernel's loops: the tiles of 16 rows x 16 columns
it reads and writes (every store, read-modify-writes both ways; a partly masked tile counts whole, scalars are left
out) and the products it computes. Two byte columns: **no L2 reuse**, each
program's distinct tiles counted once per program; **shared tiles once**, a tile that several programs resident
at the same time touch counted once. Residency: programs in grid order, in waves of 132 SMs x CTAs per SM, the
CTAs per SM from the launch's register cap (maxnreg x 32 x warps of 64K registers) and warps (2048 threads), 1
where the launch sets no cap; shared memory is not modelled, and no tile is assumed to stay in L2 from one wave
or one launch to the next. The torch glue's bytes are each op's inputs read and outputs written (a memset, zeros or
fill_, writes its output), its FLOPs those of its matrix products.

The irreducible bytes: the forward reads q, k, v, phi_q, phi_k once and writes y once; the backward reads them, y
and dy once and writes dq, dk, dv, dphi_q, dphi_k once (bf16). The needed FLOPs: each product the math needs
computed once, at the kernels' tiles (per query chunk the band's blocks of 64 keys, NB + 1 but for the first
chunks, phi_q phi_k^T and its gradients on those with L terms only (at window 64 the block one back: a query's own
chunk is all window), the sinks' tile, the state; the backward's one recompute of the scores and of phi_q phi_k^T
included).
Targets (issue 67): fwd+bwd bytes at most 3x the irreducible with no L2 reuse; at most 7 Triton launches as
planned for 132 SMs; no torch op on more than T x F elements; FLOPs at most 1.3x the needed. Time bounds use the
H200's measured ceilings (about 790 TFLOP/s for bf16 matrix products, 4.3 TB/s for copies; it has 132 SMs too).

    python -m benchmarks.run roofline [--out docs/results/kernel_roofline.md]      (make kernel-roofline)

Estimates, not measurements: benchmarks/device_speed.sh measures the kernels on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from hybrid_scale_kernels import chunk_h
from hybrid_scale_kernels.chunk import triton_hybrid_attention
from hybrid_scale_kernels.utils import CHUNK, blocks_back, pow2
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.attention.kernel_tiles import KERNELS, Program
from hybrid_scale.attention.options import AttentionOptions
from tools.compile_check import record_launches
from tools.kernel_compile import SMS

PEAK_FLOPS = 790e12  # bf16 dense matrix products, H200 (measured ceiling)
PEAK_BYTES = 4.3e12  # HBM copy bandwidth, H200 (measured ceiling)
SHAPE = dict(H=32, Hkv=8, D=128, F=256, w=64, sinks=8)  # Llama-3-8B, Hedgehog, its preset's window and sinks
LENGTHS = (4096, 16384)
TARGET_BYTES = 3.0  # fwd+bwd bytes (no L2 reuse) / irreducible bytes (issue 67)
TARGET_LAUNCHES = 7  # Triton launches per fwd+bwd, planned for SMS SMs
TARGET_FLOPS = 1.3  # FLOPs / needed FLOPs
E = 2  # bytes of bf16


@dataclass
class Cost:
    name: str
    launches: int = 0
    programs: int = 0
    ctas: int = 0  # per SM, as assumed (see the module's docstring)
    flops: float = 0.0
    nbytes: float = 0.0  # no L2 reuse
    shared: float = 0.0  # tiles shared by resident programs once
    written: Counter = field(default_factory=Counter)  # bytes stored per kernel parameter (no L2 reuse)
    read: Counter = field(default_factory=Counter)  # bytes loaded per kernel parameter (no L2 reuse)


def ctas_per_sm(kwargs: dict) -> int:
    """CTAs of a launch one SM holds at once: from its register cap and warps where it sets a cap, else 1."""
    return chunk_h.resident(kwargs.get("num_warps", 4), kwargs.get("maxnreg"))


def _arguments(launch) -> tuple[dict, dict]:
    """(scalar and constexpr arguments by name, element size of each tensor argument by name)."""
    names = launch.kernel.arg_names if hasattr(launch.kernel, "arg_names") else launch.kernel.fn.__code__.co_varnames
    bound = dict(zip(names, launch.args, strict=False)) | launch.kwargs
    scalars = {k: v for k, v in bound.items() if not isinstance(v, torch.Tensor)}
    return scalars, {k: v.element_size() for k, v in bound.items() if isinstance(v, torch.Tensor)}


def _tally(tiles: dict, size: dict, into: Counter | None = None) -> float:
    total = 0.0
    for (name, _), mask in tiles.items():
        b = mask.bit_count() * size[name]
        total += b
        if into is not None:
            into[name] += b
    return total


def cost_of(launch, into: Cost) -> None:
    """Add one launch's programs to `into`: FLOPs, bytes with no L2 reuse and with shared tiles once."""
    a, elem = _arguments(launch)
    program = KERNELS[launch.name](a)
    grid = (tuple(launch.grid) + (1, 1))[:3]
    ctas = ctas_per_sm(launch.kwargs)
    wave, units, resident = SMS * ctas, {}, ({}, {})
    size: dict = {}
    count = 0
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                p = Program(units)
                program(p, x, y, z)
                if len(size) < len(units):
                    size = {n: 16 * u * elem[n] for n, u in units.items()}  # (bytes of one bit: 16 rows x u columns)
                into.flops += p.flops
                into.nbytes += _tally(p.reads, size, into.read) + _tally(p.writes, size, into.written)
                for mine, theirs in zip((p.reads, p.writes), resident, strict=True):
                    for k, m in mine.items():
                        theirs[k] = theirs.get(k, 0) | m
                count += 1
                if count % wave == 0:
                    into.shared += sum(_tally(t, size) for t in resident)
                    resident = ({}, {})
    into.shared += sum(_tally(t, size) for t in resident)
    into.launches += 1
    into.programs += count
    into.ctas = ctas


class Glue(TorchDispatchMode):
    """The torch ops between the kernels: their count, bytes (inputs read, outputs written; a memset writes its
    output), FLOPs (batched matrix products) and the ops on more than T x F elements (what the targets forbid).
    Views and allocations move nothing; an op on no elements launches nothing."""

    FREE = {"view", "_unsafe_view", "empty", "empty_like", "expand", "transpose", "t", "permute", "detach", "alias",
            "as_strided", "select", "slice", "unsqueeze", "squeeze", "new_empty", "empty_strided", "lift_fresh",
            "_to_copy_noop"}  # fmt: skip
    MEMSETS = {"zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full", "full_like", "new_full", "ones",
               "ones_like"}  # fmt: skip

    def __init__(self, big: int):
        super().__init__()
        self.big, self.ops, self.memsets, self.nbytes, self.flops, self.over = big, 0, 0, 0.0, 0.0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.FREE:
            return out
        ins = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
        outs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        if name in self.MEMSETS:
            ins = []
            self.memsets += any(t.numel() for t in outs)
        elif name == "copy_":  # reads the source, writes the destination
            ins, outs = ins[1:], ins[:1]
        if not any(t.numel() for t in (*ins, *outs)):
            return out
        self.ops += 1
        self.nbytes += sum(t.numel() * t.element_size() for t in (*ins, *outs))
        if name in ("bmm", "mm"):
            self.flops += 2.0 * outs[0].numel() * ins[0].shape[-1]
        if any(t.numel() > self.big for t in (*ins, *outs)):
            self.over.append(name)
        return out


def count(T: int) -> tuple[list[Cost], Glue, float]:
    """The launches (per kernel, in order of first launch) and the glue of one forward + backward at T tokens,
    planned for SMS SMs, and the irreducible bytes."""
    H, Hkv, D, F = (SHAPE[k] for k in ("H", "Hkv", "D", "F"))

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    q, k, v, fq, fk = meta(1, H, T, D), meta(1, Hkv, T, D), meta(1, Hkv, T, D), meta(1, H, T, F), meta(1, Hkv, T, F)
    gamma = torch.empty(H, device="meta", requires_grad=True)
    rho = torch.empty(Hkv, device="meta", requires_grad=True)
    glue = Glue(big=T * F)
    with mock.patch.object(chunk_h, "SMS_OFF_GPU", SMS), record_launches() as recorded, glue:
        o = AttentionOptions(window=SHAPE["w"], sinks=SHAPE["sinks"], hybrid_sinks=True)
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, la_decay=rho)
        torch.autograd.grad(y, (q, k, v, fq, fk, gamma, rho), torch.empty_like(y))  # (no .grad to accumulate into)
    costs: dict[str, Cost] = {}
    for launch in recorded:
        cost_of(launch, costs.setdefault(launch.name, Cost(launch.name)))
    inputs = (H * T * (D + F) + Hkv * T * (2 * D + F)) * E
    y_bytes = H * T * D * E
    floor = (inputs + y_bytes) + (inputs + 2 * y_bytes + inputs)  # forward; backward (inputs, y and dy; gradients)
    return list(costs.values()), glue, floor


def needed_flops(T: int) -> dict[str, float]:
    """The products one forward + backward at SHAPE needs, each computed once, at the kernels' tiles (per pass)."""
    H, Hkv, D, F, C = SHAPE["H"], SHAPE["Hkv"], SHAPE["D"], SHAPE["F"], CHUNK
    nc, nb, bs = -(-T // C), blocks_back(SHAPE["w"], True, True), pow2(SHAPE["sinks"])
    band = H * sum(min(c, nb) + 1 for c in range(nc)) * C * C  # (query, key) pairs in the band's tiles
    # those of its blocks with L terms: b blocks back, the last query b C + C - 1 past the first key, lin_off = window
    lin_band = H * sum(sum(b * C + C - 1 >= SHAPE["w"] for b in range(min(c, nb) + 1)) for c in range(nc)) * C * C
    sink = H * T * bs  # (query, sink) pairs in the sinks' tile
    state_rows = H * (nc - nb - 1) * C  # queries that read a state (chunks NB + 1 on)
    scan = Hkv * (nc - nb - 1) * C  # keys a stored state holds (chunks 0 .. NS - 2)
    # forward: q k^T, (g E + L) v, phi_q phi_k^T; the sinks' q k^T and E v; phi_q h; the scan's phi_k^T v
    fwd = 2 * band * 2 * D + 2 * lin_band * F + 2 * sink * 2 * D + 2 * state_rows * F * D + 2 * scan * F * D
    # backward: q k^T again, dp = do v^T, ds k, ds^T q, (g E + L)^T do; phi_q phi_k^T again, dp_L phi_k,
    # dp_L^T phi_q; the sinks' scores, dp, dq, dk, dv; do h^T and phi_q^T do; phi_k dh and v dh^T
    bwd = 2 * band * 5 * D + 2 * lin_band * 3 * F + 2 * sink * 5 * D + 2 * state_rows * 2 * F * D + 2 * scan * 2 * F * D
    return dict(forward=float(fwd), backward=float(bwd))


def seconds(flops: float, nbytes: float) -> float:
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)


def summary(T: int, counted=None) -> dict:
    """The totals the targets are about (`counted`: count(T)'s result, if already made)."""
    costs, glue, floor = counted or count(T)
    flops, needed = sum(c.flops for c in costs) + glue.flops, sum(needed_flops(T).values())
    moved = sum(c.nbytes for c in costs) + glue.nbytes
    shared = sum(c.shared for c in costs) + glue.nbytes
    return dict(
        launches=sum(c.launches for c in costs), glue_ops=glue.ops, memsets=glue.memsets, over=list(glue.over),
        moved=moved, shared=shared, glue_bytes=glue.nbytes, floor=floor, ratio=moved / floor,
        shared_ratio=shared / floor, flops=flops, needed=needed, flops_ratio=flops / needed,
        bound_us=(sum(seconds(c.flops, c.nbytes) for c in costs) + glue.nbytes / PEAK_BYTES) * 1e6,
        shared_us=(sum(seconds(c.flops, c.shared) for c in costs) + glue.nbytes / PEAK_BYTES) * 1e6,
    )  # fmt: skip


def _ok(b: bool) -> str:
    return "meets" if b else "misses"


def _length(T: int) -> list[str]:
    counted = count(T)
    costs, glue, floor = counted
    t = summary(T, counted)
    lines = [f"### T = {T}", "",
             "| kernel | launches | programs | CTAs / SM | GFLOP | MB, no L2 reuse | MB, shared tiles once | "
             "time bound (us), no reuse / shared |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in costs:
        us = (seconds(c.flops, c.nbytes) * 1e6, seconds(c.flops, c.shared) * 1e6)
        lines.append(f"| `{c.name}` | {c.launches} | {c.programs} | {c.ctas} | {c.flops / 1e9:.1f} | "
                     f"{c.nbytes / 1e6:.0f} | {c.shared / 1e6:.0f} | {us[0]:.0f} / {us[1]:.0f} |")  # fmt: skip
    lines += [
        f"| torch glue ({glue.ops} ops, {glue.memsets} of them memsets) | | | | {glue.flops / 1e9:.1f} | "
        f"{glue.nbytes / 1e6:.0f} | {glue.nbytes / 1e6:.0f} | {glue.nbytes / PEAK_BYTES * 1e6:.0f} |",
        f"| **fwd+bwd** | **{t['launches']}** | | | **{t['flops'] / 1e9:.0f}** | **{t['moved'] / 1e6:.0f}** | "
        f"**{t['shared'] / 1e6:.0f}** | **{t['bound_us']:.0f} / {t['shared_us']:.0f}** |",
        "",
    ]
    over = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in Counter(t["over"]).items()) or "none"
    need = needed_flops(T)
    lines += [
        "| target (issue 67) | counted | |",
        "|---|---|---|",
        f"| bytes <= {TARGET_BYTES:g}x the irreducible ({floor / 1e6:.0f} MB), no L2 reuse | **{t['ratio']:.2f}x** "
        f"({t['shared_ratio']:.2f}x with shared tiles once) | {_ok(t['ratio'] <= TARGET_BYTES)} |",
        f"| Triton launches <= {TARGET_LAUNCHES}, planned for {SMS} SMs | {t['launches']} (and {glue.ops} torch ops) "
        f"| {_ok(t['launches'] <= TARGET_LAUNCHES)} |",
        f"| no torch op on more than T x F = {T * SHAPE['F'] / 1e6:.1f}M elements | {over} | {_ok(not t['over'])} |",
        f"| FLOPs <= {TARGET_FLOPS:g}x the needed ({need['forward'] / 1e9:.0f} forward + {need['backward'] / 1e9:.0f} "
        f"backward = {t['needed'] / 1e9:.0f} GFLOP) | **{t['flops_ratio']:.2f}x** | "
        f"{_ok(t['flops_ratio'] <= TARGET_FLOPS)} |",
        "",
    ]
    return lines


def table() -> str:
    return "\n".join(line for T in LENGTHS for line in _length(T))


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the page here (markdown)")


def run(args) -> int:
    text = table()
    print(text)
    if args.out:
        what = "\n\n".join(p.replace("\n", " ") for p in __doc__.split("\n\n")[1:3])
        args.out.write_text(
            "# The kernels' cost model (bytes and launches counted on CPU; no GPU has measured them)\n\n"
            "Made by `make kernel-roofline` (`python -m benchmarks.run roofline --out docs/results/kernel_roofline.md`"
            f"). {what}\n\n{text}"
        )
    return 0
