"""A prefill forward with flash-linear-attention's chunk structure (a state scan, then one output kernel per chunk),
for inference: no autograd, no denominators, no padding, no initial state, window <= 64.

Positions are cut into chunks of CHUNK = 64 tokens. With a window w <= 64, query n of chunk c (n in [64c, 64c + 64))
finds its window keys (n - w, n] in chunks c - 1 and c, and every key before chunk c - 1 has left its window (it is
at most 64c - 65 <= n - w - 1). So one program of `_chunk_output` needs the 128 keys of chunks c - 1 and c, the
sinks, and the LA state of the keys before chunk c - 1; `_chunk_states` makes those states. This is the structure of
fla's `chunk_h` (a scan over chunks per head and state block) and `chunk_o` (one program per chunk: the state term
plus masked intra-chunk terms), with two changes: the intra part reaches one chunk back (the window), and the softmax
of the window shares the LA's normaliser (docs/design.md section 2, hybrid_scale/attention/naive.py):

    y_n = (gamma sum_{W(n) u S(n)} E_nj v_j + sum_{P(n) \\ S(n)} L_nj v_j) / (gamma sum E_nj + sum L_nj + EPS)

with E_nj = exp(s q_n.k_j - c_n), c_n the exact max over the row's real window (and sink) keys, and L_nj =
phi_q(q_n).phi_k(k_j) alpha^max(0, n - w - j) (alpha = exp(-rho) of the KV head; 1 without a decay).

- `_chunk_states`, one program per (feature block, value block, batch x KV head): walks the chunks in order and
  stores, before adding chunk c, h_c = sum over the LA keys j < 64c of alpha^(64c - 1 - j) phi_k(k_j) v_j^T [F, D] and
  z_c the same sum of phi_k(k_j) [F] (kept as key 64c - 1 sees them: every weight alpha^(>= 0), the carry from one
  chunk to the next one multiply by alpha^64). The hybrid with its own sinks leaves the first S keys out. The
  products are tl.dot of [64 features, 64 keys] x [64 keys, BLOCK_DV values] with fp32 accumulation in registers;
  h is stored in bf16 for bf16 inputs, fp32 otherwise (fp16's range is too small for a sum over the sequence), z in
  fp32 (1/D of h's bytes, and it is the whole LA normaliser). Splitting the features and the values over programs
  gives (F / 64) (D / 32) B Hkv programs: 128 at Llama-3-8B's shape, batch 1.
- `_chunk_output`, one program per (batch x query head, chunk): 64 query rows against the keys of chunks c - 1 and c,
  one 64-key block at a time, in two passes. The first finds c_n, the exact max of the row's window scores s q.k
  (and of its sink scores: one separate tile of the first S keys, those that have left the window, or all of them
  for sinks_only). The second recomputes the scores of each block and sums, in one [64, 64] tile, gamma E on the
  window keys and L = phi_q phi_k^T (masked, decayed) on the LA keys (they never share a key), then multiplies it by
  the block's values; the LA keys before chunk c - 1 come from phi_q h_{c-1}, times alpha^(n - w - (64c - 65)) as
  query n sees a state kept for key 64c - 65. The row sums of gamma E and L make the one normaliser. (Recomputing
  q.k costs about a sixth more products than keeping the [64, 128] score tile of both chunks, which spilled.)

A query head reads its KV head's keys, values, phi_k and state (GQA); the query heads of a KV head are adjacent
programs, so they read the same tiles from L2. Every product is a tl.dot with 64 rows (wgmma on sm_90 in half
precision). Modes: hybrid (with or without its sinks), swa_only, swa_sinks, la_only, sinks_only, none; bf16 and
fp16 on a GPU (fp32 in Triton's interpreter only: its FMA products spill kilobytes at 64-row tiles). The caller
(`triton_hybrid_attention`, when nothing needs a gradient) falls back to the fused forward of hybrid_attention.py
for anything `chunk_prefill` does not take (it returns None).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .jit_helpers import _EPS, MODE_PARTS

CHUNK = 64  # tokens per chunk; also the largest window taken (the window keys lie in this chunk and the previous one)
_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _chunk_states(
    FK, V, RHO,  # inputs: phi_k [B, Hkv, T, F], v [B, Hkv, T, D], rho [Hkv]
    HKV, HK,  # outputs: h [B, Hkv, NS, F, D] (bf16 or fp32), z [B, Hkv, NS, F] (fp32)
    T, F, D, NS, Hkv, n_excl,
    DECAY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """The LA state before each of the chunks 0..NS-1, one program per (feature block, value block, batch x KV head):
    h_c[f, d] = sum over keys n_excl <= j < c CHUNK of alpha^(c CHUNK - 1 - j) phi_k(k_j)[f] v_j[d], and z_c[f] the
    same sum of phi_k(k_j)[f] (only the programs of the first value block store z). n_excl = S when the hybrid has its
    own sinks (the LA leaves them out), else 0; alpha = exp(-rho) of the KV head (DECAY), else 1. Each chunk adds one
    product phi_k^T [BLOCK_F, CHUNK] x v [CHUNK, BLOCK_DV] in DT with fp32 accumulation; the state goes to memory in
    HKV's dtype."""
    f0 = tl.program_id(0) * BLOCK_F
    d0 = tl.program_id(1) * BLOCK_DV
    pid_bh = tl.program_id(2)
    base = pid_bh.to(tl.int64)
    of = f0 + tl.arange(0, BLOCK_F)
    od = d0 + tl.arange(0, BLOCK_DV)
    both = (of < F)[:, None] & (od < D)[None, :]
    z_lim = tl.where(tl.program_id(1) == 0, F, 0)  # (z: stored by the first value block's programs only)
    h = tl.zeros([BLOCK_F, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_F], tl.float32)
    if DECAY:
        rho = tl.load(RHO + pid_bh % Hkv).to(tl.float32)
        carry = tl.exp(-rho * CHUNK)
    for c in range(0, NS):
        st = base * NS + c
        tl.store(HKV + (st * F + of)[:, None] * D + od[None, :], h.to(HKV.dtype.element_ty), mask=both)
        tl.store(HK + st * F + of, z, mask=of < z_lim)
        j = c * CHUNK + tl.arange(0, CHUNK)
        ok = (j >= n_excl) & (j < T)
        row = base * T + j
        fk = tl.load(FK + row[:, None] * F + of[None, :], mask=ok[:, None] & (of < F)[None, :], other=0.0)
        v = tl.load(V + row[:, None] * D + od[None, :], mask=ok[:, None] & (od < D)[None, :], other=0.0)
        if DECAY:  # carried to key (c + 1) CHUNK - 1, and chunk c's keys as that key sees them
            fk = fk.to(tl.float32) * tl.exp(-rho * ((c + 1) * CHUNK - 1 - j).to(tl.float32))[:, None]
            h = h * carry
            z = z * carry
        h += tl.dot(tl.trans(fk.to(DT)), v.to(DT), input_precision=PREC)
        z += tl.sum(fk.to(tl.float32), 0)


