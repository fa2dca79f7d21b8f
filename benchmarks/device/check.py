"""The pipeline check of the device harness (the GPU check): the whole toolkit on one GPU in one call, with its
figures in one table.

Parts (each guarded by run.py's run_part: a failing part is reported with its traceback and FAILED in the table, the
others still run):
  tests. the gpu-marked tests (tests.py: the compiled kernels against the spec; at most GPU_CHECK_TIMEOUT s);
  a. build: a tiny random Llama with a byte-level tokenizer made here (no download), briefly pretrained on
     benchmarks/device/text.jsonl (generated prose) so that its attention is not uniform, and two small synthetic
     task datasets (PIQA- and ARC-Easy-shaped) for the evaluation;
  b. pipeline: distill -> finetune -> evaluate -> export through the CLI (one subprocess per stage) on the checked
     device/dtype (default cuda/bfloat16) and on the reference (default cpu/float32; the GPU is hidden from it);
     every output finite, the stage-1 final losses, stage-2 held-out losses, perplexities by mode and bucket, task
     log-likelihoods and the export's held-out loss compared within stated relative tolerances (TOL), and the
     export's cached decode checked against its full forward; both runs under tests/collectives' checker (every
     torch.distributed collective recorded, one on another device than the run's reported). The reference starts
     in the background when part a is done; on the GPU, parts c, d and e run meanwhile (one at a time), then b's GPU
     run, which then joins it;
  c. big: a Llama-3.2-1B-shaped random model (hidden 2048, 32 heads, 8 KV heads, head_dim 64, intermediate 8192; 4
     layers by default) in the checked dtype on the checked device: seconds per stage-1 layer and per stage-2 step;
  d. attention: hybrid attention (every registered backend, the Triton kernels on CUDA only; naive only up to
     GPU_CHECK_NAIVE_MAX) vs SDPA (is_causal, GQA) at 4k and 16k tokens, batch 1, the 1B head shape: forward and
     forward+backward time (CUDA events, after warm-up) and peak memory, with the ratios to SDPA;
  e. kernels: benchmarks/attention/kernels.py (the Triton kernels vs SDPA, FlashAttention if importable and the
     torch path, T = 1k..64k, SmolLM2 and Llama-3-8B head shapes; decode at 1k/8k/32k context vs a KV-cache decode)
     within GPU_CHECK_KERNEL_BUDGET seconds; its kernel_speed.md/json land beside the report;
  then the table (gpu_check.md) and every figure (gpu_check.json) in --out (default $OUT, else docs/results; the dry
     run: benchmarks/out/gpu_check_dry), rewritten after each part (report.py); printed at the end with a one-line
     summary; exit status 1 if any check failed.

Run on the GPU machine: `bash benchmarks/gpu_check.sh` (= `bash benchmarks/device.sh check`: installs the carried
wheels of `make gpu-wheels` first). On a CPU: `python -m benchmarks.device check --dry-run` (toy sizes, cpu bfloat16
against cpu float32; tests/integration/test_gpu_check.py).
Environment (defaults in brackets):
  GPU_CHECK_DEVICE [cuda; cpu in the dry run], GPU_CHECK_DTYPE [bfloat16]      the checked run (b, c, d)
  GPU_CHECK_REF_DEVICE [cpu], GPU_CHECK_REF_DTYPE [float32]      the reference of step b
  GPU_CHECK_SMALL [0]             1 = toy sizes (what --dry-run sets)
  GPU_CHECK_STEPS [tests,a,b,c,d,e]   the parts to run
  GPU_CHECK_LENGTHS [4096,16384], GPU_CHECK_NAIVE_MAX [8192]     step d
  GPU_CHECK_KERNEL_BUDGET [100]   step e: seconds after which `benchmarks.run kernels` starts no measurement
  GPU_CHECK_BIG_LAYERS [4]        depth of the 1B-shaped model of step c (16 = Llama-3.2-1B's)
  GPU_CHECK_PRETRAIN_STEPS [300]  pretraining of the tiny model (step a)
  GPU_CHECK_CLI [stages]          one CLI process per stage; `pipeline` = one `hybrid-scale pipeline` per run
  GPU_CHECK_PARALLEL [0]          1 = steps b, c, d at once (the CPU dry run: its timings mean nothing anyway)
  GPU_CHECK_TIMEOUT [240]         seconds per subprocess
  GPU_CHECK_DEADLINE [450]        seconds, from device.sh's start (its wheel installation included), after
                                  which no subprocess runs on (each is cut to what is left) and no part starts;
                                  part b's stages end 30 s before it (its export check runs after them), parts c
                                  and d 150 s before it (part b's GPU run comes after them): the report is complete
                                  inside an 8-minute call of the device tool
  GPU_CHECK_WORK [a temporary folder]
(GPU_CHECK_SMALL=1 and --dry-run switch the defaults of GPU_CHECK_CLI to pipeline and of GPU_CHECK_PARALLEL to 1.)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.device import attention, build, kernel_bench, pipeline, stages, tests
from benchmarks.device.report import document, in_order
from benchmarks.device.run import Run, child_part, run_part, start_deadline
from benchmarks.device.settings import CHECK_PARTS, DECODE_TOL, ROOT, TOL, check_settings
from benchmarks.report_table import fmt

NAME = "gpu_check"  # its files: gpu_check.md, .json, _children.log (and device.sh's gpu_check.log)
B_RESERVE = 150  # s before the deadline by which parts c, d and e end when part b's GPU run comes after them
CHILDREN = {"build": build.part_build, "big": stages.part_stages, "attention": attention.part_attention,
            "export_check": pipeline.part_export_check}  # fmt: skip


def threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def start_reference(run: Run, work: Path, pool) -> concurrent.futures.Future:
    """The reference pipeline of part b, started in the background (on the CPU: the GPU hidden from it, half the
    cores, DeepSpeed's one-time C++ op build on a quarter of them)."""
    s = run.cfg
    env = {"OMP_NUM_THREADS": str(threads()), "MAX_JOBS": str(max(1, threads() // 2))}
    if s["ref_device"] == "cpu" and s["device"] != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    built = run.data["build"]
    return pool.submit(pipeline.run_pipeline, s, "ref", s["ref_device"], s["ref_dtype"], built, work, run.log, env)


def step_pipeline(run: Run, work: Path, ref_job: concurrent.futures.Future) -> None:
    s, d, built = run.cfg, run.data, run.data["build"]
    env = {"OMP_NUM_THREADS": str(threads())}
    own = pipeline.run_pipeline(s, "run", s["device"], s["dtype"], built, work, run.log, env)
    ref = ref_job.result()
    d["pipeline"] = {"run": own["stage_s"], "ref": ref["stage_s"]}
    tags = {"run": f"{s['device']} {s['dtype']}", "ref": f"{s['ref_device']} {s['ref_dtype']}"}
    done = {key: r for key, r in (("run", own), ("ref", ref)) if not r["failed"]}
    if done:  # a run that finished is checked on its own even when the other one failed
        (work / "export_check_runs.json").write_text(
            json.dumps([[r["run_dir"], r["device"], r["dtype"]] for r in done.values()])
        )
        t0 = time.perf_counter()
        try:
            checked = child_part(run, "export_check", s["timeout"], work)
            for r in done.values():
                r |= checked[r["run_dir"]]
                d["checks"] += pipeline.own_checks(r, tags["run" if r is own else "ref"])
        except Exception as e:
            for r in done.values():
                r["failed"] = f"export check: {e}"
        d["pipeline"]["run"]["export check (both runs)"] = time.perf_counter() - t0
    d["pipeline_figures"] = {"run": own, "ref": ref}
    if not own["failed"] and not ref["failed"]:
        d["pipeline_info"] = {"run": own["task_avg"], "ref": ref["task_avg"]}
        d["compare"] = pipeline.compare_pipelines(own, ref)
    for r in d["compare"]:
        print(f"  {r['status']:>6}  {r['figure']}: {fmt(r['value'], 4)} vs {fmt(r['ref'], 4)} (rel {fmt(r['rel'], 2)})")
    for r in d["checks"]:
        print(f"  {r['status']:>6}  {r['check']}: {fmt(r['value'], 3)} (limit {r['limit']})")
    problems = [f"{tags[key]}: {r['failed']}" for key, r in (("run", own), ("ref", ref)) if r["failed"]]
    if problems:
        raise RuntimeError("\n".join(problems))


def failures(d: dict) -> list[str]:
    out = [f"part {k} ({v['title']})" for k, v in d["parts"].items() if v["status"] == "FAILED"]
    out += [r["figure"] for r in d["compare"] if r["status"] == "FAILED"]
    return out + [r["check"] for r in d["checks"] if r["status"] == "FAILED"]


def summary(d: dict, seconds: float) -> str:
    failed = failures(d)
    figures = [*d["compare"], *d["checks"]]
    n_ok = sum(r["status"] == "ok" for r in figures)  # failed parts are not figures
    steps = ", ".join(f"{k} {v['status']}" for k, v in in_order(d))
    head = "gpu_check: PASSED" if not failed else f"gpu_check: FAILED ({len(failed)}: {'; '.join(failed[:6])})"
    return f"{head}; steps {steps}; {n_ok}/{len(figures)} figure checks ok; {seconds:.0f} s"


def markdown(d: dict) -> str:
    s = d["settings"]
    title = "# GPU check" + (" (CPU dry run, toy sizes)" if s["small"] else "")
    header = [f"- checked {s['device']} {s['dtype']}; reference {s['ref_device']} {s['ref_dtype']}"]
    sections = (build.section, pipeline.section, stages.section, attention.section,
                lambda d: kernel_bench.section(d, Path(d["out"])), tests.section,
                lambda d: ["", f"**Summary:** {summary(d, d.get('seconds', 0.0))}"])  # fmt: skip
    return document(d, title, header, sections)


def main(args) -> int:
    """The pipeline check (args: __main__.py's); the exit status."""
    s = check_settings(args.dry_run)
    default = ROOT / "benchmarks" / "out" / f"{NAME}_dry" if args.dry_run else ROOT / "docs" / "results"
    out = Path(args.out or os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    start_deadline(s["deadline"])
    run = Run("check", NAME, s, out, args.command, markdown)
    run.data |= dict(order=list(CHECK_PARTS), out=str(out), compare=[], checks=[])
    run.data |= dict(tolerances=TOL, decode_tolerances=DECODE_TOL)
    print(f"gpu_check: {json.dumps({k: s[k] for k in ('device', 'dtype', 'ref_device', 'ref_dtype', 'small')})}")
    print(f"gpu_check: work in {work}, results in {out}", flush=True)

    def part(key: str, fn, needs: str = "") -> None:
        if key in s["steps"]:
            run_part(run, key, CHECK_PARTS[key], fn, margin=20, needs=needs)
            run.data["seconds"] = run.seconds()

    def gpu_reserve() -> int:  # c, d and e leave part b's GPU run its time when it comes after them
        return B_RESERVE if ref_job is not None and not s["parallel"] else 0

    def build_part() -> None:
        run.data["build"] = built = child_part(run, "build", s["timeout"], work)
        run.data["versions"], run.data["device_info"] = built["versions"], built["device_info"]

    def attention_part() -> None:
        run.data["attention"] = data = child_part(run, "attention", s["timeout"], work, reserve=gpu_reserve())
        bad = [f"{r['backend']} at {r['T']}: {r['error']}" for r in data["rows"] if "error" in r]
        bad += [f"{r['backend']} at {r['T']}: output not finite" for r in data["rows"] if r.get("finite") is False]
        if bad:
            raise RuntimeError("; ".join(bad))

    def big_part() -> None:
        run.data["big"] = child_part(run, "big", s["timeout"], work, reserve=gpu_reserve())

    def kernels_part() -> None:
        run.data["kernel_speed"] = kernel_bench.kernel_speed(run, reserve=gpu_reserve())

    part("tests", lambda: tests.part_tests(run))
    part("a", build_part)
    steps = [("b", lambda: step_pipeline(run, work, ref_job), "a"), ("c", big_part), ("d", attention_part),
             ("e", kernels_part)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ref_job = None
        if "b" in s["steps"] and run.data["parts"].get("a", {}).get("status") == "ok":
            ref_job = start_reference(run, work, pool)
            print("gpu_check: the reference pipeline of part b runs in the background from now on", flush=True)
        if s["parallel"]:  # the CPU dry run: its timings mean nothing, its wall time does
            for f in [pool.submit(part, *step) for step in steps]:
                f.result()
        else:  # the GPU parts one at a time (c, d while the CPU reference runs; then b's GPU run, joined with it)
            for step in (*steps[1:], steps[0]):
                part(*step)
    run.data["seconds"] = run.seconds()
    run.save()
    print("\n" + markdown(run.data))
    print(summary(run.data, run.data["seconds"]), flush=True)
    return 1 if failures(run.data) else 0
