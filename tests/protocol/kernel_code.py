"""Run a Gluon kernel function's own Python body on plain integers (no GPU, no compiler).

The protocol tests model the kernels' scheduling arithmetic (turns, walks, ping-pong
barriers). Rather than a hand copy of that arithmetic, they call the very functions the
kernels call: a `@gluon.jit` function keeps its Python function as `.fn`; `on_ints` runs it
with the Gluon names it uses (`gl`, `mbarrier`) replaced by integer stand-ins, so a change
to the kernel's arithmetic changes what the tests see.
"""

from __future__ import annotations

import types

import pytest


class _Gl:
    """The `gl` calls the scheduling arithmetic makes, on Python ints."""

    constexpr = staticmethod(lambda x: x)
    maximum = staticmethod(max)
    minimum = staticmethod(min)


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


def on_ints(jit_fn, *args, mbarrier=None):
    """Call `jit_fn`'s Python body with `args` (ints; constexprs as plain values)."""
    fn = getattr(jit_fn, "fn", None)
    if fn is None:
        pytest.skip("triton's Gluon (the kernels' source) is not importable here")
    env = dict(fn.__globals__, gl=_Gl)
    if mbarrier is not None:
        env["mbarrier"] = mbarrier
    body = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    return body(*args)
