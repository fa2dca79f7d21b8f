"""What every kernel file shares, defined once: the modes, EPS, the dtype map, and the jit helpers that the forward
and the backward both call (so the backward recomputes exactly what the forward computes)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-12  # must equal hybrid_scale.attention.window.naive.EPS (checked by the tests)
TL_EPS = tl.constexpr(EPS)
CHUNK = 64  # tokens per chunk: every 2D tile of the chunked kernels is [CHUNK, CHUNK] or [CHUNK, a head-dim block]

# mode -> (window softmax, linear attention, sinks, gamma used)
MODE_PARTS = {
    "hybrid": (True, True, False, True),
    "swa_only": (True, False, False, False),
    "swa_sinks": (True, False, True, False),
    "la_only": (False, True, False, False),
    "sinks_only": (False, False, True, False),
}
MODES = (*MODE_PARTS, "none")
TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def mode_parts(mode: str, hybrid_sinks: bool) -> tuple[bool, bool, bool, bool]:
    """(window softmax, linear attention, sinks, gamma used) of a mode; the hybrid with its sinks adds them."""
    soft, lin, sink, hybrid = MODE_PARTS[mode]
    return soft, lin, sink or (mode == "hybrid" and bool(hybrid_sinks)), hybrid


def pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(x)))


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: half inputs on the tensor cores (and the fp32 state dots in tf32, exact for values
    that came from half); fp32 inputs (Triton's interpreter only: see chunk.py) in IEEE fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def blocks_back(window: int, soft: bool, decay: bool) -> int:
    """NB: how many chunks before its own a query chunk streams. Query n of chunk c has its window keys (n - w, n] in
    chunks c - NB .. c with NB = ceil(w / CHUNK), and every key before chunk c - NB has left every window of the chunk
    (it is at most CHUNK (c - NB) - 1 <= n - w - 1): those come from the state. la_only without a decay has no window
    (every key weighs 1), and streams one chunk back."""
    return max(1, -(-int(window) // CHUNK)) if (soft or decay) else 1


@triton.jit
def scores(Q, K, q_row, q_ok, k_row, k_ok, D, BLOCK_DK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
           DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """q . k [ROWS, COLS] (unscaled, fp32) of query rows q_row and key rows k_row (int64 row numbers of [rows, D]
    tensors), the head dim walked in chunks of BLOCK_DK (small operand tiles: no [ROWS, D] q stays in registers)."""
    a = tl.zeros([ROWS, COLS], tl.float32)
    for d0 in range(0, D, BLOCK_DK):
        od = d0 + tl.arange(0, BLOCK_DK)
        dm = od < D
        q = tl.load(Q + q_row[:, None] * D + od[None, :], mask=q_ok[:, None] & dm[None, :], other=0.0)
        k = tl.load(K + k_row[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
        a += tl.dot(q.to(DT), tl.trans(k.to(DT)), input_precision=PREC)
    return a


@triton.jit
def argmax_update(a, j, m, arg):
    """The argmax of the row max after the scores a [rows, cols] of keys j [cols], given the max m and argmax arg so
    far: a block's first key at its max, where that max exceeds m (the earlier key wins a tie)."""
    bm = tl.max(a, 1)
    bi = tl.min(tl.where(a == bm[:, None], j[None, :], 2147483647), 1)
    return tl.where(bm > m, bi, arg)


@triton.jit
def state_lag(rho, n, window, st, CHUNK: tl.constexpr):
    """alpha^(n - window - (CHUNK st - 1)): how query n sees the state st, kept as its last key CHUNK st - 1 sees it
    (the initial state is state 0, kept as key -1 sees it)."""
    return tl.exp(-rho * tl.maximum(n - window - (st * CHUNK - 1), 0).to(tl.float32))


def options(opts, given: dict):
    """The call's settings: an AttentionOptions of hybrid_scale's attention package (read by attribute: this package
    imports none of it), or a clear error for a call in the keyword contract that came before it."""
    if given or opts is None or not hasattr(opts, "window"):
        raise TypeError(
            "the triton backend takes the call's settings as one AttentionOptions (hybrid_scale.attention.options) "
            f"after gamma, got {type(opts).__name__} and keywords {sorted(given)}: call it with AttentionOptions("
            "window=..., ...); an export made before it runs on attention.backend=torch"
        )
    return opts
