"""Component-ablation evaluation on the embedded SmolLM2 (<= 50 items per task) and on a tiny model."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import procs
import pytest
import torch
from conftest import assert_split, one_thread, save_stage2_like
from transformers import AutoModelForCausalLM

from hybrid_scale.cli import main
from hybrid_scale.config import load_config
from hybrid_scale.distributed.requeue import EXIT_REQUEUE, REQUEUE_MARKER, Requeue
from hybrid_scale.evaluate.results import SCHEMA, Comparison, EvalResults
from hybrid_scale.evaluate.stage import evaluate

LIMIT = 10  # items per task: enough for base > none by 0.1 and none near chance (the first 10 of each)


@pytest.fixture(scope="module")
def smollm2_eval(smollm2, tmp_path_factory):
    """base, swa_only with a window longer than any item, and none, on PIQA and ARC-Easy."""
    out = tmp_path_factory.mktemp("eval_smollm2")
    cfg = load_config(
        overrides=[
            "eval.tasks=[piqa,arc_easy]",
            f"eval.limit={LIMIT}",
            "eval.modes=[base,swa_only,none]",
            "eval.window=4096",
            "eval.ppl_sequences=0",
            "eval.passkey_trials=0",
            f"eval.out_dir={out}",
            "eval.progress=false",
        ]
    )
    return evaluate(cfg)


def test_swa_only_with_long_window_scores_exactly_the_base(smollm2_eval):
    r = smollm2_eval
    assert r.untrained_feature_maps and r.window == 4096
    for task in ("piqa", "arc_easy"):
        base, swa = r.modes["base"].tasks[task], r.modes["swa_only"].tasks[task]
        assert base.n == LIMIT and base.correct == swa.correct and base.metric == swa.metric
        worst = max(abs(x - y) for a, b in zip(base.loglik, swa.loglik, strict=True) for x, y in zip(a, b, strict=True))
        assert worst < 1e-3
        assert r.tasks[task].beyond_window[4096] == 0.0 and r.tasks[task].beyond_window[16] > 0.5
    # no attention at all: near chance, well below the base model
    assert abs(r.modes["none"].tasks["piqa"].metric - 0.5) <= 0.2
    assert r.modes["none"].tasks["arc_easy"].metric <= 0.25 + 0.15
    assert r.modes["base"].avg >= r.modes["none"].avg + 0.1
    assert r.modes["swa_only"].rec == 100.0


def _lm_eval_task(tmp: Path, name: str, arrow: Path, body: str) -> None:
    (tmp / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: arrow\ndataset_kwargs:\n  data_files:\n    validation: {arrow}\n"
        f"output_type: multiple_choice\nvalidation_split: validation\n{body}"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def test_per_item_loglikelihoods_agree_with_lm_evaluation_harness(smollm2, smollm2_eval, tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = smollm2.datasets
    _lm_eval_task(
        tmp_path,
        "hs_piqa",
        data / "piqa" / "data-00000-of-00001.arrow",
        'doc_to_text: "Question: {{goal}}\\nAnswer:"\ndoc_to_target: label\ndoc_to_choice: "{{[sol1, sol2]}}"\n',
    )
    _lm_eval_task(
        tmp_path,
        "hs_arc_easy",
        data / "arc_easy" / "data-00000-of-00001.arrow",
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{choices.label.index(answerKey)}}"\ndoc_to_choice: "{{choices.text}}"\n',
    )
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={smollm2.model},dtype=float32",
        tasks=["hs_piqa", "hs_arc_easy"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=LIMIT,
        log_samples=True,
        batch_size=8,
        device="cpu",
    )
    ours = smollm2_eval.modes["base"].tasks
    for name, task in (("hs_piqa", "piqa"), ("hs_arc_easy", "arc_easy")):
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == LIMIT
        theirs = [[ll for ll, _ in s["filtered_resps"]] for s in samples]
        worst = max(
            abs(x - y) for a, b in zip(theirs, ours[task].loglik, strict=True) for x, y in zip(a, b, strict=True)
        )
        assert worst <= 1e-3, (task, worst)
        assert out["results"][name]["acc,none"] == pytest.approx(ours[task].acc, abs=1e-9)


def _evaluate(overrides: list[str]) -> EvalResults:
    with one_thread():
        return evaluate(load_config(overrides=overrides))


def _tiny_overrides(model, out):
    return [
        f"eval.model={model}",
        "eval.tasks=[piqa,winogrande]",
        "eval.limit=10",
        "eval.batch_size=3",
        "eval.modes=[base,hybrid,swa_sinks,la_only,none]",
        "attention.window=8",
        "eval.ppl_sequences=1",
        "eval.ppl_seq_len=96",
        "eval.la_share_seq_len=64",
        "eval.passkey_distances=[12,40]",
        "eval.passkey_trials=3",
        "eval.passkey_modes=[base,hybrid,swa_sinks]",
        "eval.bootstrap=50",
        f"eval.out_dir={out}",
        "eval.progress=false",
    ]


@pytest.fixture(scope="module")
def tiny_one_rank(tiny_smollm_vocab, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_one")
    return out, _evaluate(_tiny_overrides(tiny_smollm_vocab, out))


def _torchrun(args, timeout=900, env=None):
    proc = procs.run(args, env, timeout=timeout, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _same_numbers(one: EvalResults, two: EvalResults):
    assert one.world_size == 1 and two.world_size == 2
    assert two.modes == one.modes and two.perplexity == one.perplexity
    assert two.delta_la == one.delta_la and two.verdict == one.verdict
    assert two.passkey == one.passkey and two.beyond_window == one.beyond_window


def test_one_and_two_ranks_give_identical_results(tiny_smollm_vocab, tiny_one_rank, tmp_path):
    out, one = tiny_one_rank
    _torchrun(["evaluate", *_tiny_overrides(tiny_smollm_vocab, tmp_path / "two")])
    _same_numbers(one, EvalResults.load(tmp_path / "two" / "results.json"))
    # the outputs a person reads
    table = (out / "table.md").read_text()
    for needle in ("| base |", "| la_only |", "Rec.%", "Verdict:", "Perplexity by position bucket", "LA share"):
        assert needle in table
    assert (out / "ablation.png").stat().st_size > 1000 and (out / "la_share.png").stat().st_size > 1000
    first = (out / "log.txt").read_text().splitlines()[0]  # what the run will compute, before it computes it
    assert "22 cells: 5 mode(s) x 2 task(s), perplexity in 5 mode(s), the LA share; passkey probe: " in first
    assert "12 prompts (with the recall probe's) x 3 " in first
    assert "mode(s): base, hybrid, swa_sinks; " in first and " k tokens, ~" in first
    assert first.endswith("min at an assumed 1e+11 FLOP/s")
    held = one.heldout  # the perplexity is reported on the half of the held-out text stage 2 never chose on
    assert (
        held["report"].startswith("report half of the held-out documents of ") and "selection half" in held["selection"]
    )
    share = one.la_share.share
    assert sorted(share) == ["0", "1"] and len(share["0"]["0-64"]) == 4  # as results.json holds it


def test_the_written_results_carry_the_schema_and_read_back_as_the_returned_record(tiny_one_rank):
    out, one = tiny_one_rank
    text = (out / "results.json").read_text()
    assert json.loads(text)["schema"] == SCHEMA and EvalResults.load(out / "results.json") == one
    assert EvalResults.from_json(json.loads(text)).dumps() == text == one.dumps()


def test_sharded_weights_equal_the_single_process_evaluation(tiny_smollm_vocab, tiny_one_rank, tmp_path):
    """ZeRO-3 over 2 CPU ranks (gloo): each rank holds half of every weight; 7 batches, so one rank repeats one.
    Every collective (the signal agreements, the gathered scores, ZeRO-3's weight gathers) is recorded: the same ops,
    dtypes and shapes on both ranks, on the rank's device."""
    _, one = tiny_one_rank
    prefix = tmp_path / "collectives"
    args = ["evaluate", *_tiny_overrides(tiny_smollm_vocab, tmp_path / "z3"), "eval.shard_weights=true"]
    _torchrun(args, env=procs.checked(prefix))
    calls = procs.collective_calls(prefix, 2)
    agreements = [c for c in calls if c["where"].startswith("runtime.py") and c["op"] == "all_reduce"]
    assert len(agreements) >= 19 and all(c["dtype"] == ["torch.int32"] for c in agreements)  # >= one per cell
    gathers = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")  # (init_comm: the first)
    assert sum(c["op"] in gathers for c in calls) > 100  # ZeRO-3's gathers
    sharded = EvalResults.load(tmp_path / "z3" / "results.json")
    assert sharded.config["eval"]["shard_weights"] is True
    assert one.la_share == sharded.la_share
    _same_numbers(one, sharded)


def _close(a, b, tol: float, where: str = "") -> None:
    """Nested results equal in structure, their numbers within tol."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= tol * max(1.0, abs(a)), (where, a, b)
    else:
        assert a == b, (where, a, b)


KINDS = ("q_proj", "o_proj", "gate_proj", "down_proj")


def test_tensor_parallel_2_evaluates_as_one_process(tiny_smollm_vocab, tiny_one_rank, tmp_path):
    """launch.tensor_parallel=2 on 2 ranks: each holds half of every attention/MLP weight and of the vocabulary and
    scores the same batches; every log-likelihood within 1e-4 of one process's, the same correct answers, the
    perplexities and the LA share of every head (the ranks' heads put together) too."""
    _, one = tiny_one_rank
    prefix = tmp_path / "collectives"
    overrides = [*_tiny_overrides(tiny_smollm_vocab, tmp_path / "tp"), "launch.procs_per_node=2"]
    _torchrun(["evaluate", *overrides, "launch.tensor_parallel=2"], env=procs.checked(prefix))
    calls = procs.collective_calls(prefix, 2)  # the same calls on both ranks, each on the rank's device
    assert not [c for c in calls if c["op"] == "scatter"]  # each rank keeps its part of the weights it loaded
    split = EvalResults.load(tmp_path / "tp" / "results.json")
    assert split.world_size == 2 and split.tensor_parallel == 2
    reports = split.tensor_parallel_split  # the base (SmolLM-like) and the hybrid model, each split in half
    assert len(reports) == 2 and all(
        assert_split(r, 2, kinds=(*KINDS, "embed_tokens")) is None for r in reports.values()
    )
    for mode, scores in one.modes.items():  # (the averages: checked through the per-item numbers)
        for task, r in scores.tasks.items():
            assert split.modes[mode].tasks[task].correct == r.correct, (mode, task)
            _close(r.loglik, split.modes[mode].tasks[task].loglik, 1e-4, f"{mode}.{task}")
    _close(one.perplexity.to_json(), split.perplexity.to_json(), 1e-4)
    assert len(split.la_share.share["0"]["0-64"]) == 4  # every head, not one rank's two
    _close(one.la_share.to_json(), split.la_share.to_json(), 1e-4)


def _requeue_overrides(model, tmp: Path) -> list[str]:
    """The tiny evaluation (22 cells: 5 modes x 2 tasks, 5 perplexities, the LA share, 3 passkey and 3 recall modes)
    in tmp/eval, its run_dir (the requeue marker) tmp/run."""
    return [*_tiny_overrides(model, tmp / "eval"), f"run_dir={tmp / 'run'}"]


def _cells(out: Path) -> list[str]:
    return sorted(p.stem for p in (out / "cells").glob("*.json"))


def _same_results_json(resumed: Path, uninterrupted: Path) -> None:
    """Equal text apart from timings_s and the two paths where the runs write (eval.out_dir, run_dir)."""
    a, b = (json.loads(path.read_text()) for path in (resumed, uninterrupted))
    for r in (a, b):
        del r["timings_s"], r["config"]["eval"]["out_dir"], r["config"]["run_dir"]
    assert json.dumps(a) == json.dumps(b)


def test_signal_after_a_cell_exits_75_and_the_rerun_equals_an_uninterrupted_run(
    tiny_smollm_vocab, tiny_one_rank, tmp_path, capsys
):
    args = _requeue_overrides(tiny_smollm_vocab, tmp_path)
    out, run = tmp_path / "eval", tmp_path / "run"
    stopped = procs.run(["evaluate", *args], {"HYBRID_SCALE_FAULT": "eval:base.piqa@USR1"})
    assert stopped.returncode == EXIT_REQUEUE, stopped.stderr[-3000:]
    assert f"evaluation stopped by a signal after 1 of 22 cells; committed cells are in {out / 'cells'}" in (
        stopped.stderr
    )
    assert (run / REQUEUE_MARKER).read_text() == "1\n"
    assert _cells(out) == ["base.piqa"] and not (out / "results.json").exists()
    with one_thread():
        assert main(["evaluate", *args]) == 0  # the requeued job
    assert "resumed 1 of 22 cells" in capsys.readouterr().err
    assert "resumed 1 of 22 cells" in (out / "log.txt").read_text() and not (run / REQUEUE_MARKER).exists()
    assert len(_cells(out)) == 22
    _same_results_json(out / "results.json", tiny_one_rank[0] / "results.json")


def _same_as_one(results: EvalResults, one: EvalResults) -> None:
    for key in ("modes", "perplexity", "la_share", "delta_la", "verdict", "passkey", "beyond_window"):
        assert getattr(results, key) == getattr(one, key), key


@pytest.fixture(scope="module")
def stopped_mid_cell(tiny_smollm_vocab, tmp_path_factory):
    """The tiny evaluation signalled inside its third cell (hybrid.piqa: 10 items in 4 batches, after its first
    round), then rerun: (tmp, the Requeue, the cells and the requeue marker at the stop, the rerun's results)."""
    tmp = tmp_path_factory.mktemp("mid_cell")
    args = _requeue_overrides(tiny_smollm_vocab, tmp)
    with pytest.MonkeyPatch.context() as env, pytest.raises(Requeue) as stop:
        env.setenv("HYBRID_SCALE_FAULT", "eval_batch:hybrid.piqa:1@USR1")
        _evaluate(args)
    marker = (tmp / "run" / REQUEUE_MARKER).read_text()
    return tmp, stop.value, (_cells(tmp / "eval"), marker), _evaluate(args)


def test_signal_inside_a_cell_drops_only_that_cell(stopped_mid_cell, tiny_one_rank):
    tmp, stop, (cells, marker), results = stopped_mid_cell
    assert stop.step == 2 and cells == ["base.piqa", "base.winogrande"] and marker == "2\n"
    assert not (tmp / "run" / REQUEUE_MARKER).exists()  # the rerun cleared it
    log = (tmp / "eval" / "log.txt").read_text()
    assert "signal: 2 of 22 cells committed; dropped the cell in progress, hybrid.piqa" in log
    assert "resumed 2 of 22 cells" in log
    _same_as_one(results, tiny_one_rank[1])


def test_a_cell_committed_under_other_settings_is_recomputed(stopped_mid_cell, tiny_smollm_vocab, tmp_path):
    """A cell whose key differs is recomputed and rewritten; one whose key matches is taken as committed (here one
    with a planted metric, to show it was not recomputed)."""
    done, _, _, results = stopped_mid_cell
    shutil.copytree(done / "eval", tmp_path / "eval")
    cells = tmp_path / "eval" / "cells"
    stale, planted = (json.loads((cells / f"{name}.json").read_text()) for name in ("hybrid.piqa", "none.winogrande"))
    right_key = dict(stale["key"])
    stale["key"]["limit"], stale["result"]["metric"] = 5, -1.0
    planted["result"]["metric"] = -2.0
    (cells / "hybrid.piqa.json").write_text(json.dumps(stale))
    (cells / "none.winogrande.json").write_text(json.dumps(planted))
    again = _evaluate(_requeue_overrides(tiny_smollm_vocab, tmp_path))
    assert (
        "cell hybrid.piqa was committed with another limit: recomputing it"
        in (tmp_path / "eval" / "log.txt").read_text()
    )
    assert again.modes["hybrid"].tasks["piqa"] == results.modes["hybrid"].tasks["piqa"]
    assert json.loads((cells / "hybrid.piqa.json").read_text())["key"] == right_key
    assert again.modes["none"].tasks["winogrande"].metric == -2.0
    assert again.modes["none"].tasks["winogrande"].loglik == results.modes["none"].tasks["winogrande"].loglik
    # the cells' records are this run's: each cell once, with what its file holds now
    records = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["cells_done"] for r in records] == list(range(1, 23))
    assert {r["cell"]: r["figures"].get("metric") for r in records}["none.winogrande"] == -2.0


def test_signal_inside_a_cell_on_two_ranks_stops_both_and_one_rank_resumes(tiny_smollm_vocab, tiny_one_rank, tmp_path):
    """Rank 0 alone gets USR1 inside hybrid.piqa (4 batches: 2 rounds of 2); both ranks stop after the first round
    (torchrun does not pass exit code 75 on: the marker says it). The cells do not depend on the number of ranks."""
    args = _requeue_overrides(tiny_smollm_vocab, tmp_path)
    stopped = procs.run(["evaluate", *args], {"HYBRID_SCALE_FAULT": "eval_batch:hybrid.piqa:1@USR1"}, ranks=2)
    assert stopped.returncode != 0 and "evaluation stopped by a signal after 2 of 22 cells" in stopped.stderr
    assert (tmp_path / "run" / REQUEUE_MARKER).read_text() == "2\n"
    assert _cells(tmp_path / "eval") == ["base.piqa", "base.winogrande"]
    resumed = _evaluate(args)
    assert resumed.world_size == 1 and "resumed 2 of 22 cells" in (tmp_path / "eval" / "log.txt").read_text()
    _same_as_one(resumed, tiny_one_rank[1])


@pytest.fixture(scope="module")
def stage2_like(tiny_smollm_vocab, tmp_path_factory):
    """A converted tiny model with moved phi/gamma and a random LoRA adapter, as stage 2 leaves it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_smollm_vocab, dtype=torch.float32)
    return save_stage2_like(model, tmp_path_factory.mktemp("stage2_like"), tiny_smollm_vocab)


PROBE = """
import json, sys
from pathlib import Path
from hybrid_scale.config import load_config
from hybrid_scale.distributed import runtime
from hybrid_scale.models.converted import load_converted
from hybrid_scale.evaluate.models import Models
from hybrid_scale.run.sources import probe

path = Path(sys.argv[1])
rt = runtime.init("cpu")
models = Models(load_config(overrides=[f"eval.model={path}", "eval.shard_weights=true"]), probe(path, "eval.model"), rt)
held = {}  # per parameter: [elements this rank holds, elements of the whole tensor or None when not partitioned]
for name, model in (("base", models._load_base()), ("converted", load_converted(path))):
    held[name] = {
        n: [p.ds_tensor.numel(), p.ds_numel] if hasattr(p, "ds_tensor") else [p.numel(), None]
        for n, p in model.named_parameters()
    }
Path(sys.argv[2], f"held.rank{rt.rank}.json").write_text(json.dumps(held))  # a file each: stdout interleaves
del models
from hybrid_scale.cli import main  # then the evaluation itself, in the same two processes

sys.exit(main(sys.argv[3:]))
"""


def test_sharded_stage2_output_is_loaded_partitioned_and_equals_one_process(stage2_like, tmp_path):
    """The adapter is merged into ZeRO-3-partitioned weights (gathered one at a time, merged on rank 0); no rank holds
    the whole model at any point of loading; the results equal one process's."""
    one = _evaluate(_tiny_overrides(stage2_like, tmp_path / "one"))
    assert one.converted
    script = tmp_path / "probe.py"  # the loading probe, then `evaluate` in the same two processes
    script.write_text(PROBE)
    args = [str(stage2_like), str(tmp_path), "evaluate", *_tiny_overrides(stage2_like, tmp_path / "z3")]
    proc = procs.run([*args, "eval.shard_weights=true"], timeout=600, ranks=2, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_numbers(one, EvalResults.load(tmp_path / "z3" / "results.json"))
    held = [json.loads((tmp_path / f"held.rank{r}.json").read_text()) for r in (0, 1)]
    for rank in held:  # half of every weight, rounded up (the small phi/gamma are whole until deepspeed.initialize)
        assert rank["base"] and all(whole and mine == -(-whole // 2) for mine, whole in rank["base"].values()), rank
        hybrid = {n for n in rank["converted"] if "feature_map" in n or "gamma_logit" in n}
        assert len(hybrid) == 2 * 5  # phi_q, phi_k (weight and bias) and gamma of 2 layers
        assert set(rank["converted"]) - hybrid == set(rank["base"])
        for n, (mine, whole) in rank["converted"].items():
            assert (whole is None) if n in hybrid else (mine == -(-whole // 2)), (n, mine, whole)


def test_clear_errors(smollm2, tmp_path, capsys):
    assert main(["evaluate", "eval.tasks=[piqa,boolq]"]) == 2
    assert "config key 'eval.tasks': 'boolq' is not allowed; choose one of: piqa, arc_easy" in capsys.readouterr().err
    assert main(["evaluate", f"eval.model={tmp_path / 'nope'}"]) == 2
    assert f"config key 'eval.model': {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert main(["evaluate", f"eval.data_dir={tmp_path}", "eval.tasks=[piqa]", "eval.modes=[base]"]) == 2
    err = capsys.readouterr().err
    assert f"config key 'eval.data_dir': {tmp_path} has no piqa dataset(s) (one save_to_disk directory per task)" in err


def test_perplexity_only_with_the_hybrids_own_sinks(tiny_smollm_vocab, tmp_path):
    """eval.tasks=[] scores the held-out text only (it used to divide by zero); a hybrid with its own sinks: swa_only
    (the hybrid without its LA) is its window plus the same sinks, so it equals swa_sinks, and the report says so."""
    out = tmp_path / "eval"
    r = _evaluate([f"eval.model={tiny_smollm_vocab}", "eval.tasks=[]", "eval.modes=[hybrid,swa_only,swa_sinks]",
                   "attention.window=8", "attention.sinks=4", "attention.hybrid_sinks=true", "eval.ppl_sequences=1",
                   "eval.ppl_seq_len=96", "eval.la_share_seq_len=0", "eval.passkey_distances=[]", f"eval.out_dir={out}",
                   "eval.progress=false"])  # fmt: skip
    assert r.modes == {} and r.hybrid_sinks and r.sinks == 4
    p = r.perplexity.by_mode
    assert p["swa_only"] == p["swa_sinks"] and p["hybrid"] != p["swa_only"]
    table = (out / "table.md").read_text()
    assert "Items per task: no tasks; window 8" in table
    assert "hybrid: window 8 + the first 4 tokens (gamma-weighted), LA over the rest" in table
    assert "`swa_only`, its own window + 4 sinks: is the LA used?" in table
    reused = "swa_sinks: the same keys as swa_only on this model (its hybrid keeps 4 sinks): its perplexity is "
    reused += "swa_only's"
    assert reused in (out / "log.txt").read_text()  # computed once
    cells = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["cells_done"], r["cells_total"]) for r in cells] == [(1, 2), (2, 2)]  # the twin has no cell to wait for


def test_reproduce_table_renders_an_evaluation(tiny_one_rank):
    """experiments/reproduce_table1/run.py's table from rows holding real results.json files (here the tiny evaluation
    as both the base row and a recipe's): the beyond-window columns, the verdict and the stage times come through."""
    import importlib.util

    path = Path(__file__).parents[2] / "experiments" / "reproduce_table1" / "run.py"
    spec = importlib.util.spec_from_file_location("reproduce_table1", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, one = tiny_one_rank
    b, code = mod.BUDGETS["tiny"], mod.code_hash()
    curves = {"eval_steps": [2], "hybrid": [3.0], "la_only": [4.0], "output": "final", "stopping": {"reason": None}}

    def row(name, results):
        times = {"stage1": 60, "stage2": 120, "eval": 180}
        r = {"row": name, "commit": "abcdef0123", "code_hash": code, "budget": b, "times_s": times, "curves": curves}
        return r | {"results": mod.slim(results.to_json())}

    swa_only = Comparison(delta=0.2, lo=0.1, hi=0.3, ratio=0.8)
    own = replace(one, hybrid_sinks=True)  # a +sinks row: its swa_only is window + sinks
    own.beyond_window = replace(one.beyond_window, against="swa_only", swa_only=swa_only)
    rows = {"base": row("base", one), "lolcats": row("lolcats", one), "lolcats+sinks": row("lolcats+sinks", own)}
    text = mod.table(rows, b, code)
    line = next(x for x in text.splitlines() if x.startswith("| lolcats |"))
    bw = one.beyond_window
    assert f"{bw.perplexity['hybrid']:.1f} / {bw.perplexity['swa_sinks']:.1f}" in line
    assert f"| {one.verdict} |" in line and line.endswith("| 1 / 2 / 3 |") and "| abcdef01 |" in line
    sinks = bw.to_json() if bw.against == "swa_sinks" else None
    assert f"| {mod._beats(sinks)} | 1 / 2 / 3 |" in line
    line = next(x for x in text.splitlines() if x.startswith("| lolcats+sinks |"))
    assert "(0.80x) | +0.200 [+0.100, +0.300] | yes | 1 / 2 / 3 |" in line  # vs swa_only = vs swa_sinks
    assert "- lolcats: 2: 3.000/4.000; output = final; stop: max_steps" in text
