"""The attention benchmarks' one runner, over benchmarks/registry.py's shapes and backends:

    python -m benchmarks.run scaling [--verify] [--max-len 32768]    # make bench: chunked vs naive vs SDPA on a CPU
    python -m benchmarks.run kernels [--verify] [--budget 150]       # make kernel-speed: the Triton kernels, a GPU
    python -m benchmarks.run roofline [--out docs/results/kernel_roofline.md]   # the kernels' roofline estimate
    python -m benchmarks.run verify [--device cuda] [--shapes llama3-8b]        # only the check below

- scaling (benchmarks/attention/scaling.py): the chunked hybrid attention against the naive spec and SDPA over the
  sequence length, and the decode step's time and bytes against a softmax KV cache (fp32, CPU, SmolLM2's shape);
  docs/results/attention_scaling.md.
- kernels (benchmarks/attention/kernels.py): the fused Triton kernels against SDPA, FlashAttention, fla and the
  torch path, prefill and decode, into --out (kernel_speed.md / .json); `--small` is its CPU dry run.
- roofline (benchmarks/attention/roofline.py): what the kernels' loop structure bounds their time to on an H200;
  docs/results/kernel_roofline.md.

`--verify` first checks every fast backend of the registry that runs on the suite's device (the chunked torch path,
the fused kernels, both decode steps) against the naive spec on each of the suite's shapes (a short sequence that
crosses the window and the chunks) and stops with exit status 1, naming each mismatch, before anything is timed.
Run from the repository root (`python -m`: benchmarks/ is a package).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--small" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on CPU

import torch  # noqa: E402

from benchmarks import registry  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # max |y - spec| <= tol (1 + max |spec|); half: 3e-2


def verify(shapes: dict, device="cpu", dtype=torch.float32, window: int = registry.WINDOW) -> list[str]:
    """Every fast backend (registry.prefill, registry.decode_backends) on `device` against the spec, computed in
    fp32 from the same inputs, at each shape: what differs (an empty list when all agree)."""
    tol = TOLERANCE.get(dtype, 3e-2)
    problems = []
    steps = 8
    for name, shape in shapes.items():
        T = 2 * window + 37 + steps  # past the window, across chunks of 64 and not a multiple of them
        x = registry.inputs(shape, T, device, dtype, seed=1)
        exact = {k: v.float() for k, v in x.items()}
        with torch.no_grad():
            spec = registry.prefill(window, device)["naive"](exact)

            def compare(what: str, y: torch.Tensor, ref: torch.Tensor, name=name, shape=shape) -> None:
                err, scale = (y.float() - ref).abs().max().item(), ref.abs().max().item()
                if not err <= tol * (1 + scale):  # the backends' self-check's measure (a NaN fails too)
                    problems.append(
                        f"{what} at {name} {shape}: differs from the spec by {err:.3g} (of {scale:.3g}; at most "
                        f"{tol:g} x (1 + that))"
                    )

            for backend, fn in registry.prefill(window, device).items():
                if backend != "naive":
                    compare(f"prefill `{backend}`", fn(x), spec)
            ctx = T - steps
            for backend in registry.decode_backends(device):
                state = registry.decode_state(shape, x, ctx, window, device, dtype, backend)
                ys = [registry.decode_step(state, x, t, window, backend) for t in range(ctx, T)]
                compare(f"decode `{backend}`", torch.cat(ys, 2), spec[:, :, ctx:])
    return problems


def check(shapes: dict, device, dtype, window: int) -> None:
    problems = verify(shapes, device, dtype, window)
    if problems:
        raise SystemExit("benchmarks.run --verify: a fast backend differs from the spec; nothing timed:\n  " +
                         "\n  ".join(problems))  # fmt: skip
    print(f"--verify: every fast backend agrees with the spec on {', '.join(shapes)} ({device}, {dtype})")


def parser() -> argparse.ArgumentParser:
    from benchmarks.attention import kernels, roofline, scaling  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="suite", required=True)
    for name, module in (("scaling", scaling), ("kernels", kernels)):
        p = sub.add_parser(name, help=module.__doc__.split("\n")[0])
        module.add_arguments(p)
        p.add_argument("--verify", action="store_true", help="check the fast backends against the spec first")
    roofline.add_arguments(sub.add_parser("roofline", help=roofline.__doc__.split("\n")[0]))
    p = sub.add_parser("verify", help="only --verify's check")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shapes", default=",".join(registry.SHAPES), help="the registry's shapes, by name")
    p.add_argument("--window", type=int, default=registry.WINDOW)
    return ap


def main(argv: list[str] | None = None) -> int:
    from benchmarks.attention import kernels, roofline, scaling  # noqa: PLC0415

    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.suite == "scaling":
        if args.verify:
            check({scaling.NAME: scaling.SHAPE}, "cpu", torch.float32, scaling.WINDOW)
        return scaling.run(args)
    if args.suite == "kernels":
        shapes = kernels.settle(args)
        if isinstance(shapes, int):
            return shapes
        if args.verify:
            check(shapes, args.device, args.dtype, args.window)
        return kernels.run(args, shapes, "python -m benchmarks.run " + " ".join(argv))
    if args.suite == "roofline":
        return roofline.run(args)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"benchmarks.run verify: --dtype {args.dtype} is not a torch dtype")
    check(registry.shapes_named(args.shapes), args.device, dtype, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
