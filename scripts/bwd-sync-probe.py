"""Does a short backward wait for the GPU on the host? (H200 device tool)

The 512-row backward cells read ~2x below the same kernels under graph replay on some
device machines, with the bench's "host issue" time close to host + GPU time added up:
what one stream synchronisation per call would give. For each case this times the call
as the benchmark does (do_bench with grads reset; the bench's host issue loop), then
lists the CUDA runtime calls a profiled call makes (any synchronize, memcpy, malloc or
free among them), the caching allocator's counters across the timed loop, and torch's
sync debug mode's complaints. A peer (cuDNN through SDPA) runs the same loop beside us.

    PYTHONPATH=. python scripts/bwd-sync-probe.py [--cases 128:1,64:1,256:1] [--seqlen 512]
        [--no-peer] [--profile] [--runner both|on|off] [--host-ab ROUNDS]

--runner: our backward through the call plan's bound runner (`bwd.BackwardRunner`, on), or
through `bwd.backward` as before it (off), or both in turn (the default). --host-ab: only the
host issue time of one backward call, runner on and off in alternating rounds (medians; the
device hosts' single CUDA calls vary by up to ~100 us, so one reading of each says little).
"""

from __future__ import annotations

import argparse
import collections
import gc
import warnings

import torch

from asymflash import flash_attn_func
from asymflash.bench.core import cell_host_us, cuda_timer, profile_calls

TOKENS, MODEL_DIM = 16384, 2048
WATCHED = ("Synchronize", "Memcpy", "Malloc", "Free", "Memset", "HostAlloc", "Query")
COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
            "num_ooms")


