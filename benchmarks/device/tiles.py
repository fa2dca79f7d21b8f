"""Part 2b, tiles: DEVICE_SPEED_TILES="a:warps=8,stages=2;b@90:dchunk=64" times tile variants of the heaviest kernels in
one call (a part run only when DEVICE_SPEED_PARTS names it; unset: settings.DEFAULT_TILES, sm_90's alternatives;
empty: the part is skipped). The kernels' launch settings are a dict by (architecture, head dim) of settings such as
dchunk, fchunk, warps, stages, dq_warps, dkv_warps, bwd_dchunk, bwd_fchunk, dkv_dchunk:
`hybrid_scale_kernels.GPU_SETTINGS` (kernels/hybrid_scale_kernels/settings.py; `python -m tools.kernel_compile
--settings 90/128:...` compiles a variant first, to see whether it spills). Each variant is applied with
unittest.mock.patch.dict on the device's architecture's head-dim-128 entry (a variant NAME@ARCH for another
architecture is skipped: its tiles were compiled for that one), warmed (compiled) at warm_T, then the hybrid's fwd
and fwd+bwd at T = 4096 are timed beside the default settings' in one table. In the dry run the torch path ignores
the settings (the table's code runs; its figures mean nothing)."""

from __future__ import annotations

import importlib
import json
import time
from unittest import mock

import torch

from benchmarks.device import prefill
from benchmarks.device.run import Run, out_of_time
from benchmarks.device.settings import tile_arch
from benchmarks.report_table import fmt, one_line, skipped_row, table

HEAD_DIM = 128  # Llama-3-8B's: the entry each variant patches


def gpu_settings(device: str) -> tuple[dict | None, int, str]:
    """(the kernels' GPU_SETTINGS, the architecture whose entry a call on `device` takes, where they were found) or
    (None, 0, why not)."""
    try:
        kernels = importlib.import_module("hybrid_scale_kernels.settings")
    except Exception as e:  # noqa: BLE001  (triton missing or broken)
        return None, 0, f"hybrid_scale_kernels does not import: {one_line(e)}"
    return kernels.GPU_SETTINGS, kernels.arch_of(torch.device(device)), "hybrid_scale_kernels.GPU_SETTINGS"


def part_tiles(run: Run) -> dict:
    cfg = run.cfg
    variants = cfg["tiles"]
    if not variants:
        return dict(rows=[], skipped_part="DEVICE_SPEED_TILES is empty")
    table, arch, where = gpu_settings(run.device)
    entry = (arch, HEAD_DIM)
    if table is None or entry not in table:
        why = where if table is None else f"{where} has no entry for sm_{arch} at head dim {HEAD_DIM}"
        print(f"device_speed: tiles: no tile variants timed: {why}", flush=True)
        return dict(rows=[], skipped_part=why)
    end = run.part_deadline("tiles")
    base = dict(table[entry])
    T, warm_T = cfg["tiles_T"], cfg["warm_T"]
    method = prefill.hybrid_method(run, "hybrid")
    warm_x, warm_gy = prefill.prefill_inputs(run, warm_T)
    x, gy = prefill.prefill_inputs(run, T)
    rows = []
    for name, changes in [("default", {}), *variants.items()]:
        row = dict(variant=name, settings=changes, T=T)
        unknown = sorted(set(changes) - set(base))
        took = max((r.get("seconds", 0.0) for r in rows[1:]), default=0.0)  # (each variant compiles anew)
        other = tile_arch(name) not in (None, arch) and f"tiles for sm_{tile_arch(name)}; this device takes sm_{arch}'s"
        why = (unknown and f"unknown settings {', '.join(unknown)} (known: {', '.join(sorted(base))})") or other or \
            out_of_time(end, f"the tiles budget ({cfg['budgets']['tiles']:.0f} s)", took)  # fmt: skip
        if why:
            rows.append(row | {"skipped": why})
            continue
        t0 = time.perf_counter()
        with mock.patch.dict(table[entry], changes):
            warm = prefill.warm_up(run, method, warm_x, warm_gy)
            row["compile_s"] = warm["seconds"]
            if "error" in warm:
                row["skipped"] = row["error"] = f"warm-up failed: {warm['error']}"
            else:
                row |= {"bwd_error": warm["bwd_error"]} if "bwd_error" in warm else {}
                prefill.measure(run, method, x, gy, row)
        row["seconds"] = time.perf_counter() - t0
        run.free()
        rows.append(row)
        print(f"device_speed: tiles {json.dumps(row)}", flush=True)
    default = rows[0]
    for r in rows:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if r.get(key) and default.get(key):
                r[f"{key[:-3]}_x_default"] = r[key] / default[key]
    note = "" if run.cuda else "dry run: the torch path does not use the kernels' settings"
    return dict(rows=rows, where=f"{where}[({arch}, {HEAD_DIM})]", head_dim=HEAD_DIM, default=base, note=note)


def section(d: dict) -> list[str]:
    """The report's section of part tiles (none when it did not run)."""
    t = d.get("tiles")
    if not t:
        return []
    lines = ["", "## 2b. Tile variants of the chunked prefill (DEVICE_SPEED_TILES)", ""]
    if t.get("skipped_part"):
        return lines + [f"Not run: {t['skipped_part']}."]
    lines += [f"Settings: {t['where']}, default {t['default']}; each variant patched over it "
              f"(unittest.mock.patch.dict). {t['note']}", ""]  # fmt: skip
    rows = []
    for r in t["rows"]:
        changes = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "(default)"
        if "skipped" in r:
            rows.append(skipped_row([r["variant"], changes, r["T"]], r["skipped"]))
            continue
        rows.append([r["variant"], changes, r["T"], *(fmt(r.get(k)) for k in ("compile_s", "fwd_ms", "fwd_bwd_ms",
                     "fwd_x_default", "fwd_bwd_x_default")), r.get("bwd_error", "")])  # fmt: skip
    head = ["variant", "settings", "T", "compile s", "fwd ms", "fwd+bwd ms", "fwd x default", "fwd+bwd x default",
            "note"]  # fmt: skip
    return lines + table(head, rows)
