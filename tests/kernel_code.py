"""Run a Gluon kernel function's own Python body on plain integers (no GPU, no compiler).

The protocol tests model the kernels' scheduling arithmetic (turns, walks, ping-pong
barriers). Rather than a hand copy of that arithmetic, they call the very functions the
kernels call: a `@gluon.jit` function keeps its Python function as `.fn`; `on_ints` runs it
with the Gluon names it uses (`gl`, `mbarrier`) replaced by integer stand-ins, so a change
to the kernel's arithmetic changes what the tests see. `I32` divides as the device does
(toward zero), for the mask bounds' negative offsets.
"""

from __future__ import annotations

import types

import pytest


class I32(int):
    """An int with the device's integer division (toward zero) and closed arithmetic."""

    def _wrap(op):
        return lambda a, b: I32(op(int(a), int(b)))

    __add__ = __radd__ = _wrap(lambda a, b: a + b)
    __sub__ = _wrap(lambda a, b: a - b)
    __rsub__ = _wrap(lambda a, b: b - a)
    __mul__ = __rmul__ = _wrap(lambda a, b: a * b)
    __floordiv__ = _wrap(lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1))


class _Gl:
    """The `gl` calls the scheduling and mask arithmetic makes, on Python ints."""

    constexpr = staticmethod(lambda x: x)
    maximum = staticmethod(lambda a, b: I32(max(a, b)) if isinstance(a, I32) else max(a, b))
    minimum = staticmethod(lambda a, b: I32(min(a, b)) if isinstance(a, I32) else min(a, b))


class BarrierLog:
    """An `mbarrier` stand-in: buffers are lists of ints (`bars.index(i)` is i) and each
    wait / arrive is recorded as ("wait", index, parity) or ("arrive", index)."""

    def __init__(self):
        self.events = []

    def wait(self, bar, parity, *args, **kwargs):
        self.events.append(("wait", bar, parity))

    def arrive(self, bar, *args, **kwargs):
        self.events.append(("arrive", bar))


class Indices:
    """A shared-memory buffer of barriers whose `.index(i)` is i."""

    @staticmethod
    def index(i):
        return i


GLUON_MISSING = "triton's Gluon (the kernels' source) is not importable here"


def gluon_module(name: str, needs: str):
    """Kernel module `name`, for a test module that runs its Gluon functions' Python bodies;
    skips that test module where Gluon is not importable (the module then lacks `needs`)."""
    mod = pytest.importorskip(name)
    if not hasattr(mod, needs):
        pytest.skip(GLUON_MISSING, allow_module_level=True)
    return mod


def python_body(jit_fn, mbarrier=None, gl=None):
    """`jit_fn`'s Python function, its Gluon names replaced by the integer stand-ins (`gl`:
    another stand-in class) and the jitted functions it calls by their own Python bodies."""
    fn = getattr(jit_fn, "fn", None)
    if fn is None:
        pytest.skip(GLUON_MISSING)
    env = dict(fn.__globals__, gl=gl or _Gl)
    if mbarrier is not None:
        env["mbarrier"] = mbarrier
    for name in fn.__code__.co_names:
        callee = env.get(name)
        if callee is not jit_fn and callable(getattr(callee, "fn", None)) \
                and hasattr(callee, "__call__") and type(callee).__name__.endswith("JITFunction"):
            env[name] = python_body(callee, mbarrier, gl)
    return types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)


def on_ints(jit_fn, *args, mbarrier=None):
    """Call `jit_fn`'s Python body with `args` (ints, or I32 where the device's division of
    negative values matters; constexprs as plain values)."""
    return python_body(jit_fn, mbarrier)(*args)
