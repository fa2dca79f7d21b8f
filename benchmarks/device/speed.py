"""The speed benchmark of the device harness (issues 51, 60 and 67): the converted attention against what it replaces,
as ratios measured side by side in one process on one GPU (bf16, Llama-3-8B attention shape: 32 heads, 8 KV heads,
head dim 128, phi of 2 x 128 = 256 features (hedgehog, f = d), window 64, 8 sinks kept by the hybrid, LA decay on),
every number of it within a deadline (DEVICE_SPEED_DEADLINE, 285 s from device.sh's start): every part has its own
budget, the budgets of the parts that run add up to at most the deadline (settings.py refuses settings that do not),
every row checks its part's budget before it starts, and nothing starts after the deadline. The report is written
when a part starts and when it ends, so a run cut short keeps every finished part's rows; every ratio is printed as
it is measured (`device_speed: RATIO ...`).

Parts, in the order they run (one module each under benchmarks/device/, whose docstrings say what they measure; the
default of a GPU run is settings.DEFAULT_PARTS, the first six):
  grad      1a. bf16 fwd+bwd of hybrid_scale_kernels.triton_hybrid_attention at T 4096 (modes hybrid, la_only)
                against the fp32 chunked torch path: per-tensor max relative error of y and every gradient, with
                tolerances, pass/fail (a gpu-marked test, tests/unit/test_triton_kernels_bf16.py, run by tests.py);
  delta     1b. fla-core's gated delta-rule kernel against the toolkit's chunked torch form (fp32, the 8B shape):
                the output, the final state and every gradient (delta.py);
  prefill   2. fwd and fwd+bwd at T 4096 and 16384 against SDPA and fla's chunk_simple_gla (g_gamma), every method
                compiled, autotuned and self-checked at T 1024 before its clock; ratios kept per row;
  tiles     2b. DEVICE_SPEED_TILES="a:warps=8,stages=2;b@90:dchunk=64": tile variants of the chunked prefill timed
                beside the default (named in DEVICE_SPEED_PARTS only; DEVICE_SPEED_TILES unset: sm_90's
                alternatives, settings.DEFAULT_TILES);
  decode    3. decode throughput of 32 sequences at 8k and 32k of context through 4 layers of the 8B shape, CUDA
                graphs, the hybrid against transformers' static KV cache: tokens/s, the ratio, and the largest batch
                each fits at 32k, allocated;
  profile   4. one torch.profiler pass: the kernels of the hybrid fwd+bwd at T 4096 and of one decode step;
  tests     5. the gpu-marked tests (a child process, cut at what is left): the chunked path's first, then the
                older fused kernels' cases (the gradient and gated delta tests left out: parts grad and delta ran
                them);
  generate  6. (named only) `generate` of the 4-layer model, converted against not, compiled with CUDA graphs, at 1k:
                ms per token, dynamo graphs, recompiles and CUDA-graph skips of each call (expected 0);
  big       7. (named only) the 8B-shaped stage-1 layer and stage-2 step (a child process): tokens/s, MFU, the
                GPU-hours of an 8B conversion.

    here:            make gpu-wheels          (the device tool: run, carry [".whl"], timeout_s 400)
    on the device:   bash benchmarks/device_speed.sh      (= bash benchmarks/device.sh speed)
    on a CPU:        python -m benchmarks.device speed --dry-run    (every part at toy shapes with the torch path: no
                     Triton, CUDA graphs, torch.compile or fla; tests/integration/test_device_speed.py)

Writes device_speed.md (the tables) and device_speed.json (every figure) into --out: $OUT when set, else docs/results
(the dry run: benchmarks/out/device_speed_dry), and the children's output into device_speed_children.log. Exit
status 0 when every part ran (or was skipped as asked) and the tests and the correctness checks passed, else 1; 2
without a GPU. The environment that changes it: benchmarks/device/settings.py (DEVICE_SPEED_PARTS, _BUDGETS,
_DEADLINE, _TILES, _FLA_CONFIGS).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from benchmarks.device import big as big_part
from benchmarks.device import decode, delta, generate, prefill, profile, tests, tiles
from benchmarks.device.machine import device_info, versions
from benchmarks.device.report import document
from benchmarks.device.run import Run, run_part, start_deadline
from benchmarks.device.settings import FLOORS, ROOT, SPEED_PARTS, TARGETS, speed_settings
from benchmarks.report_table import fmt, table

NAME = "device_speed"  # its files: device_speed.md, .json, _children.log (and device.sh's device_speed.log)
STEPS = {"grad": tests.part_gradients, "delta": delta.part_delta, "prefill": prefill.part_prefill,
         "tiles": tiles.part_tiles, "decode": decode.part_decode, "profile": profile.part_profile,
         "tests": tests.part_tests, "generate": generate.part_generate, "big": big_part.part_big}  # fmt: skip
assert list(STEPS) == list(SPEED_PARTS)
CHILDREN = {"big": big_part.child_big}  # the parts that run in their own process (`--part NAME`)
SECTIONS = (tests.gradients_section, delta.section, prefill.section, tiles.section, decode.section, profile.section,
            tests.section, generate.section, big_part.section)  # fmt: skip


def targets(d: dict) -> list[str]:
    """The targets (issues 51 and 67; issue 60's counts), each with what was measured, and the other ratios."""
    lines = ["", "## Targets (issues 51 and 67, H100 or H200; issue 60's counts)", ""]
    ratios, rows = d["ratios"], []
    bounds = [(k, "at most", v) for k, v in TARGETS.items()] + [(k, "at least", v) for k, v in FLOORS.items()]
    for key, sign, bound in bounds:
        r = ratios.get(key)
        status = "not measured" if r is None or r["met"] is None else ("met" if r["met"] else "MISSED")
        rows.append([key, fmt(r["value"]) if r else "n/a", f"{sign} {bound:.3g}", status])
    lines += table(["figure", "measured", "target", "status"], rows)
    others = [[k, fmt(r["value"]), r["note"]] for k, r in ratios.items() if k not in TARGETS and k not in FLOORS]
    return lines + (["", "Other ratios:", ""] + table(["figure", "value", "note"], others) if others else [])


def markdown(d: dict) -> str:
    cfg, s = d["settings"], d["settings"]["shape"]
    title = "# Device speed (issues 51, 60, 67)" + (
        " -- CPU dry run, toy shapes: timings mean nothing" if d["dry_run"] else ""
    )
    header = [f"- {cfg['dtype']}; attention backend {cfg['backend']}; shape: {s['H']} heads, {s['Hkv']} KV heads, head "
              f"dim {s['D']}, phi {s['F']} features, window {cfg['window']}, {cfg['sinks']} sinks (the hybrid's own), "
              "LA decay; batch 1 but in part decode"]  # fmt: skip
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
