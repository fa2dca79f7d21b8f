"""The implementations of each kind of linear part, one registry for all: (kind, name) -> function, chosen the same
way for every part, for the forward and for decode.

Each part registers its built-ins from its folder (parts.py: "naive", its spec, and "chunk", its torch form; a part's
function follows its part's contract: hedgehog/part.py, gated_delta/part.py) and its self-check (`register_check`). A
faster implementation registers itself from its own package: every installed entry point in the group
"hybrid_scale.attention_backends" is called once, the first time a backend outside the built-ins is wanted, with
`register_backend` (the kernels of kernels/ register the Hedgehog kind's "triton" with its fused decode step, and the
gated delta rule's "fla", fla-core's kernel). Attention never imports such a package by name, so an exported model
uses the kernels where they are installed and runs on the torch backends where they are not.

The config's `attention.backend` names a choice, resolved per call by `resolve(choice, device, shape)` for the kind
the shape names (`Shape.la_kind`): "torch" = "chunk"; "auto" = the kind's accelerated implementations in order
(kinds.Kind.backends) for CUDA tensors, the first that registered and passed its self-check on that device at the
call's shape (`self_check`: once per process, kind, device and `Shape`; a shape the backend declares it cannot take
is refused by name; on failure a warning names what failed and "chunk" is used), else "chunk"; a name the kind does
not have is an error naming what it has (never a silent substitute); a name asked for on CUDA runs the same check
first and raises its failure there, so it never fails later than that. `get_decode(name, kind)` is the decode step
registered with it (None: the part's torch step).

The Hedgehog kind's functions are called with the tensors positionally, then the call's settings as one
options.AttentionOptions, then the optional tensors by keyword:

    fn(q, k, v, fq, fk, gamma, opts, *, attention_mask, initial_state, la_decay)

q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F], fk [B,Hkv,T,F], gamma [H] > 0; opts (options.py) as the
layer computes it (`own()`: hybrid_sinks only in hybrid mode); attention_mask [B,T] or None (1 = token, 0 = padding),
initial_state None or (kv [B,Hkv,F,D], k [B,Hkv,F]): the LA sums of keys that precede the sequence by more than the
window (stage 1 attends a block of rows with the keys before it folded in; gradients flow into it), la_decay None or
rho [Hkv] >= 0 (the LA's decay per KV head, hedgehog/naive.py). It returns y [B,H,T,D] in q's dtype, or with
opts.return_denominators (y, sum of E [B,H,T], sum of L [B,H,T]), and must equal the naive backend in outputs and
gradients (docs/design.md §7); what it cannot do it refuses with a ValueError. A backend written for the keyword
contract before AttentionOptions fails its self-check on the positional options (a TypeError it reports), so "auto"
runs the torch path instead. The gated delta rule's functions are its recurrence (gated_delta/naive.py's contract:
fn(q, k, v, beta, g, *, initial_state, chunk_size) -> (o, final state)).

This file imports only torch, importlib.metadata and its siblings (the export copies the package flattened).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points

import torch

from .kinds import DEFAULT, KINDS
from .shape import Shape

BUILTIN = ("naive", "chunk")
PLUGIN_GROUP = "hybrid_scale.attention_backends"
Key = tuple[str, str]  # (kind, backend name)
_BACKENDS: dict[Key, Callable] = {}
_DECODERS: dict[Key, Callable] = {}
_SUPPORTS: dict[Key, Callable] = {}  # supports(head_dim, value_dim, features, sinks, dtype) -> None or why not
_CHECKS: dict[str, Callable] = {}  # kind -> check(fn, decode, device, shape) -> None or what differed
_PLUGIN_ERRORS: dict[str, str] = {}
_plugins_loaded = False
_CHECKED: dict[tuple, str | None] = {}  # (kind, backend, device, shape) -> None when it passed its self-check, else why


def _kind(kind: str | None) -> str:
    kind = DEFAULT.name if kind in (None, "hybrid") else kind  # ("hybrid": what an older plugin calls the default)
    if kind not in KINDS:
        raise ValueError(f"unknown LA kind '{kind}'; available: {', '.join(KINDS)}")
    return kind


def register_backend(
    name: str, fn: Callable, decode: Callable | None = None, supports: Callable | None = None, kind: str | None = None
) -> Callable:
    """Make `fn` the implementation called `name` of the LA kind `kind` (None: the default kind, kinds.DEFAULT;
    registering a name again replaces it; a built-in cannot be). `decode`, optional: a fused one-token decode step,
    called as decode(state, q, k, v, fq, fk, gamma, opts, *, attention_mask, la_decay) with a
    window.recurrent.DecodeState that it advances in place; it returns y, or None for a step it does not take (then
    the part's torch step runs). `supports`, optional: supports(head_dim, value_dim, features, sinks, dtype) -> None,
    or why it cannot take that shape (its self-check then fails with it)."""
    kind = _kind(kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"an attention backend needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend '{name}' must be callable, got {type(fn).__name__}")
    key = (kind, name)
    if name in BUILTIN and key in _BACKENDS and _BACKENDS[key] is not fn:
        raise ValueError(
            f"attention backend '{name}' is built in and cannot be replaced ({kind}); register another name"
        )
    _BACKENDS[key] = fn
    if decode is not None:
        _DECODERS[key] = decode
    if supports is not None:
        _SUPPORTS[key] = supports
    return fn


def register_check(kind: str, check: Callable) -> None:
    """The self-check of `kind`'s implementations: check(fn, decode, device, shape) -> None, or what differed from its
    chunked torch form (each part registers its own: hedgehog/part.py, gated_delta/part.py)."""
    _CHECKS[_kind(kind)] = check


def load_plugins() -> None:
    """Call every installed "hybrid_scale.attention_backends" entry point once (a failing one is remembered and named
    when its backend is asked for)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for point in entry_points(group=PLUGIN_GROUP):
        try:
            point.load()(register_backend)
        except Exception as e:  # noqa: BLE001  (e.g. triton missing or broken: the torch backends still work)
            _PLUGIN_ERRORS[point.name] = f"{type(e).__name__}: {e}"


def available(kind: str | None = None) -> tuple[str, ...]:
    """Names of the registered implementations of `kind` (installed plugins included), sorted."""
    load_plugins()
    kind = _kind(kind)
    return tuple(sorted(name for k, name in _BACKENDS if k == kind))


def resolve(choice: str, device: torch.device | str, shape: Shape | None = None) -> str:
    """The implementation an `attention.backend` choice (or a backend name) means for tensors on `device` in an
    attention call of `shape` (None: the self-check's small default shape, of the default kind), for the kind the
    shape names."""
    shape = shape or Shape()
    kind = KINDS[_kind(shape.la_kind)]
    if choice == "torch":
        return "chunk"
    device = torch.device(device)
    if choice == "auto":
        if device.type == "cuda":
            load_plugins()
            for name in kind.accelerated:
                if (kind.name, name) in _BACKENDS and _passes(name, device, shape):
                    return name
        return "chunk"
    if choice not in kind.backends and choice not in available(kind.name):
        raise ValueError(
            f"attention backend '{choice}' is not an implementation of the {kind.name} LA; it has "
            f"{', '.join(kind.backends)} (or auto, torch)"
        )
    if device.type == "cuda" and choice not in BUILTIN:
        get_backend(choice, kind.name)  # not installed: its own error
        why = _check(choice, device, shape)
        if why is not None:
            raise ValueError(
                f"attention backend '{choice}' failed its self-check on {device} at {shape} ({why}); "
                "set attention.backend=auto (which then uses the torch path) or torch"
            )
    return choice


def _check(name: str, device: torch.device, shape: Shape) -> str | None:
    key = (shape.la_kind, name, str(device), shape)
    if key not in _CHECKED:
        _CHECKED[key] = self_check(name, device, shape=shape)
    return _CHECKED[key]


def _passes(name: str, device: torch.device, shape: Shape) -> bool:
    fresh = (shape.la_kind, name, str(device), shape) not in _CHECKED
    why = _check(name, device, shape)
    if why is not None and fresh:
        warnings.warn(
            f"attention backend '{name}' failed its self-check on {device} at {shape} ({why}); attention.backend=auto "
            f"uses the chunked torch path instead (attention.backend={name} would refuse to run)",
            stacklevel=3,
        )
    return why is None


def self_check(name: str, device, dtype: torch.dtype = torch.bfloat16, shape: Shape | None = None) -> str | None:
    """Implementation `name` of the shape's kind on `device` at `shape` (default: a small one of the default kind in
    `dtype`) against the kind's chunked torch form, by the kind's own check (a forward and every gradient, unpadded
    and padded, and its decode step when it has one). None when it agrees, else what differed, failed, or the shape
    the backend cannot take.

    It runs in a thread of its own, so none of the caller's thread-local autograd state reaches it: its first call is
    often inside a decoder layer under activation checkpointing, whose saved-tensor hooks took the check's tensors
    into the layer's (on an H200 the check then failed and the layer's backward raised CheckpointError), and a
    caller may also be under autocast, inference mode, a region that disables saved-tensor hooks or a dispatch mode."""
    shape = shape or Shape(dtype=dtype)
    result: list[str | None] = []

    def run(device: torch.device) -> None:
        try:
            with (
                torch.cuda.device(device)
                if device.index is not None and device.type == "cuda"
                else contextlib.nullcontext()
            ):
                result.append(_self_check_here(name, device, shape))
        except Exception as e:  # noqa: BLE001  (e.g. no CUDA here: reported, not raised)
            result.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")

    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # (the thread's own current device is 0)
    thread = threading.Thread(target=run, args=(device,), name=f"hybrid_scale self-check of {name}")
    thread.start()
    thread.join()
    return result[0]


def _self_check_here(name: str, device: torch.device, shape: Shape) -> str | None:
    kind = _kind(shape.la_kind)
    key = (kind, name)
    supports = _SUPPORTS.get(key)
    if supports is not None:
        why = supports(shape.head_dim, shape.value_dim, shape.features, shape.sinks, shape.dtype)
        if why is not None:
            return f"it cannot take this shape: {why}"
    try:
        return _CHECKS[kind](get_backend(name, kind), _DECODERS.get(key), device, shape)
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile or launch here: reported, not raised)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}"


def get_backend(name: str, kind: str | None = None) -> Callable:
    """The implementation `name` of `kind` (None: the default kind)."""
    kind = _kind(kind)
    if (kind, name) not in _BACKENDS:
        load_plugins()
    try:
        return _BACKENDS[(kind, name)]
    except (KeyError, TypeError):
        pass
    if name in KINDS[kind].accelerated:
        why = _PLUGIN_ERRORS.get(name, "hybrid_scale_kernels is not installed")
        raise ValueError(
            f"attention backend '{name}' is not available ({why}); install the kernels with "
            "pip install 'hybrid_scale[triton]' on a CUDA machine, or set attention.backend=auto or torch"
        )
    raise ValueError(f"unknown attention backend '{name}' of the {kind} LA; available: {', '.join(available(kind))}")


def get_decode(name: str, kind: str | None = None) -> Callable | None:
    """The fused decode step registered with implementation `name` of `kind`, or None (the part's torch step)."""
    get_backend(name, kind)
    return _DECODERS.get((_kind(kind), name))
