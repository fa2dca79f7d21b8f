"""Compile the kernels for a GPU that is not here: what `ptxas` makes of them on sm_80 and sm_90.

The Triton interpreter runs the kernels with Python semantics, so it misses what a real compile enforces (types of
loop-carried values, shared memory, registers). Triton can compile for any target without a driver, and its wheel
ships `ptxas`. This module records the launches a wrapper makes (`record_launches`: `JITFunction.run` is replaced,
nothing runs, so the wrapper may be fed meta tensors at a 70B model's shapes), then compiles each launch exactly as
Triton's launcher would (its own binder gives the signature, the specialisations and the options) for a
`GPUTarget("cuda", arch, 32)`, and reads registers, spills and the stack frame from `ptxas -v`, the shared memory
from the compiled kernel, and whether the matrix products are wgmma (sm_90) or mma.sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.runtime.jit import JITFunction

# Largest shared memory one block may use (the opt-in maximum): A100 163 KiB, H100/H200 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# 32-bit registers one block may hold (sm_80 and sm_90), allocated per warp in units of 256 (8 per thread): with
# maxnreg=255 ptxas may give a thread up to 255 whatever the warps, and a block of 16 warps at over 128 cannot launch
REGISTER_FILE = 65536
ARCHS = (80, 90)


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    grid: tuple = ()  # the launch's grid (a callable grid is called with the launch's keyword arguments)

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    @property
    def programs(self) -> int:
        grid = self.grid(self.kwargs) if callable(self.grid) else self.grid
        n = 1
        for g in grid:
            n *= int(g)
        return n


@dataclass(frozen=True)
class Compiled:
    kernel: str
    arch: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared: int  # bytes
    num_warps: int
    wgmma: bool
    mma_sync: bool
    seconds: float
    constants: str  # the constexpr values, for the table
    error: str = ""  # the compile error, when it did not compile (then the figures above are 0)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def shared_ok(self) -> bool:
        return not self.error and self.shared <= SHARED_LIMIT[self.arch]

    @property
    def block_registers(self) -> int:
        """The registers a block of num_warps warps takes (per thread rounded up to a multiple of 8)."""
        return -(-self.registers // 8) * 8 * 32 * self.num_warps

    @property
    def registers_ok(self) -> bool:
        return self.block_registers <= REGISTER_FILE

    @property
    def products(self) -> str:
        return "wgmma" if self.wgmma else ("mma.sync" if self.mma_sync else "none (FMA)")


@contextlib.contextmanager
def record_launches():
    """Within the block, `kernel[grid](...)` records a Launch instead of running (compiled kernels, and the
    interpreter's under TRITON_INTERPRET=1: those Launches can be counted, not compiled); yields the list they go to."""
    launches: list[Launch] = []
    classes = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    runs = [cls.run for cls in classes]

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), tuple(grid) if not callable(grid) else grid))

    for cls in classes:
        cls.run = record
    try:
        yield launches
    finally:
        for cls, run in zip(classes, runs, strict=True):
            cls.run = run


def _target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def _bind(launch: Launch, arch: int):
    """Triton's own launch-time binding for this target: options, signature, constexprs, specialisations."""
    backend, binder = _binder(launch.kernel, arch)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return launch.kernel._pack_args(backend, launch.kwargs, bound, specialization, options)


@functools.cache
def _binder(kernel: JITFunction, arch: int):
    """(backend, binder) of a kernel for a target, made once (Triton keeps one per device the same way): making it
    took half the time of a gate whose results were all stored."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target(arch))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def key(launch: Launch, arch: int) -> str:
    """What makes one compile differ from another: the kernel's source and the jit functions it calls (Triton's
    cache_key), the signature, constexprs, specialisations, options, target and Triton's version. Equal keys
    compile to the same code."""
    options, signature, constexprs, attrs = _bind(launch, arch)
    text = repr((launch.name, source_key(launch.kernel), triton.__version__, arch))
    text += repr((sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items())))
    text += repr(sorted((k, _portable(k, v)) for k, v in options.__dict__.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def source_key(kernel: JITFunction) -> str:
    """Triton's cache_key (the source of the kernel and of every jit function it calls, and the global values they
    read) without the line each function starts on: a docstring or a kernel added above moves the lines, and
    registers, spills and shared memory do not depend on them, so such an edit keeps every stored result."""
    if kernel not in _SOURCE_KEYS:
        _SOURCE_KEYS[kernel] = _line_free_cache_key(kernel)
    return _SOURCE_KEYS[kernel]


_SOURCE_KEYS: dict[JITFunction, str] = {}


def _line_free_cache_key(kernel: JITFunction) -> str:
    own = kernel.fn.__module__
    mods = [m for name, m in list(sys.modules.items()) if name.startswith("hybrid_scale_kernels") or name == own]
    fns = [f for mod in mods for f in vars(mod).values() if isinstance(f, JITFunction)] + [kernel]
    saved = [(f, f.starting_line_number, f.hash) for f in fns]
    try:
        for f in fns:
            f.starting_line_number, f.hash = 0, None
        return kernel.cache_key
    finally:
        for f, line, h in saved:
            f.starting_line_number, f.hash = line, h


def _portable(name: str, value) -> str:
    """An option as it keys a compile on any machine: libraries by file name (their folder is the venv's)."""
    if name == "extern_libs" and value:
        return str(tuple((lib, Path(path).name) for lib, path in value))
    return str(value)


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack frame bytes) from the wheel's ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return _parse(out.stderr)


