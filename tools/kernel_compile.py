"""The kernels compiled for sm_80 and sm_90 on this machine (no GPU): every launch the wrappers make, as a model
makes them, each architecture with its own settings (hybrid_scale_kernels/settings.py, GPU_SETTINGS[(arch, head
dim)]: the launches are recorded once per architecture, the meta device standing for it).

For each model preset (configs/models/*.yaml: its heads, KV heads, head dim, feature dim, window and sinks) at its
own window and training length, and again at every other window a shipped config uses (configs/**.yaml: the
quickstart's 16) and at lengths that are not a multiple of the chunk (96: one state, which Triton specialises as the
constant 1; 100: not a multiple of 16), each attention mode and each of bf16 / fp16 / fp32, the wrappers are called
as training and generation call them -- the forward and its backward through autograd on meta tensors (the meta
device stands for a GPU: fp32 runs the kernels in bf16), the same with an initial state (stage 1), the forward
without gradients (a prefill; at 16k tokens, training's too, where both state scans are split as on an H100), also
with an initial state (a prompt after a full ring) and with the denominators (the balance report; a padding mask
launches what an unpadded batch launches: the rows are packed on the host), one fused decode step on a ring of
`window` keys for one row and for DECODE_ROWS (Triton compiles a batch of 1 apart) -- with the settings the kernels
choose on a GPU of that architecture. Every launch they make is recorded (nothing runs) and
compiled for both architectures by Triton and the wheel's ptxas (tools/compile_check.py); equal launches compile
once.

The same gate runs under the device image's Triton (3.6: `make kernel-compile-triton36`, its wheel put in
.triton36/ ahead of the project's on the path), where the register allocation differs.

    python -m tools.kernel_compile [--out docs/results/kernel_compile.md] [--presets llama3-8b,...]
        [--reuse docs/results/kernel_compile.json --verify 8]
        [--archs 90 --kernels _chunk_output,... --modes hybrid+sinks+decay,... --dtypes bf16,...]
        [--settings 90/128:dchunk=64,stages=2] [--progress /tmp/kernel_compile.progress.json]

--archs, --kernels, --modes and --dtypes compile a part of the matrix (while trying tiles); --settings compiles
with other settings than GPU_SETTINGS' (apply_settings).

--out also writes the results as JSON beside the table (kernel_compile.json), keyed by what determines a compile:
the kernel's source and the jit functions it calls, the launch's signature, constexprs and options, the target and
Triton's version. --reuse takes the results of unchanged keys from such a file and compiles the rest; --verify N
compiles N of the reused ones again and fails if any differs (the test suite does this: a change to a kernel is
compiled, an unchanged one costs nothing). --progress FILE keeps the results in FILE as they come (every
PROGRESS_EVERY compiles) and reuses those it holds: a run cut short goes on where it stopped when started again.

Prints one line per failing compile and exits 1 when a kernel does not compile, uses more shared memory than the
architecture allows or more registers per block than an SM has, spills more than SPILL_BUDGET bytes, or is one of
WGMMA and has no wgmma on sm_90 in bf16 or fp16. `make kernel-compile` writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hybrid_scale_kernels import chunk_h, settings
from hybrid_scale_kernels.chunk import triton_hybrid_attention
from hybrid_scale_kernels.decode import triton_decode_step
from hybrid_scale_kernels.utils import MODE_PARTS

from hybrid_scale.attention.hedgehog.feature_maps import make_feature_map
from hybrid_scale.attention.options import AttentionOptions
from hybrid_scale.attention.shape import Shape as CallShape
from hybrid_scale.attention.window.recurrent import DecodeState
from hybrid_scale.config import PRESETS, load_config
from tools import compile_check

# Bytes of spill stores + loads a kernel may have: none (fp32 calls run the chunked kernels in bf16 on a GPU; the
# decode step's fp32 launch is the one fp32 compile)
SPILL_BUDGET = {"bf16": 0, "fp16": 0, "fp32": 0}
# every mode the kernels compute ("none" launches nothing), and the hybrid with its sinks (attention.hybrid_sinks);
# each also with the LA's decay (attention.la_decay, "+decay"): the modes with an LA decay it, and the decode step
# carries a decayed state on in every mode
HYBRID_SINKS = "hybrid+sinks"
DECAY = "+decay"
MODES = (*MODE_PARTS, HYBRID_SINKS)
MODES = (*MODES, *(m + DECAY for m in MODES))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# kernels whose half-precision products must be wgmma on sm_90 (the chunked kernels' 64-row tiles)
WGMMA = ("_chunk_states", "_chunk_output", "_chunk_bwd_dq", "_chunk_dstates", "_chunk_bwd_dkv")


@dataclass(frozen=True)
class Shape:
    preset: str
    heads: int
    kv_heads: int
    head_dim: int
    features: int
    window: int
    sinks: int
    length: int  # T of the training kernels: the preset's training length, or one that is not a multiple of the chunk
    label: str = ""  # the table's name for a shape other than the preset's own: preset@w<window>@T<length>

    @property
    def name(self) -> str:
        return self.label or self.preset


ODD_LENGTHS = (96, 100)  # not a multiple of the chunk: one state (Triton specialises NS = 1), and not a multiple of 16


def shipped_windows() -> set[int]:
    """Every attention window a shipped config sets (configs/**/*.yaml)."""
    import yaml

    found = set()
    for path in PRESETS.rglob("*.yaml"):
        attention = (yaml.safe_load(path.read_text()) or {}).get("attention") or {}
        if isinstance(attention.get("window"), int):
            found.add(attention["window"])
    return found


def preset_shapes(names: list[str] | None = None) -> list[Shape]:
    """The attention shapes of every model preset, from its YAML file: at its window and training length, then at
    every other shipped window and the odd lengths."""
    shapes = []
    windows = shipped_windows()
    for path in sorted((PRESETS / "models").glob("*.yaml")):
        if names and path.stem not in names:
            continue
        cfg = load_config(f"models/{path.name}")
        arch, a = cfg.model.arch, cfg.attention
        d = arch.head_dim or arch.hidden_size // arch.num_attention_heads
        f = make_feature_map(a.feature_map, 1, d, a.feature_dim).out_dim
        own = Shape(path.stem, arch.num_attention_heads, arch.num_key_value_heads, d, f, a.window, a.sinks,
                    cfg.finetune.seq_len)  # fmt: skip
        shapes.append(own)
        for window in sorted(windows - {a.window}):
            label = f"{path.stem}@w{window}@T{ODD_LENGTHS[0]}"
            shapes.append(dataclasses.replace(own, window=window, length=ODD_LENGTHS[0], label=label))
        shapes += [dataclasses.replace(own, length=t, label=f"{path.stem}@T{t}") for t in ODD_LENGTHS]
    return shapes


DECODE_ROWS = 4  # a decode step's batch besides 1 (serving several sequences)
LONG = 16384  # tokens of a prefill (and a training step) whose state scans a GPU splits (chunk_h.plan; the presets'
# training lengths are not)
SMS = 132  # an H100's / H200's SMs: the state scan is split as on such a GPU (chunk_h.plan)


@contextlib.contextmanager
def _as_on_a_gpu():
    """The state scan planned for SMS SMs, as on a GPU (off a GPU it is never split)."""
    before = chunk_h.SMS_OFF_GPU
    chunk_h.SMS_OFF_GPU = SMS
    try:
        yield
    finally:
        chunk_h.SMS_OFF_GPU = before


def launches(shape: Shape, mode: str, dtype: torch.dtype, arch: int) -> list[compile_check.Launch]:
    """The launches on sm_<arch>, with its settings, of one forward + backward (meta tensors, batch 1), the same with
    an initial state (stage 1's units), forwards without gradients (a prefill, at the shape's length and at LONG
    tokens, whose state scan is split as on an H100/H200; with an initial state; with the denominators), a forward +
    backward at LONG tokens (both scans split) and one decode step (a ring of `window`) of one row and of
    DECODE_ROWS."""
    b, h, hkv, t, d, f = 1, shape.heads, shape.kv_heads, shape.length, shape.head_dim, shape.features

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=dtype, requires_grad=True)

    q, k, v, fq, fk = meta(b, h, t, d), meta(b, hkv, t, d), meta(b, hkv, t, d), meta(b, h, t, f), meta(b, hkv, t, f)
    gamma = torch.empty(h, device="meta", requires_grad=True)
    decay = mode.endswith(DECAY)
    mode = mode.removesuffix(DECAY)
    own = mode == HYBRID_SINKS
    o = AttentionOptions(window=shape.window, mode="hybrid" if own else mode, sinks=shape.sinks, hybrid_sinks=own)
    rho = torch.empty(hkv, device="meta", requires_grad=True)
    init = (torch.empty(b, hkv, f, d, device="meta", requires_grad=True),
            torch.empty(b, hkv, f, device="meta", requires_grad=True))  # fmt: skip
    with compile_check.record_launches() as recorded, _as_on_a_gpu(), settings.standing_for(arch):
        extra = {"la_decay": rho} if decay else {}
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, **extra)
        y.backward(torch.empty_like(y))  # training
        y = triton_hybrid_attention(q, k, v, fq, fk, gamma, o, **extra, initial_state=init)
        y.backward(torch.empty_like(y))  # stage 1's units: an initial state
        plain = [t.detach() for t in (q, k, v, fq, fk, gamma)]  # generation's prefill: no gradient, y in q's dtype
        extra = {"la_decay": rho.detach()} if decay else {}
        triton_hybrid_attention(*plain, o, **extra)
        long = [x.new_empty(*x.shape[:2], LONG, x.shape[3]) if x.dim() == 4 else x for x in plain]
        triton_hybrid_attention(*long, o, **extra)  # a state scan split over the sequence, as on a GPU
        y = triton_hybrid_attention(*(x.requires_grad_() if x.dim() == 4 else x for x in long), o, **extra)
        y.backward(torch.empty_like(y))  # training at LONG: the reverse scan split too
        triton_hybrid_attention(*plain, o, **extra, initial_state=tuple(x.detach() for x in init))  # a prompt after
        # a full ring, without gradients
        triton_hybrid_attention(*plain, dataclasses.replace(o, return_denominators=True), **extra)  # the balance report
        for rows in (1, DECODE_ROWS):
            _decode_step(shape, o, dtype, rows, decay)
    return list(recorded)


def _decode_step(shape: Shape, o: AttentionOptions, dtype: torch.dtype, rows: int, decay: bool) -> None:
    """One fused decode step of `rows` rows on a ring of the shape's window (recorded by the caller)."""
    h, hkv, d, f = shape.heads, shape.kv_heads, shape.head_dim, shape.features
    call = CallShape(kv_heads=hkv, head_dim=d, value_dim=d, features=f, window=shape.window, sinks=shape.sinks,
                     dtype=dtype)  # fmt: skip
    state = DecodeState.empty(call, rows, shape.window, "cpu")

    def one(*size):
        return torch.zeros(*size, dtype=dtype)

    triton_decode_step(state, one(rows, h, 1, d), one(rows, hkv, 1, d), one(rows, hkv, 1, d), one(rows, h, 1, f),
                       one(rows, hkv, 1, f), torch.ones(h), o,
                       **({"la_decay": torch.zeros(hkv)} if decay else {}))  # fmt: skip


