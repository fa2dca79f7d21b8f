"""Backends of the hybrid attention entry point (hybrid.attend, HybridAttention.attend): a name -> function registry.

Registered here: "naive" (naive.naive_hybrid_attention, the O(T^2) spec) and "chunk" (chunked.chunk_hybrid_attention,
O(T (w + C)), fp32 state). A faster implementation registers itself from its own package: every installed entry point
in the group "hybrid_scale.attention_backends" is called once, the first time a backend outside the built-ins is
wanted, with `register_backend` (the fused Triton kernels of kernels/ register "triton" and its decode step this way).
Attention never imports such a package by name, so an exported model (these files copied next to a modeling file) uses
the kernels where they are installed and runs on the torch backends where they are not.

The config's `attention.backend` names a choice, resolved per call by `resolve(choice, device, shape)`: "torch" =
"chunk", "triton" = the kernels (an error naming the fix when they are not installed), "auto" = "triton" for CUDA
tensors when it registered and passed its self-check on that device at the call's attention shape (`self_check`,
once per process, device and `Shape` -- the model's heads, KV heads, head dim, feature dim, window, sinks and
dtype: a forward, backward and 20 decode steps against the chunked path; a shape the backend declares it cannot
take is refused by name; on failure a warning names what failed and "chunk" is used), else "chunk". A backend asked
for by name on CUDA runs the same check first and raises its failure there, so it never fails later than that.

A backend is called with the tensors positionally, then the call's settings as one options.AttentionOptions, then
the optional tensors by keyword:

    fn(q, k, v, fq, fk, gamma, opts, *, attention_mask, initial_state, la_decay)

q [B,H,T,D], k/v [B,Hkv,T,D] after RoPE, fq [B,H,T,F], fk [B,Hkv,T,F], gamma [H] > 0; opts (options.py) as the
layer computes it (`own()`: hybrid_sinks only in hybrid mode): window, mode, sinks, hybrid_sinks (its softmax also
covers the first S real tokens and its LA leaves them out; naive.py), scale (None = 1/sqrt(D)), chunk_size (a hint; a
backend without chunks ignores it), return_denominators; a backend reads the fields by name and ignores one it does not
know (la_combine is the gated delta rule's). attention_mask [B,T] or None (1 = token, 0 = padding), initial_state
None or (kv [B,Hkv,F,D], k [B,Hkv,F]): the LA sums of keys that precede the sequence by more than the window (stage 1
attends a block of rows with the keys before it folded in; gradients flow into it), la_decay None or rho [Hkv] >= 0
(the LA's decay per KV head, naive.py; with it an initial state is as the row's query w-1 sees it).
It returns y [B,H,T,D] in q's dtype, or with opts.return_denominators (y, sum of E [B,H,T], sum of L [B,H,T]), and
must equal the naive backend in outputs and gradients (docs/design.md §7); what it cannot do it refuses with a
ValueError. A backend written for the keyword contract before AttentionOptions fails its self-check on the positional
options (a TypeError it reports), so "auto" runs the torch path instead.

This file imports only torch, importlib.metadata and its siblings (the export copies it next to a modeling file).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points

import torch

from .hedgehog.chunk import chunk_hybrid_attention
from .hedgehog.naive import masked_attention, naive_hybrid_attention
from .hedgehog.recurrent import extend
from .options import AttentionOptions
from .settings import BACKENDS
from .shape import Shape
from .window.naive import real_positions
from .window.recurrent import DecodeState

BUILTIN = ("naive", "chunk")
CHOICES = BACKENDS  # the values of attention.backend
PLUGIN_GROUP = "hybrid_scale.attention_backends"
_BACKENDS: dict[str, Callable] = {}
_DECODERS: dict[str, Callable] = {}
_PLUGIN_ERRORS: dict[str, str] = {}
_plugins_loaded = False
_SUPPORTS: dict[str, Callable] = {}  # backend -> supports(shape) -> None, or why it cannot take that shape
_DELTA_IMPLS: dict[str, Callable] = {}  # gated delta-rule implementations registered by plugins (kind="gated_delta")
_CHECKED: dict[tuple, str | None] = {}  # (backend, device, shape) -> None when it passed its self-check, else why


def _naive(q, k, v, fq, fk, gamma, opts=None, *, attention_mask=None, initial_state=None, la_decay=None, **settings):
    opts = AttentionOptions.of(opts, **settings)
    if initial_state is None:
        return naive_hybrid_attention(q, k, v, fq, fk, gamma, opts, attention_mask=attention_mask, la_decay=la_decay)
    pos = real_positions(attention_mask, q.shape[0], q.shape[2], q.device)
    ref = opts.window - 1  # with a decay, an initial state is as the row's query w-1 sees it
    return masked_attention(
        q, k, v, fq, fk, gamma, pos, pos, opts, state=initial_state, state_ref=ref, la_decay=la_decay
    )


def register_backend(
    name: str, fn: Callable, decode: Callable | None = None, supports: Callable | None = None, kind: str = "hybrid"
) -> Callable:
    """Make `fn` the backend called `name` (registering a name again replaces it; the built-ins cannot be).
    `decode`, optional: a fused one-token decode step, called as decode(state, q, k, v, fq, fk, gamma, opts, *,
    attention_mask, la_decay) with a recurrent.DecodeState that it advances in place; it returns y, or None for a step
    it does not take (then recurrent.step runs). `supports`, optional: supports(head_dim, value_dim,
    features, sinks, dtype) -> None, or why the backend cannot take that shape (its self-check then fails with it).
    kind="gated_delta": `fn` is instead an implementation of the gated delta rule (delta.chunk_gated_delta's
    contract), found by delta_impl(name): fla-core's kernel, which the kernels package registers as "fla"."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an attention backend needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend '{name}' must be callable, got {type(fn).__name__}")
    if kind == "gated_delta":
        _DELTA_IMPLS[name] = fn
        return fn
    if name in BUILTIN and name in _BACKENDS and _BACKENDS[name] is not fn:
        raise ValueError(f"attention backend '{name}' is built in and cannot be replaced; register another name")
    _BACKENDS[name] = fn
    if decode is not None:
        _DECODERS[name] = decode
    if supports is not None:
        _SUPPORTS[name] = supports
    return fn


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