def runtime_calls(call, leaves, n=5):
    """(name -> (count, total us)) of the CUDA runtime / driver calls n calls make."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            for t in leaves:
                t.grad = None
            call()
        torch.cuda.synchronize()
    seen = collections.defaultdict(lambda: [0, 0.0])
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[name[:60]][0] += 1
            kernels[name[:60]][1] += ev.device_time_total
        elif name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
            seen[name][0] += 1
            seen[name][1] += ev.cpu_time_total
    return ({k: (c, t / n) for k, (c, t) in seen.items()},
            {k: (c, t / n) for k, (c, t) in kernels.items()})


def sync_warnings(call, leaves):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for t in leaves:
                t.grad = None
            call()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0][:120] for w in caught})


def probe(label, fwd, leaves, dout, flops):
    fwd()  # the first call of a signature plans it; the timed graph is the plan's
    out = fwd()
    call = lambda: out.backward(dout, retain_graph=True)  # noqa: E731 - as bench_core
    timer = cuda_timer(100, 100)
    timer(call, leaves)  # warm
    before = torch.cuda.memory_stats()
    ms = timer(call, leaves)
    after = torch.cuda.memory_stats()
    host = cell_host_us("bwd", fwd, leaves, dout)
    gc.disable()
    host_nogc = cell_host_us("bwd", fwd, leaves, dout)
    gc.enable()
    counters = {c: after.get(c, 0) - before.get(c, 0) for c in COUNTERS}
    print(f"{label:34s} {flops / ms / 1e9:6.0f} TFLOP/s  {ms * 1e3:7.1f} us  host issue "
          f"{host:6.1f} us (gc off {host_nogc:6.1f})  allocator {counters}")
    calls, kernels = runtime_calls(call, leaves)
    for name, (count, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        flag = " <--" if any(w in name for w in WATCHED) else ""
        print(f"    {name:44s} {count / 5:5.1f} per call {us:8.1f} us per call{flag}")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"    GPU {name:60s} {count / 5:5.1f} per call {us:8.1f} us per call")
    for msg in sync_warnings(call, leaves):
        print(f"    sync debug: {msg}")


def profile_backward(fwd, leaves, dout):
    """cProfile of our backward's host work, autograd kept on the calling thread (where
    cProfile sees it): sorted by own time. The second forward's graph: its call plan's."""
    fwd()
    out = fwd()

    def call():
        for t in leaves:
            t.grad = None
        with torch.autograd.set_multithreading_enabled(False):
            out.backward(dout, retain_graph=True)
    print(profile_calls(call, n=100, top=25))  # 100: the launch queue never fills


def without_runner(run):
    """run() with the sm90 backend offering call plans no backward runner."""
    from asymflash.backends.sm90 import backend
    from asymflash.runtime import plans

    make = backend.backward_runner
    backend.backward_runner = lambda *args: None
    plans.clear()
    try:
        run()
    finally:
        backend.backward_runner = make
        plans.clear()


def host_ab(d, causal, s, rounds):
    """Median host issue per backward call, runner on / off, alternating rounds."""
    b, h = TOKENS // s, MODEL_DIM // d
    leaves = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
              for _ in range(3)]
    dout = torch.randn_like(leaves[0])
    for det in (False, True):
        host_ab_mode(f"d={d} causal={causal} s={s}{' det' if det else ''}", leaves, dout,
                     bool(causal), det, rounds)


def host_ab_mode(label, leaves, dout, causal, det, rounds):
    import statistics

    from asymflash.bench.core import host_issue_us

    def planned():
        flash_attn_func(*leaves, causal=causal, deterministic=det)  # plans the signature
        return flash_attn_func(*leaves, causal=causal, deterministic=det)
    graphs = {"on": planned()}
    without_runner(lambda: graphs.setdefault("off", planned()))

    def issue(out):
        for t in leaves:
            t.grad = None
        out.backward(dout, retain_graph=True)
    times = {"on": [], "off": []}
    for _ in range(rounds):
        for how, out in graphs.items():
            times[how].append(host_issue_us(lambda out=out: issue(out), 50))
    med = {how: statistics.median(t) for how, t in times.items()}
    print(f"{label}: host issue per backward runner on {med['on']:6.1f} us, off "
          f"{med['off']:6.1f} us ({rounds} rounds: on {min(times['on']):.0f}-"
          f"{max(times['on']):.0f}, off {min(times['off']):.0f}-{max(times['off']):.0f})")


def run_case(d, causal, s, peer, profile=False, runner="both"):
    b, h = TOKENS // s, MODEL_DIM // d
    base = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    leaves = [t.detach().requires_grad_(True) for t in base]
    dout = torch.randn_like(base[0])
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    name = f"d={d} causal={causal} s={s}"
    if peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        bhsd = [t.transpose(1, 2) for t in leaves]

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *bhsd, is_causal=bool(causal))
            return out.transpose(1, 2)
        try:
            probe(f"{name} cuDNN", sdpa, leaves, dout, flops)
        except Exception as e:  # noqa: BLE001 - the peer is context only
            print(f"{name} cuDNN: {type(e).__name__}: {e}")
    for det in (False, True):
        for how in (("on", "off") if runner == "both" else (runner,)):
            def run(det=det, how=how):
                probe(f"{name} asymflash{' det' if det else ''} runner {how}",
                      lambda: flash_attn_func(*leaves, causal=bool(causal), deterministic=det),
                      leaves, dout, flops)
            if how == "on":
                run()
            else:
                without_runner(run)
    if profile:
        profile_backward(lambda: flash_attn_func(*leaves, causal=bool(causal)), leaves, dout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="128:1,128:0,64:1,256:1")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile our backward's host work (calling thread)")
    ap.add_argument("--runner", choices=("both", "on", "off"), default="both")
    ap.add_argument("--host-ab", type=int, default=0, metavar="ROUNDS")
    a = ap.parse_args()
    torch.manual_seed(0)
    for case in a.cases.split(","):
        d, causal = (int(x) for x in case.split(":"))
        if a.host_ab:
            host_ab(d, causal, a.seqlen, a.host_ab)
            continue
        run_case(d, causal, a.seqlen, not a.no_peer, a.profile, a.runner)


if __name__ == "__main__":
    main()
