"""Stage 1's objectives, computed per query block, and how a step's query blocks are split over the ranks.

A step trains on `distill.batch_size` sequences. Its work is cut into units -- (sequence, query rows a..b-1) -- each
needing only keys 0..b-1, so that every rank works every step even when there are fewer sequences than ranks
(70B preset: 8 sequences x 8 blocks of 128 rows for 32 ranks). The loss is the sum of the units' terms, each
normalised per sequence as the whole-sequence objective is, so the split changes nothing but rounding.

Precision: the score matrices come from the inputs' dtype (bf16 matrix products on GPUs); softmax, logarithms, the
products with the teacher rows and every sum are fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.hedgehog.naive import decay_weight
from ..attention.layer import Projections
from ..attention.window.naive import compute_dtype


def _expand(x, group):
    return x.repeat_interleave(group, dim=1)


def _causal(a: int, rows: int, keys: int, device) -> torch.Tensor:
    """[rows, keys]: query row a+i sees keys 0..a+i."""
    return torch.arange(keys, device=device)[None, :] <= torch.arange(a, a + rows, device=device)[:, None]


def xent_rows(q, k, fq, fk, a: int, scale: float) -> torch.Tensor:
    """Per sequence: the sum over heads and query rows a..a+Tq-1 of the soft cross-entropy between the teacher's
    causal softmax row and linear attention's normalised row (LA-only). q/fq [B,H,Tq,*] hold rows a..a+Tq-1, k/fk
    [B,Hkv,a+Tq,*] keys 0..a+Tq-1. [B], fp32 (fp64 for fp64 inputs)."""
    group = q.shape[1] // k.shape[1]
    k, fk = _expand(k, group), _expand(fk, group)
    causal = _causal(a, q.shape[2], k.shape[2], q.device)
    acc = compute_dtype(q)
    with torch.no_grad():
        scores = (scale * q @ k.transpose(-1, -2)).to(acc)
        teacher = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    lin = (fq @ fk.transpose(-1, -2)).to(acc).masked_fill(~causal, 0.0)
    log_rows = torch.log(lin.clamp_min(1e-30)) - torch.log(lin.sum(-1, keepdim=True).clamp_min(1e-30))
    return -(teacher * log_rows.masked_fill(~causal, 0.0)).sum((-1, -2)).sum(1)


def weights_xent(q, k, fq, fk, scale, block: int) -> torch.Tensor:
    """Per sequence: mean over heads and queries of `xent_rows`, in query blocks (memory O(block * T)). [B]"""
    B, H, T, _ = q.shape
    total = q.new_zeros(B, dtype=compute_dtype(q))
    for a in range(0, T, block):
        b = min(T, a + block)
        total = total + xent_rows(q[:, :, a:b], k[:, :, :b], fq[:, :, a:b], fk[:, :, :b], a, scale)
    return total / (H * T)


def teacher_rows(q, k, v, a: int, scale: float) -> torch.Tensor:
    """Rows a..a+Tq-1 of the teacher's attention output (exact causal softmax) from keys 0..a+Tq-1."""
    group = q.shape[1] // k.shape[1]
    mask = _causal(a, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, _expand(k, group), _expand(v, group), attn_mask=mask, scale=scale)


def unit_loss(m, x: Projections, a: int, b: int, seq_len: int, weights: dict[str, float]) -> torch.Tensor:
    """One unit's share of its sequence's weighted objective (fp32 scalar, summed over the B given sequences).
    x holds the sequence's projections of rows 0..b'-1 for some b' >= b (q, k, v detached); m the layer's
    HybridAttention (its gamma, window, sinks and scaling)."""
    q, k, v, fq, fk = x[:5]
    H, d = m.all_heads, q.shape[-1]  # with tensor parallelism q holds this rank's heads: a partial sum over heads
    qa, fqa, kb, vb, fkb = q[:, :, a:b], fq[:, :, a:b], k[:, :, :b], v[:, :, :b], fk[:, :, :b]
    loss = q.new_zeros((), dtype=compute_dtype(q))
    if weights.get("weights_xent"):
        if "weights_xent" not in m.part.kind.objectives:
            raise ValueError(
                "distill objective 'weights_xent' transfers attention weights, which the gated delta rule does not "
                "have; with attention.la_kind=gated_delta use output_mse and/or hybrid_output_mse"
            )
        loss = loss + weights["weights_xent"] * xent_rows(qa, kb, fqa, fkb, a, m.scaling).sum() / (H * seq_len)
    if weights.get("output_mse") or weights.get("hybrid_output_mse"):
        with torch.no_grad():
            target = teacher_rows(qa.float(), kb.float(), vb.float(), a, m.scaling)
        for name, mode in (("output_mse", "la_only"), ("hybrid_output_mse", "hybrid")):
            if weights.get(name):
                y = unit_attention(m, x, a, b, mode)
                loss = loss + weights[name] * (y - target).pow(2).sum() / (H * seq_len * d)
    return loss


def unit_attention(m, x: Projections, a: int, b: int, mode: str) -> torch.Tensor:
    """Rows a..b-1 of the layer's attention in `mode` (fp32), through its backend (attention.backend): the backend
    attends rows a0..b-1 with a0 = a - w + 1 (every window key of row a on), and the keys before a0 -- all of them
    in P(n) of every row -- enter as the initial LA state (fp32, differentiable). A hybrid with its own sinks attends
    rows 0..b-1 instead: its rows need the first S keys in their softmax, and no sink in the state; so does the gated
    delta rule (its state is a recurrence, not a sum: it runs over keys 0..b-1, in O(b))."""
    q, k, v, fq, fk, gates = x
    if gates is not None:
        cut = type(gates)(*(None if t is None else t[:, :, :b] for t in gates))
        y = m.attend(q[:, :, :b].float(), k[:, :, :b], v[:, :, :b], fq[:, :, :b], fk[:, :, :b], gates=cut, mode=mode)
        return y[:, :, a:]
    a0 = 0 if (mode == "hybrid" and m.hybrid_sinks) else max(0, a - m.window + 1)
    state = None
    if a0 > 0:
        acc = compute_dtype(q)
        fk0, v0 = fk[:, :, :a0].to(acc), v[:, :, :a0].to(acc)
        rho = m.la_decay
        if rho is not None:  # as row a = a0 + w - 1 sees key j: alpha^(a - w - j)
            j = torch.arange(a0, device=q.device)
            fk0 = fk0 * decay_weight(rho.to(acc).view(-1, 1), a - m.window - j)[None, :, :, None]
        state = (fk0.transpose(-1, -2) @ v0, fk0.sum(2))
    rows = slice(a0, b)
    y = m.attend(
        q[:, :, rows].float(),
        k[:, :, rows],
        v[:, :, rows],
        fq[:, :, rows],
        fk[:, :, rows],
        mode=mode,
        initial_state=state,
    )  # fmt: skip (q in fp32: y comes back in fp32)
    return y[:, :, a - a0 :]
