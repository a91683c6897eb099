"""Find which portable forward tiles and head-dim shapes go wrong on this GPU (device tool).

Each (case, tile) runs in its own process (an illegal address poisons the CUDA context),
repeats the forward `--repeats` times, and reports the max error against the fp32
reference, "CRASH" with the CUDA error, or "ok". Usage:
    PYTHONPATH=. python scripts/portable-probe.py [--repeats 50] [--jobs 14]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

# (d, dv, window, sink, dtype)
CASES = [
    (40, 24, (-1, 3), True, "bfloat16"),
    (40, 24, (-1, -1), False, "bfloat16"),
    (40, 24, (-1, 3), False, "float16"),
    (40, 40, (-1, 3), True, "bfloat16"),
    (64, 32, (-1, 3), True, "bfloat16"),
    (32, 24, (-1, -1), False, "bfloat16"),
    (24, 40, (-1, -1), False, "bfloat16"),
]
TILES = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3),
         (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 2)]


def run_one(case, tile, repeats: int) -> str:
    import torch

    from asymflash import flash_attn_func
    from asymflash.backends import portable
    from asymflash.reference import attention_ref
    from asymflash.runtime.dispatch import use_backend

    d, dv, window, with_sink, dtype = case
    portable._CANDIDATES["fwd"] = {c: [tile] for c in (64, 128, 256)}
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter, a dry run
    q = torch.randn(1, 29, 2, d, device=dev, dtype=dt)
    k = torch.randn(1, 29, 2, d, device=dev, dtype=dt)
    v = torch.randn(1, 29, 2, dv, device=dev, dtype=dt)
    sink = torch.randn(2, device=dev) if with_sink else None
    try:
        with use_backend("portable"):
            for _ in range(repeats):
                out = flash_attn_func(q, k, v, window_size=window, learnable_sink=sink)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - report, do not stop the sweep
        return "CRASH " + str(e).splitlines()[0][:60]
    ref, _ = attention_ref(q.float(), k.float(), v.float(), window_size=window,
                           learnable_sink=sink)
    err = (out.float() - ref).abs().max().item()
    return f"{'ok' if err < 0.05 else 'WRONG'} {err:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        case, tile = eval(args.one)  # noqa: S307 - our own repr, passed to a child
        print(run_one(case, tile, args.repeats))
        return
    jobs = list(itertools.product(CASES, TILES))
    results, running = {}, []
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for job in jobs + [None] * args.jobs:
        if job is not None:
            cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--one", repr(job)]
            running.append((job, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True, env=env)))
        while running and (len(running) >= args.jobs or job is None):
            done, p = running.pop(0)
            text = p.communicate(timeout=300)[0].strip().splitlines()
            results[done] = text[-1] if text else "no output"
    print("| case (d, dv, window, sink, dtype) | " + " | ".join(map(str, TILES)) + " |")
    for case in CASES:
        print(f"| {case} | " + " | ".join(results[(case, t)] for t in TILES) + " |")


if __name__ == "__main__":
    main()