def _parse(log: str) -> tuple[int, int, int, int]:
    registers = int(_PTXAS.search(log)[1])
    stack, stores, loads = (int(x) for x in _SPILL.search(log).groups())
    return registers, stores, loads, stack


@contextlib.contextmanager
def _ptxas_log():
    knobs = triton.knobs.nvidia
    before = knobs.dump_ptxas_log
    knobs.dump_ptxas_log = True
    try:
        yield
    finally:
        knobs.dump_ptxas_log = before


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile one recorded launch for sm_<arch> (no GPU needed) and read what it costs."""
    from triton.compiler import ASTSource

    options, signature, constexprs, attrs = _bind(launch, arch)
    names = [p.name for p in launch.kernel.params]
    constants = ", ".join(f"{names[path[0]]}={value}" for path, value in sorted(constexprs.items()))
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), _ptxas_log():  # Triton's own ptxas -v run prints its log
            kernel = triton.compile(
                ASTSource(launch.kernel, signature, constexprs, attrs), target=_target(arch), options=options.__dict__
            )
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile: reported with its reason)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return Compiled(launch.name, arch, 0, 0, 0, 0, 0, int(options.num_warps), False, False,
                        time.perf_counter() - t0, constants, error=f"{type(e).__name__}: {first[:300]}")  # fmt: skip
    seconds = time.perf_counter() - t0
    ptx = kernel.asm["ptx"]
    if _PTXAS.search(log.getvalue()) and _SPILL.search(log.getvalue()):
        registers, stores, loads, stack = _parse(log.getvalue())
    else:  # from Triton's cache (no ptxas run): run it here
        registers, stores, loads, stack = ptxas_report(ptx, arch)
    return Compiled(
        kernel=launch.name,
        arch=arch,
        registers=registers,
        spill_stores=stores,
        spill_loads=loads,
        stack=stack,
        shared=int(kernel.metadata.shared),
        num_warps=int(options.num_warps),
        wgmma="wgmma.mma_async" in ptx,
        mma_sync="mma.sync" in ptx,
        seconds=seconds,
        constants=constants,
    )


class Cache:
    """One compile per distinct (launch, arch): the matrix of shapes and modes repeats many. `known` (key -> the
    fields of a Compiled, from an earlier run's JSON) is used for keys it has: their kernel source, launch and
    Triton version are those that produced the stored result, so compiling again would give it again (`verify`
    recompiles some to check that)."""

    def __init__(self, known: dict[str, dict] | None = None):
        self._done: dict[str, Compiled] = {}
        self._known = known or {}
        self._launches: dict[str, Launch] = {}
        self.compiled = self.reused = 0

    def __call__(self, launch: Launch, arch: int, k: str | None = None) -> Compiled:
        """The launch's result for arch; k: its `key` where the caller has it already."""
        k = k or key(launch, arch)
        if k not in self._done:
            self._launches[k] = launch
            if k in self._known:
                self._done[k] = Compiled(**self._known[k])
                self.reused += 1
            else:
                self._done[k] = compile_launch(launch, arch)
                self.compiled += 1
        return self._done[k]

    def __len__(self) -> int:
        return len(self._done)

    def results(self) -> dict[str, dict]:
        return {k: dataclasses.asdict(c) for k, c in sorted(self._done.items())}

    def verify(self, count: int, rng) -> list[str]:
        """Compile `count` of the reused results again (chosen by rng); what differs from the stored result."""
        reused = sorted(k for k in self._done if k in self._known)
        out = []
        for k in rng.sample(reused, min(count, len(reused))):
            stored, launch = self._done[k], self._launches[k]
            fresh = compile_launch(launch, stored.arch)
            for field in ("registers", "spill_stores", "spill_loads", "stack", "shared", "wgmma", "mma_sync", "error"):
                if getattr(fresh, field) != getattr(stored, field):
                    out.append(f"{stored.kernel} sm_{stored.arch} ({stored.constants}): {field} is "
                               f"{getattr(fresh, field)}, stored {getattr(stored, field)}")  # fmt: skip
        return out
