"""Time asymflash.flex_attention against torch's compiled flex_attention, per mod of the
test suite (tests/flex_mods.py), forward and forward+backward, on one CUDA GPU.

    python scripts/flex-bench.py [--seqlen 8192] [--batch 2] [--heads 16] [--dim 128]
                                 [--backend sm90|portable] [--json results.json]

--backend forces asymflash's flex forward onto one backend (default: the dispatcher's
choice, sm90 on Hopper); the backward is the portable one either way. Each mod's outputs
are compared with torch's first (max |difference|, printed).

Prints a markdown table (TFLOP/s counted on the blocks each BlockMask visits, the same
count for both, and the ratio asymflash / torch); --json writes the raw times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from flex_mods import MODS  # noqa: E402

import asymflash  # noqa: E402


def _time(fn, qkv, score_mod, block_mask, learned, dout):
    """(forward ms, forward+backward ms) of one implementation."""
    def fwd():
        return fn(*qkv, score_mod=score_mod, block_mask=block_mask)

    def fwd_bwd():
        torch.autograd.grad(fwd(), [*qkv, *learned], dout)

    with torch.no_grad():
        fwd_ms = triton.testing.do_bench(fwd)
    return fwd_ms, triton.testing.do_bench(fwd_bwd)


def _on_backend(fn, backend):
    if backend is None:
        return fn
    from asymflash.runtime.dispatch import use_backend

    def run(*args, **kw):
        with use_backend(backend):
            return fn(*args, **kw)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from torch.nn.attention import flex_attention as tf

    warnings.simplefilter("ignore")
    compiled = torch.compile(tf.flex_attention)
    b, h, s, d = args.batch, args.heads, args.seqlen, args.dim
    rows, results = [], {}
    for name, make in MODS.items():
        score_mod, mask_mod, learned = make(s, s, h, "cuda")
        bm = tf.create_block_mask(mask_mod if mask_mod else tf.noop_mask, b, h, s, s,
                                  device="cuda")
        # visited fraction: the work both implementations do (block-sparse skips the rest)
        visited = (bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum()
                   if bm.full_kv_num_blocks is not None else 0)).item()
        total = bm.kv_num_blocks.shape[0] * bm.kv_num_blocks.shape[1] * \
            bm.kv_num_blocks.shape[2] * triton.cdiv(s, bm.BLOCK_SIZE[1])
        flops = 4 * b * h * s * s * d * visited / max(total, 1)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        timings = {}
        ours = _on_backend(asymflash.flex_attention, args.backend)
        with torch.no_grad():
            diff = (ours(q, k, v, score_mod=score_mod, block_mask=bm).float()
                    - compiled(q, k, v, score_mod=score_mod, block_mask=bm).float())
        timings["max_abs_diff"] = diff.abs().max().item()
        for label, fn in (("asymflash", ours), ("torch", compiled)):
            fwd_ms, fwdbwd_ms = _time(fn, (q, k, v), score_mod, bm, learned, dout)
            timings[f"{label}_fwd_ms"], timings[f"{label}_fwdbwd_ms"] = fwd_ms, fwdbwd_ms
        results[name] = dict(timings, visited=visited / max(total, 1))
        fwd_tf = [flops / timings[f"{p}_fwd_ms"] * 1e-9 for p in ("asymflash", "torch")]
        rows.append(f"| {name} | {visited / max(total, 1):.2f} | {fwd_tf[0]:.0f} | "
                    f"{fwd_tf[1]:.0f} | {fwd_tf[0] / fwd_tf[1]:.2f} | "
                    f"{timings['torch_fwdbwd_ms'] / timings['asymflash_fwdbwd_ms']:.2f} | "
                    f"{timings['max_abs_diff']:.2g} |")
    print(f"b={b} h={h} s={s} d={d} bf16, {torch.cuda.get_device_name()}")
    print(f"asymflash forward backend: {args.backend or 'default'}")
    print("| mod | blocks visited | asymflash fwd TFLOP/s | torch flex fwd TFLOP/s | "
          "fwd ratio | fwd+bwd ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