def available() -> tuple[str, ...]:
    """Names of the registered backends (installed plugins included), sorted."""
    load_plugins()
    return tuple(sorted(_BACKENDS))


def resolve(choice: str, device: torch.device | str, shape: Shape | None = None) -> str:
    """The backend name an `attention.backend` choice (or a backend name) means for tensors on `device` in an
    attention call of `shape` (None: the self-check's small default shape)."""
    if choice == "torch":
        return "chunk"
    device = torch.device(device)
    if choice == "auto":
        if device.type == "cuda":
            load_plugins()
            if "triton" in _BACKENDS and _passes("triton", device, shape or Shape()):
                return "triton"
        return "chunk"
    if device.type == "cuda" and choice not in BUILTIN:
        get_backend(choice)  # not installed: its own error
        why = _check(choice, device, shape or Shape())
        if why is not None:
            raise ValueError(
                f"attention backend '{choice}' failed its self-check on {device} at {shape or Shape()} ({why}); "
                "set attention.backend=auto (which then uses the torch path) or torch"
            )
    return choice


def _check(name: str, device: torch.device, shape: Shape) -> str | None:
    key = (name, str(device), shape)
    if key not in _CHECKED:
        _CHECKED[key] = self_check(name, device, shape=shape)
    return _CHECKED[key]


def _passes(name: str, device: torch.device, shape: Shape) -> bool:
    fresh = (name, str(device), shape) not in _CHECKED
    why = _check(name, device, shape)
    if why is not None and fresh:
        warnings.warn(
            f"attention backend '{name}' failed its self-check on {device} at {shape} ({why}); attention.backend=auto "
            f"uses the chunked torch path instead (attention.backend={name} would refuse to run)",
            stacklevel=3,
        )
    return why is None


def self_check(name: str, device, dtype: torch.dtype = torch.bfloat16, shape: Shape | None = None) -> str | None:
    """Backend `name` on `device` at `shape` (default: a small one in `dtype`) against the chunked torch path: a
    forward of 2 rows across several tiles, unpadded (training's and a prefill's path) and with one row left-padded,
    in hybrid mode (with its sinks if the shape's hybrid
    keeps them), the output and the gradients of q, k, v, phi_q, phi_k and gamma (and of the LA's decay rho, if the
    shape has one); and (if it has a fused decode step) 20 decode steps past the window against recurrent.extend.
    None when it agrees, else what differed, failed, or the shape the backend cannot take.

    It runs in a thread of its own, so none of the caller's thread-local autograd state reaches it: its first call is
    often inside a decoder layer under activation checkpointing, whose saved-tensor hooks took the check's tensors
    into the layer's (on an H200 the check then failed and the layer's backward raised CheckpointError), and a
    caller may also be under autocast, inference mode, a region that disables saved-tensor hooks or a dispatch mode."""
    result: list[str | None] = []

    def run(device: torch.device) -> None:
        try:
            with (
                torch.cuda.device(device)
                if device.index is not None and device.type == "cuda"
                else contextlib.nullcontext()
            ):
                result.append(_self_check_here(name, device, dtype, shape))
        except Exception as e:  # noqa: BLE001  (e.g. no CUDA here: reported, not raised)
            result.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")

    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # (the thread's own current device is 0)
    thread = threading.Thread(target=run, args=(device,), name=f"hybrid_scale self-check of {name}")
    thread.start()
    thread.join()
    return result[0]


