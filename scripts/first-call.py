"""Time to first result: a fresh process's first forward and backward of one attention call,
cold (empty kernel caches) and cached (the caches the cold run filled), beside FA4.

Each measurement is a new Python process (this script with --child), so imports, CUDA
initialisation and every per-process cache count as a user sees them. The child prints one
JSON line of phases, in seconds:

  import_torch  cuda_init (first CUDA tensor)  import_lib  first_fwd  first_bwd  second
  (second: a forward+backward of the same shape again, the steady state for scale)

and, for asymflash, where the first forward's time went inside Triton (by wrapping its
functions for the child's lifetime): triton_key (Triton hashes its own 400 MB library once
per process to key its disk cache), compile (triton.compile, triton_key included: the cache
lookup, or the whole compile when cold), load (module load and launcher, CompiledKernel's handles).
--profile writes a cProfile of the cached child's first forward+backward under --out.

    PYTHONPATH=. python scripts/first-call.py [--head-dim 128] [--causal] [--out DIR]

FA4 joins when `flash_attn.cute` imports (source .peers/fa4-b/activate.sh first); its cold
run gets an empty CUTE_DSL_CACHE_DIR as well. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PHASES = ("import_torch", "cuda_init", "import_lib", "first_fwd", "first_bwd", "second")
TRITON_PARTS = ("triton_key", "compile", "load")


def _wrap_triton(parts: dict) -> None:
    """Accumulate the time of Triton's per-process key, compile and kernel loading."""
    import triton.compiler
    import triton.compiler.compiler as compiler
    import triton.runtime.cache as cache

    def timed(name, fn):
        def inner(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
        return inner

    # get_cache_key reads cache.triton_key at each call; a JIT function takes
    # triton.compiler.compile when it first binds (its first launch), after this runs.
    cache.triton_key = timed("triton_key", cache.triton_key)
    triton.compiler.compile = timed("compile", compiler.compile)
    compiler.CompiledKernel._init_handles = timed("load", compiler.CompiledKernel._init_handles)


def _call(lib, q, k, v, causal):
    if lib == "asymflash":
        from asymflash import flash_attn_func
        return flash_attn_func(q, k, v, causal=causal)
    from flash_attn.cute import flash_attn_func
    return flash_attn_func(q, k, v, causal=causal)[0]


def child(args) -> dict:
    t = {}
    start = time.perf_counter()
    import torch
    t["import_torch"] = time.perf_counter() - start

    def phase(name, fn):
        torch.cuda.synchronize() if name != "cuda_init" else None
        s = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        t[name] = time.perf_counter() - s
        return result

    phase("cuda_init", lambda: torch.zeros(1, device="cuda"))
    parts: dict = {}
    if args.lib == "asymflash":
        phase("import_lib", lambda: __import__("asymflash"))
        _wrap_triton(parts)
    else:
        phase("import_lib", lambda: __import__("flash_attn.cute"))
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    out = phase("first_fwd", lambda: _call(args.lib, q, k, v, args.causal))
    triton_fwd = dict(parts)
    phase("first_bwd", lambda: out.backward(dout))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)

    def again():
        _call(args.lib, q, k, v, args.causal).backward(dout)
    phase("second", again)
    t.update({f"fwd_{name}": triton_fwd.get(name, 0.0) for name in TRITON_PARTS if parts})
    return t


def _run_child(args, lib, cache_dir, profile=None) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               CUTE_DSL_CACHE_DIR=os.path.join(cache_dir, "cute"))
    cmd = [sys.executable, __file__, "--child", lib, "--head-dim", str(args.head_dim),
           "--seqlen", str(args.seqlen), "--batch", str(args.batch), "--heads",
           str(args.heads)] + (["--causal"] if args.causal else [])
    if profile:
        cmd += ["--profile", profile]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = wall
    return result


def _available(lib) -> bool:
    code = "import flash_attn.cute" if lib == "FA4" else "import asymflash"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=("asymflash", "FA4"), help=argparse.SUPPRESS)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    if args.child:
        args.lib = args.child
        print(json.dumps(child(args)))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("first-call: needs a CUDA GPU (it times real first calls)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for lib in ("asymflash", "FA4"):
        if not _available(lib):
            print(f"first-call: {lib} does not import; left out")
            continue
        with tempfile.TemporaryDirectory() as cache_dir:
            rows.append((lib, "cold", _run_child(args, lib, cache_dir)))
            prof = os.path.join(args.out, f"first-call-{lib}.prof") if lib == "asymflash" else None
            rows.append((lib, "cached", _run_child(args, lib, cache_dir, prof)))
    with open(os.path.join(args.out, "first-call.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    cols = PHASES + tuple(f"fwd_{n}" for n in TRITON_PARTS) + ("process",)
    print(f"d={args.head_dim} seqlen={args.seqlen} batch={args.batch} heads={args.heads} "
          f"causal={args.causal}; seconds")
    print("| lib | caches | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for lib, kind, r in rows:
        if "error" in r:
            print(f"| {lib} | {kind} | error: {r['error']} |")
            continue
        print(f"| {lib} | {kind} | " + " | ".join(
            f"{r[c]:.3f}" if c in r else "-" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
