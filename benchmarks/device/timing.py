"""Timing helpers of the device benchmark's decode parts: a function captured in a CUDA graph (`graphed`), ms per
call over n calls (`per_call_ms`, CUDA events), and one torch.profiler pass over n calls as a per-kernel table
(`kernel_table`: every CUDA kernel's microseconds and launches per call; in the dry run the CPU's aten ops instead)."""

from __future__ import annotations

import time

import torch


def graphed(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream, as torch.cuda.graph asks), as a replay function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def per_call_ms(cuda: bool, fn, n: int) -> float:
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t0) / n


def kernel_table(cuda: bool, fn, n: int, top: int = 15) -> dict:
    """torch.profiler over n calls of fn (after one unprofiled call): per call, every kernel's microseconds and
    launches, the `top` longest by name (the rest summed as `other`), the total and the number of launches. On a CPU
    (the dry run) the same of the aten ops' self time."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    if cuda:
        events = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    else:
        events = [(e.key, e.self_cpu_time_total / max(1, e.count)) for e in prof.key_averages()
                  if e.key.startswith("aten::") for _ in range(e.count)]  # fmt: skip
    for name, us in events:
        entry = by_name.setdefault(name[:90], [0.0, 0])
        entry[0] += us / n
        entry[1] += 1 / n
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    rows = [dict(kernel=k, us=v[0], launches=v[1]) for k, v in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append(dict(kernel=f"other ({len(rest)} kernels)", us=sum(v[0] for _, v in rest),
                         launches=sum(v[1] for _, v in rest)))  # fmt: skip
    total = sum(v[0] for v in by_name.values())
    return dict(rows=rows, total_us=total, launches=sum(v[1] for v in by_name.values()), calls=n,
                kind="CUDA kernels" if cuda else "aten ops' self CPU time (dry run: no CUDA)")  # fmt: skip