@dataclass
class Row:
    kernel: str
    mode: str
    dtype: str
    presets: list[str]
    compiled: dict[int, compile_check.Compiled]
    tiles: dict[int, str] = dataclasses.field(default_factory=dict)  # per architecture: its launch's tiles and warps


@dataclass(frozen=True)
class Selection:
    """The part of the matrix compiled: by default all of it."""

    archs: tuple[int, ...] = compile_check.ARCHS
    kernels: tuple[str, ...] = ()  # () = every kernel
    modes: tuple[str, ...] = MODES
    dtypes: tuple[str, ...] = tuple(DTYPES)


def tiles_of(launch: compile_check.Launch) -> str:
    """The table's tiles of a launch: its BLOCK_* constants, warps, pipeline stages and register cap."""
    kw = launch.kwargs
    out = [f"{k}={v}" for k, v in sorted(kw.items()) if k.startswith("BLOCK")]
    names = (("num_warps", "warps"), ("num_stages", "stages"), ("maxnreg", "maxnreg"))
    out += [f"{short}={kw[k]}" for k, short in names if k in kw]
    return ", ".join(out)


def paired(per_arch: dict[int, list[compile_check.Launch]]) -> list[dict[int, compile_check.Launch]]:
    """The launches of the architectures side by side: the i-th launch of a kernel on one beside the i-th of that
    kernel on the others (a setting may change how many launches a kernel makes: the split scan's segments follow
    the state kernel's blocks; one no other architecture makes stands alone)."""
    groups: dict[tuple, dict[int, compile_check.Launch]] = {}
    for arch, recorded in per_arch.items():
        seen: dict[str, int] = {}
        for x in recorded:
            n = seen[x.name] = seen.get(x.name, -1) + 1
            groups.setdefault((x.name, n), {})[arch] = x
    return list(groups.values())


