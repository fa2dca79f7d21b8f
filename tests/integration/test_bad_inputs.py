"""The bad-input table: every stage's user-supplied files, paths and keys, each wrong in one way. Each row asserts the
exit code (2), one line on stderr naming the problem and the fix, no traceback, and the run directory (and every
input) byte-for-byte unchanged -- the errors are raised before any work starts. The four inputs that used to end in
a traceback also run through a real `python -m hybrid_scale` process."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_stage2_like, tiny_model, tiny_run_overrides
from transformers import AutoTokenizer, LlamaForCausalLM

import hybrid_scale as hs
from hybrid_scale.cli import main


def snapshot(*roots: Path) -> dict:
    """Every path under the roots with the sha256 of each file (directories as None): a byte-for-byte picture."""
    out = {}
    for root in roots:
        if not root.exists():
            out[str(root)] = "absent"
            continue
        for p in sorted([root, *root.rglob("*")]):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


@pytest.fixture(scope="module")
def w(tiny_run_model, smollm2, tmp_path_factory):
    """Good and bad inputs around the tiny run model m (2 layers, SmolLM2's tokenizer, text.txt)."""
    root = tmp_path_factory.mktemp("bad")
    m = tiny_run_model
    x = {"root": root, "m": m, "run": root / "run"}
    x["run"].mkdir()
    (x["run"] / "notes.txt").write_text("the user's own file in the run directory\n")

    def copy_model(name, files=None):
        d = root / name
        d.mkdir()
        for f in m.iterdir():
            if f.is_file() and (files is None or f.name in files):
                shutil.copy(f, d / f.name)
        return d

    x["truncated"] = copy_model("truncated")
    data = (x["truncated"] / "model.safetensors").read_bytes()
    (x["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    x["garbage"] = copy_model("garbage")
    (x["garbage"] / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    model = LlamaForCausalLM.from_pretrained(m, dtype=torch.float32)
    x["sharded_missing"] = root / "sharded_missing"
    model.save_pretrained(x["sharded_missing"], max_shard_size="2MB")
    AutoTokenizer.from_pretrained(m).save_pretrained(x["sharded_missing"])
    shards = sorted(x["sharded_missing"].glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[-1].unlink()
    x["bad_index"] = root / "bad_index"
    shutil.copytree(x["sharded_missing"], x["bad_index"])
    (x["bad_index"] / "model.safetensors.index.json").write_text('{"weight_map": ')
    x["no_tokenizer"] = copy_model("no_tokenizer", {"config.json", "model.safetensors", "generation_config.json"})
    x["bin_only"] = copy_model("bin_only", None)
    (x["bin_only"] / "model.safetensors").unlink()
    torch.save(model.state_dict(), x["bin_only"] / "pytorch_model.bin")
    x["gpt2"] = copy_model("gpt2")
    (x["gpt2"] / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    x["a_file"] = root / "a_file.txt"
    x["a_file"].write_text("not a directory\n")

    # converted models: stage-1-like (no adapter), stage-2-like (adapter), an export, damaged ones
    x["s1"] = hs.save_converted(hs.convert_model(model, {"window": 8}), root / "s1", base_path=m)
    x["s2"] = save_stage2_like(LlamaForCausalLM.from_pretrained(m, dtype=torch.float32), root / "s2", m)
    x["s1_corrupt"] = root / "s1_corrupt"
    shutil.copytree(x["s1"], x["s1_corrupt"])
    (x["s1_corrupt"] / "hybrid_params.safetensors").write_bytes(b"\x00" * 16)
    x["s1_no_base"] = root / "s1_no_base"
    shutil.copytree(x["s1"], x["s1_no_base"])
    meta = json.loads((x["s1"] / "hybrid_config.json").read_text())
    (x["s1_no_base"] / "hybrid_config.json").write_text(json.dumps({**meta, "base_model": str(root / "gone")}))
    other = tiny_model("llama", vocab_size=49152, hidden_size=32, intermediate_size=48, pad_token_id=2)
    other.save_pretrained(root / "other_base")
    save_stage2_like(other, root / "other_s2", root / "other_base")
    x["foreign_adapter"] = root / "foreign_adapter"
    shutil.copytree(x["s1"], x["foreign_adapter"])
    shutil.copytree(root / "other_s2" / "adapter", x["foreign_adapter"] / "adapter")
    x["export"] = root / "export"
    assert main(["export", f"export.model={x['s2']}", f"export.out_dir={x['export']}", f"run_dir={root / 'xr'}"]) == 0

    # training text
    x["missing_txt"] = root / "missing.txt"
    x["empty_txt"] = root / "empty.txt"
    x["empty_txt"].write_text("\n\n  \n")
    x["short_txt"] = root / "short.txt"
    x["short_txt"].write_text("A few words.\n\nAnd a few more.\n")
    x["non_utf8"] = root / "latin1.txt"
    x["non_utf8"].write_bytes("caf\xe9 au lait\n\n".encode("latin-1") * 50)
    good = [json.dumps({"text": d}) for d in (m / "text.txt").read_text().split("\n\n")[:200]]
    x["broken_jsonl"] = root / "broken.jsonl"
    x["broken_jsonl"].write_text("\n".join(good[:2] + ['{"text": "unterminated'] + good[2:]) + "\n")
    x["no_field_jsonl"] = root / "nofield.jsonl"
    x["no_field_jsonl"].write_text("\n".join(good[:4] + [json.dumps({"body": "x"})] + good[4:]) + "\n")
    x["list_jsonl"] = root / "list.jsonl"
    x["list_jsonl"].write_text("\n".join(good[:1] + ['["a", "b"]'] + good[1:]) + "\n")
    x["not_dataset"] = root / "not_dataset"
    x["not_dataset"].mkdir()
    (x["not_dataset"] / "readme.md").write_text("just a folder\n")

    # evaluation inputs
    x["empty_tasks"] = root / "empty_tasks"
    x["empty_tasks"].mkdir()
    x["foreign_dir"] = root / "photos"
    x["foreign_dir"].mkdir()
    (x["foreign_dir"] / "holiday.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return x


def base(w, *extra):
    return tiny_run_overrides(w["m"], w["run"], *extra)


# (id, command, overrides(w) -> list, fragments the one line must hold: the problem and the fix)
ROWS = [
    # stage 1: the model
    (
        "model-path-missing",
        "distill",
        lambda w: base(w, f"model.path={w['root'] / 'nope'}"),
        ["nope does not exist", "set model.path to a local Hugging Face model directory"],
    ),
    (
        "model-path-is-a-file",
        "distill",
        lambda w: base(w, f"model.path={w['a_file']}"),
        ["a_file.txt is a file", "set model.path to the model's directory"],
    ),
    (
        "truncated-safetensors",
        "distill",
        lambda w: base(w, f"model.path={w['truncated']}"),
        [
            "model.safetensors is not a readable safetensors file",
            "incomplete metadata",
            "restore the checkpoint's files or set model.path",
        ],
    ),
    (
        "garbage-safetensors",
        "distill",
        lambda w: base(w, f"model.path={w['garbage']}"),
        ["garbage/model.safetensors is not a readable safetensors file", "restore the checkpoint's files"],
    ),
    (
        "index-names-missing-shard",
        "distill",
        lambda w: base(w, f"model.path={w['sharded_missing']}"),
        ["shard(s) named in its index are missing: model-0000", "restore the checkpoint's files"],
    ),
    (
        "index-not-json",
        "distill",
        lambda w: base(w, f"model.path={w['bad_index']}"),
        ["model.safetensors.index.json is not valid JSON", "restore the checkpoint's files"],
    ),
    (
        "no-tokenizer",
        "distill",
        lambda w: base(w, f"model.path={w['no_tokenizer']}"),
        ["has no tokenizer files", "copy the tokenizer next to the weights"],
    ),
    (
        "bin-weights-only",
        "distill",
        lambda w: base(w, f"model.path={w['bin_only']}"),
        ["has no model.safetensors(.index.json)", "save_pretrained(safe_serialization=True)"],
    ),
    (
        "unsupported-architecture",
        "distill",
        lambda w: base(w, f"model.path={w['gpt2']}"),
        ["architecture 'gpt2' is not supported", "supported: llama, mistral, qwen2"],
    ),
    (
        "model-path-is-an-export",
        "distill",
        lambda w: base(w, f"model.path={w['export']}"),
        ["is a hybrid_scale export, not a base model", "set model.path to the plain model it was made from"],
    ),
    (
        "model-path-is-a-stage2-output",
        "distill",
        lambda w: base(w, f"model.path={w['s2']}"),
        ["is a converted model (a stage-1/stage-2 output), not a base model", "set model.path to its base model"],
    ),
    (
        "layers-out-of-range",
        "distill",
        lambda w: base(w, "attention.layers=[99]"),
        ["config key 'attention.layers': layer(s) [99] do not exist; the model has 2 layers (0-1)"],
    ),
    (
        "run-dir-is-a-file",
        "distill",
        lambda w: base(w, f"run_dir={w['a_file']}"),
        ["config key 'run_dir'", "a_file.txt is a file, not a directory", "set run_dir to a directory"],
    ),
    (
        "wrong-dtype-string",
        "distill",
        lambda w: base(w, "model.dtype=fp16"),
        ["config key 'model.dtype': 'fp16' is not allowed; choose one of: float32, bfloat16, float16"],
    ),
    (
        "wrong-buffer-dtype",
        "distill",
        lambda w: base(w, "distill.buffer_dtype=float8"),
        ["config key 'distill.buffer_dtype': 'float8' is not allowed; choose one of"],
    ),
    # stage 1: the training text
    (
        "data-missing",
        "distill",
        lambda w: base(w, f"data.source={w['missing_txt']}"),
        ["config key 'data.source'", "missing.txt does not exist; point it at a .txt, a .jsonl or a saved dataset"],
    ),
    (
        "data-empty",
        "distill",
        lambda w: base(w, f"data.source={w['empty_txt']}"),
        ["empty.txt holds no text; point data.source at a file with documents in it"],
    ),
    (
        "data-too-short",
        "distill",
        lambda w: base(w, f"data.source={w['short_txt']}"),
        ["sequences of 64", "lower data.num_sequences or data.seq_len, or give more text"],
    ),
    (
        "jsonl-broken-line",
        "distill",
        lambda w: base(w, f"data.source={w['broken_jsonl']}"),
        ["broken.jsonl:3 is not valid JSON", "fix or remove that line"],
    ),
    (
        "jsonl-no-text-field",
        "distill",
        lambda w: base(w, f"data.source={w['no_field_jsonl']}"),
        ["nofield.jsonl:5 has no field 'text'", "set data.text_field"],
    ),
    (
        "jsonl-line-not-an-object",
        "distill",
        lambda w: base(w, f"data.source={w['list_jsonl']}"),
        ["list.jsonl:2 is a JSON list, not an object", "write one object per line"],
    ),
    (
        "data-dir-not-a-dataset",
        "distill",
        lambda w: base(w, f"data.source={w['not_dataset']}"),
        ["is a directory but not a `datasets` save_to_disk directory", "point it at a .txt, a .jsonl"],
    ),
    (
        "data-not-utf8",
        "distill",
        lambda w: base(w, f"data.source={w['non_utf8']}"),
        ["latin1.txt is not UTF-8 text", "convert it to UTF-8"],
    ),
    # stage 2
    (
        "finetune-model-not-converted",
        "finetune",
        lambda w: base(w, f"finetune.model={w['m']}"),
        ["config key 'finetune.model'", "is not a converted model (no hybrid_config.json); point it at a stage-1"],
    ),
    (
        "finetune-model-has-adapter",
        "finetune",
        lambda w: base(w, f"finetune.model={w['s2']}"),
        ["already carries a LoRA adapter", "export it (merged) first and fine-tune the export"],
    ),
    (
        "finetune-model-base-missing",
        "finetune",
        lambda w: base(w, f"finetune.model={w['s1_no_base']}"),
        ["the base model", "gone named in", "is missing; restore it or edit 'base_model'"],
    ),
    (
        "finetune-params-corrupt",
        "finetune",
        lambda w: base(w, f"finetune.model={w['s1_corrupt']}"),
        ["hybrid_params.safetensors is not a readable safetensors file", "rerun the stage that wrote it"],
    ),
    (
        "finetune-heldout-too-small",
        "finetune",
        lambda w: base(w, f"finetune.model={w['s1']}", "finetune.heldout_sequences=500"),
        ["finetune.heldout_sequences asks for 500", "lower it or finetune.seq_len, or give more held-out text"],
    ),
    (
        "finetune-batch-not-multiple",
        "finetune",
        lambda w: base(w, "finetune.global_batch=3", "finetune.micro_batch=2"),
        ["config key 'finetune.global_batch': 3 is not a multiple of finetune.micro_batch (2)"],
    ),
    # evaluation
    (
        "eval-model-missing",
        "evaluate",
        lambda w: base(w, f"eval.model={w['root'] / 'nope'}"),
        ["config key 'eval.model'", "nope does not exist; set it to a model directory, or leave it unset"],
    ),
    (
        "eval-model-not-a-model",
        "evaluate",
        lambda w: base(w, f"eval.model={w['not_dataset']}"),
        ["config key 'eval.model'", "is neither a Hugging Face model nor a converted model", "point it at one"],
    ),
    (
        "eval-ppl-text-missing",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", f"eval.ppl_text={w['missing_txt']}"),
        ["config key 'eval.ppl_text'", "missing.txt does not exist; point it at a text file"],
    ),
    (
        "eval-passkey-too-close",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", "eval.passkey_distances=[3,64]"),
        ["config key 'eval.passkey_distances': passkey distances must be >= 6 (the needle's end and the question"],
    ),
    (
        "eval-passkey-beyond-the-text",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", "eval.passkey_distances=[100000]"),
        ["config key 'eval.passkey_distances': passkey distance 100000 needs", "tokens of filler", "eval.ppl_text"],
    ),
    (
        "eval-data-dir-empty",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", f"eval.data_dir={w['empty_tasks']}"),
        ["config key 'eval.data_dir'", "has no piqa dataset(s)", "point eval.data_dir at such a folder"],
    ),
    (
        "eval-out-dir-is-a-file",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", f"eval.out_dir={w['a_file']}"),
        ["config key 'eval.out_dir'", "is a file"],
    ),
    (
        "eval-out-dir-foreign",
        "evaluate",
        lambda w: base(w, f"eval.model={w['s1']}", f"eval.out_dir={w['foreign_dir']}"),
        [
            "config key 'eval.out_dir'",
            "photos is a non-empty directory without an evaluation of ours",
            "nothing was touched: choose a new or empty directory",
        ],
    ),
    (
        "eval-adapter-from-another-model",
        "evaluate",
        lambda w: base(w, f"eval.model={w['foreign_adapter']}"),
        [
            "config key 'eval.model': the adapter in",
            "gives model.layers.0.self_attn.o_proj.weight a delta of shape [32, 32] but the base model",
            "holds [64, 64]: it was trained on another model",
        ],
    ),
    (
        "eval-unknown-task",
        "evaluate",
        lambda w: base(w, "eval.tasks=[piqa,squad]"),
        ["config key 'eval.tasks': 'squad' is not allowed"],
    ),
    # export: where it writes
    (
        "export-into-the-run-dir",
        "export",
        lambda w: base(w, f"export.model={w['s2']}", f"export.out_dir={w['run']}"),
        ["config key 'export.out_dir'", "which the export reads or the run keeps; nothing was touched"],
    ),
    (
        "export-into-a-parent-of-the-base",
        "export",
        lambda w: base(w, f"export.model={w['s2']}", f"export.out_dir={w['m'].parent}"),
        ["config key 'export.out_dir'", "is or holds", "nothing was touched: choose a new directory"],
    ),
    (
        "export-into-a-foreign-dir",
        "export",
        lambda w: base(w, f"export.model={w['s2']}", f"export.out_dir={w['foreign_dir']}"),
        ["photos exists and is not an export written by hybrid_scale", "nothing was touched"],
    ),
    (
        "export-onto-a-file",
        "export",
        lambda w: base(w, f"export.model={w['s2']}", f"export.out_dir={w['a_file']}"),
        ["a_file.txt exists and is not a directory; nothing was touched"],
    ),
    # export: what it reads
    (
        "export-adapter-from-another-model",
        "export",
        lambda w: base(w, f"export.model={w['foreign_adapter']}", f"export.out_dir={w['root'] / 'never'}"),
        [
            "config key 'export.model': the adapter in",
            "holds [64, 64]: it was trained on another model",
            "use the stage-2 output made from this base",
        ],
    ),
    (
        "export-params-corrupt",
        "export",
        lambda w: base(w, f"export.model={w['s1_corrupt']}", f"export.out_dir={w['root'] / 'never'}"),
        ["hybrid_params.safetensors is not a readable safetensors file"],
    ),
    (
        "export-base-missing",
        "export",
        lambda w: base(w, f"export.model={w['s1_no_base']}", f"export.out_dir={w['root'] / 'never'}"),
        ["the base model", "is missing; restore it or edit 'base_model'"],
    ),
    (
        "export-model-not-converted",
        "export",
        lambda w: base(w, f"export.model={w['m']}"),
        ["config key 'export.model'", "is not a converted model", "point it at a stage-1/stage-2 output"],
    ),
    (
        "export-wrong-dtype",
        "export",
        lambda w: base(w, f"export.model={w['s2']}", "export.dtype=half"),
        ["config key 'export.dtype': 'half' is not allowed"],
    ),
]


@pytest.mark.parametrize("name,command,args,expect", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_clear_line_and_nothing_changes(w, capsys, name, command, args, expect):
    before = snapshot(w["root"])
    code = main([command, *args(w)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hybrid-scale {command}: error: "), err
    assert "Traceback" not in err
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert snapshot(w["root"]) == before  # the run directory and every input, byte for byte


def test_at_least_thirty_rows():
    assert len(ROWS) >= 30 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize(
    "name", ["truncated-safetensors", "jsonl-broken-line", "layers-out-of-range", "run-dir-is-a-file"]
)
def test_the_four_former_tracebacks_through_the_console(w, name):
    """As a user sees them: a real process, exit 2, one line, no traceback, nothing written."""
    _, command, args, expect = next(r for r in ROWS if r[0] == name)
    before = snapshot(w["root"])
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_scale", command, *args(w)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if "real_accelerator" not in x]  # deepspeed's import note
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(f in lines[0] for f in expect), lines[0]
    assert snapshot(w["root"]) == before


def test_a_full_disk_during_the_export_keeps_nothing_half_written(w, capsys, monkeypatch):
    out = w["root"] / "full_disk_export"
    monkeypatch.setenv("HYBRID_SCALE_FAULT", "enospc:export")
    code = main(["export", f"export.model={w['s2']}", f"export.out_dir={out}", f"run_dir={w['run']}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no space left on the device" in err and "free space there" in err
    assert not out.exists() and not (w["root"] / "full_disk_export.partial").exists()
