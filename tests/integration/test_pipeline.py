"""`hybrid-scale pipeline` on a tiny model: all four stages, killed mid-stage and rerun == uninterrupted, config
changes refused by name."""

import json
import re
import signal

import procs
import pytest
import torch
from conftest import tiny_run_overrides
from omegaconf import OmegaConf
from safetensors.torch import load_file

from hybrid_scale.evaluate.results import EvalResults

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny(tiny_run_model):
    return tiny_run_model


def overrides(tiny, run_dir, *extra):
    return tiny_run_overrides(tiny, run_dir, *extra)


def outputs(run):
    adapter = {}  # every tensor of the export: merged base weights and phi/gamma
    for f in (run / "export").glob("*.safetensors"):
        adapter.update(load_file(f))
    curves = json.loads((run / "stage2" / "curves.json").read_text())
    results = EvalResults.load(run / "eval" / "results.json")
    return adapter, curves["train"], {m: r.tasks["piqa"].loglik for m, r in results.modes.items()}


def test_pipeline_killed_mid_stage_then_rerun_equals_uninterrupted(tiny, tmp_path):
    full = procs.run(["pipeline", *overrides(tiny, tmp_path / "full")], timeout=900)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "pipeline done: distill" in full.stdout
    # USR1 in stage 1 (layer 0's first of 2 steps): the pipeline's flag is the stage's; it commits layer 0, exits 75
    cut = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut")], {"HYBRID_SCALE_FAULT": "train:0:0@USR1"})
    assert cut.returncode == 75, cut.stderr[-3000:]
    assert (
        "stage 1 stopped by a signal after committing layer 0 of 2" in cut.stderr
        and (tmp_path / "cut" / "requeue_requested").is_file()
    )
    killed = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut")], {"HYBRID_SCALE_FAULT": "step:3"}, timeout=900)
    assert killed.returncode == -signal.SIGKILL  # and SIGKILL in stage 2, after stage 1 resumed at layer 1
    assert json.loads((tmp_path / "cut" / ".lock").read_text())["stage"] == "pipeline"  # the dead holder's lock...
    again = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut")], timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at layer 1 from buffer" in (tmp_path / "cut" / "stage1" / "log.txt").read_text()
    assert not (tmp_path / "cut" / ".lock").exists()  # ...did not block the rerun, which released its own
    a, b = outputs(tmp_path / "full"), outputs(tmp_path / "cut")
    assert a[0].keys() == b[0].keys() and all(torch.allclose(a[0][k], b[0][k], atol=1e-6) for k in a[0])
    assert torch.allclose(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-6)
    assert a[2].keys() == b[2].keys()
    for mode in a[2]:
        assert torch.allclose(torch.tensor(a[2][mode]), torch.tensor(b[2][mode]), atol=1e-5)
    # a third run finds everything done; a changed result-affecting key is refused by name
    third = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut")], timeout=600)
    assert third.returncode == 0 and third.stdout.count("skipped") == 3
    changed = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut", "finetune.lr=0.01", "seed=3")], timeout=600)
    assert changed.returncode == 2
    assert "finetune.lr, seed changed" in changed.stderr and "allow_config_change=true" in changed.stderr
    allowed = procs.run(
        ["pipeline", *overrides(tiny, tmp_path / "cut", "finetune.lr=0.01", "allow_config_change=true")]
    )
    assert allowed.returncode == 2 and "finetune.lr changed, but stage 2 has started" in allowed.stderr
    recorded = OmegaConf.load(tmp_path / "cut" / "config.yaml")
    assert recorded.finetune.lr != 0.01 and not recorded.allow_config_change  # the record still says what ran
    # an evaluation setting changed: the evaluation runs again (every cell reused) and so does the export, whose card
    # carries it; stage 2 stays done
    evaluated = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut", "eval.bootstrap=20")], timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert evaluated.stdout.count("skipped") == 1 and "[pipeline] export: running" in evaluated.stdout
    assert re.search(r"resumed (\d+) of \1 cells", (tmp_path / "cut" / "eval" / "log.txt").read_text())
    results = EvalResults.load(tmp_path / "cut" / "eval" / "results.json")
    assert results.identity["eval"]["bootstrap"] == 20
    again = procs.run(["pipeline", *overrides(tiny, tmp_path / "cut", "eval.bootstrap=20")], timeout=600)
    assert again.returncode == 0 and again.stdout.count("skipped") == 3


