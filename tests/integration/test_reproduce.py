"""`make reproduce ROW=...` at a tiny budget (a 2-layer model, seconds per stage): one row end to end into its row
file (budget, settings, figures without the per-item lists, stage times, commit, code hash), killed in stage 2 and
resumed by running it again (the row marks that stage's time as its last attempt's), and the table made from the row
files."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from experiments.reproduce_table1 import run as reproduce

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def make(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # -o: never reinstall the venv from here (its stamp counts as up to date)
    cmd = ["make", "-s", "-C", str(ROOT), "-o", ".venv/.installed", "reproduce", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)


def test_make_reproduce_runs_a_row_resumes_it_after_a_kill_and_tables_it(tiny_run_model, tmp_path):
    rows = tmp_path / "rows"
    args = (
        f"--budget tiny --model {tiny_run_model} --data {tiny_run_model / 'text.txt'} --run-root {tmp_path / 'runs'} "
        f"--rows-dir {rows} --out {tmp_path / 'table.md'}"
    )
    killed = make("ROW=lolcats", f"ARGS={args}", env_extra={"HYBRID_SCALE_FAULT": "step:2"})  # SIGKILL in stage 2
    assert killed.returncode != 0 and not (rows / "lolcats.json").exists()
    (measured,) = (tmp_path / "runs").iterdir()  # runs/<budget>-<code hash>
    assert measured.name.startswith("tiny-") and (measured / "stage1_hybrid_output_mse" / "wall_stage1.json").is_file()
    again = make("ROW=lolcats", f"ARGS={args}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step_00000001" in (measured / "lolcats" / "stage2" / "log.txt").read_text()
    row = json.loads((rows / "lolcats.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert row["row"] == "lolcats" and row["commit"].startswith(head) and len(row["code_hash"]) == 64
    assert measured.name == f"tiny-{reproduce.same_numbers_as(row['code_hash'])[:12]}"
    assert set(row["times_s"]) == {"stage1", "stage2", "eval"} and row["budget"]["steps"] == 2
    assert row["resumed"] == ["stage2"]  # its time is the second attempt's only, and the row says so
    assert "finetune.recipe=lolcats" in row["settings"]["finetune"] and "run_dir" not in json.dumps(row["settings"])
    r = row["results"]
    assert {"hybrid", "swa_only", "swa_sinks", "la_only", "none"} <= set(r["modes"]) and r["verdict"]
    assert "delta_swa" in r and "delta_la" in r and "la_share" in r and "swa_sinks" in r["perplexity"]["by_mode"]
    assert '"correct"' not in json.dumps(row) and '"per_trial"' not in json.dumps(row)
    assert row["curves"]["eval_steps"] == [1, 2]
    table = make(f"ARGS={args} --table")
    assert table.returncode == 0, table.stderr[-3000:]
    text = (tmp_path / "table.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("| lolcats |"))
    assert f"| {row['commit'][:8]} |" in line and "stale" not in line and "| hedgecats | not run |" in text
    assert f"| {r['verdict']} |" in line and "lolcats:" in text and "| LA share |" in text
    assert f"| {row['times_s']['stage1'] / 60:.0f} / {row['times_s']['stage2'] / 60:.0f}* / " in line
