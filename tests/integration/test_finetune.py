"""Stage 2 under DeepSpeed ZeRO-3 on a tiny converted model: 2 ranks (gloo), SIGKILL / SIGUSR1 and resume (also on
1 rank), the saved adapter, unused gamma in la_only, HedgeCATs early stopping, tensor parallelism.
Its module fixtures (the converted model, the reference run, the tp 1 run) are built once per pytest worker under
--dist loadfile."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch
from conftest import perturb_hybrid, tiny_model
from finetune_common import assert_schedule, curves, finetune, make_setup, overrides
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybrid_scale as hs
from hybrid_scale.data import corpus
from hybrid_scale.distributed.requeue import EXIT_REQUEUE
from hybrid_scale.finetune.checkpoints import committed_steps
from hybrid_scale.storage.commits import MARKER, PARTIAL_TAG

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(smollm2, tmp_path_factory):
    return make_setup(smollm2, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    proc = finetune(overrides(setup, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


RECORDER = """
import json, os, sys
from pathlib import Path

from hybrid_scale.distributed.deepspeed import import_deepspeed

deepspeed = import_deepspeed()
real_initialize = deepspeed.initialize
fed = []  # every row of input_ids this rank's engine receives in a training forward, in order


def record(module, args, kwargs):
    if module.training:  # not the held-out losses
        fed.extend(kwargs["input_ids"].tolist())


def initialize(*args, **kwargs):
    kwargs["model"].register_forward_pre_hook(record, with_kwargs=True)  # the PEFT model the engine calls
    return real_initialize(*args, **kwargs)


deepspeed.initialize = initialize
from hybrid_scale.cli import main

try:
    code = main(sys.argv[1:])
