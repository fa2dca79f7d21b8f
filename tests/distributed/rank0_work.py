"""Run under torchrun: the pipeline's work done by rank 0 alone. `record`: the config record fails on rank 0; every
rank prints what it raised. `export`: an export that outlasts the process group's timeout (0.02 min); the other
rank does not wait for it, and both print that they are done."""

import sys
import time

from hybrid_scale import pipeline
from hybrid_scale.distributed import runtime

rt = runtime.init("cpu", 1, 0.02)


def fail():
    raise ValueError("rank 0's own error")


if sys.argv[1] == "record":
    try:
        pipeline.on_rank0(rt, "recording the config", fail)
        print(f"rank {rt.rank}: no error", flush=True)
    except Exception as e:  # noqa: BLE001 (the test reads what each rank raised)
        print(f"rank {rt.rank}: {type(e).__name__}: {e}", flush=True)
else:
    pipeline.export = lambda cfg: time.sleep(5)  # longer than the 1.2 s a collective would wait
    pipeline.export_on_rank0(None, rt)
    print(f"rank {rt.rank}: done", flush=True)
