"""Timing helpers of the device benchmark's decode and profile parts: a function captured in a CUDA graph
(`graphed`), ms per call over n calls (`per_call_ms`, CUDA events), and one torch.profiler pass over several functions
as a per-kernel table of each (`kernel_tables`: every CUDA kernel's microseconds and launches per call; in the dry run
the CPU's aten ops instead)."""

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


PHASE = "device_speed phase: "  # the record_function label of each profiled function


def phase_of(ranges: dict, start: float) -> str | None:
    """The phase whose host time range holds `start` (us), else None."""
    return next((name for name, (t0, t1) in ranges.items() if t0 <= start <= t1), None)


def kernel_tables(cuda: bool, phases: dict, n: int, top: int = 15) -> dict:
    """One torch.profiler pass over n calls of each function of `phases` ({name: fn}; each called once before, not
    profiled), one after the other, each under a record_function range that ends after a device synchronisation: per
    phase, every kernel's microseconds and launches per call, the `top` longest by name (the rest summed as `other`),
    the total and the number of launches. A kernel belongs to the phase whose host time range holds its start (the
    profiler puts the device's times on the host's clock); `unplaced` counts those none holds. On a CPU (the dry run)
    the same of the aten ops' self time."""
    from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

    for fn in phases.values():
        fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for name, fn in phases.items():
            with record_function(PHASE + name):
                for _ in range(n):
                    fn()
                if cuda:
                    torch.cuda.synchronize()
    events = prof.events()
    ranges = {e.name[len(PHASE) :]: (e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith(PHASE) and e.device_type != torch.autograd.DeviceType.CUDA}  # fmt: skip
    if cuda:
        timed = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(PHASE)]  # fmt: skip
    else:
        timed = [(e.name, e.time_range.start, e.self_cpu_time_total) for e in events if e.name.startswith("aten::")]
    by_phase: dict[str, dict[str, list[float]]] = {name: {} for name in phases}
    unplaced = 0
    for kernel, start, us in timed:
        phase = phase_of(ranges, start)
        if phase is None:
            unplaced += 1
            continue
        entry = by_phase[phase].setdefault(kernel[:90], [0.0, 0])
        entry[0] += us / n
        entry[1] += 1 / n
    kind = "CUDA kernels" if cuda else "aten ops' self CPU time (dry run: no CUDA)"
    return {name: dict(one_table(by_name, top), calls=n, kind=kind, unplaced=unplaced)
            for name, by_name in by_phase.items()}  # fmt: skip


def one_table(by_name: dict[str, list[float]], top: int) -> dict:
    """{kernel: [us, launches] per call} as rows, the longest first (the rest summed as `other`), total, launches."""
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    rows = [dict(kernel=k, us=v[0], launches=v[1]) for k, v in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append(dict(kernel=f"other ({len(rest)} kernels)", us=sum(v[0] for _, v in rest),
                         launches=sum(v[1] for _, v in rest)))  # fmt: skip
    total = sum(v[0] for v in by_name.values())
    return dict(rows=rows, total_us=total, launches=sum(v[1] for v in by_name.values()))