def compile_matrix(
    shapes: list[Shape], selection: Selection = Selection(), progress=None, cache: compile_check.Cache | None = None
) -> list[Row]:
    """Every launch of every (shape, mode, dtype) in `selection`, recorded for each architecture with its settings
    and compiled for it; one row per distinct set of compiles of a (kernel, mode, dtype), with the presets that
    share it."""
    cache = cache if cache is not None else compile_check.Cache()
    rows: dict[tuple, Row] = {}
    for shape in shapes:
        for mode in selection.modes:
            for name in selection.dtypes:
                per_arch = {arch: launches(shape, mode, DTYPES[name], arch) for arch in selection.archs}
                for pair in paired(per_arch):
                    kernel = next(iter(pair.values())).name
                    if selection.kernels and kernel not in selection.kernels:
                        continue
                    keyed = {arch: compile_check.key(x, arch) for arch, x in pair.items()}  # (once: it costs)
                    done = {arch: cache(x, arch, keyed[arch]) for arch, x in pair.items()}
                    keys = tuple(keyed.items())
                    tiles = {arch: tiles_of(x) for arch, x in pair.items()}
                    row = rows.setdefault((kernel, mode, name, keys), Row(kernel, mode, name, [], done, tiles))
                    if shape.name not in row.presets:  # (the forward's states are launched again in the backward)
                        row.presets.append(shape.name)
                    if progress:
                        progress(len(cache))
    return list(rows.values())


