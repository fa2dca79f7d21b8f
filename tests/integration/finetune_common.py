"""What the stage-2 tests share (test_finetune.py, test_finetune_tp.py): a tiny converted model and its text, the
overrides of a 10-step SSD run on it, and running `hybrid-scale finetune` on ranks."""

import json
from pathlib import Path

import procs
from conftest import perturb_hybrid, tiny_model
from transformers import AutoTokenizer

import hybrid_scale as hs


def make_setup(smollm2, tmp_path_factory) -> Path:
    """A tiny converted model (window 8, perturbed hybrid parameters) and 300 documents of text."""
    root = tmp_path_factory.mktemp("stage2")
    base = root / "base"
    model = tiny_model("llama", vocab_size=49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(base)
    perturb_hybrid(hs.convert_model(model, {"window": 8}))
    hs.save_converted(model, root / "converted", base_path=base)
    docs = smollm2.train_text.read_text().split("\n\n")[:300]
    (root / "text.txt").write_text("\n\n".join(docs))
    return root


def overrides(setup: Path, run_dir: Path, *extra) -> list[str]:
    return [
        f"finetune.model={setup / 'converted'}",
        f"data.source={setup / 'text.txt'}",
        f"run_dir={run_dir}",
        "finetune.seq_len=64",
        "finetune.max_steps=10",
        "finetune.global_batch=4",
        "finetune.micro_batch=1",
        "finetune.eval_every=5",
        "finetune.save_every=3",
        "finetune.heldout_sequences=4",
        "finetune.lr=0.002",
        "finetune.warmup_steps=2",
        "finetune.recipe=ssd",
        "finetune.ssd_granularity=layer",
        "finetune.ssd_windows=[[0,8],[0.5,16]]",
        "finetune.train_gamma=true",
        "finetune.train_feature_maps=true",
        "finetune.progress=false",
        *extra,
    ]


LR, WARMUP = 0.002, 2  # the overrides' finetune.lr and finetune.warmup_steps


def documented_lr(max_steps: int) -> list[float]:
    """The learning rate of steps 1..max_steps as finetune/schedule.py's docstring writes it (not its code)."""
    n, w = max_steps, WARMUP
    return [LR * k / w if k <= w else LR * (n + 1 - k) / (n + 1 - w) for k in range(1, n + 1)]


def assert_schedule(run: Path, max_steps: int = 10) -> None:
    """The learning rates that metrics.jsonl logs for the steps of the run (one record each, resumes included) are
    the documented ones: step 1 already trains, the last one too."""
    steps = [r for r in map(json.loads, (run / "stage2" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]  # fmt: skip
    assert [r["step"] for r in steps] == list(range(1, max_steps + 1))
    got, want = [r["lr"] for r in steps], documented_lr(max_steps)
    assert all(abs(a - b) <= 1e-12 for a, b in zip(got, want, strict=True)), (got, want)
    assert min(got) > 0


def finetune(args, ranks=2, env=None, cold=False):
    return procs.run(["finetune", *args], env, timeout=600, ranks=ranks, cold=cold)


def curves(run: Path) -> dict:
    return json.loads((run / "stage2" / "curves.json").read_text())
