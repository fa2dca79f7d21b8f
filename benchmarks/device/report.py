"""The one report writer of the device harness: NAME.md and NAME.json of a run (device_speed.* of the speed benchmark,
gpu_check.* of the pipeline check), rewritten after every part. `document` lays out the markdown every harness shares
(the title, date and command, the machine, the harness's own header lines, the table of parts, then each part's
section: each part module's `section(data)`); `save_report` writes both files, the JSON first, each whole (a process
killed while writing leaves the last whole file), and never loses the report to a figure the markdown did not expect
(it writes the traceback instead). Every table is written by benchmarks/report_table.py."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.report_table import table


def machine_lines(d: dict) -> list[str]:
    """The device and the package versions (the run's `device_info` and `versions`)."""
    info, v = d.get("device_info") or {}, d.get("versions") or {}
    memory = f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else ""
    return [
        f"- device: {info.get('device', '?')} ({info.get('gpu') or info.get('cpu') or '?'}{memory})",
        f"- torch {v.get('torch', '?')} (CUDA {v.get('cuda')}), triton {v.get('triton')}, transformers "
        f"{v.get('transformers')}, peft {v.get('peft')}, deepspeed {v.get('deepspeed')}, datasets {v.get('datasets')}, "
        f"omegaconf {v.get('omegaconf')}, fla-core {v.get('fla-core')}, python {v.get('python')}; hybrid_scale from "
        f"{v.get('hybrid_scale_from')}",
    ]


def in_order(d: dict) -> list[tuple[str, dict]]:
    """The parts' (key, status) in the harness's order (d["order"]), not in the order they ended (parallel parts)."""
    order = d.get("order") or list(d["parts"])
    return sorted(d["parts"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def document(d: dict, title: str, header: list[str], sections: Iterable[Callable[[dict], list[str]]]) -> str:
    """The report: `title`, the date and command, the machine, `header`, the parts' table, every section."""
    lines = [title, "", f"- date: {d['date']}; command: `{d['command']}`", *machine_lines(d), *header, ""]
    parts = [[f"{k}: {p['title']}", p["status"], p["seconds"], p["note"]] for k, p in in_order(d)]
    lines += table(["part", "status", "seconds", "note"], parts, digits=3)
    for write in sections:
        lines += write(d)
    return "\n".join(lines) + "\n"


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a process killed while writing (the device tool's
    timeout) leaves the last whole file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_report(out: Path, name: str, data: dict, markdown: Callable[[dict], str]) -> None:
    """NAME.json (every figure) and NAME.md (the tables) in `out`, each whole or as it was; the markdown's own
    failure written in its place."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / f"{name}.json", json.dumps(data, indent=1, default=str) + "\n")
    try:
        text = markdown(data)
    except Exception:  # noqa: BLE001  (a figure it did not expect: the report is never lost)
        text = f"# {name}\n\nThe tables failed (the figures are in {name}.json):\n\n```\n{traceback.format_exc()}```\n"
    write_whole(out / f"{name}.md", text)