def failures(rows: list[Row]) -> list[str]:
    out = []
    for row in rows:
        for arch, c in row.compiled.items():
            what = f"{row.kernel} {row.mode} {row.dtype} sm_{arch} ({', '.join(row.presets)})"
            if c.error:
                out.append(f"{what}: does not compile: {c.error}")
                continue
            if arch == 90 and row.kernel in WGMMA and row.dtype != "fp32" and not c.wgmma:
                out.append(f"{what}: its products are {c.products}, not wgmma")
            if not c.shared_ok:
                out.append(f"{what}: {c.shared} bytes of shared memory, over the {compile_check.SHARED_LIMIT[arch]}")
            if not c.registers_ok:
                out.append(f"{what}: {c.registers} registers x {c.num_warps} warps need {c.block_registers} per "
                           f"block, over the {compile_check.REGISTER_FILE} an SM has: it cannot launch")  # fmt: skip
            if c.spills > SPILL_BUDGET[row.dtype]:
                out.append(
                    f"{what}: {c.spills} bytes of spills (budget {SPILL_BUDGET[row.dtype]}), {c.registers} registers"
                )
    return out


def totals(rows: list[Row]) -> str:
    """Per architecture: the spill bytes of every row, the largest shared memory against its limit, and (sm_90) how
    many of the WGMMA kernels' half-precision rows have wgmma products."""
    out = []
    for arch in compile_check.ARCHS:
        done = [(r, r.compiled[arch]) for r in rows if arch in r.compiled]
        if not done:
            continue
        shared = max(c.shared for _, c in done) / 1024
        text = (f"sm_{arch}: {sum(c.spills for _, c in done)} spill bytes in {len(done)} rows, shared memory up to "
                f"{shared:.0f} of {compile_check.SHARED_LIMIT[arch] // 1024} KiB")  # fmt: skip
        if arch == 90:
            half = [c for r, c in done if r.kernel in WGMMA and r.dtype != "fp32"]
            text += f", wgmma in {sum(c.wgmma for c in half)} of {len(half)} half-precision rows of {', '.join(WGMMA)}"
        out.append(text)
    return "; ".join(out)


