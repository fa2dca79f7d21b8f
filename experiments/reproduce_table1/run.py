"""Reproduce the paper's Table 1 on SmolLM2 (the embedded default), one row at a time. (Over 500 lines: SAME_NUMBERS,
its append-only ledger of code hashes, grows with every change to the measured code.)

    make reproduce ROW=lolcats+sinks      # one row end to end: stage 1, stage 2, the evaluation (resumable)
    make reproduce                        # every row that is missing or stale, then the table
    .venv/bin/python -m experiments.reproduce_table1.run --table   # the table from the committed rows alone

A row is `base` (the softmax model evaluated), a recipe (lolcats, hedgecats, ssd, la_only) with a variant: plain,
`+sinks` (the hybrid's own attention sinks, SINKS_OVERRIDES), `+decay` (the length-robust LA: attention.la_decay),
`+sinks+decay` (both: the main job's attention, configs/quickstart.yaml, at this table's window and lengths), or
`la_only+calibrated` (the la_only row's model exported with export.mode=hybrid export.calibrate_gamma=true, the
paper's inference-time hybridisation, and evaluated). Each stage runs as its own `hybrid-scale` process, as a user
would run it; the rows of one objective and variant share their stage 1 (hedgecats, ssd and la_only all train
weights_xent), and each row counts its stage 1's time as its own.

A row writes experiments/reproduce_table1/reproduce/<row>.json: its budget and settings, every figure the table
shows (the evaluation's results.json without its per-item and per-trial lists), the stage times, the commit it ran
on and a hash of the code it measured (CODE: the attention and the recipes). A row is stale when that hash or the budget
differs from the current ones; the table marks it and `make reproduce` runs it again. A row killed at any point
resumes when rerun: every stage resumes or is skipped when finished. The run directories are under
--run-root/<budget>-<code hash>, so a stale row runs again from scratch rather than reusing stages measured on other
code; a row whose code changes while it runs is refused (no row file). A change of CODE that computes the same
numbers (a refactor) keeps the rows current only when it is declared in SAME_NUMBERS, and
tests/integration/test_same_numbers.py then runs both commits' stages on a tiny model and finds every output equal to
the bit.

`--budget long` (`make reproduce ROW=... ARGS="--budget long"`) trains on the default's tokens in 1024-token
sequences, the main job's training length, and reads the same 1024 tokens: its rows and table are its own
(experiments/reproduce_table1/reproduce_long/, reproduce_table1_long.md beside it).

Why one file of over 500 lines: the rows, their runner and both tables (Table 1's and the switched rows') share
the budgets, the code hash and the row records; splitting the runner from the tables inside this package is left
for when a second runner needs the tables.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from hybrid_scale.evaluate.results import EvalResults
from hybrid_scale.recipes import RECIPES as RECIPE_TABLE

HERE = Path(__file__).resolve().parent  # experiments/reproduce_table1/: the runner, its rows and tables
REPO = HERE.parents[1]

RECIPES = ("lolcats", "hedgecats", "ssd", "la_only")
VARIANTS = {
    "": "plain",
    "+sinks": "the hybrid's own sinks",
    "+decay": "the length-robust LA (attention.la_decay)",
    "+sinks+decay": "both: the main job's attention (configs/quickstart.yaml)",
}
CALIBRATED = "la_only+calibrated"
ROWS = ("base", *(r + v for v in VARIANTS for r in RECIPES), CALIBRATED)
MODES = ("hybrid", "swa_only", "swa_sinks", "la_only", "none")
ACCURACY_MODES = ("hybrid", "swa_only", "la_only", "none")
SINKS_OVERRIDES = ["attention.hybrid_sinks=true", "attention.gamma_param=exp", "attention.gamma_init=30.0"]
DECAY_OVERRIDES = ["attention.la_decay=true"]
OVERRIDES = {
    "": [],
    "+sinks": SINKS_OVERRIDES,
    "+decay": DECAY_OVERRIDES,
    "+sinks+decay": SINKS_OVERRIDES + DECAY_OVERRIDES,
}
DELTA_SWITCH = ["attention.la_kind=gated_delta", "attention.la_decay=false", "attention.gamma_init=1.0",
                "attention.la_combine=normaliser"]  # fmt: skip
DELTA_BUDGET = {"passkey_distances": [64, 128, 192, 256, 512]}  # 1-4 and 8 windows of 64
# One-switch changes of a row (`--switch NAME`, with --row): the exploration of issue 52, whether some recipe makes the
# LA worth its place at the presets' window (64) trained at 1024 (--budget long). Each is (what it changes, budget
# changes, extra overrides of every stage); its row file is <row>@<switch>.json beside the budget's rows, its table
# explore_table_of(budget).
SWITCHES = {
    "steps128": ("4x the stage-2 tokens (128 steps)", {"steps": 128}, []),
    "features32": ("a smaller feature map (hedgehog on 32 dims: F = 64, not 128)", {}, ["attention.feature_dim=32"]),
    "features128": ("a larger feature map (hedgehog on 128 dims: F = 256)", {}, ["attention.feature_dim=128"]),
    "horizon512": ("a decay every head starts with: rho = 1/512 at conversion", {}, ["attention.la_decay_horizon=512"]),
    "gamma3": (
        "a window 10x weaker at conversion (gamma_init 3, not 30): more of the output left to the LA",
        {},
        ["attention.gamma_init=3.0"],
    ),
    # issue 59: the gated delta rule in place of Hedgehog + decay, its passkey and recall at 1-4 and 8 windows
    "delta": (
        "the gated delta-rule LA (la_kind gated_delta, normaliser, gamma from 1) in place of Hedgehog + decay",
        DELTA_BUDGET,
        DELTA_SWITCH,
    ),
    "delta_map_out": (
        "gated_delta with a learned q/k map per head, stage 1 on the LA alone (output_mse)",
        DELTA_BUDGET,
        [*DELTA_SWITCH, "attention.la_qk_map=true", "distill.objectives={output_mse: 1.0}"],
    ),
    "delta_mix": (
        "gated_delta as a gated mix of the window's softmax and the LA (mix gate from 0.1)",
        DELTA_BUDGET,
        [*DELTA_SWITCH, "attention.la_combine=mix"],
    ),
}
CODE = ("hybrid_scale/attention", "hybrid_scale/recipes", "hybrid_scale/distill/objectives.py",
        "hybrid_scale/finetune/schedule.py")  # fmt: skip
# Changes of CODE declared to compute the same numbers: {code hash after: (code hash before, commit before, commit
# after, what changed)}. A row measured on the code before is current on the code after; the test of each entry
# (tests/integration/test_same_numbers.py) checks both hashes against their commits and runs stage 1, stage 2 and the
# evaluation of both on a tiny model: every tensor and figure must be equal to the bit.
SAME_NUMBERS: dict[str, tuple[str, str, str, str]] = {
    "c98a2d8adb3529fa9fd29dd66b810befbd52de7f09c11524867172b04e0b516e": (
        "e5fd499e5497f59fd9f0555485a64088542a16b920b757d4b927fceaaaa904a1",
        "a1ce32605dd0e4fde49f3d5a0deeedf87402325b",
        "b9a71e8ec4232c7ac33a87b0346b12264e67adaf",
        "issue 66: the cache of exact keys (attention/cache/: attention.cache, cache_select, cache_heads, cache_train; "
        "the cache_only mode), off by default: a cache of 0 is the hybrid without it; its decode state adds nothing "
        "without it; checked on both LA kinds",
    ),
    "e5fd499e5497f59fd9f0555485a64088542a16b920b757d4b927fceaaaa904a1": (
        "20a04f7c1c6a4d3ab53ec763dc2bdfb3f16303d79d1f3922b12c18106210aea1",
        "86f1115a0ee4ed3897f34e644b0502ca6982ed6c",
        "e9cf96f08b75bca005da8253f7f02225be908bf3",
        "issue 65: attention/ in folders (window/, hedgehog/, gated_delta/, hf/), the layer composing its kind's part "
        "(part.py), one record of settings (settings.py), one registry of kinds (kinds.py) and of implementations per "
        "kind (backends.py); stage 2's metrics in finetune/monitor.py; checked on both LA kinds",
    ),
    "20a04f7c1c6a4d3ab53ec763dc2bdfb3f16303d79d1f3922b12c18106210aea1": (
        "5a439368c60910a7fd74cdf7bdfd25e67feb7ceae2d48a48fc1c4990b7263459",
        "2599d4460407554f1c196c3aa1865d4328538536",
        "0104d069a655aeab56a5dae6a9e0a70dc6e6c5c6",
        "issue 61's review: the layer builds its AttentionOptions once per call (one dict, not a replace of an "
        "object), two stray format markers gone",
    ),
    "5a439368c60910a7fd74cdf7bdfd25e67feb7ceae2d48a48fc1c4990b7263459": (
        "d506c951620b9305fee150c46f5ff52d7a174074700d90bbd968a100aa969e69",
        "8cde22271bb3cdf1fc92f61d5038adc769fc7bc9",
        "a6a285a38e1c992f3f652dfa38f6c0e1c5b45a78",
        "issue 61: every attention op takes its tensors, then one frozen AttentionOptions (options.py), instead of "
        "12-17 keyword settings written out in each; the decode state's ring growth in one method (make_room)",
    ),
    "d506c951620b9305fee150c46f5ff52d7a174074700d90bbd968a100aa969e69": (
        "a26cc4ffe8a3da29d3586db1c256a85e674406a7385d62179703074ab5d31dc5",
        "81536db6ce580ff1173c5276f993177ccb7d3ae0",
        "d0f02b1dc489ba7e04d02a036796d4f58d0f6c3b",
        "issues 60-61: a half-precision decode state keeps phi_k in its dtype (fp32 runs, as the rows, are unchanged); "
        "decode rings no longer than the longest context they see (generate's max_length, the scoring's batch); the "
        "feature maps' size and parameters from their specs (choices.FEATURE_MAP_SPECS); the export's classes made "
        "from the architecture records",
    ),
    "a26cc4ffe8a3da29d3586db1c256a85e674406a7385d62179703074ab5d31dc5": (
        "6793ac6d2c5c7e8f384350dd646af1cb8fcc8dc738b7fa831d5f4f46ba734736",
        "4ef155aa56075a34f52ed0675425dc05f422868a",
        "21c81aefc8a95cb832af7b1a067545067e874c8d",
        "issue 60: generate's default cache is the HybridCache, the decode state marked static, the self-check "
        "unpadded too",
    ),
    "6793ac6d2c5c7e8f384350dd646af1cb8fcc8dc738b7fa831d5f4f46ba734736": (
        "e1f86d081a1199ee59154d84ec8ffa935ddeac81f17ea2e99a7a40f26d8868c7",
        "ba761d6f554e114f17542e7d56a7a7579345e81b",
        "7732d1a3aa73b89984a0fd1f5b58901ccbb1cc2f",
        "issue 59: signatures (attend's gates keyword-only), two private helpers made public, fla's kernel moved out",
    ),
    "e1f86d081a1199ee59154d84ec8ffa935ddeac81f17ea2e99a7a40f26d8868c7": (
        "35de553932e7fdd5b8c7deeda380c58f0aa754c2d0fc36698af46f18679b9cc7",
        "935a76288a3797e05e305d0d16a66160fe093fd2",
        "ba761d6f554e114f17542e7d56a7a7579345e81b",
        "issue 59: attention.la_kind gated_delta beside the Hedgehog LA (the default, whose math is unchanged)",
    ),
    "35de553932e7fdd5b8c7deeda380c58f0aa754c2d0fc36698af46f18679b9cc7": (
        "6dbee7326402d44022480eb166b93a6dcd13195c32a722f58ae84617be2d9b82",
        "5502e66870ee1dfe6d4ecbff04ad76ce18c09909",
        "49ddd57db77ab77618ec2143af6a460a27f5a578",
        "issue 52: attention.la_decay_max_horizon, off by default (rho >= 0 as before)",
    ),
    "6dbee7326402d44022480eb166b93a6dcd13195c32a722f58ae84617be2d9b82": (
        "5f4a6ddb7cb386dc0a447e66af3a9fe16eb03474e434e62318bd68bef1520ccc",
        "bcb2e456f2a9f74e22fbb2ed395e11cc7733e357",
        "5502e66870ee1dfe6d4ecbff04ad76ce18c09909",
        "issue 53: signatures only (Projections, Shape, DecodeState.empty(shape, ...), keyword-only settings)",
    ),
}
ROWS_DIR = HERE / "reproduce"
TABLE = HERE / "reproduce_table1.md"


def rows_dir_of(budget: str) -> Path:
    """The committed row files of a budget: each budget has its own rows and table (the default's: ROWS_DIR, TABLE)."""
    return ROWS_DIR if budget == "default" else ROWS_DIR.with_name(f"reproduce_{budget}")


def explore_table_of(budget: str) -> Path:
    """The table of a budget's switched rows (SWITCHES)."""
    return TABLE.with_name(f"reproduce_switches_{budget}.md")


def table_of(budget: str) -> Path:
    return TABLE if budget == "default" else TABLE.with_name(f"reproduce_table1_{budget}.md")


# the budget of every row: one row, its own stage 1 included, within an hour of 2 CPU cores (the table's header
# gives the times measured); perplexity out to 4x the training length (stage 1 and stage 2: 256 tokens)
BUDGETS = {
    "default": {
        "window": 64,
        "stage1_sequences": 128,
        "stage1_seq_len": 256,
        "stage1_epochs": 2,
        "steps": 32,
        "global_batch": 4,
        "seq_len": 256,
        "lr": 1e-3,
        "eval_every": 4,
        "heldout_sequences": 4,
        "tasks": ["piqa", "arc_easy"],
        "eval_limit": 25,
        "ppl_seq_len": 1024,
        "ppl_sequences": 4,
        "buckets": [0, 64, 256, 512],
        "passkey_distances": [32, 128, 512],
        "passkey_trials": 10,
    },
    # the tests' (a tiny model: every stage in seconds)
    "tiny": {
        "window": 8,
        "stage1_sequences": 8,
        "stage1_seq_len": 32,
        "stage1_epochs": 1,
        "steps": 2,
        "global_batch": 2,
        "seq_len": 32,
        "lr": 1e-3,
        "eval_every": 1,
        "heldout_sequences": 1,
        "tasks": ["piqa"],
        "eval_limit": 4,
        "ppl_seq_len": 128,
        "ppl_sequences": 1,
        "buckets": [0, 8, 32, 64],
        "passkey_distances": [12, 24],
        "passkey_trials": 2,
    },
}
# the default's tokens (stage 1 32k, stage 2 32 x 1024, held-out 1024) in 1024-token sequences: the main job's training
# length, with the default's window and evaluation (read at the same 1024 tokens), so that its rows compare bucket by
# bucket with the default's and say whether training on longer sequences (not more tokens) is what the LA needs
BUDGETS["long"] = BUDGETS["default"] | {
    "stage1_sequences": 32,
    "stage1_seq_len": 1024,
    "global_batch": 1,
    "seq_len": 1024,
    "heldout_sequences": 1,
}
# this machine's paths: not part of a row's settings
LOCAL = ("run_dir=", "model.path=", "data.source=", "finetune.model=", "eval.model=", "eval.out_dir=", "export.model=",
         "export.out_dir=")  # fmt: skip
DROPPED = ("correct", "loglik", "per_trial", "config")  # results.json's per-item lists and the whole config


def code_hash(repo: Path = REPO) -> str:
    """sha256 over the path and bytes of every .py file of CODE (in `repo`, a checkout): what a row measured."""
    h = hashlib.sha256()
    for root in CODE:
        path = repo / root
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def same_numbers_as(code: str) -> str:
    """The oldest code hash that `code` computes the same numbers as (SAME_NUMBERS, followed back; itself when none)."""
    while code in SAME_NUMBERS:
        code = SAME_NUMBERS[code][0]
    return code


def commit() -> str:
    """The commit the row ran on (+ "-dirty" when CODE had uncommitted changes)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *CODE], cwd=REPO, capture_output=True, text=True)
    return (head or "unknown") + ("-dirty" if dirty.stdout.strip() else "")


def split(row: str) -> tuple[str, str]:
    """(recipe, variant) of a recipe row."""
    recipe, _, variant = row.partition("+")
    return recipe, f"+{variant}" if variant else ""


def hybrid_scale(*args: str) -> None:
    print("$ hybrid-scale " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "hybrid_scale.cli", *args], check=True, cwd=REPO)


def timed(run_dir: Path, name: str, fn) -> float:
    """Wall time of a stage, recorded when it finishes (a rerun of a finished stage keeps that figure). Each attempt
    is logged first (wall_<name>.attempts): a stage killed and resumed counts only the run that finished it, and the
    row says so (resumed())."""
    path = run_dir / f"wall_{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / f"wall_{name}.attempts").open("a") as f:
        f.write(time.strftime("%Y-%m-%d %H:%M:%S UTC\n", time.gmtime()))
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    path.write_text(json.dumps(seconds))
    return seconds


def resumed(run_dir: Path, name: str) -> bool:
    """Whether the stage took more than one attempt (killed and resumed): its time is the last attempt's only."""
    attempts = run_dir / f"wall_{name}.attempts"
    return attempts.is_file() and len(attempts.read_text().splitlines()) > 1


def slim(obj):
    """results.json without its per-item and per-trial lists (the row file keeps every figure the table shows)."""
    if isinstance(obj, dict):
        return {k: slim(v) for k, v in obj.items() if k not in DROPPED}
    return obj


def evaluation(b: dict) -> list[str]:
    return [
        f"eval.tasks=[{','.join(b['tasks'])}]",
        f"eval.limit={b['eval_limit']}",
        f"eval.ppl_seq_len={b['ppl_seq_len']}",
        f"eval.ppl_sequences={b['ppl_sequences']}",
        f"eval.buckets=[{','.join(map(str, b['buckets']))}]",
        f"eval.la_share_seq_len={b['ppl_seq_len']}",
        f"eval.passkey_distances=[{','.join(map(str, b['passkey_distances']))}]",
        f"eval.passkey_trials={b['passkey_trials']}",
    ]


def measured_root(run_root: Path, budget: str, code: str) -> Path:
    """Where a row's stages run: one directory per budget and code hash, so that a stage finished on other code or at
    another budget (its wall time, its results) is never taken for this one: a stale row runs again from scratch."""
    return run_root / f"{budget}-{same_numbers_as(code)[:12]}"  # (a declared refactor resumes the same runs)


def run_row(
    row: str, b: dict, root: Path, model: list[str], code: str, switch: list[str] = (), stage1_root: Path | None = None
) -> dict:
    """One row end to end (each stage resumed or skipped when finished) under `root` (measured_root); returns the
    row's record, refused when the measured code changed while it ran. `switch`: more overrides of every stage;
    `stage1_root`: where its stage 1 runs when not under `root` (a switch that leaves stage 1 as it is shares it)."""
    common = [*model, f"attention.window={b['window']}", "seed=0"]
    modes = [f"eval.modes=[{','.join(MODES)}]", f"eval.passkey_modes=[{','.join(m for m in MODES if m != 'none')}]"]
    settings, times, again = {}, {}, []

    def stage(key: str, run_dir: Path, name: str, fn) -> None:
        times[key] = timed(run_dir, name, fn)
        again.extend([key] if resumed(run_dir, name) else [])

    if row == "base":
        run = root / "base"
        base = ["eval.modes=[base]", "eval.passkey_modes=[base]", "eval.la_share_seq_len=0", f"run_dir={run}"]
        settings["evaluate"] = [*common, *switch, *evaluation(b), *base]
        stage("eval", run, "eval", lambda: hybrid_scale("evaluate", *settings["evaluate"]))
        return record(row, b, settings, times, run / "eval" / "results.json", None, code, again)
    recipe, variant = split(CALIBRATED.split("+")[0] if row == CALIBRATED else row)
    extra = [*OVERRIDES[variant], *switch]  # the switch last: it overrides the variant's own keys (gamma3)
    objective = RECIPE_TABLE[recipe].objective
    stage1_run = (stage1_root or root) / f"stage1_{objective}{variant.replace('+', '_')}"
    settings["distill"] = [
        *common,
        *extra,
        f"run_dir={stage1_run}",
        f"distill.recipe={recipe}",
        f"data.num_sequences={b['stage1_sequences']}",
        f"data.seq_len={b['stage1_seq_len']}",
        f"distill.epochs={b['stage1_epochs']}",
        "distill.progress=false",
    ]
    stage("stage1", stage1_run, "stage1", lambda: hybrid_scale("distill", *settings["distill"]))
    run = root / (recipe + variant.replace("+", "_"))
    settings["finetune"] = [
        *common,
        *extra,
        f"run_dir={run}",
        f"finetune.model={stage1_run / 'stage1' / 'converted'}",
        f"finetune.recipe={recipe}",
        f"finetune.max_steps={b['steps']}",
        f"finetune.global_batch={b['global_batch']}",
        f"finetune.seq_len={b['seq_len']}",
        f"finetune.lr={b['lr']}",
        f"finetune.warmup_steps={max(1, b['steps'] // 10)}",
        f"finetune.eval_every={b['eval_every']}",
        f"finetune.save_every={b['eval_every']}",
        f"finetune.heldout_sequences={b['heldout_sequences']}",
        "finetune.progress=false",
    ]
    stage("stage2", run, "stage2", lambda: hybrid_scale("finetune", *settings["finetune"]))
    model_dir = (run / "stage2" / "output").resolve()
    curves = json.loads((run / "stage2" / "curves.json").read_text())
    if row == CALIBRATED:  # the la_only model, SWA added at export with gamma calibrated, evaluated
        exported = run / "export_hybrid_calibrated"
        settings["export"] = [
            *common,
            f"run_dir={run}",
            f"export.model={model_dir}",
            f"export.out_dir={exported}",
            "export.mode=hybrid",
            "export.calibrate_gamma=true",
            "export.report_sequences=0",  # the evaluation measures the perplexity
        ]
        stage("export", run, "export_calibrated", lambda: hybrid_scale("export", *settings["export"]))
        model_dir, out, name = exported, run / "eval_calibrated", "eval_calibrated"
    else:
        out, name = run / "eval", "eval"
    where = [f"eval.model={model_dir}", f"eval.out_dir={out}", f"run_dir={run}"]
    settings["evaluate"] = [*common, *extra, *evaluation(b), *modes, *where]
    stage("eval", run, name, lambda: hybrid_scale("evaluate", *settings["evaluate"]))
    return record(row, b, settings, times, out / "results.json", curves, code, again)


def record(
    row: str, b: dict, settings: dict, times: dict, results: Path, curves: dict | None, code: str, again=()
) -> dict:
    if code_hash() != code:
        raise SystemExit(
            f"reproduce: the code the row {row} measures ({', '.join(CODE)}) changed while it ran; its row file is "
            "not written. Commit or undo the change, then run the row again (it starts over on the new code)."
        )
    return {
        "row": row,
        "commit": commit(),
        "code_hash": code,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "budget": b,
        "settings": {stage: [o for o in opts if not o.startswith(LOCAL)] for stage, opts in settings.items()},
        "times_s": times,
        "resumed": list(again),  # stages killed and resumed: their time is the last attempt's only
        "curves": curves,
        "results": slim(EvalResults.load(results).to_json()),  # (refused when not a results.json of this schema)
    }


def stale(r: dict, b: dict, code: str) -> list[str]:
    """Why a committed row no longer describes the current code and budget (empty: current)."""
    why = []
    if same_numbers_as(r["code_hash"]) != same_numbers_as(code):
        why.append("the attention or recipe code changed since")
    if r.get("base_budget", r["budget"]) != b:  # (a switched row: the budget it changed)
        why.append("another budget")
    return why


def load_rows(rows_dir: Path, switched: bool = False) -> dict[str, dict]:
    """The row files of a budget: Table 1's rows, or (switched) the rows with a switch (<row>@<switch>)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json")) if ("@" in p.stem) == switched}


def run_switched(row: str, switch: str, b: dict, root: Path, model: list[str], code: str) -> dict:
    """`row` with one switch (SWITCHES) under root/@switch; its stage 1 is the unswitched row's when the switch
    leaves stage 1 as it is (no overrides, no stage-1 budget key). The record names the switch."""
    _, changes, overrides = SWITCHES[switch]
    own = overrides or any(k.startswith("stage1") for k in changes)
    r = run_row(row, b | changes, root / f"@{switch}", model, code, overrides, None if own else root)
    return r | {"switch": switch, "base_budget": b}


# --- the table -------------------------------------------------------------------------------------------------------


def _ci(d: dict) -> str:
    return f"{100 * d['delta']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _nats(d: dict) -> str:
    return f"{d['delta']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _beats(d: dict | None) -> str:
    """yes / no / ~ : the 95% CI of the NLL gain above 0, below 0, or around it."""
    if not d:
        return ""
    return "yes" if d["lo"] > 0 else ("no" if d["hi"] < 0 else "~")


def quoted_cells(name: str, budget: str) -> tuple[str, str, str]:
    """What the README quotes of a committed row, as its table prints it: (hybrid / swa_sinks perplexity past the
    window with the ratio, the NLL gain over swa_sinks [95% CI], beats swa_sinks). Raises if the row is stale: the
    README quotes only current rows (tests/unit/test_readme.py)."""
    r = load_rows(rows_dir_of(budget), switched="@" in name).get(name)
    if r is None:
        raise ValueError(f"no committed row {name} at budget {budget}")
    why = stale(r, r.get("base_budget", BUDGETS[budget]), code_hash())
    if why:
        raise ValueError(f"row {name} (budget {budget}) is stale: {'; '.join(why)}")
    res = r["results"]
    sinks, ppl = against_sinks(res), (res.get("beyond_window") or {}).get("perplexity", {})
    return f"{ppl['hybrid']:.1f} / {ppl['swa_sinks']:.1f} ({sinks['ratio']:.2f}x)", _nats(sinks), _beats(sinks)


def against_sinks(r: dict) -> dict | None:
    """The hybrid against swa_sinks beyond the window: the verdict's `against` when that is swa_sinks; for a hybrid
    with its own sinks, its swa_only (the same keys: window + the same sinks)."""
    b = r.get("beyond_window") or {}
    if b.get("against") == "swa_sinks":
        return b
    return b.get("swa_only") if r.get("hybrid_sinks") else None


def _minutes(r: dict) -> str:
    """The stage times in minutes, a resumed stage's marked * (its last attempt's time only)."""
    t, again = r["times_s"], r.get("resumed", ())

    def m(k: str) -> str:
        return f"{t[k] / 60:.0f}" + ("*" if k in again else "") if k in t else "-"

    export = f" (+{m('export')} export)" if "export" in t else ""
    return " / ".join(m(k) for k in ("stage1", "stage2", "eval")) + export


def table(rows: dict[str, dict], b: dict, code: str, budget: str = "default") -> str:
    """The budget's table (table_of) from its row records: every row of ROWS, run or not, each with its commit and,
    when it no longer matches the code or the budget, marked stale."""
    w = b["window"]
    args = "" if budget == "default" else f' ARGS="--budget {budget}"'
    flag = "" if budget == "default" else f" --budget {budget}"
    lines = [
        "# Table 1 on SmolLM2-135M-Instruct, row by row" + ("" if budget == "default" else f" (budget {budget})"),
        "",
        f"<!-- made by `make reproduce{args}` (experiments/reproduce_table1/run.py) from "
        f"experiments/reproduce_table1/{rows_dir_of(budget).name}/<row>.json -->",
        "",
        f"Budget of every row: stage 1 {b['stage1_sequences']} x {b['stage1_seq_len']} tokens, {b['stage1_epochs']} "
        f"epochs per layer; stage 2 {b['steps']} LoRA steps x {b['global_batch']} x {b['seq_len']} tokens, lr "
        f"{b['lr']}; window {w}; {b['eval_limit']} items per task ({', '.join(b['tasks'])}); perplexity on "
        f"{b['ppl_sequences']} held-out sequences of {b['ppl_seq_len']} tokens ({b['ppl_seq_len'] // b['seq_len']}x "
        f"the training length); passkey "
        f"{b['passkey_trials']} prompts per distance {b['passkey_distances']}. Run one row with `make reproduce "
        f"ROW=<row>{args}` (within an hour of 2 CPU cores, its stage 1 included: the last column); `make "
        f"reproduce{args}` runs the rows that are missing or stale, then writes this table.",
        "",
        "Accuracy in points (the reported metric per task, AVG over tasks); dSWA = hybrid - swa_only, dLA = la_only - "
        "none (95% CIs, paired bootstrap). Beyond the window: held-out tokens at positions >= "
        f"{w}; NLL gain in nats/token with its 95% CI (positive: the hybrid is better). A row is stale when the "
        "attention or recipe code (or the budget) changed after it ran: it is shown, marked, and `make reproduce` "
        "runs it again. A time marked * is a stage killed and resumed: the time of the attempt that finished it.",
        "",
        "| row | commit | hybrid | swa_only | la_only | none | dSWA [95% CI] | dLA [95% CI] | verdict | hybrid / "
        "swa_sinks ppl beyond window | hybrid vs swa_sinks: gain [95% CI] | beats swa_sinks | stage 1 / 2 / eval "
        "(min) |",
        "|---|---|" + "---:|" * 11,
    ]
    for name in ROWS:
        r = rows.get(name)
        if r is None:
            lines.append(f"| {name} | not run |" + " |" * 11)
            continue
        why = stale(r, b, code)
        mark = f"{r['commit'][:8]}" + (f" **stale** ({'; '.join(why)})" if why else "")
        res = r["results"]
        m = res["modes"]
        if name == "base":
            acc = f"{100 * m['base']['avg']:.1f} (base) | | | "
            lines.append(f"| {name} | {mark} | {acc}| | | | | | | {_minutes(r)} |")
            continue
        acc = " | ".join(f"{100 * m[x]['avg']:.1f}" if x in m else "-" for x in ACCURACY_MODES)
        d_swa = _ci(res["delta_swa"]["avg"]) if "delta_swa" in res else ""
        d_la = _ci(res["delta_la"]["avg"]) if "delta_la" in res else ""
        bw, sinks = res.get("beyond_window") or {}, against_sinks(res)
        ppl = bw.get("perplexity", {})
        ratio = f"{ppl['hybrid']:.1f} / {ppl['swa_sinks']:.1f}" if {"hybrid", "swa_sinks"} <= set(ppl) else ""
        if sinks and "ratio" in sinks:
            ratio += f" ({sinks['ratio']:.2f}x)"
        lines.append(
            f"| {name} | {mark} | {acc} | {d_swa} | {d_la} | {res['verdict']} | {ratio} | "
            f"{_nats(sinks) if sinks else ''} | {_beats(sinks)} | {_minutes(r)} |"
        )
    lines += ["", "## Perplexity by position bucket (held-out text)", ""]
    for name in ROWS:
        r = rows.get(name)
        if r is None or "perplexity" not in r["results"]:
            continue
        by_mode = r["results"]["perplexity"]["by_mode"]
        buckets = list(next(iter(by_mode.values())))
        lines += [f"{name}:", "", "| mode | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
        lines += [f"| {mode} | " + " | ".join(f"{v[x]:.1f}" for x in buckets) + " |" for mode, v in by_mode.items()]
        share = r["results"].get("la_share")
        if share:
            lines.append("| LA share | " + " | ".join(_share(share, x) for x in buckets) + " |")
        lines.append("")
    lines += ["## Stage 2 held-out losses (hybrid / la_only) at each evaluation, and why it stopped", ""]
    for name in ROWS:
        c = (rows.get(name) or {}).get("curves")
        if c and name != CALIBRATED:
            pts = ", ".join(
                f"{s}: {h:.3f}/{la:.3f}" for s, h, la in zip(c["eval_steps"], c["hybrid"], c["la_only"], strict=True)
            )
            lines.append(f"- {name}: {pts}; output = {c['output']}; stop: {c['stopping']['reason'] or 'max_steps'}")
    lines += [
        "",
        "## Commands",
        "",
        "```bash",
        f"make reproduce ROW=lolcats{args}   # one row (any of: " + ", ".join(ROWS) + ")",
        f"make reproduce{args}               # the missing and stale rows, then this table",
        f".venv/bin/python -m experiments.reproduce_table1.run --table{flag}"
        "   # this table from the committed rows alone",
        "```",
    ]
    return "\n".join(lines) + "\n"


def explore_table(rows: dict[str, dict], switched: dict[str, dict], b: dict, code: str, budget: str) -> str:
    """The switched rows beside the rows they change: the hybrid against swa_sinks past the window (the gain's CI),
    bucket by bucket (perplexity ratio hybrid / swa_sinks; < 1: the hybrid is better), and the LA's share of the
    hybrid's normaliser by bucket."""
    w = b["window"]
    flag = "" if budget == "default" else f" --budget {budget}"
    # every recipe with the main job's attention (issue 52's "SSD or HedgeCATs with the decay"), each followed by its
    # switched rows
    names = sorted({name.split("@")[0] for name in switched} | {n for n in rows if n.endswith("+sinks+decay")})
    lines = [
        f"# One switch at a time: does some recipe make the LA worth its place at window {w}? (budget {budget})",
        "",
        f"<!-- made by experiments/reproduce_table1/run.py --row ROW --switch SWITCH{flag} from "
        f"experiments/reproduce_table1/{rows_dir_of(budget).name}/<row>@<switch>.json -->",
        "",
        f"Each switched row is a row of {table_of(budget).name} with one change (SWITCHES in "
        "experiments/reproduce_table1/run.py): " + "; ".join(f"`{k}`: {v[0]}" for k, v in SWITCHES.items()) + ". "
        f"The target (issue 52): the hybrid beats swa_sinks past the window (positions >= {w}) with the gain's 95% "
        "CI above 0, no bucket worse, and an LA share of at least 10% past the window. Per bucket: perplexity "
        "hybrid / swa_sinks (below 1: the hybrid is better) and the LA's share of the normaliser. Every recipe with "
        "the main job's attention (+sinks+decay) is here, each followed by its switched rows.",
        "",
        "| row | switch | commit, code | hybrid / swa_sinks ppl past the window | gain [95% CI] | beats swa_sinks | "
        "per bucket: hybrid / swa_sinks | per bucket: LA share | stage 1 / 2 / eval (min) |",
        "|---|---|---|---:|---:|---|---|---|---:|",
    ]
    for name in names:
        mine = sorted((k, v) for k, v in switched.items() if k.split("@")[0] == name)
        for r in [rows.get(name), *(v for _, v in mine)]:
            if r is None:
                lines.append(f"| {name} | - | not run | | | | | | |")
                continue
            why = stale(r, b, code)
            mark = f"{r['commit'][:8]}, {r['code_hash'][:8]}" + (" **stale**" if why else "")
            res = r["results"]
            sinks = against_sinks(res)
            ppl = (res.get("beyond_window") or {}).get("perplexity", {})
            ratio = f"{ppl['hybrid']:.2f} / {ppl['swa_sinks']:.2f}" if {"hybrid", "swa_sinks"} <= set(ppl) else ""
            by_mode = res.get("perplexity", {}).get("by_mode", {})
            per = ""
            if {"hybrid", "swa_sinks"} <= set(by_mode):
                h, s_ = by_mode["hybrid"], by_mode["swa_sinks"]
                per = ", ".join(f"{x}: {h[x] / s_[x]:.3f}" for x in h)
            share = res.get("la_share")
            shares = ", ".join(f"{x}: {_share(share, x)}" for x in (by_mode.get("hybrid") or {})) if share else ""
            lines.append(
                f"| {name} | {r.get('switch', '-')} | {mark} | {ratio} | {_nats(sinks) if sinks else ''} | "
                f"{_beats(sinks)} | {per} | {shares} | {_minutes(r)} |"
            )
    lines += ["", "```bash"]
    script = ".venv/bin/python -m experiments.reproduce_table1.run"
    lines += [f"{script} --row {name}{flag}" for name in names]
    lines += [f"{script} --row {k.split('@')[0]} --switch {k.split('@')[1]}{flag}" for k in sorted(switched)]
    lines += ["```"]
    return "\n".join(lines) + "\n"


def _share(share: dict, bucket: str) -> str:
    """The LA's share of the hybrid's normaliser in a bucket, mean over layers and heads, in % ('' when the bucket was
    not measured)."""
    values = [h for by_bucket in share.get("share", {}).values() for h in by_bucket.get(bucket, [])]
    return f"{100 * sum(values) / len(values):.1f}%" if values else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", choices=ROWS, help="run this row only (end to end, resumable) and write its file")
    ap.add_argument("--switch", choices=sorted(SWITCHES), help="with --row: the row with this one-switch change")
    ap.add_argument("--table", action="store_true", help="only write the table from the committed rows")
    ap.add_argument("--budget", default="default", choices=sorted(BUDGETS))
    ap.add_argument("--model", default=None, help="model.path (default: the embedded SmolLM2)")
    ap.add_argument("--data", default=None, help="data.source (default: the embedded default's text)")
    ap.add_argument("--run-root", default="runs/reproduce")
    ap.add_argument(
        "--rows-dir",
        default=None,
        help="the row files (default: experiments/reproduce_table1/reproduce/, or reproduce_<budget>/ beside it for "
        "another budget)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the table (default: experiments/reproduce_table1/reproduce_table1.md, or reproduce_table1_<budget>.md "
        "beside it)",
    )
    a = ap.parse_args(argv)
    if a.switch and not a.row:
        ap.error("--switch goes with --row (the row it changes)")
    b, code = BUDGETS[a.budget], code_hash()
    rows_dir, out = Path(a.rows_dir or rows_dir_of(a.budget)), Path(a.out or table_of(a.budget))
    model = [*([f"model.path={a.model}"] if a.model else []), *([f"data.source={a.data}"] if a.data else [])]
    rows = load_rows(rows_dir)
    todo = [] if a.table else [a.row] if a.row else [r for r in ROWS if r not in rows or stale(rows[r], b, code)]
    if todo and not a.model:  # the embedded default, converted from its packages once (cached; new machines lack it)
        hybrid_scale("assets")
    root = measured_root(Path(a.run_root), a.budget, code)
    for name in todo:
        print(f"reproduce: row {name}" + (f" @{a.switch}" if a.switch else ""), flush=True)
        if a.switch:
            r = run_switched(name, a.switch, b, root, model, code)
            name = f"{name}@{a.switch}"
        else:
            r = run_row(name, b, root, model, code)
        rows_dir.mkdir(parents=True, exist_ok=True)
        path = rows_dir / f"{name}.json"
        path.with_suffix(".tmp").write_text(json.dumps(r, indent=1) + "\n")
        path.with_suffix(".tmp").replace(path)
        rows[name] = r
        print(f"reproduce: row {name} written to {path} ({sum(r['times_s'].values()) / 60:.1f} min)", flush=True)
    if not a.row:
        out.write_text(table(rows, b, code, a.budget))
        print(f"reproduce: table written to {out}")
    switched = load_rows(rows_dir, switched=True)
    if switched:
        explore_table_of(a.budget).write_text(explore_table(rows, switched, b, code, a.budget))
        print(f"reproduce: the switched rows' table written to {explore_table_of(a.budget)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
