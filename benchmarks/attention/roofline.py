"""A roofline estimate of the fused kernels, from their loop structure and tiles, until a GPU measures them.

For one attention layer of Llama-3-8B (32 heads, 8 KV heads, head dim 128, Hedgehog feature dim 256, window 64,
bf16, batch 1) at 4k / 16k / 64k tokens, each kernel's FLOPs and HBM bytes are counted from what its programs do
with the tiles `default_tiles` picks on a GPU (hybrid_scale_kernels.hybrid_attention.GPU_TILES): the key tiles each
query tile streams (the masked ones it skips not counted), the feature chunks it walks, every tile it loads or
stores (loads of the same tile by several programs counted each time: an upper bound on HBM traffic, L2 hits would
lower it). The time bound of a kernel is max(FLOPs / peak FLOP/s, bytes / peak bandwidth) with the H200's
measured ceilings (about 790 TFLOP/s for bf16 matrix products, 4.3 TB/s for copies). Beside it: causal SDPA
(FlashAttention: 2 H D T^2 FLOPs forward, compute bound) and fla's chunk_linear_attn (chunk 64, states per chunk
in fp32, its GQA groups repeated), counted the same way.

    python -m benchmarks.run roofline [--out docs/results/kernel_roofline.md]

Estimates, not measurements: `python -m benchmarks.run kernels` measures the kernels on a GPU (kernel_speed.md, its
own page; this one never writes it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from hybrid_scale_kernels.hybrid_attention import default_tiles

from benchmarks import registry

PEAK_FLOPS = 790e12  # bf16 dense matrix products, H200 (measured ceiling)
PEAK_BYTES = 4.3e12  # HBM copy bandwidth, H200 (measured ceiling)
SHAPE = registry.SHAPES["llama3-8b"] | {"w": registry.WINDOW}  # Llama-3-8B, Hedgehog, window 64
LENGTHS = (4096, 16384, 65536)
BF16, FP32 = 2, 4


def _tiles_streamed(block: int, w: int, G: int) -> tuple[float, float]:
    """Per packed query tile of a long sequence (block rows: block / G positions of each of the G heads of a KV
    head), on average over the tiles' alignments: the key tiles with some window term, and those with some LA term
    (the streamed span starts at the key tile at or before m0 - w + 1; a key tile past every query's window only has
    LA terms)."""
    soft = la = 0
    first = 64 * G  # tiles far from the start; G of them cover every alignment of m0 to the key tiles
    for i in range(first, first + G * block):
        m0, m1 = i * block // G, ((i + 1) * block - 1) // G
        lo = (m0 - w + 1) // block * block
        for kb in range(lo, m1 + 1, block):
            soft += kb + block - 1 > m0 - w
            la += kb <= m1 - w
    return soft / (G * block), la / (G * block)


def hybrid_kernels(T: int) -> dict[str, tuple[float, float]]:
    """FLOPs and bytes of each kernel launch of one forward + backward, hybrid mode. Query-side kernels run one
    program per packed tile (H * T / block of them, as many as unpacked tiles); key-side ones one per key tile and
    KV head, over the packed tiles that reach it."""
    H, Hkv, D, F, w = (SHAPE[k] for k in ("H", "Hkv", "D", "F", "w"))
    G = H // Hkv
    tiles = default_tiles(torch.device("cuda"), D, F, torch.bfloat16)
    B = tiles.block
    nm = T // B
    soft, la = _tiles_streamed(B, w, G)
    out = {}
    # forward
    fc = tiles.of("_states_fwd")[1]
    out["_states_fwd"] = (2 * T * F * D * Hkv, Hkv * (T * F * BF16 + (F // fc) * T * D * BF16 + nm * F * D * FP32))
    per_tile = 4 * B * B * D * soft + la * (2 * B * B * F + 2 * B * B * D) + 2 * B * F * D
    load = B * D * BF16 + soft * 2 * B * D * BF16 + la * (2 * B * F * BF16) + B * F * BF16 + F * D * FP32
    out["_fwd"] = (H * nm * per_tile, H * nm * (load + B * D * BF16 + 5 * B * FP32))
    # backward: delta (torch), the recomputed states, then the kernels
    out["delta (torch)"] = (2 * H * T * D, H * T * (2 * D * BF16 + FP32))
    out["_states_fwd (recompute)"] = out["_states_fwd"]
    per_tile = soft * (2 * B * B * D * 3) + 0
    load = 2 * B * D * BF16 + soft * 2 * B * D * BF16 + 3 * B * FP32
    out["_bwd_dq"] = (H * nm * per_tile, H * nm * (load + B * D * FP32 + B * FP32))
    fc = tiles.of("_bwd_dfq")[1]
    per_prog = la * (2 * B * B * D + 2 * B * B * fc) + 2 * B * fc * D
    load = B * D * BF16 + 2 * B * FP32 + la * (B * D * BF16 + B * fc * BF16) + fc * D * FP32
    out["_bwd_dfq"] = (H * nm * (F // fc) * per_prog, H * nm * (F // fc) * (load + B * fc * FP32))
    fc = tiles.of("_states_bwd")[1]
    out["_states_bwd"] = (
        2 * T * F * D * H,
        Hkv * (F // fc) * (G * T * (D * BF16 + 2 * FP32 + fc * BF16)) + Hkv * nm * F * D * FP32,
    )
    q_tiles = (B + w - 1) * G / B + 1  # packed query tiles that reach a key tile with window terms
    per_prog = q_tiles * (6 * B * B * D)
    load = 2 * B * D * BF16 + q_tiles * (2 * B * D * BF16 + 3 * B * FP32)
    out["_bwd_dkv (window)"] = (Hkv * nm * per_prog, Hkv * nm * (load + 2 * B * D * FP32))
    la_q = (B - 1) * G / B + 1  # packed query tiles whose streamed span holds a key tile, with LA terms in it
    per_prog = la_q * (2 * B * B * F + 2 * B * B * D) + 2 * B * F * D
    load = 2 * B * D * BF16 + la_q * (B * D * BF16 + 2 * B * F * BF16) + F * D * FP32 + B * F * BF16
    out["_bwd_dkv (LA)"] = (Hkv * nm * per_prog, Hkv * nm * (load + 2 * B * D * FP32))
    fc = tiles.of("_bwd_dfk")[1]
    per_prog = la_q * (2 * B * B * D + 2 * B * B * fc) + 2 * B * fc * D
    load = B * D * BF16 + la_q * (B * D * BF16 + B * fc * BF16 + 2 * B * FP32) + fc * D * FP32
    out["_bwd_dfk"] = (Hkv * nm * (F // fc) * per_prog, Hkv * nm * (F // fc) * (load + B * fc * FP32))
    return out


def seconds(flops: float, nbytes: float) -> float:
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)


def sdpa(T: int) -> tuple[float, float]:
    H, D = SHAPE["H"], SHAPE["D"]
    fwd = 2 * H * D * T * T
    return 3.5 * fwd, 4 * H * T * D * BF16 * 3  # fwd+bwd; q, k, v, o read/written a few times


def fla(T: int, chunk: int = 64) -> tuple[float, float]:
    H, D, F = SHAPE["H"], SHAPE["D"], SHAPE["F"]
    fwd = 2 * T * F * D * H * 2 + 2 * T * chunk * (F + D) * H
    states = (T // chunk) * F * D * FP32 * H
    io = H * T * (2 * F + 2 * D) * BF16
    return 3.5 * fwd, 3 * (io + 2 * states)


def table() -> str:
    lines = []
    for T in LENGTHS:
        ks = hybrid_kernels(T)
        lines += [
            f"### T = {T}",
            "",
            "| kernel | GFLOP | MB moved | bound | time bound (us) |",
            "|---|---:|---:|---|---:|",
        ]
        total = 0.0
        for name, (f, b) in ks.items():
            t = seconds(f, b)
            total += t
            bound = "compute" if f / PEAK_FLOPS >= b / PEAK_BYTES else "memory"
            lines.append(f"| `{name}` | {f / 1e9:.1f} | {b / 1e6:.0f} | {bound} | {t * 1e6:.0f} |")
        s, fl = seconds(*sdpa(T)), seconds(*fla(T))
        lines += [
            f"| **hybrid fwd+bwd, all kernels** | | | | **{total * 1e6:.0f}** |",
            f"| SDPA causal fwd+bwd (FlashAttention) | {sdpa(T)[0] / 1e9:.0f} | | compute | {s * 1e6:.0f} |",
            f"| fla chunk_linear_attn fwd+bwd | {fla(T)[0] / 1e9:.0f} | {fla(T)[1] / 1e6:.0f} | | {fl * 1e6:.0f} |",
            "",
            f"Bound ratios at T = {T}: SDPA / hybrid = {s / total:.2f}x, hybrid / fla = {total / fl:.2f}x.",
            "",
        ]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the page here (markdown)")


def run(args) -> int:
    text = table()
    print(text)
    if args.out:
        args.out.write_text(
            "# Kernel speed: a roofline estimate (no GPU has measured the kernels yet)\n\n"
            "Made by `python -m benchmarks.run roofline --out docs/results/kernel_roofline.md`. "
            + __doc__.split("\n\n")[1].replace("\n", " ")
            + "\n\n"
            + text
            + "\n\nWhat only a GPU can measure: the real times (these are lower bounds at peak), the L2 hit rate that "
            "makes re-read tiles cheaper than counted here, whether wgmma is used where the compile table says "
            "mma.sync, and the occupancy the register counts allow. `python -m benchmarks.run kernels` measures "
            "them (kernel_speed.md).\n"
        )
    return 0
