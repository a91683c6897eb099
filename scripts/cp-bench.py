"""Context-parallel throughput: asymflash ring attention vs torch's context_parallel over SDPA.

NOT RUN YET: this needs a machine with several GPUs (2, 4 or 8 H200 over NVLink); it was
checked only in its CPU smoke mode (gloo, tiny shapes, `--device cpu`). The runs to make,
one per GPU count, from the repository root:

    for n in 2 4 8; do
      torchrun --standalone --nproc-per-node $n scripts/cp-bench.py \\
          --seqlens 131072 262144 524288 1048576 --causal both \\
          --out benchmarks/results/cp-h200x$n.json
    done

and, before the timings, the ring's values on NCCL against one GPU's (`--check 32768`
compares out and gradients with single-GPU asymflash on the whole sequence; exit status 1
on a mismatch):

    torchrun --standalone --nproc-per-node 8 scripts/cp-bench.py --check 32768 \\
        --seqlens 131072 --iters 3

CPU smoke test of the script itself (no timing meaning):

    torchrun --standalone --nproc-per-node 2 scripts/cp-bench.py --device cpu \\
        --seqlens 256 --heads 2 --kv-heads 2 --headdim 16 --iters 1 --warmup 0

For each total sequence length N (one sequence, split over the W ranks) and causal / not,
it times forward and forward+backward (median of --iters, host clock around device
synchronizes, the slowest rank's time):
- `ring`: asymflash.distributed.ring_attention (zigzag shards for causal);
- `compute`: the same ring schedule with every transfer removed (each rank attends to its
  own K/V in place of the received ones): the single-GPU kernels doing exactly the ring's
  work, so ring / compute is the share of communication the overlap failed to hide
  (issue 44's target: ring throughput >= 90 % of this);
- `torch-cp`: torch.distributed.tensor.experimental.context_parallel over
  F.scaled_dot_product_attention with the flash backend (its load-balanced sharding for
  causal), on (batch, heads, seqlen, dim) tensors; nheads_kv must equal nheads there.
Reported per row: ms, tokens/s per GPU (N / time / W) and attention TFLOP/s per GPU
(4 * N^2 * heads * dim, halved for causal, x2.5 for forward+backward, divided by W).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asymflash.distributed import zigzag_shard
from asymflash.distributed.comm import Ring
from asymflash.distributed.ring import RingSpec, ring_backward, ring_forward
from asymflash.distributed.rows import DenseRows


class _NoTransfer:
    """comm.Transfer's interface with the sent tensors handed straight back."""

    def __init__(self, tensors):
        self._tensors = list(tensors)

    def wait(self):
        return self._tensors


class _LocalRing:
    """A Ring whose shifts move nothing: the ring's schedule, compute only."""

    def __init__(self, ring: Ring):
        self.group, self.rank, self.world = ring.group, ring.rank, ring.world

    def shift(self, tensors, tag):
        return _NoTransfer(tensors)


def _timer(device):
    if device.type == "cuda":
        def sync():
            torch.cuda.synchronize(device)
    else:
        def sync():
            pass
    return sync


def _time(fn, iters, warmup, device):
    """Median ms of fn over iters, the slowest rank's (the ring runs at its pace)."""
    sync = _timer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _flops(n, heads, d, causal, mode):
    f = 4 * n * n * heads * d * (0.5 if causal else 1.0)
    return f * (2.5 if mode == "fwd+bwd" else 1.0)


def _asymflash_cases(q, k, v, dout, causal, ring, deterministic):
    """(name, forward fn, forward+backward fn) for the ring and its compute-only twin."""
    cases = []
    for name, r in (("ring", ring), ("compute", _LocalRing(ring))):
        spec = RingSpec(r, q.shape[-1] ** -0.5, causal, True, 0.0, deterministic,
                        DenseRows(q.shape[1]))

        def fwd(spec=spec):
            return ring_forward(spec, q, k, v)

        def fwd_bwd(spec=spec):
            out, lse = ring_forward(spec, q, k, v)
            ring_backward(spec, dout, q, k, v, out.to(q.dtype), lse)

        cases.append((name, fwd, fwd_bwd))
    return cases


def _torch_cp_case(q_full, k_full, v_full, dout_full, causal, world, device, stack):
    """torch's context_parallel over SDPA (flash backend) as a callable(backward), entered
    on `stack` (it shards its buffers in place once, so every timed call runs inside one
    context), or (None, the reason it cannot run)."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        return None, f"torch context_parallel unavailable: {e}"
    if device.type != "cuda":
        return None, "torch context_parallel's SDPA ring is CUDA only"
    if k_full.shape[2] != q_full.shape[2]:
        return None, "torch-cp here runs MHA only (pass --kv-heads equal to --heads)"
    mesh = init_device_mesh("cuda", (world,))
    # (batch, heads, seqlen, dim): SDPA's layout; context_parallel shards dim 2 in place
    bufs = [t.transpose(1, 2).contiguous() for t in (q_full, k_full, v_full, dout_full)]
    stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
    stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4))
    q, k, v, dout = bufs
    for t in (q, k, v):  # leaves after the in-place sharding, as torch's own CP tests do
        t.requires_grad_()

    def run(backward):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if backward:
            out.backward(dout)

    return run, None


def _time_torch_cp(name, full, causal, world, device, args, results):
    """Time torch's context_parallel into results[(name, mode)]: "torch-cp" on torch's own
    flash kernels, "torch-cp-asymflash" on asymflash's through the SDPA registration (the
    same ring of torch's calling asymflash per block). Returns a note, or None."""
    from asymflash.integrations import torch_sdpa

    with contextlib.ExitStack() as stack:
        if name == "torch-cp-asymflash":
            torch_sdpa.register()
            stack.callback(torch_sdpa.unregister)
        run, note = _torch_cp_case(*full, causal, world, device, stack)
        for mode in args.modes if run is not None else ():
            try:
                results[(name, mode)] = _time(lambda b=(mode != "fwd"), run=run: run(b),
                                              args.iters, args.warmup, device)
            except Exception as e:  # report, keep measuring the other rows
                note = f"{mode}: {type(e).__name__}: {e}"
    return f"{name}: {note}" if note else None


