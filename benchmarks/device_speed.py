"""The device benchmark (issues 51 and 60): the converted attention against what it replaces, as ratios measured side by
side in one process on one GPU (bf16, Llama-3-8B attention shape: 32 heads, 8 KV heads, head dim 128, phi of 2 x 128 =
256 features (hedgehog, f = d), window 64, 8 sinks kept by the hybrid, LA decay on; batch 1), every number of it in
at most 5 minutes of device time: every part has its own budget, every row checks it before it starts, and the run a
deadline (DEVICE_SPEED_DEADLINE, 285 s, counted from device_speed.sh's start) after which nothing starts; what was
measured is written after every part, and every ratio printed as it is measured (`device_speed: RATIO ...`).

Parts, in the order they run (one module each under benchmarks/device/, whose docstrings say what they measure):
  grad      1. bf16 fwd+bwd of hybrid_scale_kernels.triton_hybrid_attention at T 4096 (modes hybrid, la_only)
               against the fp32 chunked torch path: per-tensor max relative error of y and every gradient, with
               tolerances, pass/fail;
  prefill   2. fwd and fwd+bwd at T 4096 and 16384 against SDPA and fla's chunk_simple_gla (g_gamma), every method
               compiled, autotuned and self-checked at T 1024 before its clock; ratios kept per row;
  profile   2b. torch.profiler: per-kernel microseconds of the hybrid fwd+bwd at T 4096 and of one decode step;
  tiles     2c. DEVICE_SPEED_TILES="a:warps=8,stages=2;b:dchunk=64": tile variants of the chunked prefill timed
               beside the default (skipped when unset);
  decode    3. one layer's decode step at context 1k, 8k, 32k against a static KV cache, both in CUDA graphs;
  generate  4. `generate` of a 4-layer 8B-shaped model, converted against not, compiled with CUDA graphs: ms per
               token, with the dynamo graphs, recompiles and CUDA-graph skips of each call counted (expected 0);
  big       5. the 8B-shaped stage-1 layer and stage-2 step (a child process): tokens/s, MFU, the GPU-hours of an
               8B conversion;
  tests     6. the gpu-marked tests (a child process, cut at what is left): the chunked path's first, then fla's
               gated delta rule, then the older fused kernels' 21 cases.

    here:            make gpu-wheels          (the device tool: run, carry [".whl"], timeout_s 400)
    on the device:   bash benchmarks/device_speed.sh
    on a CPU:        python -m benchmarks.device_speed --dry-run    (every part at toy shapes with the torch path: no
                     Triton, CUDA graphs, torch.compile or fla; seconds; tests/integration/test_device_speed.py)

Writes device_speed.md (the tables) and device_speed.json (every figure) into --out: $OUT when set, else docs/results
(the dry run: benchmarks/out/device_speed_dry), and the children's output into device_speed_children.log. Exit
status 0 when every part ran (or was skipped as asked) and the tests and the gradient check passed, else 1; 2 without
a GPU. The environment that changes it: benchmarks/device/settings.py (DEVICE_SPEED_PARTS, _BUDGETS, _DEADLINE,
_TILES, _FLA_CONFIGS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.device.big import child_big, part_big
from benchmarks.device.decode import part_decode
from benchmarks.device.generate import part_generate
from benchmarks.device.gradients import part_gradients
from benchmarks.device.prefill import part_prefill
from benchmarks.device.profile import part_profile
from benchmarks.device.report import markdown
from benchmarks.device.run import Run
from benchmarks.device.settings import PARTS, settings
from benchmarks.device.tests import part_tests
from benchmarks.device.tiles import part_tiles
from benchmarks.gpu_check.common import DEADLINE, device_info, versions
from benchmarks.report_table import one_line

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"grad": part_gradients, "prefill": part_prefill, "profile": part_profile, "tiles": part_tiles,
         "decode": part_decode, "generate": part_generate, "big": part_big, "tests": part_tests}  # fmt: skip
assert list(STEPS) == list(PARTS)


def package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def status_of(result: dict) -> tuple[str, str]:
    """(ok / FAILED / skipped, the note) of a part's result."""
    if result.get("skipped_part"):
        return "skipped", result["skipped_part"]
    if result.get("failed"):
        return "FAILED", result["failed"] if isinstance(result["failed"], str) else "checks failed (see its section)"
    skipped = [r for r in result.get("rows", []) if "skipped" in r]
    if skipped:
        return "ok", f"{len(skipped)} rows not measured: " + "; ".join(sorted({r["skipped"] for r in skipped}))[:300]
    return "ok", ""


