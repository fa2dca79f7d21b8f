"""Training text: documents from a text file, a jsonl, a local `datasets` directory or the embedded default,
tokenized and packed into sequences of seq_len (documents joined by EOS, no state reset at their boundaries, as in
LoLCATs). Deterministic given the seed. The held-out split is taken by document before any shuffling.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from ..config.schema import Config
from ..errors import ConfigError, CorpusError
from .assets import require


def read_documents(source: str | Path | None, text_field: str = "text") -> list[str]:
    """Documents of a .txt (separated by blank lines), .jsonl (one object per line, `text_field`), or a
    `datasets` save_to_disk directory (column `text_field`). None = the embedded default's training text."""
    if source is None:
        source = require().train_text
    path = Path(source)
    if not path.exists():
        raise CorpusError(
            f"config key 'data.source': {path} does not exist; point it at a .txt, a .jsonl or a saved dataset, or "
            "leave it unset for the embedded default"
        )
    if path.is_dir():
        from datasets import load_from_disk

        try:
            data = load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise CorpusError(
                f"config key 'data.source': {path} is a directory but not a `datasets` save_to_disk directory "
                f"({str(e).splitlines()[0][:120]}); point it at a .txt, a .jsonl or a saved dataset"
            ) from None
        if hasattr(data, "keys") and not hasattr(data, "column_names"):  # a DatasetDict: name the split
            raise CorpusError(
                f"config key 'data.source': {path} holds several splits ({', '.join(data.keys())}); point it at one "
                f"of them, e.g. {path / next(iter(data.keys()))}"
            )
        if text_field not in data.column_names:
            raise CorpusError(
                f"{path} has no column '{text_field}' (columns: {data.column_names}); set data.text_field"
            )
        docs = list(data[text_field])
    elif path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(_text(path).splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise CorpusError(
                        f"{path}:{n} is not valid JSON ({e}); fix or remove that line (one JSON object per line)"
                    ) from None
                if not isinstance(obj, dict):
                    raise CorpusError(
                        f"{path}:{n} is a JSON {type(obj).__name__}, not an object; write one object per line"
                    )
                if text_field not in obj:
                    raise CorpusError(f"{path}:{n} has no field '{text_field}'; set data.text_field")
                if not isinstance(obj[text_field], str):
                    raise CorpusError(
                        f"{path}:{n}: field '{text_field}' is a {type(obj[text_field]).__name__}, not text; set "
                        "data.text_field to the field holding the text"
                    )
                docs.append(obj[text_field])
    else:
        docs = _text(path).split("\n\n")
    docs = [d.strip() for d in docs if d and d.strip()]
    if not docs:
        raise CorpusError(f"{path} holds no text; point data.source at a file with documents in it")
    return docs


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8 or give a .jsonl") from None


def split_documents(docs: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    cut = len(docs) - max(1, int(round(len(docs) * heldout_fraction))) if heldout_fraction > 0 else len(docs)
    return docs[:cut], docs[cut:]


PACKED_KEPT = 4  # the packings a process keeps (preflight's, read again by the stage; a few runs in one process)
_PACKED: dict[tuple, torch.Tensor] = {}


def identity(tokenizer, docs: list[str], seq_len: int, num_sequences: int | None, seed: int) -> tuple:
    """What a packing depends on: the tokenizer (its class, where it was loaded from, its vocabulary size), the
    documents' text (a sha256 of it, in order), the sequence length, the count and the seed."""
    text = hashlib.sha256()
    for doc in docs:
        text.update(doc.encode("utf-8", "surrogatepass") + b"\0")
    who = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))
    return who, text.hexdigest(), int(seq_len), num_sequences, int(seed)


def forget() -> None:
    """Drop the packings kept (between a pipeline's stages: one stage's text is not held while the next runs)."""
    _PACKED.clear()


def pack(tokenizer, docs: list[str], seq_len: int, num_sequences: int | None, seed: int) -> torch.Tensor:
    """[N, seq_len] token ids: documents shuffled with the seed, joined with EOS, cut into full sequences. Tokenized
    once per process for the same identity (`identity`): preflight's check and the stage read the same tensor (do not
    write into it)."""
    key = identity(tokenizer, docs, seq_len, num_sequences, seed)
    if key not in _PACKED:
        while len(_PACKED) >= PACKED_KEPT:
            _PACKED.pop(next(iter(_PACKED)))
        _PACKED[key] = _pack(tokenizer, docs, seq_len, num_sequences, seed)
    return _PACKED[key]


def _pack(tokenizer, docs: list[str], seq_len: int, num_sequences: int | None, seed: int) -> torch.Tensor:
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


SPLITS = ("selection", "report")  # held-out text: stage 2 chooses / early-stops on one, evaluation reports the other


def heldout_splits(heldout: list[str], where: str) -> dict[str, list[str]]:
    """The held-out documents cut in two disjoint halves, by document: `selection` (stage 2's held-out loss, best/
    and early stopping) and `report` (the evaluation's perplexity), so that the reported figure is not the one the
    checkpoint was chosen on."""
    if len(heldout) < 2:
        raise CorpusError(
            f"{where} holds {len(heldout)} held-out document(s); two disjoint held-out splits (selection, report) "
            "need at least 2: raise data.heldout_fraction or give more documents"
        )
    cut = len(heldout) // 2
    return {"selection": heldout[:cut], "report": heldout[cut:]}


def heldout_source(source: str | Path | None) -> str:
    """Where the held-out text comes from, for results.json."""
    if source is None:
        return str(require().heldout_text)
    return str(source)


def train_and_heldout(source: str | Path | None, text_field: str, heldout_fraction: float, split: str = "selection"):
    """(training documents, held-out documents of `split`): the embedded default has its own held-out text; a user
    source is split by document (the last heldout_fraction of them). The held-out documents are then cut into the
    disjoint `selection` and `report` halves (heldout_splits)."""
    if source is None:
        held = read_documents(require().heldout_text, text_field)
        return read_documents(None, text_field), heldout_splits(held, "the embedded default")[split]
    docs = read_documents(source, text_field)
    if heldout_fraction <= 0:
        raise CorpusError("config key 'data.heldout_fraction': stage 2 needs held-out text; set it above 0")
    train, held = split_documents(docs, heldout_fraction)
    return train, heldout_splits(held, f"data.source {source}")[split]


def heldout_documents(source: str | Path | None, text_field: str, heldout_fraction: float, split: str) -> list[str]:
    """The held-out documents of `split` alone (the embedded default's training text is not read for them)."""
    if source is None:
        return heldout_splits(read_documents(require().heldout_text, text_field), "the embedded default")[split]
    return train_and_heldout(source, text_field, heldout_fraction, split)[1]


def report_text(cfg: Config) -> tuple[str, str]:
    """(text, description) of the held-out text the perplexity and the LA share are reported on: eval.ppl_text, else
    the `report` half of the held-out documents (of data.source, else of the embedded default) -- never the
    `selection` half on which stage 2 chose its checkpoint."""
    evaluation = cfg.eval
    if evaluation.ppl_text:
        path = Path(evaluation.ppl_text)
        if not path.is_file():
            raise ConfigError(
                f"config key 'eval.ppl_text': {path} does not exist; point it at a text file, or leave it unset for "
                "the report half of the held-out text"
            )
        return path.read_text(), f"eval.ppl_text {path}"
    docs = heldout_documents(cfg.data.source, cfg.data.text_field, cfg.data.heldout_fraction, "report")
    where = heldout_source(cfg.data.source)
    return "\n\n".join(docs), f"report half of the held-out documents of {where} ({len(docs)} documents)"
