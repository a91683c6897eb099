"""`python -m asymflash {demo,bench,env,warm}`: the command-line entry points."""

from __future__ import annotations

import argparse
import sys
import time

import torch

COMMANDS = {
    "demo": "forward + backward on the best device, checked against the reference "
            "(exit 1 if a result is outside the tolerance)",
    "bench": "the benchmark grid (or --suite models) beside the peers found here "
             "(see `bench --help`)",
    "env": "versions, devices, the backends each device gets, and the environment switches",
    "warm": "compile a model's attention kernels into Triton's disk cache (on its GPU)",
}


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m asymflash demo", description=COMMANDS["demo"],
        epilog="Tolerance (flash-attn's rule): max|x - ref| <= 2 * max|plain - ref| + "
               "2^-10 * max|ref|, with ref the fp32 reference and plain the same math in bf16.")
    p.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda where available, else cpu)")
    p.add_argument("--seqlen", type=_positive, default=None,
                   help="sequence length (default 4096 on a GPU, 1024 on the CPU)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    return p


def demo(argv) -> int:
    """Forward + backward at a realistic size, checked against the reference; prints the
    backends, each tensor's error against its bound, times, and a verdict."""
    from . import flash_attn_func
    from .bench.core import error_and_bound
    from .reference import attention_ref
    from .runtime.dispatch import backend_names

    parser = _demo_parser()
    args = parser.parse_args(argv)
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        parser.error(f"--device {name!r}: the demo runs on cuda (cuda:N) or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name!r}: this torch sees no CUDA device "
                     f"(torch {torch.__version__}); use --device cpu")
    on_gpu = device.type == "cuda"
    batch, heads, d = (4, 16, 128) if on_gpu else (2, 8, 64)
    seqlen = args.seqlen or (4096 if on_gpu else 1024)
    dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"asymflash demo: {device} ({gpu}), backends {backend_names(device)}")
    print(f"  bf16 q/k/v ({batch}, {seqlen}, {heads}, {d}), causal={args.causal}")
    q, k, v = (torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device)
    # compile / warm up both directions outside the timing
    torch.autograd.grad(flash_attn_func(q, k, v, causal=args.causal), (q, k, v), dout)
    out, t_fwd = _timed(lambda: flash_attn_func(q, k, v, causal=args.causal), device)
    grads, t_bwd = _timed(lambda: torch.autograd.grad(out, (q, k, v), dout), device)
    print(f"  forward {t_fwd * 1e3:9.2f} ms, backward {t_bwd * 1e3:9.2f} ms")
    references = []
    for upcast in (True, False):  # fp32, then the same math in bf16 (the tolerance's base)
        leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_(True)
                  for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=args.causal, upcast=upcast)
        references.append((ref, *torch.autograd.grad(ref, leaves, dout.to(ref.dtype))))
    failed = []
    for i, (tensor_name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
        err, bound = error_and_bound(got, references[0][i], references[1][i])
        ok = err <= bound
        failed += [] if ok else [tensor_name]
        print(f"  {tensor_name:3s} max error {err:.2e} (bound {bound:.2e}) "
              f"{'ok' if ok else 'FAILED'}")
    print("asymflash demo: " + ("PASS" if not failed else f"FAIL ({', '.join(failed)})"))
    return 1 if failed else 0


def env(argv) -> int:
    """What this machine gives asymflash: versions, devices, backends, switches."""
    argparse.ArgumentParser(prog="python -m asymflash env",
                            description=COMMANDS["env"]).parse_args(argv)
    import triton

    from .runtime import env as switches
    from .runtime.dispatch import backend_names

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for name in devices:
        label = torch.cuda.get_device_name(name) if name != "cpu" else "CPU"
        print(f"{name} ({label}): backends {backend_names(name)}")
    print("environment switches (none is needed; see docs/tuning.md):")
    print(switches.describe())
    return 0


def _usage() -> str:
    lines = ["usage: python -m asymflash COMMAND [options]", "", "commands:"]
    lines += [f"  {name:6s} {what}" for name, what in COMMANDS.items()]
    lines += ["", "`python -m asymflash COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest)
    if command == "env":
        return env(rest)
    if command == "warm":
        from .warm import main as warm_main

        return warm_main(rest)
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    print(f"asymflash: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