def run_part(run: Run, key: str) -> None:
    """Part `key` (guarded: a part failing must not lose the others), its status into run.data, the files saved."""
    title, t0 = PARTS[key], time.perf_counter()
    if run.left() < 10:
        run.data["parts"][key] = dict(title=title, status="FAILED", seconds=0.0, note="not started: deadline")
        print(f"\n== part {key}: {title}: not started, the deadline is reached", flush=True)
        run.save()
        return
    print(f"\n== part {key}: {title} ({run.left():.0f} s left)", flush=True)
    try:
        run.data[key] = result = STEPS[key](run)
        status, note = status_of(result)
    except Exception as e:  # noqa: BLE001  (a part failing must not lose the others)
        traceback.print_exc()
        status, note = "FAILED", one_line(e)
    run.data["parts"][key] = dict(title=title, status=status, seconds=time.perf_counter() - t0, note=note)
    print(f"== part {key}: {status} ({time.perf_counter() - t0:.1f} s) {note}", flush=True)
    run.save()
    run.free()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, the torch path (seconds)")
    parser.add_argument("--out", help="folder of device_speed.md/.json (default: $OUT, else docs/results)")
    parser.add_argument("--part", choices=["big"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cfg = settings(args.dry_run)
    if args.part:  # part big's child
        run = Run(cfg, Path(args.work), args.dry_run, "")
        Path(args.json).write_text(json.dumps(child_big(run, Path(args.work)), default=str))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("device_speed: no CUDA device here; the figures are measured on a GPU (--dry-run: the CPU check)")
        return 2
    default = ROOT / "benchmarks" / "out" / "device_speed_dry" if args.dry_run else ROOT / "docs" / "results"
    out = Path(args.out or os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    started = float(os.environ.get("DEVICE_SPEED_STARTED") or time.time())  # device_speed.sh's start (epoch s)
    DEADLINE[0] = time.monotonic() + cfg["deadline"] - max(0.0, time.time() - started)
    command = os.environ.get("DEVICE_SPEED_COMMAND") or "python " + " ".join(
        ["-m", "benchmarks.device_speed", *(argv if argv is not None else sys.argv[1:])]
    )
    run = Run(cfg, out, args.dry_run, command)
    run.data["versions"] = versions() | {"triton": package_version("triton")}
    run.data["fla_core"] = package_version("fla-core")
    run.data["device_info"] = device_info(run.device)
    print(f"device_speed: {json.dumps(run.data['device_info'])}; deadline in {run.left():.0f} s; results in {out}")
    for key in PARTS:
        if key in cfg["parts"]:
            run_part(run, key)
    run.save()
    print("\n" + markdown(run.data))
    failed = [k for k, p in run.data["parts"].items() if p["status"] == "FAILED"]
    missed = [k for k, r in run.data["ratios"].items() if r["met"] is False]
    judged = sum(r["met"] is not None for r in run.data["ratios"].values())
    seconds = time.monotonic() - DEADLINE[0] + cfg["deadline"]
    head = f"FAILED parts {','.join(failed)}" if failed else "every part ran"
    print(f"device_speed: {head}; {len(missed)} of {judged} targets missed; {seconds:.0f} s; {out / 'device_speed.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
