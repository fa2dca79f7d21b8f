"""The launch settings of the chunked kernels: on a GPU per architecture and head dim (`GPU_SETTINGS[(arch,
head_dim)]`, arch 80 or 90, head dim 64 or 128; the compile gate tools/kernel_compile.py checks each architecture
against its own, and benchmarks/device's DEVICE_SPEED_TILES times variants of them), and small fast ones for
Triton's interpreter (CPU tensors, the tests).

`settings_for` picks the entry of the call's device: sm_90's on a GPU of compute capability 9.x (H100, H200), sm_80's
on any other GPU (the A100's; the gate checks them against sm_80's 163 KiB of shared memory, not the 99 KiB of
sm_86 / sm_89, and compiles nothing for sm_100), and on the meta device, which stands for a GPU in the compile gate
and the cost model, the architecture ARCH_OFF_GPU names (`standing_for` sets it for a block).

A setting for a new kernel goes into SM80's two entries and INTERPRETER: sm_90 takes it as it is unless SM90 gives
its own value (tests/unit/test_kernel_compile.py checks that every entry has every key the kernels read).
"""

from __future__ import annotations

import contextlib

import torch

from .utils import pow2

ARCHS = (80, 90)
# The architecture the meta device stands for: an H100's / H200's, as the cost model (benchmarks/attention/
# roofline.py, planned for 132 SMs) counts them; the compile gate sets each of ARCHS in turn (`standing_for`)
ARCH_OFF_GPU = 90

