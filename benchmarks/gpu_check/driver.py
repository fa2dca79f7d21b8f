"""The driver: main() runs steps a-f in order (each guarded: a failing step is reported and the others still run;
the reference pipeline of step b in the background), each part in a child process of this package (run_part:
`python -m benchmarks.gpu_check --part NAME`, which main_parts answers); and step_pipeline, which joins step b's two
runs, checks their exports and compares them."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.report_table import fmt

from . import __doc__ as HELP  # the package's docstring: what --help prints
from .attention import part_attention
from .big import part_big
from .build import part_build
from .common import B_RESERVE, DEADLINE, Log, run_child
from .kernel_bench import kernel_speed
from .pipeline import compare_pipelines, own_checks, part_export_check, run_pipeline
from .report import Report
from .settings import ROOT, settings

PACKAGE = "benchmarks.gpu_check"  # what run_part starts again, as `python -m benchmarks.gpu_check` (cwd: the root)


def run_part(name: str, s: dict, work: Path, log: Log, extra: list[str] = (), reserve: int = 0) -> dict:
    json_path = work / f"{name}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", PACKAGE, "--part", name, "--work", str(work), "--json", str(json_path), *extra]
    rc, out, err, _ = run_child(cmd, f"part {name}", log, s["timeout"], reserve=reserve)
    print(out[-4000:], end="", flush=True)
    if rc != 0:
        raise RuntimeError(f"part {name} failed (exit {rc}); its stderr ends with:\n{err.strip()[-3000:]}")
    return json.loads(json_path.read_text())


def threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def start_reference(s: dict, report: Report, work: Path, log: Log, pool) -> concurrent.futures.Future:
    """The reference pipeline of step b, started in the background (on the CPU: the GPU hidden from it, half the
    cores, DeepSpeed's one-time C++ op build on a quarter of them)."""
    env = {"OMP_NUM_THREADS": str(threads()), "MAX_JOBS": str(max(1, threads() // 2))}
    if s["ref_device"] == "cpu" and s["device"] != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    built = report.data["build"]
    return pool.submit(run_pipeline, s, "ref", s["ref_device"], s["ref_dtype"], built, work, log, env)


def step_pipeline(s: dict, report: Report, work: Path, log: Log, ref_job: concurrent.futures.Future) -> None:
    built = report.data["build"]
    run = run_pipeline(s, "run", s["device"], s["dtype"], built, work, log, {"OMP_NUM_THREADS": str(threads())})
    ref = ref_job.result()
    report.data["pipeline"] = {"run": run["stage_s"], "ref": ref["stage_s"]}
    tags = {"run": f"{s['device']} {s['dtype']}", "ref": f"{s['ref_device']} {s['ref_dtype']}"}
    done = {key: r for key, r in (("run", run), ("ref", ref)) if not r["failed"]}
    if done:  # a run that finished is checked on its own even when the other one failed
        (work / "export_check_runs.json").write_text(
            json.dumps([[r["run_dir"], r["device"], r["dtype"]] for r in done.values()])
        )
        t0 = time.perf_counter()
        try:
            checked = run_part("export_check", s, work, log)
            for r in done.values():
                r |= checked[r["run_dir"]]
                report.checks += own_checks(r, tags["run" if r is run else "ref"])
        except Exception as e:
            for r in done.values():
                r["failed"] = f"export check: {e}"
        report.data["pipeline"]["run"]["export check (both runs)"] = time.perf_counter() - t0
    report.data["pipeline_figures"] = {"run": run, "ref": ref}
    if not run["failed"] and not ref["failed"]:
        report.data["pipeline_info"] = {"run": run["task_avg"], "ref": ref["task_avg"]}
        report.compare = compare_pipelines(run, ref)
    for r in report.compare:
        print(f"  {r['status']:>6}  {r['figure']}: {fmt(r['value'], 4)} vs {fmt(r['ref'], 4)} (rel {fmt(r['rel'], 2)})")
    for r in report.checks:
        print(f"  {r['status']:>6}  {r['check']}: {fmt(r['value'], 3)} (limit {r['limit']})")
    problems = [f"{tags[key]}: {r['failed']}" for key, r in (("run", run), ("ref", ref)) if r["failed"]]
    if problems:
        raise RuntimeError("\n".join(problems))


def command_line(s: dict) -> str:
    if os.environ.get("GPU_CHECK_COMMAND"):
        return os.environ["GPU_CHECK_COMMAND"]
    internal = ("GPU_CHECK_OUT", "GPU_CHECK_WORK", "GPU_CHECK_STARTED")
    keys = sorted(k for k in os.environ if k.startswith("GPU_CHECK_") and k not in internal)
    prefix = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in keys)
    return (prefix + " " if prefix else "") + "python -m benchmarks.gpu_check"


def main_parts(args) -> int:
    s = settings()
    work = Path(args.work)
    if args.part == "build":
        result = part_build(s, work)
    elif args.part == "big":
        result = part_big(s, work)
    elif args.part == "attention":
        result = part_attention(s, work)
    else:
        result = part_export_check(s, work)
    Path(args.json).write_text(json.dumps(result, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["build", "big", "attention", "export_check"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        return main_parts(args)
    s = settings()
    out = Path(os.environ.get("GPU_CHECK_OUT") or os.environ.get("OUT") or ROOT / "docs" / "results")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check_children.log")
    report = Report(s, out, command_line(s))
    # counted from gpu_check.sh's start (GPU_CHECK_STARTED, epoch s): its wheel installation is inside the call too
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    DEADLINE[0] = time.monotonic() + s["deadline"] - max(0.0, time.time() - started)
    print(f"gpu_check: {json.dumps({k: s[k] for k in ('device', 'dtype', 'ref_device', 'ref_dtype', 'small')})}")
    print(f"gpu_check: work in {work}, results in {out}", flush=True)

    def guarded(key: str, title: str, fn, needs: str | None = None) -> None:
        if key not in s["steps"]:
            return
        t0 = time.perf_counter()
        if time.monotonic() > DEADLINE[0] - 20:
            report.step(key, title, "FAILED", 0.0, "not started: GPU_CHECK_DEADLINE reached")
            print(f"\n== step {key}: {title}: not started, GPU_CHECK_DEADLINE reached", flush=True)
            report.write()
            return
        if needs and report.steps.get(needs, {}).get("status") != "ok":
            report.step(key, title, "skipped", 0.0, f"needs step {needs}")
            print(f"\n== step {key}: {title}: skipped (needs step {needs})", flush=True)
            report.write()
            return
        print(f"\n== step {key}: {title}", flush=True)
        try:
            fn()
            report.step(key, title, "ok", time.perf_counter() - t0)
        except Exception as e:
            traceback.print_exc()
            sys.stdout.flush()
            note = str(e).strip().splitlines()[-1][:300].replace("|", "/") if str(e).strip() else type(e).__name__
            report.step(key, title, "FAILED", time.perf_counter() - t0, note)
        print(f"== step {key}: {report.steps[key]['status']} ({report.steps[key]['seconds']:.1f} s)", flush=True)
        report.write()

    def build():
        report.data["build"] = run_part("build", s, work, log)

    def pipeline():
        step_pipeline(s, report, work, log, ref_job)

    def gpu_reserve() -> int:  # c, d and e leave step b's GPU run its time when it comes after them
        return B_RESERVE if ref_job is not None and not s["parallel"] else 0

    def big():
        report.data["big"] = run_part("big", s, work, log, reserve=gpu_reserve())

    def attention():
        report.data["attention"] = data = run_part("attention", s, work, log, reserve=gpu_reserve())
        bad = [f"{r['backend']} at {r['T']}: {r['error']}" for r in data["rows"] if "error" in r]
        bad += [f"{r['backend']} at {r['T']}: output not finite" for r in data["rows"] if r.get("finite") is False]
        if bad:
            raise RuntimeError("; ".join(bad))

    def kernels():
        report.data["kernel_speed"] = kernel_speed(s, out, log, reserve=gpu_reserve())

    guarded("a", "build the tiny model, tokenizer and task data", build)
    step_b = ("b", "pipeline via the CLI, checked vs reference", pipeline, "a")
    step_c = ("c", "1B-shaped stage-1 layer and stage-2 step", big, None)
    step_d = ("d", "hybrid attention vs SDPA", attention, None)
    step_e = ("e", "Triton kernels vs SDPA: prefill and decode", kernels, None)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ref_job = None
        if "b" in s["steps"] and report.steps.get("a", {}).get("status") == "ok":
            ref_job = start_reference(s, report, work, log, pool)
            print("gpu_check: the reference pipeline of step b runs in the background from now on", flush=True)
        if s["parallel"]:  # the CPU dry run: its timings mean nothing, its wall time does
            for f in [pool.submit(guarded, *step) for step in (step_b, step_c, step_d, step_e)]:
                f.result()
        else:  # the GPU steps one at a time (c, d while the CPU reference runs; then b's GPU run, joined with it)
            for step in (step_c, step_d, step_e, step_b):
                guarded(*step)
    report.write()
    print("\n" + report.safe_markdown())
    print(report.summary(), flush=True)
    return 1 if report.failures() else 0
