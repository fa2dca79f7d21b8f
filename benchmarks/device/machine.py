"""What the parts of both harnesses share about the machine and the models: the byte-level tokenizer (the tiny model's
and the shaped models'), the shaped random Llama's config, synchronising the device, the package versions and the
machine for the reports."""

from __future__ import annotations

import platform
from pathlib import Path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the tokenizers ByteLevel pre-tokenizer maps bytes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def byte_tokenizer():
    """A byte-level tokenizer (ids 0-2: <pad>, <s>, </s>; 3-258: the 256 bytes), built here, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for _, ch in sorted(bytes_to_unicode().items()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def llama_config(m: dict, vocab: int, max_positions: int, tie: bool, special: tuple = (0, 1, None)):
    """The LlamaConfig of a shaped random model (m: hidden, inter, layers, heads, kv, head_dim), Llama 3's RoPE;
    special: the pad, bos and eos ids (eos None: `generate` never stops early)."""
    from transformers import LlamaConfig

    pad, bos, eos = special
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        head_dim=m["head_dim"],
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=tie,
    )


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


PACKAGES = (
    "transformers",
    "peft",
    "deepspeed",
    "tokenizers",
    "safetensors",
    "datasets",
    "omegaconf",
    "triton",
    "fla-core",
)


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    out |= {name: package_version(name) for name in PACKAGES}
    import hybrid_scale

    out["hybrid_scale_from"] = str(Path(hybrid_scale.__file__).parent)
    return out


def device_info(device: str) -> dict:
    import torch

    info = {"device": device}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info |= {
            "gpu": p.name,
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}",
        }
    else:
        info |= {"gpu": None, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    return info
