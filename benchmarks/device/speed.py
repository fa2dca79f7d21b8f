"""The speed benchmark of the device harness (issues 51 and 60): the converted attention against what it replaces, as
ratios measured side by side in one process on one GPU (bf16, Llama-3-8B attention shape: 32 heads, 8 KV heads, head dim
128, phi of 2 x 128 = 256 features (hedgehog, f = d), window 64, 8 sinks kept by the hybrid, LA decay on; batch 1),
every number of it in at most 5 minutes of device time: every part has its own budget, every row checks it before it
starts, and the run a deadline (DEVICE_SPEED_DEADLINE, 285 s, counted from device.sh's start) after which nothing
starts; what was measured is written after every part, and every ratio printed as it is measured (`device_speed: RATIO
...`).

Parts, in the order they run (one module each under benchmarks/device/, whose docstrings say what they measure):
  grad      1. bf16 fwd+bwd of hybrid_scale_kernels.triton_hybrid_attention at T 4096 (modes hybrid, la_only)
               against the fp32 chunked torch path: per-tensor max relative error of y and every gradient, with
               tolerances, pass/fail (a gpu-marked test, tests/unit/test_triton_kernels_bf16.py, run by tests.py);
  prefill   2. fwd and fwd+bwd at T 4096 and 16384 against SDPA and fla's chunk_simple_gla (g_gamma), every method
               compiled, autotuned and self-checked at T 1024 before its clock; ratios kept per row;
  profile   2b. torch.profiler: per-kernel microseconds of the hybrid fwd+bwd at T 4096 and of one decode step;
  tiles     2c. DEVICE_SPEED_TILES="a:warps=8,stages=2;b@90:dchunk=64": tile variants of the chunked prefill timed
               beside the default (unset: sm_90's alternatives, settings.DEFAULT_TILES; skipped when empty);
  decode    3. one layer's decode step at context 1k, 8k, 32k against a static KV cache, both in CUDA graphs;
  generate  4. `generate` of a 4-layer 8B-shaped model, converted against not, compiled with CUDA graphs: ms per
               token, with the dynamo graphs, recompiles and CUDA-graph skips of each call counted (expected 0);
  big       5. the 8B-shaped stage-1 layer and stage-2 step (a child process): tokens/s, MFU, the GPU-hours of an
               8B conversion;
  tests     6. the gpu-marked tests (a child process, cut at what is left): the chunked path's first, then fla's
               gated delta rule, then the older fused kernels' 21 cases.

    here:            make gpu-wheels          (the device tool: run, carry [".whl"], timeout_s 400)
    on the device:   bash benchmarks/device_speed.sh      (= bash benchmarks/device.sh speed)
    on a CPU:        python -m benchmarks.device speed --dry-run    (every part at toy shapes with the torch path: no
                     Triton, CUDA graphs, torch.compile or fla; seconds; tests/integration/test_device_speed.py)

Writes device_speed.md (the tables) and device_speed.json (every figure) into --out: $OUT when set, else docs/results
(the dry run: benchmarks/out/device_speed_dry), and the children's output into device_speed_children.log. Exit
status 0 when every part ran (or was skipped as asked) and the tests and the gradient check passed, else 1; 2 without
a GPU. The environment that changes it: benchmarks/device/settings.py (DEVICE_SPEED_PARTS, _BUDGETS, _DEADLINE,
_TILES, _FLA_CONFIGS).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from benchmarks.device import big as big_part
from benchmarks.device import decode, generate, prefill, profile, tests, tiles
from benchmarks.device.machine import device_info, versions
from benchmarks.device.report import document
from benchmarks.device.run import Run, run_part, start_deadline
from benchmarks.device.settings import ROOT, SPEED_PARTS, TARGETS, speed_settings
from benchmarks.report_table import fmt, table

NAME = "device_speed"  # its files: device_speed.md, .json, _children.log (and device.sh's device_speed.log)
STEPS = {"grad": tests.part_gradients, "prefill": prefill.part_prefill, "profile": profile.part_profile,
         "tiles": tiles.part_tiles, "decode": decode.part_decode, "generate": generate.part_generate,
         "big": big_part.part_big, "tests": tests.part_tests}  # fmt: skip
assert list(STEPS) == list(SPEED_PARTS)
CHILDREN = {"big": big_part.child_big}  # the parts that run in their own process (`--part NAME`)
SECTIONS = (tests.gradients_section, prefill.section, profile.section, tiles.section, decode.section,
            generate.section, big_part.section, tests.section)  # fmt: skip


def targets(d: dict) -> list[str]:
    """Issue 51's targets, each with what was measured, and the other ratios."""
    lines = ["", "## Targets (issue 51, H200; issue 60's counts)", ""]
    ratios, rows = d["ratios"], []
    for key, target in TARGETS.items():
        r = ratios.get(key)
        status = "not measured" if r is None else ("met" if r["met"] else "MISSED")
        rows.append([key, fmt(r["value"]) if r else "n/a", f"{target:.3g}", status])
    lines += table(["figure", "measured", "target (at most)", "status"], rows)
    others = [[k, fmt(r["value"]), r["note"]] for k, r in ratios.items() if k not in TARGETS]
    return lines + (["", "Other ratios:", ""] + table(["figure", "value", "note"], others) if others else [])


def markdown(d: dict) -> str:
    cfg, s = d["settings"], d["settings"]["shape"]
    title = "# Device speed (issues 51, 60)" + (
        " -- CPU dry run, toy shapes: timings mean nothing" if d["dry_run"] else ""
    )
    header = [f"- {cfg['dtype']}; attention backend {cfg['backend']}; shape: {s['H']} heads, {s['Hkv']} KV heads, head "
              f"dim {s['D']}, phi {s['F']} features, window {cfg['window']}, {cfg['sinks']} sinks (the hybrid's own), "
              "LA decay; batch 1"]  # fmt: skip
    return document(d, title, header, (targets, *SECTIONS))


def main(args) -> int:
    """The speed benchmark (args: __main__.py's); the exit status."""
    cfg = speed_settings(args.dry_run)
    if not args.dry_run and not torch.cuda.is_available():
        print("device_speed: no CUDA device here; the figures are measured on a GPU (--dry-run: the CPU check)")
        return 2
    default = ROOT / "benchmarks" / "out" / f"{NAME}_dry" if args.dry_run else ROOT / "docs" / "results"
    out = Path(args.out or os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    start_deadline(cfg["deadline"])
    run = Run("speed", NAME, cfg, out, args.command, markdown)
    run.data |= dict(order=list(SPEED_PARTS), ratios={})
    run.data["versions"] = versions()
    run.data["device_info"] = device_info(run.device)
    print(f"device_speed: {run.data['device_info']}; deadline in {run.left():.0f} s; results in {out}", flush=True)
    for key in SPEED_PARTS:
        if key in cfg["parts"]:
            run_part(run, key, SPEED_PARTS[key], lambda key=key: STEPS[key](run))
    print("\n" + markdown(run.data))
    failed = [k for k, p in run.data["parts"].items() if p["status"] == "FAILED"]
    missed = [k for k, r in run.data["ratios"].items() if r["met"] is False]
    judged = sum(r["met"] is not None for r in run.data["ratios"].values())
    head = f"FAILED parts {','.join(failed)}" if failed else "every part ran"
    seconds = run.seconds()
    print(f"device_speed: {head}; {len(missed)} of {judged} targets missed; {seconds:.0f} s; {out / f'{NAME}.md'}")
    return 1 if failed else 0