finally:
    out = Path(os.environ["HYBRID_SCALE_TEST_FED_DIR"])  # (HYBRID_SCALE_*: read at run time, the run forks warm)
    (out / f"fed.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(fed))
sys.exit(code)
"""


def test_each_step_consumes_the_same_sequences_on_one_and_two_ranks(setup, smollm2, tmp_path):
    """The real data path of finetune() at 1 and at 2 ranks (global batch 4, micro-batch 1): a recorder around
    deepspeed.initialize logs the input_ids of every training forward on every rank. 9 training sequences and 5 steps
    cross two epoch boundaries, both inside a step. Per step, the union over the ranks of what they fed is the same
    multiset of sequences as one rank alone fed."""
    text = tmp_path / "six_docs.txt"  # 3 training documents: 9 sequences of 64 tokens; 3 held out
    text.write_text("\n\n".join(smollm2.train_text.read_text().split("\n\n")[:6]))
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    fed, losses = {}, {}
    for world in (1, 2):
        run = tmp_path / f"world{world}"
        run.mkdir()
        args = overrides(
            setup,
            run,
            f"data.source={text}",
            "data.heldout_fraction=0.5",
            "finetune.max_steps=5",
            "finetune.eval_every=0",
            "finetune.heldout_sequences=1",
            "finetune.save_every=5",
        )
        proc = procs.run(
            ["finetune", *args],
            {"HYBRID_SCALE_TEST_FED_DIR": str(run)},
            600,
            ranks=world if world > 1 else 0,
            script=script,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        fed[world] = [[tuple(s) for s in json.loads((run / f"fed.rank{r}.json").read_text())] for r in range(world)]
        losses[world] = curves(run)["train"]
    (alone,) = fed[1]
    assert len(alone) == 5 * 4 and all(len(s) == 64 for s in alone)
    assert [len(r) for r in fed[2]] == [5 * 2, 5 * 2]  # each rank feeds its half: 2 micro-batches of 1 per step
    for step in range(5):
        shared = [s for r in fed[2] for s in r[2 * step : 2 * step + 2]]
        assert sorted(shared) == sorted(alone[4 * step : 4 * step + 4]), f"step {step}"
    # what was consumed: the training sequences, each once per epoch, in a new order each epoch
    tokenizer = AutoTokenizer.from_pretrained(setup / "base")
    train_docs, _ = corpus.train_and_heldout(text, "text", 0.5)
    train = {tuple(s) for s in corpus.pack(tokenizer, train_docs, 64, None, 0).tolist()}
    assert len(train) == 9
    first, second = alone[:9], alone[9:18]
    assert set(first) == set(second) == train and first != second
    # the same data and the same summed gradients: the same curve up to the order of the sums
    assert torch.allclose(torch.tensor(losses[2]), torch.tensor(losses[1]), rtol=1e-4)


def test_reference_run_trains_and_keeps_the_newest_two_checkpoints(reference):
    c = curves(reference)
    assert len(c["train"]) == 10 and c["eval_steps"] == [5, 10]
    assert_schedule(reference)  # DeepSpeed's engine, given finetune/schedule.py's schedule
    assert c["hybrid"][-1] < c["hybrid"][0]  # held-out hybrid loss went down
    assert [p.name for p in committed_steps(reference / "stage2")] == ["step_00000009", "step_00000010"]
    assert (reference / "stage2" / "output").resolve().name == "final"  # no early stopping for ssd
    assert not (reference / "stage2" / "best").exists()  # best/ is early stopping's choice only: one model per run
    origin = json.loads((reference / "stage2" / "final" / "hybrid_config.json").read_text())["origin"]
    assert origin == {"stage": "stage2", "checkpoint": "final", "step": 10}
    realised = c["ssd"]
    assert [r["p"] for r in realised] == [0.9, 0.75, 0.5] and sum(r["layer_forwards"] for r in realised) == 20
    assert c["window"] == [8] * 5 + [16] * 5  # the window schedule; the window in force goes with the model
    assert json.loads((reference / "stage2" / "final" / "hybrid_config.json").read_text())["attention"]["window"] == 16
    state = json.loads((reference / "stage2" / "step_00000009" / "state.json").read_text())
    assert state["window"] == 16 and state["world"] == 2
    step10 = reference / "stage2" / "step_00000010"
    assert sorted(p.name for p in step10.iterdir()) == [  # the RNG state as tensors: resuming loads no pickle
        "COMMITTED",
        "optimizer.safetensors",
        "rng_rank0.safetensors",
        "rng_rank1.safetensors",
        "state.json",
        "trainable.safetensors",
    ]
    saved = load_file(reference / "stage2" / "step_00000010" / "trainable.safetensors")
    assert all(("lora_" in k) or ("feature_map" in k) or ("gamma_logit" in k) for k in saved)  # never the base
    log = (reference / "stage2" / "log.txt").read_text()
    assert "2 ranks" in log and "ssd realised drop rate per phase" in log


def test_a_signal_saves_exits_75_then_sigkill_and_resume_equal_uninterrupted(setup, reference, tmp_path):
    """One run, stopped twice on 2 ranks. USR1 (TERM sets the same flag: tests/unit/test_requeue.py) during step 4:
    the handler only sets a flag; the ranks agree at the next step boundary, save step 5 and exit 75. Resumed, it is
    SIGKILLed during step 7 (step 6 committed): partial and corrupt step directories are ignored on the next resume,
    whose losses and adapter equal the uninterrupted run's. A copy of the run as the signal left it, resumed on 1
    rank, continues the same curve."""
    run, copy = tmp_path / "a", tmp_path / "b"
    proc = finetune(overrides(setup, run), env={"HYBRID_SCALE_FAULT": "step:4@USR1"}, cold=True)
    assert proc.returncode != 0 and f"exitcode  : {EXIT_REQUEUE}" in proc.stderr, proc.stderr[-3000:]
    stage2 = run / "stage2"
    # the signal came after step 4's agreement: the ranks agree at the end of step 5 and save there
    assert committed_steps(stage2)[-1].name == "step_00000005"
    assert re.search(r"signal: saved step_00000005 in [\d.]+ s", (stage2 / "log.txt").read_text())  # (how long: logged)
    shutil.copytree(stage2, copy / "stage2")

    proc = finetune(overrides(setup, run), env={"HYBRID_SCALE_FAULT": "step:7"})
    assert proc.returncode != 0
    assert [p.name for p in committed_steps(stage2)] == ["step_00000005", "step_00000006"]
    shutil.copytree(stage2 / "step_00000006", stage2 / "step_00000007.partial")  # a save cut short
    corrupt = shutil.copytree(stage2 / "step_00000006", stage2 / "step_00000008")  # marker no longer matches
    (corrupt / "trainable.safetensors").write_bytes(b"\0" * 64)
    assert finetune(overrides(setup, run)).returncode == 0
    log = (stage2 / "log.txt").read_text()
    assert "resumed from step_00000005" in log and "resumed from step_00000006" in log
    assert_schedule(run)  # resumed twice: every step's rate as documented
    ref, got = curves(reference), curves(run)
    assert torch.allclose(torch.tensor(got["train"]), torch.tensor(ref["train"]), rtol=0, atol=1e-6)
    assert got["hybrid"] == pytest.approx(ref["hybrid"], abs=1e-6)
    a = load_file(reference / "stage2" / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(stage2 / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    one = finetune(overrides(setup, copy), ranks=0)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "saved by 2 ranks, now 1" in (copy / "stage2" / "log.txt").read_text()
    assert_schedule(copy)
    got = curves(copy)["train"]
    assert got[:5] == ref["train"][:5]  # restored from the checkpoint
    assert torch.allclose(torch.tensor(got[5:]), torch.tensor(ref["train"][5:]), rtol=1e-4)  # the same curve continues


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(setup, tmp_path):
    """The disk fills while step 6 is saved (the OS error injected where the files are written): one line, exit 2,
    step 3 committed and intact; once there is room again, the same command resumes from step 3 and finishes."""
    args = overrides(setup, tmp_path, "finetune.max_steps=7", "finetune.eval_every=0")
    proc = procs.run(["finetune", *args], {"HYBRID_SCALE_FAULT": "enospc:save:step_00000006"}, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybrid-scale finetune: error: no space left on the device (save:step_00000006)")
    assert "the work committed before it is kept" in last and "Traceback" not in proc.stderr
    stage2 = tmp_path / "stage2"
    assert [p.name for p in committed_steps(stage2)] == ["step_00000003"]
    assert (stage2 / "step_00000006.partial" / PARTIAL_TAG).is_file()  # the toolkit's: the next save clears it
    assert procs.run(["finetune", *args], timeout=600).returncode == 0
    assert "resumed from step_00000003" in (stage2 / "log.txt").read_text()
    assert [p.name for p in committed_steps(stage2)] == ["step_00000006", "step_00000007"]
    assert not (stage2 / "step_00000006.partial").exists() and len(curves(tmp_path)["train"]) == 7


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_disk_that_really_fills_during_a_save_is_one_line_and_resumes_bitwise(setup, tmp_path, small_disk):
    """A real full disk, not an injected error: the run dir on a tmpfs, which another writer fills once step 3 is
    committed, leaving half a step checkpoint free, so step 6's save runs out of space while it writes. One line,
    exit 2, no traceback, step 3 kept; with room again the same command resumes from step 3 and ends bitwise as a
    run that never stopped. TensorBoard is on (run/tensorboard.py: its failure is one line, never the last)."""
    args = ("finetune.max_steps=7", "finetune.eval_every=0", "log.tensorboard=true")
    reference = tmp_path / "reference"  # one process, as the run below (2 ranks would differ in rounding)
    assert procs.run(["finetune", *overrides(setup, reference, *args)], timeout=600).returncode == 0
    run, filler = small_disk / "run", small_disk / "filler"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_SCALE_STEP_SLEEP": "1"}  # a second per step: time to fill
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_scale.cli", "finetune", *overrides(setup, run, *args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    step3 = run / "stage2" / "step_00000003"
    deadline = time.time() + 300
    while not (step3 / MARKER).is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    stat = os.statvfs(small_disk)
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - _size(step3) // 2))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("hybrid-scale finetune: error: no space left on the device (")
    assert "the work committed before it is kept" in last and "Traceback" not in err
    assert (run / "stage2" / "tensorboard").is_dir()
    assert [p.name for p in committed_steps(run / "stage2")] == ["step_00000003"]
    filler.unlink()
    assert procs.run(["finetune", *overrides(setup, run, *args)], timeout=600).returncode == 0
    assert "resumed from step_00000003" in (run / "stage2" / "log.txt").read_text()
    assert curves(run)["train"] == curves(reference)["train"]
    a = load_file(reference / "stage2" / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(run / "stage2" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_writer_and_a_reader_are_refused_while_stage_2_runs(setup, tmp_path):
    """One writer per run dir (run/lock.py): while stage 2 runs (paused by SIGSTOP mid-run), a second stage 2 on
    the same run_dir and an evaluation of the run's model are each refused with one line naming the holder, exit 2,
    and leave the run dir byte for byte as it was; the first run then finishes and releases the lock."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_SCALE_STEP_SLEEP": "1"}
    first = subprocess.Popen([sys.executable, "-m", "hybrid_scale.cli", "finetune", *overrides(setup, run)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while not list((run / "stage2").glob("step_*")) and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)  # until it has written a checkpoint
        assert first.poll() is None, first.communicate()[1][-3000:]
        first.send_signal(signal.SIGSTOP)
        before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
        second = finetune(overrides(setup, run), ranks=0)
        reader = procs.run(["evaluate", f"run_dir={run}", "eval.tasks=[piqa]", "eval.limit=2", "eval.progress=false"])
        after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    finally:
        first.send_signal(signal.SIGCONT)
    holder = f"is in use by finetune (pid {first.pid} on {socket.gethostname()}"
    for proc, cmd in ((second, "finetune"), (reader, "evaluate")):
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"hybrid-scale {cmd}: error: {run.resolve()} {holder}") and line.endswith(
            "wait for it to finish, or choose another run_dir"
        ), line
    assert after == before  # neither wrote a byte
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert not (run / ".lock").exists() and (run / "stage2" / "output").is_symlink()