def test_the_pipeline_on_two_ranks_runs_through_its_export(tiny, tmp_path):
    """Every stage on 2 gloo ranks; the export on rank 0 alone, not waited for by rank 1 (pipeline.export_on_rank0)."""
    run = tmp_path / "two"
    proc = procs.run(["pipeline", *overrides(tiny, run)], ranks=2, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "export" / "COMMITTED").is_file() and (run / "eval" / "results.json").is_file()
    assert not (run / ".lock").exists() and "(data 2 x tensor 1)" in (run / "stage2" / "log.txt").read_text()


def test_quickstart_runs_the_pipeline_and_prints_table_verdict_and_paths(tiny, tmp_path):
    """The quickstart preset with the model and budgets shrunk to the tiny model (the real one is `make quickstart`)."""
    args = ["quickstart", "--run-dir", str(tmp_path / "qs"), *overrides(tiny, tmp_path / "qs")[:2]]
    args += [o for o in overrides(tiny, tmp_path / "qs")[3:] if not o.startswith("eval.modes")]
    proc = procs.run(args, timeout=900, cold=True)  # (cold: a fresh process has warned about nothing yet)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # a new user sees no warning: Python's (FutureWarning of a deprecated collective or property) nor DeepSpeed's
    noise = [x for x in (proc.stdout + proc.stderr).splitlines() if "Warning" in x or "[WARNING]" in x]
    assert noise == [], noise
    assert "| mode | PIQA (acc) | AVG | Rec.% |" in out and "| swa_sinks |" in out  # base + the preset's modes
    assert "Verdict on the linear attention: " in out and "Perplexity by position bucket" in out
    assert "beyond the window (" in out and "passkey exact match at distances [12, 24] (beyond the window)" in out
    assert "| d=12 * | d=24 * |" in out  # the passkey table, both distances past the tiny model's window of 8
    figure = tmp_path / "qs" / "eval" / "long_context.png"
    assert f"Figure (retrieval and perplexity past the window): {figure.resolve()}" in out and figure.is_file()
    assert f"Run directory: {(tmp_path / 'qs').resolve()}" in out
    assert f"tensorboard --logdir {(tmp_path / 'qs').resolve()}" in out  # each stage's events are under it
    assert (tmp_path / "qs" / "stage2" / "tensorboard").is_dir() and (
        tmp_path / "qs" / "eval" / "metrics.jsonl"
    ).is_file()
    assert (tmp_path / "qs" / "export" / "COMMITTED").is_file() and (tmp_path / "qs" / "config.yaml").is_file()
    card = (tmp_path / "qs" / "export" / "README.md").read_text()  # the model card carries the figure and the probe
    assert "![retrieval and perplexity past the window](balance/long_context.png)" in card and "Passkey" in card
    assert (tmp_path / "qs" / "export" / "balance" / "long_context.png").is_file()


COUNT_READS = """
import builtins, io, json, sys
from pathlib import Path

from hybrid_scale.config import load_config
from hybrid_scale.pipeline import pipeline

reads, current, real_open = {}, ["pipeline"], io.open


def counting(file, mode="r", *args, **kwargs):  # every text read (a parse) of a hybrid_config.json, by stage
    # (the commit markers hash the files a stage writes, in binary: not a read of its input's settings)
    if isinstance(file, (str, Path)) and Path(file).name == "hybrid_config.json" and not set(mode) & set("waxb+"):
        reads.setdefault(current[0], []).append(str(Path(file).resolve()))
    return real_open(file, mode, *args, **kwargs)


def log(msg):
    if msg.endswith(": running"):
        current[0] = msg.split()[1].rstrip(":")


io.open = builtins.open = counting  # pathlib's read_text opens through io.open
pipeline(load_config(overrides=sys.argv[2:]), log=log)
Path(sys.argv[1]).write_text(json.dumps(reads))
"""


def test_each_stage_reads_its_models_hybrid_config_once(tiny, tmp_path):
    """The one disk probe (run/sources.stage_model) is made when a stage starts: the model a stage reads has its
    hybrid_config.json read once, by the stage's entry; the checks, the plan and the body take what it read."""
    script = tmp_path / "count_reads.py"
    script.write_text(COUNT_READS)
    proc = procs.run([str(tmp_path / "reads.json"), *overrides(tiny, tmp_path / "run")], timeout=900, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = json.loads((tmp_path / "reads.json").read_text())
    stage1, stage2 = (
        str((tmp_path / "run" / d / "hybrid_config.json").resolve()) for d in ("stage1/converted", "stage2/output")
    )
    assert reads == {"finetune": [stage1], "evaluate": [stage2], "export": [stage2]}
