"""Training text: documents from a text file, a jsonl, a local `datasets` directory or the embedded default,
tokenized and packed into sequences of seq_len (documents joined by EOS, no state reset at their boundaries, as in
LoLCATs). Deterministic given the seed. The held-out split is taken by document before any shuffling.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch


class CorpusError(ValueError):
    pass


def read_documents(source: str | Path | None, text_field: str = "text") -> list[str]:
    """Documents of a .txt (separated by blank lines), .jsonl (one object per line, `text_field`), or a
    `datasets` save_to_disk directory (column `text_field`). None = the embedded default's training text."""
    if source is None:
        from .assets import require

        source = require().train_text
    path = Path(source)
    if not path.exists():
        raise CorpusError(f"config key 'data.source': {path} does not exist")
    if path.is_dir():
        from datasets import load_from_disk

        data = load_from_disk(str(path))
        if text_field not in data.column_names:
            raise CorpusError(
                f"{path} has no column '{text_field}' (columns: {data.column_names}); set data.text_field"
            )
        docs = list(data[text_field])
    elif path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                obj = json.loads(line)
                if text_field not in obj:
                    raise CorpusError(f"{path}:{n} has no field '{text_field}'; set data.text_field")
                docs.append(obj[text_field])
    else:
        docs = path.read_text().split("\n\n")
    docs = [d.strip() for d in docs if d and d.strip()]
    if not docs:
        raise CorpusError(f"{path} holds no text")
    return docs


def split_documents(docs: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    cut = len(docs) - max(1, int(round(len(docs) * heldout_fraction))) if heldout_fraction > 0 else len(docs)
    return docs[:cut], docs[cut:]


def pack(tokenizer, docs: list[str], seq_len: int, num_sequences: int | None, seed: int) -> torch.Tensor:
    """[N, seq_len] token ids: documents shuffled with the seed, joined with EOS, cut into full sequences."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    need = None if num_sequences is None else num_sequences * seq_len
    for i in order:
        ids += tokenizer.encode(docs[i]) + ([eos] if eos is not None else [])
        if need is not None and len(ids) >= need:
            break
    n = len(ids) // seq_len if num_sequences is None else min(num_sequences, len(ids) // seq_len)
    if n == 0 or (num_sequences is not None and n < num_sequences):
        raise CorpusError(
            f"the text yields {len(ids)} tokens, {len(ids) // seq_len} sequences of {seq_len}; "
            f"{num_sequences} were asked for: lower data.num_sequences or data.seq_len, or give more text"
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def train_and_heldout(source: str | Path | None, text_field: str, heldout_fraction: float):
    """(training documents, held-out documents): the embedded default has its own held-out text; a user source is
    split by document (the last heldout_fraction of them)."""
    if source is None:
        from .assets import require

        return read_documents(None, text_field), read_documents(require().heldout_text, text_field)
    docs = read_documents(source, text_field)
    if heldout_fraction <= 0:
        raise CorpusError("config key 'data.heldout_fraction': stage 2 needs held-out text; set it above 0")
    return split_documents(docs, heldout_fraction)