def test_saved_adapter_is_whole_and_reloads_to_the_trained_logits(setup, reference):
    """final/ (adapter gathered from ZeRO-3 partitions) merged == the checkpoint's fp32 masters applied unmerged."""
    final = reference / "stage2" / "final"
    assert (final / MARKER).is_file()
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 4 * 2  # lora_A and lora_B of q/k/v/o in 2 layers
    assert all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained (B starts at zero)
    # the adapter names the converted model it belongs to, so PEFT's Auto class fails on it instead of loading the
    # LoRA onto the softmax base; its README says how to load it
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(final.resolve())
    assert f'hybrid_scale.load_converted("{final.resolve()}")' in (final / "adapter" / "README.md").read_text()
    from peft import AutoPeftModelForCausalLM

    with pytest.raises((OSError, ValueError), match="config.json"):  # (transformers: no model_type / no file)
        AutoPeftModelForCausalLM.from_pretrained(final / "adapter")
    merged = hs.load_converted(final, dtype=torch.float32)

    plain = AutoModelForCausalLM.from_pretrained(setup / "base", dtype=torch.float32)
    window = json.loads((final / "hybrid_config.json").read_text())["attention"]["window"]
    assert window == 16  # the SSD window schedule's last window is the one the model keeps
    hs.convert_model(plain, {"window": window})
    trained = load_file(reference / "stage2" / "step_00000010" / "trainable.safetensors")
    model = get_peft_model(
        plain, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    missing = model.load_state_dict(trained, strict=False)
    assert not missing.unexpected_keys
    assert any("feature_map_q" in k for k in trained) and any("gamma_logit" in k for k in trained)
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model.eval()(ids).logits, atol=1e-5)