# sm_80 (A100), half precision, by head dim (<= 64, <= 128), and the base of sm_90's (SM90 below): _chunk_states'
# feature and value blocks and warps; _chunk_output's head-dim chunk of the q.k products, feature chunk, warps and
# pipeline stages. Found with tools/kernel_compile.py at the presets'
# shapes, every mode, bf16 and fp16: 4 warps (one warpgroup on the 64 rows; with 8, Triton's layouts replicate the
# rows or the operands and spill), one stage (2 spilled on sm_80 at head dim 128), head-dim chunks of 32 at 128 (64
# spilled 60-300 bytes: a [64, 64] q operand in registers) and 16 at 64 (64 and 32 spilled 8-16 bytes on sm_80).
# The backward's (ChunkAttention), found the same way (tools/kernel_compile.py, and a script that compiles only
# the backward's launches): head-dim chunks of 16 (bwd_dchunk: at 32 the operands of mma.sync's B, whole in every warp
# on sm_80, spilled 40-160 bytes), feature chunks of 16 (bwd_fchunk: 32 spilled 40-160 bytes in dq with the sinks),
# and maxnreg=255 (ptxas otherwise caps some at 128-160 registers and spills, as in decode.py).
# The key side (issue 67: one _chunk_bwd_dkv program per KV head and key chunk over the whole head and feature dims,
# its accumulators dk, dv [64, D] and dphi_k^T [F, 64] in fp32: 128 registers a thread at head dim 128 and 8 warps):
# 8 warps (dkv_warps; 4 spilled 2-4 KB at head dim 128), query blocks of 16 rows (dkv_qblock; 32 spilled 60-272
# bytes on sm_80 and 84 on sm_90 in the hybrid), head-dim chunks of 32 for the scores, dp and the state's dphi_k
# (dkv_dchunk; 64 spilled 16-128 bytes at head dim 128) and feature chunks of 32 for phi_q phi_k^T and the state's
# dv (dkv_fchunk; 64 spilled 24-100 bytes on sm_80 at 128; 16 with head-dim chunks of 16 also spill none), maxnreg
# 255. Every backward kernel then uses 0 spill bytes in bf16 and fp16 on sm_80 and sm_90 at every preset's shapes,
# windows and odd lengths, every mode, with wgmma on sm_90 (tools/kernel_compile.py's launches, the backward's only;
# Triton 3.9; 3.6 not checked: its wheel was not here).
# The state scan split over the sequence (chunk_h.py, its segments' sums stored) spilled 8 bytes at 96 registers
# on sm_80 in bf16 without decay; maxnreg=128 (state_maxnreg) lets it use 127 and spill none.
# Issue 60 (the gate compiles what the wrappers launch under the project's Triton and the device image's 3.6, at the
# shipped windows and at lengths off the chunk): 8 warps for _chunk_output at head dim 128 (4 spilled 12-136 bytes on
# sm_80 with the denominators or the sinks; 8 use 150-210 registers, wgmma on sm_90), dk and dv of _chunk_bwd_dkv in
# one launch over head-dim blocks of 32 (since replaced by the key side above), 8 warps for the reverse scan
# _chunk_dstates with a register cap of 255 (4 warps spilled 24 bytes on sm_80 at 168 registers with the decay; 8
# warps, 24-32 bytes at 128 in fp16 under 3.6), and 8 warps for _chunk_bwd_dq (4 spilled 8 bytes on sm_80 at T = 100
# with the sinks and the decay).
# Head and feature dims as constexprs (static loop bounds): _chunk_states, _chunk_dstates and _decode
# (its ring length too) take them with no spill under triton 3.9 and 3.6; _chunk_output with them spilled 8-136 bytes
# on sm_80 under both (81 and 114 compiles, head dim 64 mostly; 8 warps there cured 3.6's at 64 but not the fp32
# launches' at 128), _chunk_bwd_dq and _chunk_bwd_dkv 12-168 bytes under 3.9: those three keep runtime dims.
# Issue 67 (the reverse scan split over the sequence as the forward's, which pays only where two of its programs fit
# on an SM): _chunk_dstates with phi_q loaded transposed (no tl.trans) and 4 warps under the cap of 255 uses 175-229
# registers unsplit and 190-254 split on sm_80 and sm_90, bf16 and fp16, no spill: two programs per SM (8 warps used
# 159-244, one per SM). 4 warps under a cap of 168 (three per SM) spilled 16-492 bytes with the decay.
# The reverse scan's tiles have keys of their own (dstates_block_f, dstates_block_dv; the forward scan's are block_f,
# block_dv): on sm_90, [64, 128] in 8 warps also compiled with no spill for both scans (llama3-8b, hybrid, la_only and
# hybrid+sinks+decay, bf16 and fp16, triton 3.9) and reads phi_q once instead of four times, but gives `plan` a
# quarter of the programs, so it cuts the scans into 7 segments, not 3: the fixes then move 165 MB, not 97, and the
# chains run on 224 programs, not 384 (benchmarks/attention/roofline.py: 1624 against 1800 MB at 4k before rho's
# lag share moved into the reverse scan, 1569 against 1731 after). A device decides: DEVICE_SPEED_TILES' `scan`
# variant times it. With that share in it, the reverse scan's [64, 128] spills 24 bytes with the decay under triton
# 3.9 (none under 3.6, the device image's; llama3-8b, bf16 and fp16). [128, 128] spilled 48-456 bytes in 8 and 16 warps.
# rho's share through a query's lag on its state, moved from _chunk_bwd_dq into _chunk_dstates (a second product and
# accumulator there), left sm_80's [64, 32] reverse-scan tiles at the edge in 4 warps: 16-32 bytes of spills in some
# launches under one Triton or the other, whichever of two equivalent forms of the sum; 8 warps capped at 128
# registers spilled 24-384. [32, 32] in 4 warps spills none under either (llama3-8b and smollm2-135m, hybrid,
# hybrid+decay, hybrid+sinks+decay, bf16, fp16, fp32; the gate for the rest): twice the programs (256 at Llama-3-8B's
# shape, so `plan` leaves the scan whole and no fix runs) reading dy twice as often. sm_90 kept [64, 32] (below).
# sm_90's reverse scan then took [64, 128] in 8 warps (SM90: dstates_block_dv=128, dstates_warps=8): it reads phi_q
# once, not four times (260 -> 67 MB at 4k), dy four times as before. It spills none (llama3-8b, smollm2-135m, every
# mode, bf16 and fp16, under 3.9 and 3.6; the gate for the rest) since rho's share through the later segments' carries
# is taken in _dstates_fix from the states themselves: the states' weighted sum the scan had kept for it, a third
# [64, 128] fp32 tile, spilled 24 bytes under 3.9 with the decay ([128, 64] in 8 warps: 96 bytes in fp16; [64, 128]
# in 16 warps under a cap of 128: 5424 bytes; phi_q, not do, scaled by the lag: 1608 bytes under 3.9). One program
# an SM: `plan` keeps the split to one wave (chunk_h.resident; 4 segments of 32 programs at Llama-3-8B's shape, 16
# states each). DEVICE_SPEED_TILES' `rscan32` times the former [64, 32] in 4 warps against it.
# fold: 1 lets _chunk_output and _chunk_bwd_dq fold the query heads of a KV head into one program where the grid
# still fills the SMs (chunk_h.fold; 0: one head a program, the `unfolded` variant, to time what folding gains).
SM80 = {
    64: dict(block_f=64, block_dv=32, state_warps=4, dchunk=16, fchunk=32, warps=4, stages=1, dq_warps=8, dkv_warps=8,
             bwd_dchunk=16, bwd_fchunk=16, dkv_fchunk=32, dkv_dchunk=32, dkv_qblock=16, dq_maxnreg=255,
             dkv_maxnreg=255, state_maxnreg=128, dstates_warps=4, dstates_maxnreg=255, dstates_block_f=32,
             dstates_block_dv=32, fold=1),
    128: dict(block_f=64, block_dv=32, state_warps=4, dchunk=32, fchunk=32, warps=8, stages=1, dq_warps=8, dkv_warps=8,
              bwd_dchunk=16, bwd_fchunk=32, dkv_fchunk=32, dkv_dchunk=32, dkv_qblock=16, dq_maxnreg=255,
              dkv_maxnreg=255, state_maxnreg=128, dstates_warps=4, dstates_maxnreg=255, dstates_block_f=32,
              dstates_block_dv=32, fold=1),
}  # fmt: skip
# sm_90 (H100, H200), where it differs from sm_80's (issue 67: sm_80's spill limits had set sm_90's tiles). Found with
# tools/kernel_compile.py --archs 90 at llama3-8b's shapes in every mode, bf16 and fp16 (the forward under triton 3.9,
# the backward under 3.9 and 3.6), and at smollm2-135m's in hybrid+sinks+decay under 3.9; the whole gate (make
# kernel-compile, kernel-compile-triton36) decides. The forward's q.k over head-dim chunks of 64 (whole at head dim
# 64) in 2 pipeline stages (at 128: 180-205 registers, 32 KiB of shared memory; whole-D chunks of 128 also compiled
# with no spill in hybrid+sinks+decay, 199-236 registers, and chunks of 64 in 3 stages, 194-216: both are
# DEVICE_SPEED_TILES' alternatives), _chunk_bwd_dkv over head-dim blocks of 64 (half the recomputed scores of 32), and
# bwd_dchunk kept at 16: _chunk_bwd_dq, which shares it, spilled 8-12 bytes in fp16 with the sinks at 64 and 8 at 32
# (2 stages), and 40-60 bytes whole-D in every backward kernel; 16 warps let it fit at 64 in 214 registers per thread,
# which a block of 512 threads cannot hold.
# The key side (_chunk_bwd_dkv, one program per KV head and key chunk) replaced the head-dim blocks (bwd_dout) after
# these were found. With sm_80's tiles it spilled 12-28 bytes on sm_90 in the hybrid with the decay and no sinks at head
# dim 128 (llama3-8b's shapes, T = 100 and 4096, bf16 and fp16, under 3.9 and 3.6: the whole gate's first run over
# it); head-dim chunks of 16 for its scores, dp and dphi_k (dkv_dchunk) spill none on sm_90 in all 300 of its
# launches, every preset and mode, bf16 and fp16, under 3.9 and 3.6, with wgmma in each (tools/kernel_compile.py
# --archs 90 --kernels _chunk_bwd_dkv --settings "90/128:dkv_dchunk=16;90/64:dkv_dchunk=16").
# _chunk_bwd_dq at head dim 128 on sm_80 takes feature chunks of 32 (bwd_fchunk): with 16 it spilled 40 bytes under
# triton 3.6 in the hybrid with sinks, decay and an initial state in fp16 at T = 100 (the whole gate's first run over
# this kernel); 32 spills none in all 504 of its sm_80 launches under 3.9 and 3.6 (tools/kernel_compile.py --archs 80
# --kernels _chunk_bwd_dq --settings 80/128:bwd_fchunk=32). sm_90 keeps 16, which its gate rows were compiled with.
SM90 = {
    64: dict(dchunk=64, stages=2, dkv_dchunk=16, dstates_block_f=64, dstates_block_dv=128, dstates_warps=8),
    128: dict(
        dchunk=64, stages=2, dkv_dchunk=16, bwd_fchunk=16, dstates_block_f=64, dstates_block_dv=128, dstates_warps=8
    ),
}
GPU_SETTINGS = {(80, d): dict(SM80[d]) for d in SM80} | {(90, d): {**SM80[d], **SM90[d]} for d in SM80}


