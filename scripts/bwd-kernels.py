"""GPU time of each kernel in one backward call, ours beside FA4 (when importable).

    python scripts/bwd-kernels.py [--cells 64:0:512,128:1:512,...] [--iters 20]

A cell is head dim : causal : seqlen, at the README's shapes (batch * seqlen = 16k, model dim
2048, bf16). Each provider's backward (`out.backward(dout)` after one forward, graph kept)
runs under torch.profiler; the table gives each kernel's mean GPU time per call in
microseconds and the sum, so that the preprocess, the dQ_acc zeroing and the dQ conversion
can be weighed against the main kernel. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict

import torch


def _providers():
    from asymflash import flash_attn_func
    from asymflash.runtime.dispatch import use_backend

    def ours(q, k, v, causal):
        with use_backend("sm90"):
            return flash_attn_func(q, k, v, causal=causal)

    found = {"asymflash-sm90": ours}
    try:
        fa4 = importlib.import_module("flash_attn.cute").flash_attn_func
        found["FA4"] = lambda q, k, v, causal: fa4(q, k, v, causal=causal)[0]
    except Exception as exc:  # noqa: BLE001 - FA4 is optional: report and go on
        print(f"FA4 not importable: {exc!r}"[:200])
    return found


def _backward_call(fn, q, k, v, dout, causal):
    """The backward of one forward of `fn`, as a callable (the graph is kept for repeats)."""
    inputs = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(*inputs, causal)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _kernel_times(run, iters):
    """{kernel name: mean GPU microseconds per call} of `run` over `iters` calls."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_time_total > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.key] += evt.device_time_total / iters
    return dict(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64:0:512,64:1:512,128:0:512,128:1:512,64:1:2048")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    providers = _providers()
    summary = []
    for cell in args.cells.split(","):
        d, causal, seqlen = (int(x) for x in cell.split(":"))
        batch, heads = 16384 // seqlen, 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for _ in range(4))
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        for name, fn in providers.items():
            times = _kernel_times(_backward_call(fn, q, k, v, dout, bool(causal)), args.iters)
            total = sum(times.values())
            print(f"\n== d={d} causal={causal} seqlen={seqlen} {name}: {total:.1f} us "
                  f"({flops / total / 1e6:.0f} TFLOP/s of GPU time)")
            for key, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"  {us:9.1f} us  {key[:110]}")
            main_us = max(times.values())
            summary.append((d, causal, seqlen, name, total, main_us))
    print("\n| d | causal | seqlen | provider | GPU us / call | largest kernel us | rest us |")
    print("|---|---|---|---|---|---|---|")
    for d, causal, seqlen, name, total, main_us in summary:
        print(f"| {d} | {causal} | {seqlen} | {name} | {total:.1f} | {main_us:.1f} | "
              f"{total - main_us:.1f} |")


if __name__ == "__main__":
    main()