def test_la_only_recipe_leaves_unused_gamma_untouched(setup, tmp_path):
    """gamma is trainable but unused in la_only: ZeRO-3 must cope, and gamma must not move."""
    args = overrides(
        setup, tmp_path, "finetune.recipe=la_only", "finetune.max_steps=4", "finetune.train_feature_maps=false"
    )
    proc = finetune(args, ranks=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = load_file(setup / "converted" / "hybrid_params.safetensors")
    after = load_file(tmp_path / "stage2" / "final" / "hybrid_params.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert "trains in la_only" in (tmp_path / "stage2" / "log.txt").read_text()


def test_hedgecats_stops_early_and_outputs_best(setup, tmp_path):
    args = overrides(
        setup,
        tmp_path,
        "finetune.recipe=hedgecats",
        "finetune.lr=0.05",
        "finetune.eval_every=2",
        "finetune.patience=1",
        "finetune.save_every=1",
    )
    proc = finetune(args, ranks=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = curves(tmp_path)
    stage2 = tmp_path / "stage2"
    # the rule worked out from the recorded losses (la_margin 0.05 first, then patience 1): no evaluation before the
    # last one stops, the last one does, for the recorded reason, and training ends right there
    h, la = c["hybrid"], c["la_only"]

    def verdict(i):
        if la[i] > min(la[: i + 1]) + 0.05:
            return (
                f"la_only loss {la[i]:.4f} rose more than 0.05 above its best {min(la[: i + 1]):.4f} "
                "(the LA path is being abandoned)"
            )
        return "patience: no better hybrid loss in 1 evaluations" if i and h[i] >= min(h[:i]) else None

    expected = [verdict(i) for i in range(len(h))]
    assert expected[-1] is not None and expected == [None] * (len(h) - 1) + [c["stopping"]["reason"]]
    assert len(c["train"]) == c["eval_steps"][-1] < 10
    best_step = c["stopping"]["best_step"]
    assert best_step == c["eval_steps"][c["hybrid"].index(min(c["hybrid"]))]
    # the best checkpoint survives the rotation that removed its step directory
    kept = [p.name for p in committed_steps(stage2)]
    assert len(kept) == 2 and f"step_{best_step:08d}" not in kept
    assert (stage2 / "output").resolve() == (stage2 / "best").resolve() and (stage2 / "best" / MARKER).is_file()
    assert (stage2 / "curves.png").stat().st_size > 10_000
    hs.load_converted(stage2 / "output", dtype=torch.float32)  # loads as a model
    # a best/ that no evaluation of this run chose (left by an attempt it did not resume from) is not its output
    again = tmp_path / "again"
    shutil.copytree(stage2 / "best", again / "stage2" / "best")
    proc = finetune(
        overrides(setup, again, "finetune.recipe=hedgecats", "finetune.max_steps=2", "finetune.eval_every=5")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "stage2" / "output").resolve() == (again / "stage2" / "final").resolve()


def test_resuming_with_other_settings_is_refused(setup, reference, tmp_path):
    shutil.copytree(reference / "stage2", tmp_path / "stage2", symlinks=True)
    proc = finetune(overrides(setup, tmp_path, "finetune.lr=0.01", "finetune.max_steps=12"), ranks=0)
    assert proc.returncode == 2
    assert "made with other settings (lr, max_steps)" in proc.stderr


@pytest.mark.parametrize("mode", ["hybrid", "la_only"])
def test_non_reentrant_checkpointing_with_peft_gives_the_same_gradients(mode):
    def grads(checkpointing: bool):
        model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 4, "mode": mode}))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        peft_model.train()
        calls, mlp = [], model.model.layers[0].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # inside the checkpointed layer
        ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
        peft_model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == (2 if checkpointing else 1)  # recomputed in backward
        return {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and len(plain) == 8
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-6) for k in plain)


