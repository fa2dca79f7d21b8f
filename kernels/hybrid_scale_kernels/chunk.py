"""The hybrid attention on the chunked kernels: the entry the backend calls (`triton_hybrid_attention`), the switches
of a call (`Case`) and the autograd Function (`ChunkAttention`). Every path runs these kernels: training and prefill,
padded or not, with or without an initial state, any window, with the denominators, bf16 / fp16 (and fp32, see
below).

The launches of a forward: `chunk_h.states` (the LA state before every chunk, modes with an LA) and
`chunk_o.chunk_fwd_o` (the output). Of a backward (ChunkAttention.backward): the states again, `chunk_bwd.bwd_dq`
(per query chunk: dq, dphi_q, dlz, the row sums of ds, the sinks' ds and E per row), `chunk_h.dstates` (the reverse
state scan, and the initial state's gradient) and `chunk_bwd.bwd_dkv` (dk, dv and dphi_k together, per key chunk,
the sinks' dk and dv in).

The backward's math. Per row n: Z_n the normaliser, do_n = dy_n / Z_n (made inside the kernels from dy and Z, rounded to
the inputs' dtype for the products), and dlz_n = do_n . y_n (y the forward's output as it returned it, in the model's
dtype, plus its rounding error, which the forward stores in that dtype beside it); every term p_nj of the numerator (g E
or L) has dp_nj = do_n . v_j - dlz_n. The window and sink terms give ds = p dp (dq, dk through s q.k), the L terms dphi
through dp times their weight, and c_n (not detached) gives -sum_j ds_nj to its argmax key. rho's gradient is taken term
by term where each weight is made (no position-weighted sums that cancel): the intra-chunk L terms (-e p dp, in
`_chunk_bwd_dkv`), a query's lag on its state and each state's carry alpha^CHUNK (both in the reverse scan, against
h_s once), and each key's weight inside its chunk.

Padding: the real tokens of each row are moved to its front (a stable sort of the mask), the kernels run on the
packed rows (each row's real tokens are positions 0..n-1, the padding after them, where no real query sees it),
and the outputs go back to their places, zero on padding. fp32 inputs on a GPU (stage 1 passes fp32 queries) run
in bf16 with fp32 accumulation and give y in fp32 (`compute_dtype`, FP32_IN_BF16: logged once per process): the
inputs of a bf16 model are exact in bf16, and 64-row fp32 products on FMAs spill kilobytes. In Triton's interpreter
(CPU tensors: the tests) fp32 runs as fp32.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import triton
from torch.autograd.function import once_differentiable

from .chunk_bwd import bwd_dkv, bwd_dq
from .chunk_h import dstates, states
from .chunk_o import chunk_fwd_o
from .settings import regs, settings_for
from .utils import CHUNK, MODES, TL_DTYPE, blocks_back, mode_parts, options, pow2, precision

LOG = logging.getLogger(__name__)
# what an fp32 call on a GPU computes (triton_hybrid_attention's docstring says it too), logged once per process
FP32_IN_BF16 = (
    "hybrid_scale_kernels: an fp32 call on a GPU computes in bf16: its inputs are rounded to bf16 (8 significant "
    "bits), the LA state each chunk reads is stored in bf16, the products accumulate in fp32, and y and the "
    "gradients come back in fp32 (attention.backend=torch computes in fp32)"
)


@dataclass(frozen=True, eq=False)
class Case:
    """The switches of one call, which every launch of it shares."""

    soft: bool  # the window softmax
    lin: bool  # the linear attention
    sink: bool  # the sinks (swa_sinks, sinks_only, the hybrid with its own)
    gamma_on: bool  # gamma weighs the window (the hybrid)
    decay: bool  # the LA decays (la_decay given, a mode with an LA)
    has_init: bool  # an initial LA state (a mode with an LA)
    window: int
    nb: int  # chunks before its own that a query chunk streams (utils.blocks_back)
    lin_off: int  # an L term needs j <= n - lin_off (the hybrid: the window; la_only: 0)
    sink_off: int  # a sink term needs j <= n - sink_off
    n_sinks: int
    n_excl: int  # the first keys the LA leaves out (the hybrid's own sinks)
    scale: float
    head_dim: int
    dt: object  # the inputs' Triton dtype
    prec: str  # tl.dot's input precision
    cfg: dict  # the launch settings (settings.py)
    chunk: int = CHUNK

    @property
    def block_s(self) -> int:
        return pow2(max(self.n_sinks, 1)) if self.sink else 16

    @staticmethod
    def of(q, fq, *, window, mode, sinks, hybrid_sinks, scale, decay, init) -> Case:
        soft, lin, sink, gamma_on = mode_parts(mode, hybrid_sinks)
        decay = lin and decay
        D = q.shape[-1]
        return Case(
            soft=soft, lin=lin, sink=sink, gamma_on=gamma_on, decay=decay, has_init=lin and init,
            window=int(window), nb=blocks_back(window, soft, decay), lin_off=int(window) if mode == "hybrid" else 0,
            sink_off=int(window) if soft else 0, n_sinks=int(sinks) if sink else 0,
            n_excl=int(sinks) if mode == "hybrid" and hybrid_sinks else 0, scale=scale, head_dim=D,
            dt=TL_DTYPE[q.dtype], prec=precision(q.dtype), cfg=settings_for(q, D, fq.shape[-1]),
        )  # fmt: skip


def _states(fk, v, rho, init, case, T):
    """The LA states before chunks 0..NS-1 (None without an LA or without a state anyone reads: chunk s + NB reads
    state s >= 1, and state 0 is read only when it is an initial state)."""
    ns = triton.cdiv(T, CHUNK) - case.nb
    ns = max(ns, 1) if case.has_init else ns
    if not case.lin or ns <= 0 or (ns == 1 and not case.has_init):
        return None
    if ns == 1:  # state 0 is the initial state itself: nothing to scan
        dtype = torch.bfloat16 if fk.dtype == torch.bfloat16 else torch.float32
        return init[0].to(dtype)[:, :, None].contiguous(), init[1][:, :, None].contiguous()
    cfg = case.cfg
    return states(fk, v, rho, case.n_excl, ns, block_f=cfg["block_f"], block_dv=min(cfg["block_dv"], pow2(v.shape[-1])),
                  warps=cfg["state_warps"], dt=case.dt, prec=case.prec, options=regs(cfg, "state"),
                  init=init if case.has_init else None)  # fmt: skip


class ChunkAttention(torch.autograd.Function):
    """The chunked forward with a backward (training): the forward keeps y as it returns it and its rounding error in
    out_dtype (for dlz; no error for fp32), c_n, Z_n and c_n's argmax per row, and the states (B Hkv (T / 64) F D in the
    inputs' dtype: 34 MB per layer at Llama-3-8B's shape and 4k tokens, a fifth of what the layer saves besides); the
    backward recomputes every score tile. Gradients of q, k, v, phi_q, phi_k in their dtype, of gamma (the hybrid's
    only), of rho (the decay) and of the initial state (fp32). Returns (y in out_dtype, sum of gamma E, sum of L): the
    two sums (not differentiable) are empty unless dens."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, gamma, rho, init_kv, init_k, case, out_dtype, dens):
        r = None if rho is None else rho.detach().float().contiguous()
        init = (init_kv, init_k) if case.has_init else None
        state = _states(fk, v, r, init, case, q.shape[2])
        y, stats, parts = chunk_fwd_o(q, k, v, fq, fk, gamma, r, state, case, stats=True, dens=dens,
                                      out_dtype=out_dtype)  # fmt: skip
        ctx.save_for_backward(q, k, v, fq, fk, gamma, rho, y, *stats, *(state or ()))
        ctx.case = case
        de, dl = parts if dens else (y.new_empty(0), y.new_empty(0))
        ctx.mark_non_differentiable(de, dl)
        return y, de, dl

    @staticmethod
    @once_differentiable  # (a second derivative would need kernels of its own: refused, not silently partial)
    def backward(ctx, dy, _de, _dl):
        q, k, v, fq, fk, gamma, rho, y, m, zs, idx, y_lo, *state = ctx.saved_tensors
        case = ctx.case
        B, Hkv = q.shape[0], k.shape[1]
        r = rho.detach().float().contiguous() if case.decay else None
        g = gamma.detach().float().contiguous()
        dy = dy.to(q.dtype).contiguous()
        state = tuple(state) or None  # (the forward's: kept, not recomputed)
        saved = (q, k, v, fq, fk, g, r, (y, y_lo), (m, zs, idx))
        grads = bwd_dq(saved, dy, state, case)
        dstate, dinit, rscan = None, (None, None), None
        if state is not None and (state[0].shape[2] > 1 or case.has_init):  # (some state has a gradient)
            dstate, dinit, rscan = dstates(fq, dy, zs, grads["dlz"], r, state, case)
        del state
        dk, dv, dfk, rkey = bwd_dkv(saved, dy, grads, dstate, case)  # (the sinks' terms in)
        dgamma = drho = None
        if ctx.needs_input_grad[5]:
            dgamma = torch.zeros_like(gamma)
            if case.gamma_on:  # d/dgamma of every E term g exp(.): ds / g
                dgamma = (grads["rsum"].sum((0, 2)) / g).to(gamma.dtype)
        if rho is not None and ctx.needs_input_grad[6]:
            drho = torch.zeros_like(rho)
            if case.decay:
                f64 = torch.float64
                total = rkey.to(f64).view(B, Hkv, -1).sum((0, 2))  # (the keys' weights; the lags and carries:)
                if rscan is not None:
                    total = total + rscan.to(f64).view(B, Hkv, -1).sum((0, 2))
                drho = total.to(rho.dtype)
        dinit_kv, dinit_k = dinit
        return (grads["dq"], dk, dv, grads["dfq"], dfk, dgamma, drho, dinit_kv, dinit_k, None, None,
                None)  # fmt: skip


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the kernels compute a call in: q's, but bf16 for fp32 off the CPU (a GPU, or the meta device that
    stands for one), which says so once per process (FP32_IN_BF16). On CPU (Triton's interpreter) fp32 stays fp32."""
    if q.dtype != torch.float32 or q.device.type == "cpu":
        return q.dtype
    _say_fp32_runs_in_bf16()
    return torch.bfloat16


@functools.cache
def _say_fp32_runs_in_bf16() -> None:
    LOG.warning(FP32_IN_BF16)


def _pack(attention_mask):
    """(order, inverse, real) that move each row's real tokens to its front (stable) and back; None when the mask
    holds no padding."""
    if attention_mask is None:
        return None
    real = attention_mask.bool()
    if bool(real.all()):
        return None
    order = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)
    return order, torch.argsort(order, dim=-1), real


