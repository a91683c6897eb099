"""Where the time of a short call goes: host issue time vs GPU time (H200 device tool).

For each call: host_us = Python time to issue one call (no sync, averaged over many),
event_us = CUDA-event time per call in a back-to-back loop (the larger of host and GPU
time), bench_us = triton's do_bench median as `asymflash bench` takes it (L2 flushed before
each call), graph_us = the same call captured in a CUDA graph and replayed (GPU time alone,
no Python). With --profile, a cProfile of the issuing code, heaviest functions first.
--rounds N measures every call N times, each round on freshly allocated inputs (the 512-row
benchmark cells of ours moved by 35-55 % between two runs of the same code);
--only SUBSTR keeps the calls whose name contains it.

    PYTHONPATH=. python scripts/host-overhead.py [--profile] [--rounds N] [--only s512]
"""

from __future__ import annotations

import argparse

import torch

from asymflash import flash_attn_func, flash_attn_with_kvcache
from asymflash.bench.core import capture_graph, host_issue_us, profile_calls


def cases():
    dev, bf = "cuda", torch.bfloat16
    # The benchmark's seqlen-512 cells (batch 32, model dim 2048): in the grid's runs the
    # causal ones measured 2.5x slower than their graph replay, the non-causal ones did not.
    for d in (64, 128, 256):
        qc = torch.randn(32, 512, 2048 // d, d, device=dev, dtype=bf)
        kc_, vc_ = torch.randn_like(qc), torch.randn_like(qc)
        for causal in (False, True):
            yield (f"fwd d{d} s512 b32 c{int(causal)}",
                   lambda q=qc, k=kc_, v=vc_, c=causal: flash_attn_func(q, k, v, causal=c), True)
    q = torch.randn(32, 512, 16, 128, device=dev, dtype=bf)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    q64 = torch.randn(32, 512, 32, 64, device=dev, dtype=bf, requires_grad=True)
    k64, v64 = (torch.randn_like(q64).requires_grad_() for _ in range(2))
    out64 = flash_attn_func(q64, k64, v64, causal=True)
    dout64 = torch.randn_like(out64)
    # read 86 TFLOP/s in one benchmark run, below its deterministic mode (144), 165 in the next
    yield ("bwd d64 s512 b32 c1 det0",
           lambda: out64.backward(dout64, retain_graph=True), False)

    def fwd_bwd():
        out = flash_attn_func(qg, kg, vg, causal=True)
        out.backward(dout)
    yield "fwd+bwd d128 s512 b32", fwd_bwd, False
    # The backward alone, as the benchmark times it; deterministic=True measured 1.8x faster
    # than the default at this cell (causal 512, d=128), which runs its key blocks in the
    # opposite order.
    for det in (False, True):
        out = flash_attn_func(qg, kg, vg, causal=True, deterministic=det)
        yield (f"bwd d128 s512 b32 c1 det{int(det)}",
               lambda out=out: out.backward(dout, retain_graph=True), False)
    for batch, splits in ((8, 1), (8, 0), (32, 0)):
        qd = torch.randn(batch, 1, 32, 128, device=dev, dtype=bf)
        kc = torch.randn(batch, 4096, 4, 128, device=dev, dtype=bf)
        vc = torch.randn_like(kc)
        lens = torch.full((batch,), 4095, dtype=torch.int32, device=dev)
        kn = torch.randn(batch, 1, 4, 128, device=dev, dtype=bf)

        def dec(qd=qd, kc=kc, vc=vc, lens=lens, kn=kn, splits=splits):
            return flash_attn_with_kvcache(qd, kc, vc, kn, kn, cache_seqlens=lens,
                                           num_splits=splits, check_values=False)
        yield f"decode b{batch} 4k splits={splits or 'auto'}", dec, True


def measure(fn, graphable, n=200):
    host = host_issue_us(fn, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def per_call_us(call):
        start.record()
        for _ in range(n):
            call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n * 1e3

    event = per_call_us(fn)
    from triton.testing import do_bench  # what the benchmark times: L2 flushed before each call

    bench = do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
    graph = float("nan")
    if graphable:
        try:
            graph = per_call_us(capture_graph(fn).replay)
        except Exception as e:  # noqa: BLE001 - report and go on
            print("graph capture failed:", type(e).__name__, str(e)[:200])
    return host, event, bench, graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for name, fn, graphable in cases():
            if args.only not in name:
                continue
            rows.append((r, name, *measure(fn, graphable)))
            if args.profile:
                # autograd runs CUDA backwards on a thread of its own, which cProfile (one
                # thread) would not see: run them in this one while profiling
                with torch.autograd.set_multithreading_enabled(False):
                    print(f"== {name}\n{profile_calls(fn)}")
    print(f"{'round':>5s} {'call':28s} {'host_us':>8s} {'event_us':>9s} {'bench_us':>9s} "
          f"{'graph_us':>9s}")
    for r, name, host, event, bench, graph in sorted(rows, key=lambda x: (x[1], x[0])):
        print(f"{r:5d} {name:28s} {host:8.1f} {event:9.1f} {bench:9.1f} {graph:9.1f}")


if __name__ == "__main__":
    main()