def test_nan_loss_stops_at_its_step_and_keeps_the_committed_checkpoints(setup, tmp_path):
    """finetune.lr=1e30 blows the weights up (warmup: the first update already has lr 5e29): the first step
    with a non-finite loss stops the stage, exit 2, naming the step and the newest committed checkpoint, which stays
    committed as it was; nothing of that step or later is written."""
    args = overrides(setup, tmp_path, "finetune.lr=1e30", "finetune.save_every=1", "finetune.eval_every=0")
    proc = finetune(args, ranks=0)
    assert proc.returncode == 2, proc.stderr[-3000:]
    stage2 = tmp_path / "stage2"
    msg = (
        "stage 2: the training loss is nan at step 2 of 10; nothing of that step is saved, the newest committed "
        "checkpoint is stage2/step_00000001 (kept); lower finetune.lr (now 1e+30) in another run_dir (a changed lr "
        f"does not resume), or check the weights of {setup / 'converted'} (and of its base model) for nan/inf"
    )
    assert f"hybrid-scale finetune: error: {msg}\n" in proc.stderr
    assert msg in (stage2 / "log.txt").read_text()
    assert [p.name for p in committed_steps(stage2)] == ["step_00000001"]  # its hashes still match
    logs = ["log.txt", "metrics.jsonl", "tensorboard"]  # the logs (run/metrics.py: TensorBoard is installed here)
    assert sorted(p.name for p in stage2.iterdir()) == sorted([*logs, "step_00000001"])
    logged = [json.loads(line) for line in (stage2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1]  # no record of the non-finite step
    state = json.loads((stage2 / "step_00000001" / "state.json").read_text())
    assert state["step"] == 1 and all(math.isfinite(x) for x in state["curves"]["train"])


def test_bf16_on_two_ranks_under_zero3_stays_near_fp32_with_checked_collectives(setup, reference, tmp_path):
    """The presets' case on CPU's stand-in: model.dtype=bfloat16 (DeepSpeed's bf16 mode: fp32 master weights and
    optimizer state) on 2 gloo ranks. Every collective (ours and DeepSpeed's) is recorded: the same ops, dtypes and
    shapes on both ranks, on the rank's device. The training and held-out losses stay within 2% of the fp32 run's."""
    prefix = tmp_path / "collectives"
    args = overrides(setup, tmp_path, "model.dtype=bfloat16", "finetune.max_steps=5")  # the reference's first 5
    proc = finetune(args, env=procs.checked(prefix))
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = procs.collective_calls(prefix, 2)
    ours = [c for c in calls if c["where"].startswith("runtime.py")]
    assert {c["op"] for c in ours} == {"all_reduce"}  # float64 sums, and the int32 agreement on the run dir's lock
    assert all(c["dtype"] in (["torch.float64"], ["torch.int32"]) for c in ours)
    assert len(ours) >= 5 + 2  # one per step, one per held-out loss
    assert any(c["where"].startswith(("partition", "stage3", "comm", "torch.py")) for c in calls)  # ZeRO-3's own
    got, ref = curves(tmp_path), curves(reference)
    for key in ("train", "hybrid", "la_only"):  # (the learning-rate decay ends at step 5 here, at 10 there)
        assert got[key] and all(math.isfinite(x) for x in got[key])
        assert max(abs(a - b) / b for a, b in zip(got[key], ref[key], strict=False)) < 0.02, (key, got[key], ref[key])


def test_stage_2_trains_without_the_cache_unless_asked_and_records_the_runs(setup, tmp_path):
    """attention.cache joins after training: stage 2 with a cache of 4 and cache_train=false trains exactly the
    hybrid without one (the same losses) and records the run's cache in its output; cache_train=true trains with it
    (other losses)."""
    losses = {}
    for name, extra in (("none", []), ("after", ["attention.cache=4"]),
                        ("trained", ["attention.cache=4", "attention.cache_train=true"])):  # fmt: skip
        run = tmp_path / name
        args = overrides(setup, run, "finetune.max_steps=2", "finetune.eval_every=2", "finetune.save_every=2", *extra)
        proc = finetune(args, ranks=0)
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = [json.loads(r) for r in (run / "stage2" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in steps if r["kind"] == "step"]
        recorded = json.loads((run / "stage2" / "final" / "hybrid_config.json").read_text())["attention"]["cache"]
        assert recorded == (0 if name == "none" else 4)
    assert losses["after"] == losses["none"]
    assert losses["trained"] != losses["none"]
