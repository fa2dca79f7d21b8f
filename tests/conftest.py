"""Tiny random models built from configs (no downloads) and random attention inputs."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter on CPU (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: each worker, and what it starts,
    torch.set_num_threads(1)  # uses one thread (tiny models gain nothing from more; the workers would oversubscribe)
    os.environ["OMP_NUM_THREADS"] = "1"
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3_rope_headdim": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": LLAMA3_ROPE, "head_dim": 24}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # (multipliers away from 1, and a scores' scale other than 1/sqrt(head_dim), so that dropping any one shows)
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
    ),  # fmt: skip
}


def assert_split(report: str, tp: int, kinds=("q_proj", "o_proj", "gate_proj", "down_proj")) -> None:
    """A stage's tensor_parallel.split_report line says each rank holds about 1/tp of the parameter bytes and each
    named weight's local part is 1/tp of it along exactly one dimension (fails when the split was skipped)."""
    import re

    fraction = float(re.search(r"each rank holds at most ([\d.]+) of the parameter bytes", report).group(1))
    assert 1 / tp <= fraction < 1 / tp + 0.1, report
    for kind in kinds:
        m = re.search(rf"\b{re.escape(kind)} \[([\d, ]+)\] of \[([\d, ]+)\]", report)
        assert m, (kind, report)
        part, whole = ([int(x) for x in g.split(",")] for g in m.groups())
        cut = [(p, w) for p, w in zip(part, whole, strict=True) if p != w]
        assert len(cut) == 1 and cut[0][0] * tp == cut[0][1], (kind, part, whole)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():  # random biases so Qwen2's q/k/v biases matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def perturb_hybrid(model, scale: float = 0.3, seed: int = 1):
    """Move phi and gamma away from their init so that tests see every parameter."""
    from hybrid_scale.models.converted import hybrid_state_dict

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hybrid_state_dict(model).values():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def save_stage2_like(model, out, base_path, **attention):
    """Convert `model` (window 8, and any other attention settings given), move its phi/gamma and save it at `out`
    with a random LoRA adapter on q, v, o, as stage 2 leaves a model."""
    from peft import LoraConfig, get_peft_model

    import hybrid_scale as hs
    from hybrid_scale.models.converted import ADAPTER_DIR

    perturb_hybrid(hs.convert_model(model, {"window": 8, **attention}))
    hs.save_converted(model, out, base_path=base_path)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out / ADAPTER_DIR)
    return out


HYBRID_SINKS = "hybrid+sinks"  # the hybrid with its own sinks (attention.hybrid_sinks), tested as one more mode


def variant(name: str) -> dict:
    """The attention keywords of a mode name, or of HYBRID_SINKS: mode="hybrid" with hybrid_sinks=True."""
    return dict(mode="hybrid", hybrid_sinks=True) if name == HYBRID_SINKS else dict(mode=name)


def attention_inputs(B=2, H=4, Hkv=2, T=12, D=4, F=3, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, positive=False):
        x = torch.rand(*shape, generator=g, dtype=dtype) if positive else torch.randn(*shape, generator=g, dtype=dtype)
        return x.requires_grad_(requires_grad)

    return dict(
        q=r(B, H, T, D),
        k=r(B, Hkv, T, D),
        v=r(B, Hkv, T, D),
        fq=r(B, H, T, F, positive=True),
        fk=r(B, Hkv, T, F, positive=True),
        gamma=(0.05 + 0.9 * torch.rand(H, generator=g, dtype=dtype)).requires_grad_(requires_grad),
    )


