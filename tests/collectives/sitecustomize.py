"""The collective checker: a Python process started with this folder on PYTHONPATH and HYBRID_SCALE_COLLECTIVES=<prefix>
in its environment wraps torch.distributed's collectives. Each call is appended to <prefix>.rank<RANK> as one JSON
line (op, dtype, shape, device, the calling line in hybrid_scale or deepspeed; DTensor's functional collectives,
which tensor parallelism issues from inside the split layers and their backward, as "funcol.<op>"), and a call whose
tensor is not on
the rank's compute device fails at once (HYBRID_SCALE_COLLECTIVES_DEVICE: cpu, or cuda = cuda:<LOCAL_RANK>), as
NCCL would fail it (HYBRID_SCALE_COLLECTIVES_REFUSE=0: only recorded, for a check that reports it instead). The
tests compare the ranks' files: the same ops with the same dtypes and shapes, in order.
Used through tests/procs.py (checked, collective_calls) by the multi-rank tests of stages 1, 2 and evaluation, and by
the device harness's pipeline check (benchmarks/device/pipeline.py); nothing in the package knows about it."""

import os

if os.environ.get("HYBRID_SCALE_COLLECTIVES"):
    import functools
    import json
    import sys

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    OPS = (
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",  # (its successor in torch 2.13: DeepSpeed's gathers, distributed/deepspeed.init_comm)
        "_all_gather_base",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        # object collectives: recorded as one call (their inner tensor collectives are not recorded again)
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
    )
    _prefix = os.environ["HYBRID_SCALE_COLLECTIVES"]
    _kind = os.environ.get("HYBRID_SCALE_COLLECTIVES_DEVICE", "cpu")
    _refuse = os.environ.get("HYBRID_SCALE_COLLECTIVES_REFUSE", "1") != "0"  # 0: record only (the GPU check)

    def _expected() -> torch.device:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if _kind == "cuda" else torch.device("cpu")

    def _tensors(args, kwargs):
        out = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out += [t for t in a if isinstance(t, torch.Tensor)]
        return out

    def _caller() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if ("hybrid_scale" in name or "deepspeed" in name) and "collectives" not in name:
                return f"{os.path.basename(name)}:{f.f_lineno}"
            f = f.f_back
        return "?"

    _depth = [0]

    def _wrap(op, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if _depth[0]:  # a collective made inside another one (all_gather_object's all_gather): recorded once
                return fn(*args, **kwargs)
            tensors = _tensors(args, kwargs)
            rank = dist.get_rank() if dist.is_initialized() else 0
            record = {
                "op": op,
                "dtype": [str(t.dtype) for t in tensors],
                "shape": [list(t.shape) for t in tensors],
                "device": [str(t.device) for t in tensors],
                "where": _caller(),
            }
            with open(f"{_prefix}.rank{rank}", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            wrong = [str(t.device) for t in tensors if t.device != _expected()]
            if wrong and _refuse:
                raise RuntimeError(
                    f"collective checker: {op} at {record['where']} got a tensor on {wrong[0]}; this rank computes "
                    f"on {_expected()}"
                )
            _depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _depth[0] -= 1

        return wrapped

    for _op in OPS:
        _fn = getattr(c10d, _op, None)
        if _fn is not None:
            _w = _wrap(_op, _fn)
            setattr(c10d, _op, _w)
            if getattr(dist, _op, None) is _fn:
                setattr(dist, _op, _w)

    import torch.distributed._functional_collectives as funcol  # DTensor calls these through the module

    FUNCTIONAL = (
        "broadcast",
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_single",
        "all_gather_single_autograd",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "reduce_scatter_single",
        "reduce_scatter_single_autograd",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
        "all_to_all_single",
        "all_to_all_single_autograd",
    )
    for _op in FUNCTIONAL:
        _fn = getattr(funcol, _op, None)
        if _fn is not None:
            setattr(funcol, _op, _wrap(f"funcol.{_op}", _fn))
