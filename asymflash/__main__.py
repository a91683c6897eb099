"""`python -m asymflash demo` and `python -m asymflash bench`."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def demo(argv) -> int:
    """Forward + backward at a realistic size on the best device, checked against the
    reference; prints the backend used, max errors and times."""
    from . import flash_attn_func
    from .reference import attention_ref
    from .runtime.dispatch import backend_names

    p = argparse.ArgumentParser(prog="python -m asymflash demo")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args(argv)
    device = args.device
    on_gpu = device == "cuda"
    batch, heads, d = (4, 16, 128) if on_gpu else (2, 8, 64)
    seqlen = args.seqlen or (4096 if on_gpu else 1024)
    dtype = torch.bfloat16
    print(f"asymflash demo: {device} ({torch.cuda.get_device_name() if on_gpu else 'CPU'}), "
          f"backends {backend_names(device)}")
    print(f"  bf16 q/k/v ({batch}, {seqlen}, {heads}, {d}), causal={args.causal}")
    q, k, v = (torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device)
    # compile / warm up both directions outside the timing
    torch.autograd.grad(flash_attn_func(q, k, v, causal=args.causal), (q, k, v), dout)
    out, t_fwd = _timed(lambda: flash_attn_func(q, k, v, causal=args.causal), device)
    grads, t_bwd = _timed(lambda: torch.autograd.grad(out, (q, k, v), dout), device)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=args.causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    print(f"  forward  {t_fwd * 1e3:8.2f} ms   max |out - ref| = "
          f"{(out.float() - ref).abs().max().item():.2e}")
    errs = [(g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    print(f"  backward {t_bwd * 1e3:8.2f} ms   max |dq, dk, dv - ref| = "
          + ", ".join(f"{e:.2e}" for e in errs))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("demo", "bench"):
        print("usage: python -m asymflash {demo,bench} [options]  (--help after either)")
        return 2
    if argv[0] == "demo":
        return demo(argv[1:])
    from .bench.cli import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
