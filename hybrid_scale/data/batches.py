"""Stage 2's data: the packed training sequences and the `selection` half of the held-out text, and which
sequences each optimizer step consumes (the same on any number of ranks)."""

from __future__ import annotations

import torch

from . import corpus


def finetune_data(cfg, tokenizer, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training sequences [N, T], held-out sequences [finetune.heldout_sequences, T]) of data.source."""
    f = cfg.finetune
    train_docs, held_docs = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction)
    train = corpus.pack(tokenizer, train_docs, T, None, cfg.seed)
    held = corpus.pack(tokenizer, held_docs, T, None, cfg.seed)
    if len(held) < f.heldout_sequences:
        raise corpus.CorpusError(
            f"the held-out text yields {len(held)} sequences of {T} tokens; finetune.heldout_sequences asks for "
            f"{f.heldout_sequences}: lower it or finetune.seq_len, or give more held-out text"
        )
    return train, held[: f.heldout_sequences]


def global_batch(step: int, n: int, size: int, seed: int) -> list[int]:
    """Indices of the training sequences of optimizer step `step`: epochs of seeded permutations, in order."""
    perms: dict[int, list[int]] = {}  # one permutation per epoch the batch touches (at most two)
    out = []
    for idx in range(step * size, (step + 1) * size):
        epoch, j = divmod(idx, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7_919 + epoch)).tolist()
        out.append(perms[epoch][j])
    return out


def rank_share(batch: list[int], rank: int, world: int) -> list[int]:
    """This rank's part of a global batch (contiguous, equal parts)."""
    per_rank = len(batch) // world
    return batch[rank * per_rank : (rank + 1) * per_rank]
