"""Run under torchrun: rank 0's own work in the pipeline fails; every rank prints what it raised."""

from hybrid_scale.distributed import runtime
from hybrid_scale.pipeline import on_rank0

rt = runtime.init("cpu", 1, 1)


def fail():
    raise ValueError("rank 0's own error")


try:
    on_rank0(rt, "the export", fail)
    print(f"rank {rt.rank}: no error", flush=True)
except Exception as e:  # noqa: BLE001 (the test reads what each rank raised)
    print(f"rank {rt.rank}: {type(e).__name__}: {e}", flush=True)