def interpreter(features: int) -> dict:
    """The settings in Triton's interpreter (CPU tensors, the tests): any tile works there, these are fast."""
    fchunk = min(pow2(features), 64)
    return dict(block_f=64, block_dv=64, state_warps=4, dchunk=32, fchunk=fchunk, warps=4, stages=1, dq_warps=4,
                dkv_warps=4, bwd_dchunk=32, bwd_fchunk=fchunk, dkv_fchunk=fchunk, dkv_dchunk=32, dkv_qblock=32,
                dstates_warps=4, dstates_block_f=64, dstates_block_dv=64, fold=1)  # fmt: skip


def arch_of(device: torch.device) -> int:
    """The architecture whose settings a call on `device` takes (the module's docstring): 90 on a GPU of compute
    capability 9.x, 80 on any other GPU, ARCH_OFF_GPU elsewhere (the meta device)."""
    if device.type == "cuda":
        return 90 if torch.cuda.get_device_capability(device)[0] == 9 else 80
    return ARCH_OFF_GPU


@contextlib.contextmanager
def standing_for(arch: int):
    """Within the block the meta device stands for sm_<arch> (the compile gate records each architecture's launches
    with its own settings)."""
    global ARCH_OFF_GPU
    if arch not in ARCHS:
        raise ValueError(f"no settings for sm_{arch}; architectures: {', '.join(f'sm_{a}' for a in ARCHS)}")
    before, ARCH_OFF_GPU = ARCH_OFF_GPU, arch
    try:
        yield
    finally:
        ARCH_OFF_GPU = before


def settings_for(x: torch.Tensor, head_dim: int, features: int) -> dict:
    """The settings of a call on x's device: the interpreter's on CPU, else GPU_SETTINGS' entry for the device's
    architecture (arch_of) and the head dim (<= 64, <= 128). The entry itself, not a copy: a patch of it (the
    device benchmark's tile variants) reaches the kernels."""
    if x.device.type == "cpu":
        return interpreter(features)
    return GPU_SETTINGS[(arch_of(x.device), 64 if head_dim <= 64 else 128)]


def regs(cfg: dict, kernel: str) -> dict:
    """The register cap (maxnreg) of a kernel (a backward one, or the state scan) where its settings name one."""
    cap = cfg.get(kernel + "_maxnreg")
    return {"maxnreg": cap} if cap else {}