PROGRESS_EVERY = 25  # compiles between two writes of --progress's file


def _results(cache: compile_check.Cache, kept: dict | None = None) -> str:
    """The results as JSON: this run's, after `kept` (--progress: what the file held, so that a run over other
    kernels or settings drops none of it)."""
    results = {**(kept or {}), **cache.results()}
    return json.dumps({"triton": __import__("triton").__version__, "results": results}, indent=1) + "\n"


def _known(*paths: Path | None) -> dict | None:
    """The stored results of the files that exist (None: no file)."""
    found = [json.loads(p.read_text())["results"] for p in paths if p and p.is_file()]
    return {k: v for results in found for k, v in results.items()} if found else None


def table(rows: list[Row]) -> str:
    head, rule = ["kernel", "mode", "dtype", "presets"], ["---"] * 4
    for arch in compile_check.ARCHS:
        head += [f"sm_{arch} tiles", f"sm_{arch}: regs / spill B / shared KiB / products"]
        rule += ["---"] * 2
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for row in sorted(rows, key=lambda r: (r.kernel, r.mode, r.dtype, r.presets)):
        cells = [f"`{row.kernel}`", row.mode, row.dtype, ", ".join(row.presets)]
        for arch in compile_check.ARCHS:
            c = row.compiled.get(arch)
            if c is None:
                cells += ["not launched", ""]
                continue
            cells += [row.tiles.get(arch, ""), f"{c.registers} / {c.spills} / {c.shared / 1024:.0f} / {c.products}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def apply_settings(spec: str) -> None:
    """--settings [ARCH/]HEAD_DIM:KEY=VALUE,... (e.g. 90/128:dchunk=64,stages=2; without ARCH every architecture's
    entry): compile with these GPU settings instead of GPU_SETTINGS' (fails where they spill), to see what another
    tiling gives. Several specs are joined by ';'."""
    for part in filter(None, spec.split(";")):
        where, pairs = part.split(":", 1)
        arch, _, head_dim = where.rpartition("/")
        archs = [int(arch)] if arch else list(settings.ARCHS)
        for a in archs:
            entry = settings.GPU_SETTINGS.get((a, int(head_dim)))
            if entry is None:
                raise SystemExit(f"kernel_compile: no settings for sm_{a} at head dim {head_dim}; known: "
                                 + ", ".join(f"{x}/{d}" for x, d in settings.GPU_SETTINGS))  # fmt: skip
            for pair in pairs.split(","):
                key, value = pair.split("=")
                if key not in entry and not key.endswith("_maxnreg"):
                    raise SystemExit(f"kernel_compile: no setting '{key}'; known: {', '.join(sorted(entry))}")
                entry[key] = int(value)


def _listed(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def selection_of(args) -> Selection:
    """The part of the matrix the arguments name (each unknown name refused)."""
    archs = tuple(int(a) for a in _listed(args.archs)) or compile_check.ARCHS
    modes, dtypes = _listed(args.modes) or MODES, _listed(args.dtypes) or tuple(DTYPES)
    for what, given, known in (("architecture", archs, compile_check.ARCHS), ("mode", modes, MODES),
                               ("dtype", dtypes, tuple(DTYPES))):  # fmt: skip
        unknown = [str(x) for x in given if x not in known]
        if unknown:
            raise SystemExit(f"kernel_compile: unknown {what} {', '.join(unknown)}; known: "
                             + ", ".join(str(x) for x in known))  # fmt: skip
    return Selection(archs=archs, kernels=_listed(args.kernels), modes=modes, dtypes=dtypes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--presets", default="", help="comma-separated preset names (default: every preset)")
    parser.add_argument("--settings", default="", help=apply_settings.__doc__.split(":", 1)[0] + " (see its doc)")
    parser.add_argument(
        "--reuse", type=Path, default=None,
        help="a JSON this script wrote: results whose key (kernel source, launch, Triton version) it holds are "
             "taken from it, the rest compiled",
    )  # fmt: skip
    parser.add_argument("--verify", type=int, default=0, help="with --reuse: compile this many reused ones again")
    parser.add_argument("--archs", default="", help="comma-separated architectures, e.g. 90 (default: 80,90)")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: every kernel)")
    parser.add_argument("--modes", default="", help="comma-separated modes, e.g. hybrid+sinks+decay (default: all)")
    parser.add_argument("--dtypes", default="", help="comma-separated dtypes of bf16, fp16, fp32 (default: all)")
    parser.add_argument("--progress", type=Path, default=None, help="keep the results here as they come, and reuse "
                        "them: a run cut short goes on where it stopped")  # fmt: skip
    args = parser.parse_args(argv)
    apply_settings(args.settings)
    selection = selection_of(args)
    shapes = preset_shapes([p for p in args.presets.split(",") if p] or None)
    t0 = time.time()
    known = _known(args.reuse, args.progress)
    held = _known(args.progress)  # (--progress: its file's results stay in it)
    cache = compile_check.Cache(known)
    kept = [0]

    def progress(n: int) -> None:
        print(f"\r{n} compiles", end="", file=sys.stderr)
        if args.progress and cache.compiled >= kept[0] + PROGRESS_EVERY:
            args.progress.write_text(_results(cache, held))
            kept[0] = cache.compiled

    rows = compile_matrix(shapes, selection, progress, cache)
    if args.progress:
        args.progress.write_text(_results(cache, held))
    print(file=sys.stderr)
    differ = cache.verify(args.verify, random.Random()) if known else []
    seconds = time.time() - t0
    bad = failures(rows) + [f"recompiled, not as stored: {d}" for d in differ]
    for line in bad:
        print(f"kernel_compile: {line}")
    print(f"kernel_compile: {len(rows)} kernel configurations x {len(selection.archs)} architectures "
          f"({cache.compiled} compiled, {cache.reused} reused from {args.reuse}, {min(args.verify, cache.reused)} of "
          f"those compiled again) in {seconds:.0f} s; {totals(rows)}; {len(bad)} over budget")  # fmt: skip
    if args.out:
        args.out.with_suffix(".json").write_text(_results(cache))
        args.out.write_text(
            "# The kernels compiled for sm_80 and sm_90 (no GPU)\n\n"
            "Made by `make kernel-compile` (`python -m tools.kernel_compile --out docs/results/kernel_compile.md`)"
            f" with triton {__import__('triton').__version__} and the ptxas its wheel ships. Each row is one compile "
            "of a kernel for a mode and dtype on each architecture, with that architecture's settings (its tiles, "
            "warps, stages and register cap in the row), at the head shapes of the presets listed (presets whose "
            "launches compile identically share a row). Registers and spill bytes (stores + loads) are `ptxas -v`'s; "
            "shared memory is what the kernel asks for (limits: sm_80 163 KiB, sm_90 227 KiB); products says whether "
            "the matrix products became wgmma (sm_90), mma.sync or plain FMAs. Spill budget in bytes: "
            + ", ".join(f"{d} {b}" for d, b in SPILL_BUDGET.items())
            + f". Totals: {totals(rows)}.\n\n"
            + table(rows)
            + "\n"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
