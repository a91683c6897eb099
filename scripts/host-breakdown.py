"""Host time of each piece of a short call, measured one piece at a time (H200 device tool).

`host-overhead.py` shows the 512-row calls are host-bound; this splits their host time:
the public call, the backend function, each Triton launch through the JIT (argument
binding + specialisation + cache lookup + launcher) and the same compiled kernel launched
directly, the allocations and casts. Each piece is timed alone, median of n calls; with
--busy the GPU runs a sleep kernel under each timed call, as in a benchmark loop (the host
may cost more while the GPU works). Nothing here checks results.

    PYTHONPATH=. python scripts/host-breakdown.py [--busy] [--n 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from triton.runtime import driver

from asymflash import flash_attn_func
from asymflash.api import dense as interface
from asymflash.backends.portable import row_delta
from asymflash.backends.sm90.bwd import host as bwd
from asymflash.backends.sm90.fwd import host as fwd
from asymflash.core.params import AttnParams, MaskSpec, SeqInfo
from asymflash.runtime import plans


def timed(fn, n, busy):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(n):
        if busy:
            torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU work ahead of the call
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6, min(samples) * 1e6


class Recorder:
    """Stands in for a JIT kernel for one call: records its grid and arguments."""

    def __init__(self, jit):
        self.jit, self.calls = jit, []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.jit[grid](*args, **kwargs)
        return call


def launch_pieces(jit, direct, grid, args, kwargs):
    """(Triton's JIT launch, asymflash's DirectLaunch, the compiled kernel's bare launcher)
    callables for one recorded call."""
    compiled = jit[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    bound, _, _ = jit.device_caches[device][4](*args, **kwargs)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def bare():
        stream = driver.active.get_current_stream(device)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)

    return (lambda: jit[grid](*args, **kwargs)), (lambda: direct[grid](*args, **kwargs)), bare


def recorded(module, name, run):
    """(recorder, launcher) of the first launch through `module.name` (a DirectLaunch
    factory, whatever key the code asks it for) while `run()` runs; the factory is
    restored afterwards."""
    factory = getattr(module, name)
    seen = {}

    def stand_in(*key):
        if "rec" not in seen:
            seen["launcher"] = factory(*key)
            seen["rec"] = Recorder(seen["launcher"].jit)
        return seen["rec"]

    setattr(module, name, stand_in)
    try:
        run()
    finally:
        setattr(module, name, factory)
    return seen["rec"], seen["launcher"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    b, s, h, d = 32, 512, 16, 128
    q = torch.randn(b, s, h, d, device=dev, dtype=bf)
    k, v = torch.randn_like(q), torch.randn_like(q)
    q2, k2, v2 = (t.view(b * s, h, d) for t in (q, k, v))
    seq = SeqInfo.dense(b, s, s, q.device)
    params = AttnParams(d ** -0.5, MaskSpec(-1, 0), 0.0, False)
    rows = []

    def add(name, fn):
        med, lo = timed(fn, a.n, a.busy)
        rows.append((name, med, lo))

    add("fwd: flash_attn_func (no grad)", lambda: flash_attn_func(q, k, v, causal=True))
    plans.ENABLED = False
    add("fwd: flash_attn_func (no grad), no call plans",
        lambda: flash_attn_func(q, k, v, causal=True))
    plans.ENABLED = True
    (plan,) = [p for key, p in plans._PLANS.items() if not key[0]]
    add("fwd: the call plan's forward runner", lambda: plan.forward(q2, k2, v2, None))
    add("fwd: sm90 fwd.forward", lambda: fwd.forward(q2, k2, v2, seq, params, None))
    rec, launcher = recorded(fwd, "_launcher",
                             lambda: fwd.forward(q2, k2, v2, seq, params, None))
    jit_call, direct, bare = launch_pieces(rec.jit, launcher, *rec.calls[0])
    add("fwd: JIT launch", jit_call)
    add("fwd: DirectLaunch", direct)
    add("fwd: bare compiled launch", bare)
    add("fwd: torch.empty out+lse",
        lambda: (torch.empty((b * s, h, d), dtype=bf, device=dev),
                 torch.empty((h, b * s), dtype=torch.float32, device=dev)))
    add("fwd: 3 tma_rows", lambda: [fwd.tma_rows(t, (128, d)) for t in (q2, k2, v2)])
    add("SeqInfo.dense", lambda: SeqInfo.dense(b, s, s, q.device))

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    out = flash_attn_func(qg, kg, vg, causal=True)
    add("fwd: flash_attn_func (grad)", lambda: flash_attn_func(qg, kg, vg, causal=True))
    plans.ENABLED = False
    add("fwd: flash_attn_func (grad), no call plans",
        lambda: flash_attn_func(qg, kg, vg, causal=True))
    plans.ENABLED = True
    add("bwd: out.backward", lambda: out.backward(dout, retain_graph=True))

    def same_thread():
        with torch.autograd.set_multithreading_enabled(False):
            out.backward(dout, retain_graph=True)
    add("bwd: out.backward, calling thread", same_thread)
    # How long our backward node's Python takes on autograd's device thread.
    inner, impl = [], interface._eager_backward

    def timed_impl(*args):
        t0 = time.perf_counter()
        result = impl(*args)
        inner.append(time.perf_counter() - t0)
        return result
    interface._eager_backward = timed_impl
    timed(lambda: out.backward(dout, retain_graph=True), a.n, a.busy)
    interface._eager_backward = impl
    rows.append(("bwd: node inside out.backward", statistics.median(inner) * 1e6,
                 min(inner) * 1e6))
    # The engine's own cost: a Function with the same inputs whose backward does nothing
    # but hand back precomputed gradients (the floor any Python backward node pays).
    grads_ready = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *rest):
            return q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[2], q.shape[1])

        @staticmethod
        def backward(ctx, dout, dlse):
            return (*grads_ready, *(None,) * 14)
    floor_out, _ = Floor.apply(qg, kg, vg, *(None,) * 14)
    add("bwd: floor, trivial Function.backward",
        lambda: floor_out.backward(dout, retain_graph=True))
    o2, lse = fwd.forward(q2, k2, v2, seq, params, None)
    do2 = dout.view(b * s, h, d)
    add("bwd: sm90 bwd.backward",
        lambda: bwd.backward(do2, q2, k2, v2, o2, lse, None, seq, params, None))
    add("bwd: row_delta", lambda: row_delta(o2, do2, None))
    add("bwd: torch.zeros dq_acc",
        lambda: torch.zeros((b * s, h, d), dtype=torch.float32, device=dev))
    acc = torch.zeros((b * s, h, d), dtype=torch.float32, device=dev)
    add("bwd: dq cast", lambda: acc.to(bf, memory_format=torch.contiguous_format))
    rec, launcher = recorded(
        bwd, "_launcher_for",
        lambda: bwd.backward(do2, q2, k2, v2, o2, lse, None, seq, params, None))
    jit_call, direct, bare = launch_pieces(rec.jit, launcher, *rec.calls[0])
    add("bwd: JIT launch", jit_call)
    add("bwd: DirectLaunch", direct)
    add("bwd: bare compiled launch", bare)
    import asymflash.backends.portable as portable
    launcher = portable._PREPROCESS
    rec = Recorder(launcher.jit)
    portable._PREPROCESS = rec
    row_delta(o2, do2, None, zero=acc)
    portable._PREPROCESS = launcher
    jit_call, direct, bare = launch_pieces(rec.jit, launcher, *rec.calls[0])
    add("bwd: preprocess JIT launch", jit_call)
    add("bwd: preprocess DirectLaunch", direct)
    add("empty kernel: torch.cuda._sleep(0)", lambda: torch.cuda._sleep(0))

    print(f"busy={a.busy} n={a.n}")
    print(f"{'piece':40s} {'median_us':>10s} {'min_us':>8s}")
    for name, med, lo in rows:
        print(f"{name:40s} {med:10.1f} {lo:8.1f}")


if __name__ == "__main__":
    main()