@triton.jit
def _scores(Q, K, q_row, q_ok, k_row, k_ok, D, BLOCK_DK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
            DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """q . k [ROWS, COLS] (unscaled, fp32) of query rows q_row and key rows k_ok (int64 row numbers of [rows, D]
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
def _chunk_output(
    Q, K, V, FQ, FK, GAMMA, RHO, HKV, HK,  # inputs (HKV, HK: _chunk_states' states)
    Y,  # output [B, H, T, D] in q's dtype
    T, H, G, D, F, NS, window, lin_off, sink_off, n_sinks, n_excl, scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_FC: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFT: tl.constexpr, LIN: tl.constexpr, SINKS: tl.constexpr, HYBRID: tl.constexpr, DECAY: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """y of the CHUNK queries n of chunk c (grid axis 1) of one query head (axis 0: batch x H), window <= CHUNK.

    The keys j of chunks c - 1 and c (from lo = max(c - 1, 0) CHUNK), a CHUNK-key block at a time:
      E terms (SOFT): n - window < j <= n, scores s q.k; c_n their exact row max, with the sink terms' (a first pass
        over the blocks finds it, the second recomputes the scores: no [CHUNK, 2 CHUNK] tile stays live);
      sink terms (SINKS): the keys j < n_sinks with j <= n - sink_off, from one tile of the first BLOCK_S keys;
      L terms (LIN): n_excl <= j <= n - lin_off, phi_q.phi_k alpha^max(0, n - window - j) (phi_q phi_k^T summed over
        feature chunks of BLOCK_FC), and the state h_{c-1} of every key before lo (all in the row's LA, none a sink
        of the hybrid), which query n sees times alpha^(n - window - (lo - 1));
      y_n = (g sum E v + sum L v) / (g sum E + sum L + EPS), g = gamma of the head in the hybrid (HYBRID), else 1.
    Per key block, g E and L (they never share a key) are one [CHUNK, CHUNK] tile and one product with v."""
    pid_bh = tl.program_id(0)
    c = tl.program_id(1)
    head = pid_bh % H
    bk = (pid_bh // H) * (H // G) + head // G  # batch x KV head
    kv_base = bk.to(tl.int64) * T  # its first row in [B * Hkv * T]
    q_base = pid_bh.to(tl.int64) * T
    n = c * CHUNK + tl.arange(0, CHUNK)  # query positions
    row_ok = n < T
    lo = tl.maximum(c - 1, 0) * CHUNK
    hi = tl.minimum((c + 1) * CHUNK, T)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    num = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    den = tl.zeros([CHUNK], tl.float32)
    if LIN:
        rho = 0.0
        if DECAY:
            rho = tl.load(RHO + head // G).to(tl.float32)
        if c >= 2:  # the state of the keys before lo = (c - 1) CHUNK: h_{c-1} (h_0 is empty)
            st = bk.to(tl.int64) * NS + c - 1
            for f0 in range(0, F, BLOCK_FC):
                of = f0 + tl.arange(0, BLOCK_FC)
                fm = of < F
                fq = tl.load(FQ + (q_base + n)[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                             other=0.0)  # fmt: skip
                h = tl.load(HKV + (st * F + of)[:, None] * D + od[None, :], mask=fm[:, None] & dm[None, :], other=0.0)
                if HKV.dtype.element_ty == DT:
                    num += tl.dot(fq.to(DT), h, input_precision=PREC)
                else:  # (fp32 state, half inputs: tf32)
                    num += tl.dot(fq.to(tl.float32), h, input_precision=PREC)
                z = tl.load(HK + st * F + of, mask=fm, other=0.0)
                den += tl.sum(fq.to(tl.float32) * z[None, :], 1)
            if DECAY:
                lag = tl.exp(-rho * tl.maximum(n - window - (lo - 1), 0).to(tl.float32))
                num = num * lag[:, None]
                den = den * lag
    if HYBRID:
        g = tl.load(GAMMA + head).to(tl.float32)
    else:
        g = 1.0
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    if SOFT:  # the first pass: the exact row max over the window
        for kb in range(lo, hi, CHUNK):
            j = kb + tl.arange(0, CHUNK)
            a = _scores(Q, K, q_base + n, row_ok, kv_base + j, j < T, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
            a = tl.where((j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window), a, float("-inf"))
            m = tl.maximum(m, tl.max(a, 1))
    if SINKS:
        js = tl.arange(0, BLOCK_S)
        s_ok = (js < n_sinks) & (js < T)
        a_s = _scores(Q, K, q_base + n, row_ok, kv_base + js, s_ok, D, BLOCK_DK, CHUNK, BLOCK_S, DT, PREC) * scale
        a_s = tl.where(s_ok[None, :] & (js[None, :] <= n[:, None] - sink_off), a_s, float("-inf"))
        m = tl.maximum(m, tl.max(a_s, 1))
        m = tl.where(m == float("-inf"), 0.0, m)  # (rows without an E term: past T)
        p_s = g * tl.exp(a_s - m[:, None])
        vs = tl.load(V + (kv_base + js)[:, None] * D + od[None, :], mask=s_ok[:, None] & dm[None, :], other=0.0)
        num += tl.dot(p_s.to(DT), vs.to(DT), input_precision=PREC)
        den += tl.sum(p_s, 1)
    else:
        m = tl.where(m == float("-inf"), 0.0, m)  # (rows without an E term: la_only, and rows past T)
    if SOFT or LIN:  # the second pass: g E + L per key block, times v
        for kb in range(lo, hi, CHUNK):
            j = kb + tl.arange(0, CHUNK)
            k_ok = j < T
            p = tl.zeros([CHUNK, CHUNK], tl.float32)
            if LIN:
                s = tl.zeros([CHUNK, CHUNK], tl.float32)
                for f0 in range(0, F, BLOCK_FC):
                    of = f0 + tl.arange(0, BLOCK_FC)
                    fm = of < F
                    fq = tl.load(FQ + (q_base + n)[:, None] * F + of[None, :], mask=row_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    fk = tl.load(FK + (kv_base + j)[:, None] * F + of[None, :], mask=k_ok[:, None] & fm[None, :],
                                 other=0.0)  # fmt: skip
                    s += tl.dot(fq.to(DT), tl.trans(fk.to(DT)), input_precision=PREC)
                lin = (j[None, :] <= n[:, None] - lin_off) & (j[None, :] >= n_excl)  # (n_excl >= 0)
                if DECAY:
                    s = s * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))
                p = tl.where(lin, s, 0.0)
            if SOFT:
                a = _scores(Q, K, q_base + n, row_ok, kv_base + j, k_ok, D, BLOCK_DK, CHUNK, CHUNK, DT, PREC) * scale
                win = (j[None, :] <= n[:, None]) & (j[None, :] > n[:, None] - window)
                p = tl.where(win, g * tl.exp(a - m[:, None]), p)
            v = tl.load(V + (kv_base + j)[:, None] * D + od[None, :], mask=k_ok[:, None] & dm[None, :], other=0.0)
            num += tl.dot(p.to(DT), v.to(DT), input_precision=PREC)
            den += tl.sum(p, 1)
    y = num / (den + _EPS)[:, None]
    tl.store(Y + (q_base + n)[:, None] * D + od[None, :], y.to(Y.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(x)))


# Launch settings on a GPU (and on the meta device, which stands for one in the compile gate), half precision, by
# head dim (<= 64, <= 128): _chunk_states' feature and value blocks and warps; _chunk_output's head-dim chunk of the
# q.k products, feature chunk, warps and pipeline stages. Found with benchmarks/kernel_compile.py at the presets'
# shapes, every mode, bf16 and fp16: 4 warps (one warpgroup on the 64 rows; with 8, Triton's layouts replicate the
# rows or the operands and spill), one stage (2 spilled on sm_80 at head dim 128), head-dim chunks of 32 at 128 (64
# spilled 60-300 bytes: a [64, 64] q operand in registers) and 16 at 64 (64 and 32 spilled 8-16 bytes on sm_80).
GPU_SETTINGS = {
    64: dict(block_f=64, block_dv=32, state_warps=4, dchunk=16, fchunk=32, warps=4, stages=1),
    128: dict(block_f=64, block_dv=32, state_warps=4, dchunk=32, fchunk=32, warps=4, stages=1),
}


def _settings(x: torch.Tensor, head_dim: int, features: int) -> dict:
    if x.device.type == "cpu":  # Triton's interpreter (tests): any tile works, these are fast there
        return dict(block_f=64, block_dv=64, state_warps=4, dchunk=32, fchunk=min(_pow2(features), 64), warps=4,
                    stages=1)  # fmt: skip
    return GPU_SETTINGS[64 if head_dim <= 64 else 128]


def chunk_prefill(
    q, k, v, fq, fk, gamma, *, window, mode, sinks, hybrid_sinks=False, scale=None, la_decay=None
) -> torch.Tensor | None:
    """The chunked prefill forward (no autograd) of the hybrid attention, naive.masked_attention's y for queries and
    keys at positions 0..T-1 with no padding and no initial state: q [B,H,T,D], k/v [B,Hkv,T,D], fq [B,H,T,F],
    fk [B,Hkv,T,F], gamma [H], la_decay rho [Hkv] or None. Returns y [B,H,T,D] in q's dtype, or None for a case it
    does not take (the caller runs the fused forward): a window over CHUNK or under 1, a mode it has no kernel for,
    more than 64 sinks, a value dim unlike the head dim, head dim over 128, feature dim over 256, a dtype other
    than bf16 / fp16 / fp32 (fp32 only on CPU, in Triton's interpreter), a la_decay of the wrong shape. It launches
    `_chunk_states` (modes with an LA, more than one chunk) and `_chunk_output`."""
    if mode == "none":
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    if mode not in MODE_PARTS or not 1 <= int(window) <= CHUNK:
        return None
    B, H, T, D = q.shape
    Hkv, F = k.shape[1], fq.shape[-1]
    hybrid_sinks = bool(hybrid_sinks) and mode == "hybrid"
    soft, lin, sink, gamma_on = MODE_PARTS[mode]
    sink = sink or hybrid_sinks
    if v.shape[-1] != D or D > 128 or F > 256 or H % Hkv or q.dtype not in _DT or (sink and sinks > 64):
        return None
    if q.dtype == torch.float32 and q.device.type != "cpu":  # (fp32 on a GPU: FMA products, which spill kilobytes
        return None  # at 64-row tiles; the fused forward's 16-row tiles take it)
    if la_decay is not None and tuple(la_decay.shape) != (Hkv,):
        return None
    y = torch.empty_like(q)
    if T == 0:
        return y
    dtype = q.dtype
    k, v, fq, fk = (t.to(dtype).contiguous() for t in (k, v, fq, fk))
    q = q.contiguous()
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    decay = lin and la_decay is not None
    rho = la_decay.detach().float().contiguous() if decay else None
    n_excl = int(sinks) if hybrid_sinks else 0
    nc = triton.cdiv(T, CHUNK)
    ns = nc - 1  # states before chunks 0..nc-2 (chunk c reads the one before chunk c - 1)
    cfg = _settings(q, D, F)
    dt, prec = _DT[dtype], ("ieee" if dtype == torch.float32 else "tf32")
    state_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    hkv = hk = None
    if lin and ns > 0:
        hkv = torch.empty(B, Hkv, ns, F, D, dtype=state_dtype, device=q.device)
        hk = torch.empty(B, Hkv, ns, F, dtype=torch.float32, device=q.device)
        bf, bdv = cfg["block_f"], min(cfg["block_dv"], _pow2(D))
        _chunk_states[(triton.cdiv(F, bf), triton.cdiv(D, bdv), B * Hkv)](
            fk, v, rho if decay else hk, hkv, hk, T, F, D, ns, Hkv, n_excl,
            DECAY=decay, CHUNK=CHUNK, BLOCK_F=bf, BLOCK_DV=bdv, DT=dt, PREC=prec, num_warps=cfg["state_warps"],
        )  # fmt: skip
    g = gamma.detach().float().contiguous()
    none = g.to(state_dtype)  # (a pointer that is not read: no state, no decay)
    _chunk_output[(B * H, nc)](
        q, k, v, fq, fk, g, rho if decay else g, none if hkv is None else hkv, g if hk is None else hk, y,
        T, H, H // Hkv, D, F, ns, int(window), int(window) if mode == "hybrid" else 0,
        int(window) if soft else 0, int(sinks) if sink else 0, n_excl, scale,
        CHUNK=CHUNK, BLOCK_D=_pow2(D), BLOCK_DK=min(_pow2(D), cfg["dchunk"]), BLOCK_FC=cfg["fchunk"],
        BLOCK_S=_pow2(max(int(sinks), 1)) if sink else 16, SOFT=soft, LIN=lin, SINKS=sink, HYBRID=gamma_on,
        DECAY=decay, DT=dt, PREC=prec, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return y


def prefill_without_grad(q, k, v, fq, fk, gamma, *, attention_mask=None, initial_state=None, **options):
    """chunk_prefill's y when nothing needs a gradient (autograd off, or no input requires one) and there is no
    padding mask and no initial state; else None (and None where chunk_prefill does not take the case)."""
    if attention_mask is not None or initial_state is not None:
        return None
    inputs = (q, k, v, fq, fk, gamma, options.get("la_decay"))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return None
    return chunk_prefill(q, k, v, fq, fk, gamma, **options)
