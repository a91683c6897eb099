"""Time flash_attn_func on the strided layouts users hand us, the sm90 path reading them in
place (ASYMFLASH_SM90_STRIDED=1) or as contiguous copies (=0), against the same call on
contiguous tensors. Forward and forward + backward, CUDA events (median).

    PYTHONPATH=. python scripts/strided-probe.py [--seqlen 2048] [--d 128]

Layouts: a (batch, seqlen, 3, heads, dim) fused QKV buffer unbound into q, k, v (rows
strided, heads side by side) and Hugging Face's (batch, heads, seqlen, dim) tensors
transposed, at batch 1 (there `flash_attn_func`'s row view keeps the transposed strides).
"""

from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench

from asymflash import flash_attn_func
from asymflash.backends.sm90 import fwd


def layouts(batch, seqlen, heads, d):
    dense = [torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
             for _ in range(3)]
    fused = torch.randn(batch, seqlen, 3, heads, d, device="cuda",
                        dtype=torch.bfloat16).unbind(2)
    hf = [torch.randn(1, heads, seqlen, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
          for _ in range(3)]
    return {"contiguous": dense, "fused-qkv": list(fused), "hf-transposed b=1": hf}


def tflops(ms, batch, seqlen, heads, d, causal, bwd):
    flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
    return flops * (3.5 if bwd else 1.0) / ms / 1e9


def time_calls(leaves, causal):
    """(forward ms, forward + backward ms) of flash_attn_func on these q, k, v."""
    q, k, v = leaves
    dout = torch.randn_like(q)

    def fwd_only():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        flash_attn_func(q, k, v, causal=causal).backward(dout)

    return (do_bench(fwd_only, warmup=50, rep=200, return_mode="median"),
            do_bench(fwd_bwd, warmup=50, rep=200, return_mode="median"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    heads = 2048 // a.d
    print(f"seqlen {a.seqlen}, d {a.d}, heads {heads}, causal {a.causal}; TFLOP/s "
          "fwd / fwd+bwd")
    for name, tensors in layouts(max(1, 16384 // a.seqlen), a.seqlen, heads, a.d).items():
        batch = tensors[0].shape[0]
        row = []
        for switch in ("0", "1"):
            os.environ[fwd.STRIDED_SWITCH] = switch
            f, fb = time_calls([t.detach().requires_grad_(True) for t in tensors], a.causal)
            row.append(f"switch={switch}: {tflops(f, batch, a.seqlen, heads, a.d, a.causal, 0):.0f}"
                       f" / {tflops(fb, batch, a.seqlen, heads, a.d, a.causal, 1):.0f}")
        print(f"{name:20s} batch {batch:3d}  " + "   ".join(row))


if __name__ == "__main__":
    main()
