"""The jit helpers every kernel of hybrid_attention.py shares, so that the backward recomputes exactly what the
forward computes: products (_dot), the spans and packed tiles of a program (_span, _packed, _query_tile, _key tiles),
column and row loads and stores, the LA state and scores (_state, _la_scores), the online softmax (_online), gamma,
the LA's decay (_rho, _decayed, _ref, _lag); and the modes (MODE_PARTS) and EPS the kernels and the wrapper read.
"""

from __future__ import annotations

import triton
import triton.language as tl

EPS = 1e-12  # must equal hybrid_scale.attention.naive.EPS (checked by the tests)
_EPS = tl.constexpr(EPS)

# mode -> (window softmax, linear attention, sinks, gamma used)
MODE_PARTS = {
    "hybrid": (True, True, False, True),
    "swa_only": (True, False, False, False),
    "swa_sinks": (True, False, True, False),
    "la_only": (False, True, False, False),
    "sinks_only": (False, False, True, False),
}
MODES = (*MODE_PARTS, "none")


def mode_parts(mode: str, hybrid_sinks: bool) -> tuple[bool, bool, bool, bool]:
    """(window softmax, linear attention, sinks, gamma used) of a mode; the hybrid with its sinks adds them."""
    soft, lin, sink, hybrid = MODE_PARTS[mode]
    return soft, lin, sink or (mode == "hybrid" and bool(hybrid_sinks)), hybrid


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _span(first, start, end, BLOCK: tl.constexpr):
    """Token indices first..first+BLOCK-1, their real-token index, and whether they are real tokens."""
    idx = first + tl.arange(0, BLOCK)
    return idx, idx - start, (idx >= start) & (idx < end)


@triton.jit
def _cols(PTR, row, ok, width, c0, BLOCK_C: tl.constexpr):
    """Columns c0..c0+BLOCK_C-1 of rows `row` (int64 row numbers of a [rows, width] tensor), 0 where not ok."""
    o = c0 + tl.arange(0, BLOCK_C)
    return tl.load(PTR + row[:, None] * width + o[None, :], mask=ok[:, None] & (o < width)[None, :], other=0.0)


@triton.jit
def _store_cols(PTR, row, ok, width, c0, x, BLOCK_C: tl.constexpr):
    o = c0 + tl.arange(0, BLOCK_C)
    tl.store(
        PTR + row[:, None] * width + o[None, :], x.to(PTR.dtype.element_ty), mask=ok[:, None] & (o < width)[None, :]
    )


@triton.jit
def _rows(PTR, row, ok, width, BLOCK_W: tl.constexpr):
    return _cols(PTR, row, ok, width, 0, BLOCK_W)


@triton.jit
def _store_rows(PTR, row, ok, width, x, BLOCK_W: tl.constexpr):
    _store_cols(PTR, row, ok, width, 0, x, BLOCK_W)


@triton.jit
def _state(STATE_KV, STATE_K, st, F, D, f0, BLOCK_FC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Features f0..f0+BLOCK_FC-1 of the fp32 LA state number st: kv [BLOCK_FC, BLOCK_D] and k [BLOCK_FC]."""
    of = f0 + tl.arange(0, BLOCK_FC)
    kv = _rows(STATE_KV + st * F * D, of.to(tl.int64), of < F, D, BLOCK_D)
    return kv, tl.load(STATE_K + st * F + of, mask=of < F, other=0.0)


@triton.jit
def _la_scores(FQ, FK, q_row, row_ok, k_row, k_ok, F, BLOCK: tl.constexpr, BLOCK_FC: tl.constexpr,
               DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """phi_q . phi_k of a query tile and a key tile, summed over feature chunks (no [BLOCK, F] tile stays live)."""
    s = tl.zeros([BLOCK, BLOCK], tl.float32)
    for f0 in range(0, F, BLOCK_FC):
        s += _dot(
            _cols(FQ, q_row, row_ok, F, f0, BLOCK_FC), tl.trans(_cols(FK, k_row, k_ok, F, f0, BLOCK_FC)), DT, PREC
        )
    return s


@triton.jit
def _online(m_i, num, den, a, v, DT: tl.constexpr, PREC: tl.constexpr):
    """One step of the online softmax: scores a (-inf where masked) and values v join the running max, numerator
    and denominator."""
    m_new = tl.maximum(m_i, tl.max(a, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(a - m_safe[:, None])
    return m_new, num * alpha[:, None] + _dot(p, v, DT, PREC), den * alpha + tl.sum(p, 1)


@triton.jit
def _packed(i, b, hk, start, end, T, H, G, BLOCK: tl.constexpr):
    """Packed tile i of the (position, query head) pairs of KV head hk's G query heads, position-major (the G heads
    of a position are adjacent rows; GQA: every key, value, phi_k and state tile is read once for the whole group):
    each row's query head, position, real-token index, whether it is a real token, and row number in [B * H * T];
    the tile's first and last position."""
    p = i * BLOCK + tl.arange(0, BLOCK)
    pos = p // G
    head = hk * G + p % G
    q_row = (b * H + head).to(tl.int64) * T + pos
    return head, pos, pos - start, (pos >= start) & (pos < end), q_row, i * BLOCK // G, ((i + 1) * BLOCK - 1) // G


@triton.jit
def _query_tile(START, END, T, H, G, BLOCK: tl.constexpr):
    """This program's packed query tile (grid axis 0, `_packed`) of batch x KV head (axis 1): each row's head, the
    first row of the KV head's keys, the batch row's real span, the tile's first and last position, each row's
    position, real-token index, whether it is real, and row number in [B * H * T]."""
    pid_bkv = tl.program_id(1)
    b, hk = pid_bkv // (H // G), pid_bkv % (H // G)
    start, end = tl.load(START + b), tl.load(END + b)
    head, rows, n, row_ok, q_row, m0, m1 = _packed(tl.program_id(0), b, hk, start, end, T, H, G, BLOCK)
    return head, pid_bkv.to(tl.int64) * T, start, end, m0, m1, rows, n, row_ok, q_row


@triton.jit
def _gammas(GAMMA, head, HYBRID: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's gamma (its head's; 1 unless the hybrid)."""
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = tl.full([BLOCK], 1.0, tl.float32)
    return g


@triton.jit
def _rho(RHO, hk):
    """The LA's decay rate rho >= 0 of KV head hk (alpha = exp(-rho))."""
    return tl.load(RHO + hk).to(tl.float32)


@triton.jit
def _decayed(s, rho, n, j, window):
    """L terms s [queries, keys] of queries n and keys j (real indices) times alpha^max(0, n - w - j): a key that has
    left the query's window by d counts alpha^d, one inside it (la_only) 1. The exponent is clamped at 0 everywhere,
    so masked entries (0) never meet an overflow."""
    return s * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))


@triton.jit
def _ref(st, start, BLOCK: tl.constexpr):
    """The token position the decayed LA state number st is kept for: its keys j count alpha^(ref - j). The state of
    the keys before block st is kept as its last key sees it; one before the first real token (the initial state
    only) as token start - 1 sees it, which is how an initial state is given (as query w - 1 of the sequence sees
    it). Never below a real key of the state, so no weight exceeds 1."""
    return tl.maximum(st * BLOCK, start) - 1


@triton.jit
def _lag(rho, rows, offset):
    """alpha^max(0, rows - offset) per row: how a query (or a key) at token position `rows` sees a state kept for
    position offset - w (the caller adds the window)."""
    return tl.exp(-rho * tl.maximum(rows - offset, 0).to(tl.float32))