def _self_check_here(name: str, device: torch.device, dtype: torch.dtype, shape: Shape | None) -> str | None:
    shape = shape or Shape(dtype=dtype)
    dtype = shape.dtype
    supports = _SUPPORTS.get(name)
    if supports is not None:
        why = supports(shape.head_dim, shape.value_dim, shape.features, shape.sinks, dtype)
        if why is not None:
            return f"it cannot take this shape: {why}"
    half = dtype in (torch.float16, torch.bfloat16)
    tol = 3e-2 if half else 1e-4
    B, H, Hkv, D, Dv, F, w, S = 2, shape.heads, shape.kv_heads, shape.head_dim, shape.value_dim, shape.features, \
        shape.window, shape.sinks  # fmt: skip
    T = 2 * w + 48  # past the window, across several tiles, not a multiple of them
    gen = torch.Generator().manual_seed(0)

    def make(*size, positive=False):
        x = torch.rand(*size, generator=gen) if positive else torch.randn(*size, generator=gen)
        return x.to(device=device, dtype=dtype)

    def differs(what, a, b):
        err, scale = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
        return None if err <= tol * (1 + scale) else f"{what} differs from the torch path by {err:.3g} (of {scale:.3g})"

    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = [make(B, H, T, D), make(B, Hkv, T, D), make(B, Hkv, T, Dv), make(B, H, T, F, positive=True)]
            x += [make(B, Hkv, T, F, positive=True), torch.full((H,), 0.3, device=device)]
            mask = torch.ones(B, T, dtype=torch.long, device=device)
            mask[1, :7] = 0
            opts = AttentionOptions(window=w, mode="hybrid", sinks=S, hybrid_sinks=shape.hybrid_sinks, chunk_size=16)
            rho = torch.linspace(0.01, 0.2, Hkv, device=device) if shape.la_decay else None
            for batch, attention_mask in (("unpadded", None), ("padded", mask)):
                results = []
                for fn in (get_backend(name), chunk_hybrid_attention):
                    inputs = [t.detach().requires_grad_() for t in (*x, *([rho] if shape.la_decay else []))]
                    decay = inputs[6] if shape.la_decay else None
                    y = fn(*inputs[:6], opts, attention_mask=attention_mask, initial_state=None, la_decay=decay)
                    results.append([y, *torch.autograd.grad(y.float().square().sum(), inputs)])
                names = ("output", "dq", "dk", "dv", "dphi_q", "dphi_k", "dgamma", "drho")
                for what, a, b in zip(names[: len(results[0])], *results, strict=True):  # (drho with a decay)
                    if (why := differs(f"{what} ({batch} batch)", a, b)) is not None:
                        return why
        step = _DECODERS.get(name)
        if step is not None:
            with torch.no_grad():
                fused = DecodeState.empty(shape, B, w, device)
                t0 = T - 20
                extend(fused, *(t[:, :, :t0] for t in x[:5]), x[5], opts, attention_mask=mask[:, :t0], la_decay=rho)
                ref = copy.deepcopy(fused)
                for t in range(t0, T):
                    token = [u[:, :, t : t + 1] for u in x[:5]]
                    got = step(fused, *token, x[5], opts, attention_mask=None, la_decay=rho)
                    want = extend(ref, *token, x[5], opts, la_decay=rho)
                    if got is None or (why := differs(f"decode step {t}", got, want)) is not None:
                        return why or "the decode step declined a plain one-token step"
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile or launch here: reported, not raised)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}"
    return None


def get_backend(name: str) -> Callable:
    if name not in _BACKENDS:
        load_plugins()
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        pass
    if name == "triton":
        why = _PLUGIN_ERRORS.get(name, "hybrid_scale_kernels is not installed")
        raise ValueError(
            f"attention backend 'triton' is not available ({why}); install the kernels with "
            "pip install 'hybrid_scale[triton]' on a CUDA machine, or set attention.backend=auto or torch"
        )
    raise ValueError(f"unknown attention backend '{name}'; available: {', '.join(available())}")


def delta_impl(name: str) -> Callable | None:
    """The gated delta-rule implementation a plugin registered as `name` (register_backend(..., kind="gated_delta")),
    or None."""
    load_plugins()
    return _DELTA_IMPLS.get(name)


def get_decode(name: str) -> Callable | None:
    """The fused decode step registered with backend `name`, or None."""
    get_backend(name)
    return _DECODERS.get(name)


register_backend("naive", _naive)
register_backend("chunk", chunk_hybrid_attention)
