"""GPU time of the sm90 backward's passes around its main kernel (H200 device tool).

At 512 rows the preprocess (delta = rowsum(dO * O), dQ_acc zeroed) and the dQ postprocess
(fragment-order fp32 tiles -> dQ rows in the input dtype) take ~135 of ~435 us of a
backward (d=64 causal, `scripts/bwd-sync-probe.py`'s kernel list). This times each pass
alone (do_bench, L2 flushed) beside the bytes it moves, at model dim 2048 and 16k tokens
as in the benchmark, the preprocess in a few tilings (each checked against the default's
delta, and for dQ_acc left zeroed). Session 28's logs (bwd-passes*.log) came from an
earlier form that also timed the previous program order (one head's row blocks in turn).

    PYTHONPATH=. python scripts/bwd-passes-probe.py [--batch 32]
"""

# ruff: noqa: B023 - every lambda here is timed at once, inside its loop iteration
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from asymflash.backends.portable import row_delta
from asymflash.backends.sm90.bwd import dq_fragments

TOKENS, MODEL_DIM = 16384, 2048


def timed(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    b = a.batch
    cu = torch.arange(0, TOKENS + 1, TOKENS // b, dtype=torch.int32, device=dev)
    for d in (64, 128, 256):
        hq = MODEL_DIM // d
        out = torch.randn(TOKENS, hq, d, device=dev, dtype=bf)
        dout = torch.randn_like(out)
        acc = dq_fragments.fragment_buffer(TOKENS, b, hq, d, out.device)
        cols = 64 if d == 128 else d  # bwd_ws's two column parts at d=128
        io = 2 * out.numel() * 2
        zero_bytes = acc.numel() * 4
        post_bytes = acc.numel() * 4 + out.numel() * 2
        torch.manual_seed(d)
        acc.normal_()
        view = dq_fragments.tiles_view(acc)
        post = timed(lambda: dq_fragments.dq_from_fragments(view, cu, TOKENS // b, TOKENS, hq,
                                                            d, d, cols, bf))
        ref = row_delta(out, dout, None, None)
        print(f"d={d:3d} b={b}: postprocess {post:6.1f} us "
              f"({post_bytes / post / 1e6:4.2f} TB/s)", flush=True)
        for block_t, warps in ((None, 4), (64, 4), (128, 8)):
            acc.normal_()
            assert torch.equal(row_delta(out, dout, None, acc, block_t, warps), ref)
            assert not acc.any(), "dQ_acc zeroed"
            pre = timed(lambda: row_delta(out, dout, None, acc, block_t, warps))
            read = timed(lambda: row_delta(out, dout, None, None, block_t, warps))
            rows = block_t or "default"
            print(f"d={d:3d} b={b} {rows} rows, {warps} warps: preprocess+zero {pre:6.1f} us "
                  f"({(io + zero_bytes) / pre / 1e6:4.2f} TB/s), preprocess {read:6.1f} us "
                  f"({io / read / 1e6:4.2f} TB/s)", flush=True)
        copy_src = torch.empty(zero_bytes // 4, device=dev)
        copy_dst = torch.empty_like(copy_src)
        c = timed(lambda: copy_dst.copy_(copy_src))
        z = timed(lambda: copy_dst.zero_())
        print(f"d={d:3d} references: copy of dQ_acc's bytes {c:6.1f} us "
              f"({2 * zero_bytes / c / 1e6:4.2f} TB/s), zero_() {z:6.1f} us "
              f"({zero_bytes / z / 1e6:4.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
