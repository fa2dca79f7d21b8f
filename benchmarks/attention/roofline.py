"""The kernels' cost model: each launch's FLOPs and HBM bytes, counted from its grid and shapes, on CPU.

One attention layer of Llama-3-8B as its preset trains it (32 heads, 8 KV heads, head dim 128, Hedgehog feature dim
256, window 64, its own 8 sinks, the LA's decay, bf16, batch 1) runs a forward and a backward through
`triton_hybrid_attention` on meta tensors at 4k and 16k tokens. Every Triton launch is recorded, not run
(tools/compile_check.record_launches), and every torch op between them too (a dispatch mode): the launches and their
grids are what the wrappers really make. Each kernel's bytes are then counted from its grid and the loads and stores
its programs make (`KERNELS`, one function per kernel, written from its loops: each distinct tile a program loads
or stores counts once, however often the program reloads it, and once for every program that loads it, so L2 hits
between programs would lower them) and its FLOPs from its products. The torch glue's
bytes are each op's inputs read and outputs written.

The irreducible bytes: the forward reads q, k, v, phi_q, phi_k once and writes y once; the backward reads them and dy
once and writes dq, dk, dv, dphi_q, dphi_k once (bf16). Targets (issue 60): fwd+bwd at most 2x those bytes, at most
6 Triton launches, no torch glue of O(T F) in fp32. Time bounds use the H200's measured ceilings (about 790 TFLOP/s
for bf16 matrix products, 4.3 TB/s for copies).

    python -m benchmarks.run roofline [--out docs/results/kernel_roofline.md]      (make kernel-roofline)

Estimates, not measurements: benchmarks/device_speed.sh measures the kernels on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from hybrid_scale_kernels.chunk import triton_hybrid_attention
from hybrid_scale_kernels.utils import CHUNK
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_scale.attention.options import AttentionOptions

PEAK_FLOPS = 790e12  # bf16 dense matrix products, H200 (measured ceiling)
PEAK_BYTES = 4.3e12  # HBM copy bandwidth, H200 (measured ceiling)
SHAPE = dict(H=32, Hkv=8, D=128, F=256, w=64, sinks=8)  # Llama-3-8B, Hedgehog, its preset's window and sinks
LENGTHS = (4096, 16384)
TARGET_BYTES = 2.0  # fwd+bwd bytes / irreducible bytes (issue 60)
TARGET_LAUNCHES = 6  # Triton launches per fwd+bwd
E, F32 = 2, 4  # bytes of bf16 and fp32


@dataclass
class Cost:
    name: str
    launches: int = 0
    flops: float = 0.0
    nbytes: float = 0.0

    def add(self, flops: float, nbytes: float) -> None:
        self.launches += 1
        self.flops += flops
        self.nbytes += nbytes


def _ints(launch) -> dict:
    """The launch's scalar arguments by name (positional ones bound to the kernel's parameter names)."""
    names = launch.kernel.arg_names if hasattr(launch.kernel, "arg_names") else launch.kernel.fn.__code__.co_varnames
    out = dict(zip(names, launch.args, strict=False)) | launch.kwargs
    return {k: v for k, v in out.items() if not isinstance(v, torch.Tensor)}


def _states(a, grid, s) -> tuple[float, float]:
    bf, bdv, C = a["BLOCK_F"], a["BLOCK_DV"], CHUNK
    chunks = a["NS"] * (grid[0] * grid[1] * grid[2] // a["P"])  # every program walks its segment's chunks
    per = C * bf * E + C * bdv * E + bf * bdv * s["h_bytes"] + bf * F32 / grid[1]
    return chunks * 2 * bf * C * bdv, chunks * per


def _segment_fix(a, grid, s) -> tuple[float, float]:
    P, bf, bdv = a["P"], a["BLOCK_F"], a["BLOCK_DV"]
    per_prog = (P / 2) * bf * bdv * F32 + 2 * a["L"] * bf * bdv * s["h_bytes"]
    return 0.0, grid[0] * grid[1] * grid[2] * per_prog


def _output(a, grid, s) -> tuple[float, float]:
    C, D, F, blocks, bs = CHUNK, a["D"], a["F"], a["NB"] + 1, a["BLOCK_S"]
    flops = blocks * 2 * C * C * D  # p @ v
    bytes_ = C * D * E + blocks * 2 * C * D * E  # q; each block's k and v
    if a["LIN"]:  # the state, then each block's phi_q phi_k^T
        flops += 2 * C * F * D + blocks * 2 * C * C * F
        bytes_ += C * F * E + F * D * s["h_bytes"] + F * F32 + blocks * C * F * E
    if a["SOFT"]:  # q.k in each of two passes
        flops += blocks * 2 * (2 * C * C * D)
    if a["SINKS"]:
        flops += 2 * (2 * C * bs * D)
        bytes_ += 2 * bs * D * E
    bytes_ += C * D * E * (1 + a["LO"]) + C * F32 * (3 * a["STATS"] + 2 * a["DENS"])  # y (and its rounding error); rows
    return grid[0] * grid[1] * flops, grid[0] * grid[1] * bytes_


def _bwd_dq(a, grid, s) -> tuple[float, float]:
    C, D, F, blocks, bs = CHUNK, a["D"], a["F"], a["NB"] + 1, a["BLOCK_S"]
    flops = blocks * 2 * C * C * D * (2 + a["SOFT"])  # dp, scores, dq
    bytes_ = C * D * (3 + a["Y_LO"]) * E + blocks * 2 * C * D * E + 5 * C * F32  # q, dy, y (+ error); k, v; rows
    bytes_ += C * D * E * (1 + a["HYBRID"])  # dq; the argmax keys' rows
    if a["SINKS"]:
        flops += 3 * 2 * C * bs * D
        bytes_ += 2 * bs * D * E + 2 * C * bs * F32
    if a["LIN"]:  # each block's phi_k, the state's h, phi_q (decay), dphi_q
        flops += blocks * 2 * C * C * F + 2 * C * D * F
        bytes_ += blocks * C * F * E + F * D * s["h_bytes"] + F * F32 + C * F * E * (1 + a["DECAY"])
    return grid[0] * grid[1] * flops, grid[0] * grid[1] * bytes_


def _dstates(a, grid, s) -> tuple[float, float]:
    bf, bdv, C, G, P = a["BLOCK_F"], a["BLOCK_DV"], CHUNK, a["G"], a["P"]
    programs = grid[0] * grid[1] * grid[2]
    states = a["NS"] * programs // P  # every program walks its segment's states
    per = G * (C * bf * E + C * bdv * E + 2 * C * F32) + bf * bdv * s["h_bytes"] * (1 + a["DECAY"])
    sums = (P > 1) * programs * bf * bdv * F32 * (1 + a["DECAY"])  # each segment's own sum (and weighted states)
    return states * G * 2 * bf * C * bdv, states * per + sums


def _dstates_fix(a, grid, s) -> tuple[float, float]:
    P, L, bf, bdv = a["P"], a["L"], a["BLOCK_F"], a["BLOCK_DV"]
    busy = grid[0] * grid[1] * grid[2] * (P - 1) // P  # (the last segment has nothing after it)
    per_prog = (P / 2) * bf * bdv * F32 + 2 * L * bf * bdv * s["h_bytes"] + a["DECAY"] * bf * bdv * F32
    return 0.0, busy * per_prog


def _bwd_dkv(a, grid, s) -> tuple[float, float]:
    C, D, F, q_blocks, bdo = CHUNK, a["D"], a["F"], (a["NB"] + 1) * a["G"], a["BLOCK_DO"]
    per = 2 * C * D * E + 2 * C * bdo * E  # this chunk's k and v; dk and dv
    per += q_blocks * (C * D * E * (1 + a["SOFT"]) + 3 * C * F32)  # each query block's dy (and q), its row stats
    flops = q_blocks * (2 * 2 * C * C * D + 2 * 2 * C * C * bdo) if a["SOFT"] else 0.0  # scores, dp; ds^T q, E^T do
    if a["LIN"]:
        per += C * F * E + q_blocks * C * F * E + F * bdo * s["h_bytes"]  # phi_k; each block's phi_q; dh
        flops += q_blocks * (2 * C * C * F + 2 * C * C * bdo) + 2 * C * F * bdo
    return grid[0] * grid[1] * grid[2] * flops, grid[0] * grid[1] * grid[2] * per


def _bwd_dfk(a, grid, s) -> tuple[float, float]:
    C, D, F, q_blocks = CHUNK, a["D"], a["F"], (a["NB"] + 1) * a["G"]
    per = C * F * E + C * D * E + F * D * s["h_bytes"] + F * F32 + 2 * C * F * F32  # phi_k, v, dh, dz; dphi_k (fp32)
    per += q_blocks * (C * D * E + C * F * E + 2 * C * F32)  # each query block's dy, phi_q, row stats
    flops = q_blocks * (2 * C * C * D + 2 * C * C * F * (1 + a["DECAY"])) + 2 * C * D * F
    return grid[0] * grid[1] * flops, grid[0] * grid[1] * per


KERNELS = {
    "_chunk_states": _states,
    "_segment_fix": _segment_fix,
    "_chunk_output": _output,
    "_chunk_bwd_dq": _bwd_dq,
    "_chunk_dstates": _dstates,
    "_dstates_fix": _dstates_fix,
    "_chunk_bwd_dkv": _bwd_dkv,
    "_chunk_bwd_dfk": _bwd_dfk,
}


class _Glue(TorchDispatchMode):
    """The torch ops between the kernels: their count, bytes (inputs read, outputs written) and fp32 ops of at least
    T x F elements (what the targets forbid). Views and allocations move nothing."""

    FREE = {"view", "_unsafe_view", "empty", "empty_like", "expand", "transpose", "t", "permute", "detach", "alias",
            "as_strided", "select", "slice", "unsqueeze", "squeeze", "new_empty", "empty_strided", "lift_fresh",
            "_to_copy_noop", "zeros", "zeros_like", "new_zeros", "fill_", "zero_"}  # fmt: skip

    def __init__(self, big: int):
        super().__init__()
        self.big, self.ops, self.nbytes, self.fp32_big = big, 0, 0.0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            tensors = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
            outs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in (*tensors, *outs))
            self.ops += 1
            self.nbytes += moved
            if any(t.dtype == torch.float32 and t.numel() >= self.big for t in outs):
                self.fp32_big.append(name)
        return out


def count(T: int) -> tuple[list[Cost], _Glue, float]:
    """The launches (per kernel, in order of first launch) and the glue of one forward + backward at T tokens, and
    the irreducible bytes."""
    from tools.compile_check import record_launches

    H, Hkv, D, F = (SHAPE[k] for k in ("H", "Hkv", "D", "F"))

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    q, k, v, fq, fk = meta(1, H, T, D), meta(1, Hkv, T, D), meta(1, Hkv, T, D), meta(1, H, T, F), meta(1, Hkv, T, F)
    gamma = torch.empty(H, device="meta", requires_grad=True)
    rho = torch.empty(Hkv, device="meta", requires_grad=True)
    glue = _Glue(big=T * F)
    with record_launches() as recorded, glue:
        o = AttentionOptions(window=SHAPE["w"], sinks=SHAPE["sinks"], hybrid_sinks=True)
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, la_decay=rho)
        torch.autograd.grad(y, (q, k, v, fq, fk, gamma, rho), torch.empty_like(y))  # (no .grad to accumulate into)
    costs: dict[str, Cost] = {}
    s = dict(h_bytes=E)
    for launch in recorded:
        a = _ints(launch)
        a.setdefault("G", H // Hkv)
        a.setdefault("D", D)
        a.setdefault("F", F)
        flops, nbytes = KERNELS[launch.name](a, launch.grid, s)
        costs.setdefault(launch.name, Cost(launch.name)).add(flops, nbytes)
    fwd_io = (H * T * (D + F) + Hkv * T * (2 * D + F)) * E + H * T * D * E
    bwd_io = 2 * (H * T * (D + F) + Hkv * T * (2 * D + F)) * E + H * T * D * E
    return list(costs.values()), glue, fwd_io + bwd_io


def seconds(flops: float, nbytes: float) -> float:
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)


def summary(T: int) -> dict:
    """The totals the targets are about."""
    costs, glue, floor = count(T)
    kernel_bytes = sum(c.nbytes for c in costs)
    return dict(
        launches=sum(c.launches for c in costs), glue_ops=glue.ops, fp32_glue=list(glue.fp32_big),
        kernel_bytes=kernel_bytes, glue_bytes=glue.nbytes, floor=floor,
        ratio=(kernel_bytes + glue.nbytes) / floor, flops=sum(c.flops for c in costs),
        bound_us=sum(seconds(c.flops, c.nbytes) for c in costs) * 1e6 + glue.nbytes / PEAK_BYTES * 1e6,
    )  # fmt: skip


def table() -> str:
    lines = []
    for T in LENGTHS:
        costs, glue, floor = count(T)
        lines += [f"### T = {T}", "", "| kernel | launches | GFLOP | MB moved | bound | time bound (us) |",
                  "|---|---:|---:|---:|---|---:|"]  # fmt: skip
        for c in costs:
            bound = "compute" if c.flops / PEAK_FLOPS >= c.nbytes / PEAK_BYTES else "memory"
            us = seconds(c.flops, c.nbytes) * 1e6
            lines.append(
                f"| `{c.name}` | {c.launches} | {c.flops / 1e9:.1f} | {c.nbytes / 1e6:.0f} | {bound} | {us:.0f} |"
            )
        lines.append(f"| torch glue ({glue.ops} ops) | | | {glue.nbytes / 1e6:.0f} | memory | "
                     f"{glue.nbytes / PEAK_BYTES * 1e6:.0f} |")  # fmt: skip
        t = summary(T)
        ok = lambda b: "meets" if b else "misses"  # noqa: E731
        lines += [
            f"| **fwd+bwd** | **{t['launches']}** | **{t['flops'] / 1e9:.0f}** | "
            f"**{(t['kernel_bytes'] + t['glue_bytes']) / 1e6:.0f}** | | **{t['bound_us']:.0f}** |",
            "",
            f"Irreducible bytes {floor / 1e6:.0f} MB; moved / irreducible = **{t['ratio']:.2f}x** (target "
            f"<= {TARGET_BYTES:g}x: {ok(t['ratio'] <= TARGET_BYTES)}). Triton launches {t['launches']} (target <= "
            f"{TARGET_LAUNCHES}: {ok(t['launches'] <= TARGET_LAUNCHES)}). fp32 glue ops of >= T x F elements: "
            f"{', '.join(t['fp32_glue']) or 'none'} (target none: {ok(not t['fp32_glue'])}).",
            "",
        ]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the page here (markdown)")


def run(args) -> int:
    text = table()
    print(text)
    if args.out:
        what = " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " ")
        args.out.write_text(
            "# The kernels' cost model (bytes and launches counted on CPU; no GPU has measured them)\n\n"
            "Made by `make kernel-roofline` (`python -m benchmarks.run roofline --out docs/results/kernel_roofline.md`"
            f"). {what}\n\n{text}"
        )
    return 0
