"""One table: which backend computes a call.

A backend is a module with
    NAME: str
    forward_enabled() / backward_enabled() -> bool    (optional gates, default on)
    unsupported(q, k, v, seq, params, sink) -> str | None      (forward; None = can do it)
    forward(q, k, v, seq, params, sink) -> (out, lse)
and, if it has a backward,
    unsupported_backward(q, k, v, seq, params, sink) -> str | None
    backward(dout, q, k, v, out, lse, dlse, seq, params, sink) -> (dq, dk, dv, dsink)
        (dsink None when sink is None)
and optionally, for the call plans of `plans.py` (one per call signature),
    forward_runner(q, k, v, seq, params, sink) -> runner(q, k, v, sink) -> (out, lse), or None
    backward_runner(q, k, v, seq, params, sink) -> a callable with backward's arguments, or
        None (the plan's seq and params are passed back to it)
All backends compute the same semantics (reference.py + core/), so any forward may be paired
with any backward. Calls go to the first backend of the device's list that can implement
them; one that cannot is skipped, never run to give a wrong answer.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import warnings

import torch

from . import env

# name -> module path; imported lazily so a CPU box never imports GPU-only code paths.
_MODULES = {
    "cpu": "asymflash.backends.cpu",
    "portable": "asymflash.backends.portable",
    "sm90": "asymflash.backends.sm90.backend",
}

# flash_attn_with_kvcache and paged varlen read K/V through a cache, a calling convention of
# its own (`core.params.CacheSpec`), so their backends are listed apart; each module has
#     unsupported_decode(q, cache, params, sink) -> str | None
#     decode(q, cache, params, sink, num_splits) -> (out, lse)
# and is tried in backend_names' order; a backend with no entry here is skipped.
_DECODE_MODULES = {
    "cpu": "asymflash.backends.cpu",  # gathers the cache, then its forward
    "portable": "asymflash.backends.portable.decode",
}

# The Gluon fast paths are enabled only on the Triton versions they were verified on a GPU
# with: Gluon's API moves between releases and a silent miscompile is worse than the portable
# kernel. (They compile for sm_90a on 3.7-3.9 too: scripts/triton-matrix.sh.)
SM90_TESTED_TRITON = ("3.6.",)


def sm90_triton_verified(version: str) -> bool:
    """Whether the sm90 Gluon kernels were verified on a GPU with this Triton version."""
    return version.startswith(SM90_TESTED_TRITON)


def sm90_triton_allowed(version: str) -> bool:
    """Whether the sm90 Gluon kernels may run with this Triton version: a verified one, or
    any where ASYMFLASH_SM90_ANY_TRITON=1 (a GPU run verifying a new release)."""
    if sm90_triton_verified(version):
        return True
    if not _ANY_TRITON:  # read once, like the other host switches
        _ANY_TRITON.append(env.get("ASYMFLASH_SM90_ANY_TRITON") == "1")
    return _ANY_TRITON[0]


_ANY_TRITON: list = []


def sm90_fallback_message(version: str) -> str:
    """The once-per-process warning where the Triton version is not verified."""
    tested = ", ".join(v + "x" if v.endswith(".") else v for v in SM90_TESTED_TRITON)
    return (f"asymflash: triton {version} is installed, but the sm90 (Hopper) Gluon kernels "
            f"were verified on a GPU only with triton {tested}: on this H100/H200 the "
            f"forward and backward of flash_attn_func, varlen and packed calls run the "
            f"portable Triton kernels instead (exact, but slower). The fast path needs "
            f"triton {tested} (torch 2.11's pin).")

_forced: contextvars.ContextVar = contextvars.ContextVar("asymflash_backend", default=None)
_warned: set = set()


_INTERPRETING: list = []


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1). Read once: Triton
    itself reads it when it decorates the kernels, at import, so a later change would not
    take effect anyway (and an environment lookup costs ~2 us per call)."""
    if not _INTERPRETING:
        _INTERPRETING.append(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    return _INTERPRETING[0]


def _sm90_allowed() -> bool:
    import triton

    if sm90_triton_verified(triton.__version__):
        return True
    if sm90_triton_allowed(triton.__version__):
        if "sm90" not in _warned:
            _warned.add("sm90")
            warnings.warn(f"asymflash: ASYMFLASH_SM90_ANY_TRITON=1: the sm90 Gluon kernels run "
                          f"on triton {triton.__version__}, which they were not verified on a "
                          f"GPU with", stacklevel=3)
        return True
    if "sm90" not in _warned:
        _warned.add("sm90")
        warnings.warn(sm90_fallback_message(triton.__version__), stacklevel=3)
    return False


def backend_names(device) -> list:
    """The backends that may apply on `device`, fastest first (a fresh list)."""
    key = (str(device), interpreting())
    names = _NAMES.get(key)
    if names is None:
        names = _NAMES[key] = _backend_names(torch.device(device))
    return list(names)


# Per-call host time matters at short sequences (every microsecond of Python is a
# microsecond the GPU may idle): the device's list and the modules are looked up once.
_NAMES: dict = {}
_LOADED: dict = {}
_LOADED_DECODE: dict = {}


def _backend_names(device: torch.device) -> list:
    if device.type == "cpu":
        return ["cpu", "portable"] if interpreting() else ["cpu"]
    if device.type != "cuda":
        return []
    names = []
    if torch.cuda.get_device_capability(device) == (9, 0) and _sm90_allowed():
        names.append("sm90")
    names.append("portable")
    return names


def get_backend(name: str):
    if name not in _MODULES:
        raise ValueError(f"unknown asymflash backend {name!r}; known: {sorted(_MODULES)}")
    mod = _LOADED.get(name)
    if mod is None:
        mod = _LOADED[name] = importlib.import_module(_MODULES[name])
    return mod


def forced_backend():
    """The backend forced by use_backend in this context, or None."""
    return _forced.get()


@contextlib.contextmanager
def use_backend(name: str):
    """Force `name` for calls inside the block (tests, benchmarks).

    A forced backend that cannot implement a call raises NotImplementedError with its reason.
    """
    get_backend(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _implements(mod, direction: str) -> bool:
    """Whether a backend has this direction at all (an optional `<direction>_enabled()` gates
    one that is still being proven, e.g. a new kernel behind an environment switch)."""
    return hasattr(mod, direction) and getattr(mod, f"{direction}_enabled", lambda: True)()


def _pick(q, k, v, seq, params, sink, direction: str):
    check = "unsupported" if direction == "forward" else "unsupported_backward"
    forced = _forced.get()
    # A forced backend without this direction leaves it to the usual table.
    if forced and _implements(get_backend(forced), direction):
        names = [forced]
    else:
        names = backend_names(q.device)
    reasons = []
    for name in names:
        mod = get_backend(name)
        if not _implements(mod, direction):
            reasons.append(f"{name}: no {direction}")
            continue
        why = getattr(mod, check)(q, k, v, seq, params, sink)
        if why is None:
            return mod
        reasons.append(f"{name}: {why}")
    raise NotImplementedError(
        f"asymflash: no backend can run this {direction} on {q.device}: " + _why(q, reasons))


def pick_forward(q, k, v, seq, params, sink):
    return _pick(q, k, v, seq, params, sink, "forward")


def pick_backward(q, k, v, seq, params, sink):
    return _pick(q, k, v, seq, params, sink, "backward")


def pick_decode(q, cache, params, sink):
    forced = _forced.get()
    # As for forward-only backends: a forced backend without a decode leaves it to the table.
    names = [forced] if forced in _DECODE_MODULES else backend_names(q.device)
    reasons = []
    for name in names:
        if name not in _DECODE_MODULES:
            reasons.append(f"{name}: no decode")
            continue
        mod = _LOADED_DECODE.get(name)
        if mod is None:
            mod = _LOADED_DECODE[name] = importlib.import_module(_DECODE_MODULES[name])
        why = mod.unsupported_decode(q, cache, params, sink)
        if why is None:
            return mod
        reasons.append(f"{name}: {why}")
    raise NotImplementedError(
        f"asymflash: no backend can run this decode on {q.device}: " + _why(q, reasons))


def _why(q, reasons: list) -> str:
    """The backends' reasons, or why there were none to ask."""
    if reasons:
        return "; ".join(reasons)
    return (f"no backend runs on {q.device.type} tensors (asymflash runs on cuda and cpu; "
            "under torch.compile, meta tensors are traced through the custom ops instead)")


# FlexAttention (score_mod / mask_mod / BlockMask, api/flex.py) has a calling convention of
# its own over core.flex.FlexProblem; each module has
#     unsupported_flex(q, k, v, problem, need_grad) -> str | None
#     flex_forward(q, k, v, problem) -> (out, lse)
#     flex_backward(dout, dlse, q, k, v, out, lse, problem, captured_need_grad)
#         -> (dq, dk, dv, [grad of each score_mod captured tensor or None])
#     unsupported_flex_backward(q, k, v, problem) -> str | None   (optional: else
#         unsupported_flex's answer holds for the backward too)
# The tiled torch module ("cpu") runs on every device, so it ends every device's list.
_FLEX_MODULES = {
    "sm90": "asymflash.backends.sm90.flex",  # forward only: its backward is the portable one
    "portable": "asymflash.backends.portable.flex",
    "cpu": "asymflash.backends.flex_torch",
}
_LOADED_FLEX: dict = {}


def flex_names(device) -> list:
    names = [n for n in backend_names(device) if n in _FLEX_MODULES]
    return names + ([] if "cpu" in names else ["cpu"])


def pick_flex(q, k, v, problem, direction: str, need_grad: bool = False):
    """The flex backend for a forward or a backward (any forward pairs with any backward:
    they compute the same semantics). need_grad tells a forward that a backward follows."""
    forced = _forced.get()
    names = [forced] if forced in _FLEX_MODULES else flex_names(q.device)
    if direction == "backward" and forced in _FLEX_MODULES:
        names += [n for n in flex_names(q.device) if n != forced]
    reasons = []
    for name in names:
        mod = _LOADED_FLEX.get(name)
        if mod is None:
            mod = _LOADED_FLEX[name] = importlib.import_module(_FLEX_MODULES[name])
        if direction == "backward" and not hasattr(mod, "flex_backward"):
            reasons.append(f"{name}: no backward")
            continue
        check = getattr(mod, "unsupported_flex_backward", None)
        if direction == "backward" and check is not None:
            why = check(q, k, v, problem)
        else:
            why = mod.unsupported_flex(q, k, v, problem, need_grad)
        if why is None:
            return mod
        reasons.append(f"{name}: {why}")
    raise NotImplementedError(
        f"asymflash: no backend can run this flex {direction} on {q.device}: "
        + _why(q, reasons))
