"""How the stages batch their data: stage 2's packed training sequences and the `selection` half of the held-out
text, which sequences each optimizer step consumes (the same on any number of ranks), and how a stage-1 step's query
blocks split over the ranks."""

from __future__ import annotations

import torch

from ..config.schema import Config
from . import corpus

Unit = tuple[int, int, int]  # (sequence within the step's batch, first query row, end row)


def finetune_data(cfg: Config, tokenizer, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training sequences [N, T], held-out sequences [finetune.heldout_sequences, T]) of data.source."""
    train_docs, held_docs = corpus.train_and_heldout(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction)
    train = corpus.pack(tokenizer, train_docs, T, None, cfg.seed)
    return train, heldout_data(cfg, tokenizer, T, held_docs)


def heldout_data(cfg: Config, tokenizer, T: int, held_docs: list[str]) -> torch.Tensor:
    """Stage 2's held-out sequences [finetune.heldout_sequences, T] of the `selection` documents; one clear error when
    they are too few."""
    n = cfg.finetune.heldout_sequences
    held = corpus.pack(tokenizer, held_docs, T, None, cfg.seed)
    if len(held) < n:
        raise corpus.CorpusError(
            f"the held-out text yields {len(held)} sequences of {T} tokens; finetune.heldout_sequences asks for "
            f"{n}: lower it or finetune.seq_len, or give more held-out text"
        )
    return held[:n]


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


def split_units(n_sequences: int, seq_len: int, block: int, world: int) -> list[list[Unit]]:
    """The step's query blocks in sequence order, cut into `world` contiguous runs of (nearly) equal length: every
    rank has work when there are at least `world` units (`plan` flags a configuration with fewer); a rank's units
    span few sequences (each sequence a rank touches is projected once on it)."""
    units = [(s, a, min(seq_len, a + block)) for s in range(n_sequences) for a in range(0, seq_len, block)]
    n = len(units)
    return [units[r * n // world : (r + 1) * n // world] for r in range(world)]


def units_per_step(batch_size: int, seq_len: int, block: int) -> int:
    return batch_size * -(-seq_len // block)
