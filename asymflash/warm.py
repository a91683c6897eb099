"""`python -m asymflash warm`: compile a model's attention kernels into Triton's disk cache
ahead of time, so that the first call of a later process loads them instead of compiling.

It warms by calling: one forward (and backward) per shape on the GPU the kernels will run on,
through the same path a model's calls take. Triton keys its disk cache on what each launch
specialises (16-byte aligned pointers, integer arguments equal to 1 or divisible by 16, the
descriptors' boxes and layouts) and on the target and compile options; only a real call
reproduces that key. A compile for sm_90a on a CPU machine (`compile_for_target`, the CI
checks) passes no such specialisation, so it lands under other keys and would warm nothing:
this command refuses to run without a GPU rather than pretend.

What a warmed process skips is the compile; the plan and launcher caches of a process
(runtime/plans.py, runtime/launch.py) are rebuilt on its first call of each signature.
Batch and sequence lengths are runtime values, but they choose the kernel's configuration
(short causal calls, three warpgroups from 2k rows at d=64, persistent grids), and a batch of
1 is specialised: give the lengths and batch sizes the model runs.
"""

from __future__ import annotations

import argparse
import time

import torch

DESCRIPTION = "compile a model's attention kernels into Triton's disk cache (on its GPU)"

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m asymflash warm", description=DESCRIPTION,
        epilog="Runs one call per shape on the GPU: Triton keys its disk cache on what each "
               "launch specialises, which only a real call reproduces. Lengths and batch "
               "sizes choose kernel configurations: give the ones the model runs.")
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, required=True, help="head dim of q, k and v")
    p.add_argument("--seqlen", type=int, nargs="+", required=True,
                   help="sequence lengths the model runs (each is warmed)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (default 1)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--window", type=int, default=None, help="sliding window (left) size")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--forward-only", action="store_true", help="inference: no backward")
    p.add_argument("--device", default="cuda", help="the GPU (default: cuda)")
    return p


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv) -> int:
    from . import flash_attn_func
    from .runtime.dispatch import backend_names

    parser = _parser()
    args = parser.parse_args(argv)
    kv_heads = args.kv_heads or args.heads
    if min(args.heads, kv_heads, args.head_dim, *args.seqlen, *args.batch) < 1:
        parser.error("heads, head dim, lengths and batch sizes must be at least 1")
    if args.heads % kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {kv_heads}")
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print("asymflash warm: needs the GPU the kernels will run on (this torch sees "
              f"{'none' if not torch.cuda.is_available() else 'one, but --device is not it'}"
              "): Triton's disk cache is keyed on each launch's specialisation, which only a "
              "real call reproduces; a CPU-side compile would warm nothing.")
        return 2
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    window = (args.window, -1) if args.window is not None else (-1, -1)
    print(f"asymflash warm: {torch.cuda.get_device_name(device)}, backends "
          f"{backend_names(device)}")
    for batch in args.batch:
        for seqlen in args.seqlen:
            def call(batch=batch, seqlen=seqlen):
                q = torch.randn(batch, seqlen, args.heads, args.head_dim, dtype=dtype,
                                device=device, requires_grad=not args.forward_only)
                k, v = (torch.randn(batch, seqlen, kv_heads, args.head_dim, dtype=dtype,
                                    device=device, requires_grad=not args.forward_only)
                        for _ in range(2))
                out = flash_attn_func(q, k, v, causal=args.causal, window_size=window)
                if not args.forward_only:
                    out.backward(torch.ones_like(out))
            first, again = _timed(call), _timed(call)
            print(f"  batch {batch:4d} seqlen {seqlen:6d}: first call {first:7.2f} s "
                  f"(compile or disk cache), again {again * 1e3:8.2f} ms")
    print("asymflash warm: done; a new process with these shapes loads the kernels from "
          "Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache)")
    return 0