@pytest.fixture
def tiny():
    return tiny_model


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default, prepared once (converted from the installed packages on a fresh machine)."""
    from hybrid_scale.data import assets

    return assets.prepare()


@pytest.fixture(scope="session")
def tiny_smollm_vocab(smollm2, tmp_path_factory):
    """A tiny random Llama that uses SmolLM2's tokenizer, saved as a local HF directory."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_vocab")
    model = tiny_model("llama", vocab_size=49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_run_model(smollm2, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and a text.txt of training documents: the model the
    whole-pipeline tests (pipeline, quickstart, Slurm) run on."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_run")
    model = tiny_model("llama", vocab_size=49152, num_hidden_layers=2, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(path)
    (path / "text.txt").write_text("\n\n".join(smollm2.train_text.read_text().split("\n\n")[:300]))
    return path


def tiny_run_overrides(model, run_dir, *extra) -> list[str]:
    """Budgets for every stage small enough for a test; `extra` overrides them (later keys win)."""
    return [
        f"model.path={model}",
        f"data.source={model / 'text.txt'}",
        f"run_dir={run_dir}",
        "attention.window=8",
        "data.seq_len=64",
        "data.num_sequences=8",
        "distill.epochs=1",
        "distill.batch_size=4",
        "distill.progress=false",
        "finetune.recipe=ssd",
        "finetune.max_steps=6",
        "finetune.global_batch=2",
        "finetune.eval_every=3",
        "finetune.save_every=2",
        "finetune.heldout_sequences=2",
        "finetune.lr=0.002",
        "finetune.progress=false",
        "eval.tasks=[piqa]",
        "eval.limit=4",
        "eval.modes=[base,hybrid,la_only,none]",
        "eval.ppl_seq_len=64",
        "eval.ppl_sequences=1",
        "eval.buckets=[0,8]",
        "eval.la_share_seq_len=0",
        "eval.passkey_distances=[12,24]",
        "eval.passkey_trials=2",
        "eval.passkey_modes=[base,hybrid,swa_sinks]",
        "eval.bootstrap=10",
        "eval.progress=false",
        *extra,
    ]


# The files that take longest (docs/results/test_time.md), longest first. `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder), so these go first and the many short files
# fill in at the end: otherwise one worker can start a four-minute file when the other has nothing left.
LONGEST_FIRST = [  # by their time in docs/results/test_time.md (a file's tests run on one worker, in order)
    "tests/unit/test_triton_kernels.py",
    "tests/slurm/test_slurm.py",
    "tests/integration/test_export.py",
    "tests/integration/test_same_numbers.py",
    "tests/integration/test_finetune.py",
    "tests/unit/test_kernel_compile.py",
    "tests/integration/test_evaluate.py",
    "tests/integration/test_gpu_check.py",
    "tests/integration/test_compiled_generate.py",
    "tests/integration/test_metrics.py",
    "tests/integration/test_distill.py",
    "tests/integration/test_finetune_tp.py",
    "tests/integration/test_device_speed.py",
    "tests/integration/test_bad_inputs.py",
    "tests/integration/test_launch.py",
    "tests/unit/test_chunk_backward.py",
    "tests/unit/test_benchmarks.py",
    "tests/integration/test_pipeline.py",
    "tests/distributed/test_dry_run.py",
    "tests/integration/test_reproduce.py",
    "tests/integration/test_gated_delta_stages.py",
    "tests/unit/test_chunk_forward.py",
    "tests/unit/test_plan_reports.py",
    "tests/unit/test_cache_decode.py",
    "tests/unit/test_imports.py",
    "tests/unit/test_chunk_scan.py",
    "tests/distributed/test_tensor_parallel.py",
]


def pytest_collection_modifyitems(config, items):
    """tests/unit is the fast tier (`make test-fast` = `-m fast`) unless a test there is marked slow; the longest
    files are collected first."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept otherwise
    for item in items:
        if item.nodeid.startswith("tests/unit/") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)


@contextmanager
def one_thread():
    """This process computes with one CPU thread, as the CLI and torchrun children do (procs: OMP_NUM_THREADS=1): CPU
    kernels round differently with another number of threads, and the tests compare numbers bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own (root only: skipped where mount is refused), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)