def _gather(x, index):
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def _check(q, k, v, fq, o, la_decay):
    if o.mode not in MODES:
        raise ValueError(f"unknown attention mode '{o.mode}'; available: {', '.join(MODES)}")
    if o.window < 1:
        raise ValueError(f"window must be >= 1, got {o.window}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the triton backend needs value dim == head dim, got {v.shape[-1]} and {q.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.dtype not in TL_DTYPE:
        raise ValueError(f"the triton backend takes bfloat16, float16 and float32, got {q.dtype}")
    if o.sinks > 64 and (o.mode in ("swa_sinks", "sinks_only") or (o.hybrid_sinks and o.mode == "hybrid")):
        raise ValueError(f"the triton backend keeps at most 64 sinks in one tile, got {o.sinks}")
    if la_decay is not None and tuple(la_decay.shape) != (k.shape[1],):
        raise ValueError(f"la_decay must hold one rho per KV head ({k.shape[1]}), got shape {tuple(la_decay.shape)}")


def triton_hybrid_attention(
    q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, initial_state=None, la_decay=None, **given
):
    """The attention backend contract of hybrid_scale/attention/backends.py, computed by the chunked kernels.
    opts: the call's AttentionOptions (its chunk_size is ignored: the kernels' chunk is CHUNK). initial_state: optional
    (kv [B,Hkv,F,D], k [B,Hkv,F]) sums over keys that precede the sequence by more than the window (differentiable;
    with la_decay as query w - 1 of the sequence sees them). la_decay: rho [Hkv] >= 0, the LA's decay (naive.py's
    spec; differentiable), None = off.

    Precision: bf16 and fp16 calls compute in their dtype with fp32 accumulation. An fp32 call on a GPU is not fp32:
    it computes in bf16 (q, k, v, phi_q, phi_k rounded to bf16, 8 significant bits, and the LA state each chunk
    reads stored in bf16) with fp32 accumulation, and returns y and the gradients in fp32; it logs that once per
    process. Its error is a bf16 call's (within 3e-2 of the fp64 spec for inputs of size ~1, as test_fp32_calls.py
    checks on a GPU), not fp32's. attention.backend=torch computes in fp32; in Triton's interpreter (CPU tensors)
    fp32 runs as fp32."""
    o = options(opts, given)
    _check(q, k, v, fq, o, la_decay)
    mode, window, sinks, return_denominators = o.mode, int(o.window), int(o.sinks), bool(o.return_denominators)
    hybrid_sinks = bool(o.hybrid_sinks) and mode == "hybrid"
    scale = o.scale
    B, H, T, D = q.shape
    if mode == "none" or T == 0:
        y = q.new_zeros(B, H, T, D)
        zero = q.new_zeros(B, H, T, dtype=torch.float32)
        return (y, zero, zero.clone()) if return_denominators else y
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out_dtype = q.dtype
    dtype = compute_dtype(q)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    packed = _pack(attention_mask)
    if packed is not None:
        q, k, v, fq, fk = (_gather(t, packed[0]) for t in (q, k, v, fq, fk))
    q, k, v, fq, fk = (t.contiguous() for t in (q, k, v, fq, fk))
    case = Case.of(q, fq, window=window, mode=mode, sinks=sinks, hybrid_sinks=hybrid_sinks, scale=scale,
                   decay=la_decay is not None, init=initial_state is not None)  # fmt: skip
    rho = la_decay if case.decay else None
    init = (None, None)
    if case.has_init:
        init = tuple(t.float().contiguous() for t in initial_state)
    inputs = (q, k, v, fq, fk, gamma, rho, *init)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        y, de, dl = ChunkAttention.apply(*inputs, case, out_dtype, return_denominators)
    else:
        with torch.no_grad():
            r = None if rho is None else rho.detach().float().contiguous()
            state = _states(fk, v, r, init if case.has_init else None, case, T)
            y, _, parts = chunk_fwd_o(q, k, v, fq, fk, gamma, r, state, case, dens=return_denominators,
                                      out_dtype=out_dtype)  # fmt: skip
            de, dl = parts if return_denominators else (None, None)
    if packed is not None:
        _, inverse, real = packed
        y = _gather(y, inverse) * real[:, None, :, None].to(y.dtype)
        if return_denominators:
            de, dl = (_gather(t[..., None], inverse)[..., 0] * real[:, None] for t in (de, dl))
    return (y, de, dl) if return_denominators else y