def _check(n, args, ring, device, dtype, causal) -> bool:
    """The ring against single-GPU asymflash on the whole sequence (every rank computes it,
    compares its zigzag shard): out and gradients, max error relative to the largest value.
    bf16 roundings of the per-block gradients bound the error at a few bf16 ulps."""
    from asymflash import flash_attn_func
    from asymflash.distributed import ring_attention

    world, rank = ring.world, ring.rank
    g = torch.Generator(device=device).manual_seed(1)
    shapes = [(1, n, args.heads, args.headdim), (1, n, args.kv_heads, args.headdim),
              (1, n, args.kv_heads, args.headdim), (1, n, args.heads, args.headdim)]
    q, k, v, dout = (torch.randn(s, generator=g, device=device, dtype=dtype) for s in shapes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full = flash_attn_func(*leaves, causal=causal)
    want = [full.detach(), *torch.autograd.grad(full, leaves, dout)]
    local = [zigzag_shard(t, world, rank).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, causal=causal)
    got = [out.detach(), *torch.autograd.grad(out, local, zigzag_shard(dout, world, rank))]
    ok = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = zigzag_shard(b, world, rank)
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).reshape(1)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        bound = 2e-2 if dtype != torch.float32 else 1e-4
        ok &= err.item() <= bound
        if rank == 0:
            print(f"check N={n} W={world} causal={causal} {name}: max error / max value "
                  f"{err.item():.2e} (bound {bound:g})", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's context_parallel")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (rank 0 writes)")
    ap.add_argument("--check", type=int, default=0, metavar="N",
                    help="first compare the ring with single-GPU asymflash at N tokens "
                         "(exit status 1 on a mismatch); 0 skips")
    args = ap.parse_args(argv)

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        dtype = torch.float32
    ring = Ring()
    world, rank = ring.world, ring.rank
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    if args.check:
        if not all([_check(args.check, args, ring, device, dtype, c) for c in causals]):
            dist.destroy_process_group()
            return 1
    rows = []
    for n in args.seqlens:
        if n % (2 * world):
            raise SystemExit(f"seqlen {n} is not a multiple of 2 * world = {2 * world}")
        g = torch.Generator(device=device).manual_seed(0)  # the same full tensors everywhere
        shape_q, shape_kv = (1, n, args.heads, args.headdim), (1, n, args.kv_heads, args.headdim)
        full = [torch.randn(s, generator=g, device=device, dtype=dtype)
                for s in (shape_q, shape_kv, shape_kv, shape_q)]
        q, k, v, dout = (zigzag_shard(t, world, rank) for t in full)
        for causal in causals:
            cases = _asymflash_cases(q, k, v, dout, causal, ring, args.deterministic)
            results = {}
            for name, fwd, fwd_bwd in cases:
                for mode in args.modes:
                    fn = fwd if mode == "fwd" else fwd_bwd
                    results[(name, mode)] = _time(fn, args.iters, args.warmup, device)
            notes = []
            for name in () if args.no_torch else ("torch-cp", "torch-cp-asymflash"):
                note = _time_torch_cp(name, full, causal, world, device, args, results)
                notes += [note] if note else []
            for (name, mode), ms in results.items():
                row = dict(provider=name, mode=mode, seqlen=n, world=world, causal=causal,
                           heads=args.heads, kv_heads=args.kv_heads, headdim=args.headdim,
                           ms=ms, tokens_per_s_per_gpu=n / (ms / 1e3) / world,
                           tflops_per_gpu=_flops(n, args.heads, args.headdim, causal, mode)
                           / (ms / 1e3) / world / 1e12)
                if name == "ring":
                    row["vs_compute_only"] = results[("compute", mode)] / ms
                rows.append(row)
                if rank == 0:
                    extra = f"  ring/compute {row['vs_compute_only']:.3f}" if name == "ring" \
                        else ""
                    print(f"N={n:>8} W={world} causal={causal!s:5} {mode:7} {name:8} "
                          f"{ms:9.2f} ms  {row['tokens_per_s_per_gpu']:12.0f} tok/s/GPU  "
                          f"{row['tflops_per_gpu']:7.1f} TFLOP/s/GPU{extra}", flush=True)
            for note in notes if rank == 0 else ():
                print(f"N={n:>8} W={world} causal={causal!s:5} {note}", flush=True)
    if rank == 0 and args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", world=world, dtype=str(dtype))
        args.out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
