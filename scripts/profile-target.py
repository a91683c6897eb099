"""One attention call, repeated: the target process for a kernel profiler (H200 diagnostics).

    PYTHONPATH=. python3 scripts/profile-target.py IMPL MODE D CAUSAL SEQLEN [--reps N]

IMPL: ours (the sm90 backend's forward / backward called directly) or fa4
(flash_attn.cute, the peer; `source .peers/fa4-b/activate.sh` first). MODE: fwd or bwd.
Shapes as the benchmark's grid: bf16, model dim 2048 (nheads = 2048 / D), batch =
16384 / SEQLEN. Each repetition runs the whole call (bwd: forward once, then the backward),
so a profiler can skip the first ones (compiles, warm-up) and take one launch, e.g.

    ncu --clock-control none --section WarpStateStats -k regex:attn_bwd -s 2 -c 1 \\
        python3 scripts/profile-target.py ours bwd 128 0 16384

Nothing here checks results: the test suite and the benchmark do.
"""

from __future__ import annotations

import argparse

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", choices=("ours", "fa4"))
    ap.add_argument("mode", choices=("fwd", "bwd"))
    ap.add_argument("d", type=int)
    ap.add_argument("causal", type=int)
    ap.add_argument("seqlen", type=int)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    batch, heads = max(1, 16384 // a.seqlen), 2048 // a.d
    shape = (batch, a.seqlen, heads, a.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    causal = bool(a.causal)
    if a.impl == "fa4":
        from flash_attn.cute import flash_attn_func as fa4

        leaves = [t.requires_grad_() for t in (q, k, v)]
        for _ in range(a.reps):
            out = fa4(q, k, v, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            if a.mode == "bwd":
                torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        return
    from asymflash.backends.sm90.bwd import host as bwd
    from asymflash.backends.sm90.fwd import host as fwd
    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    rows = [t.view(batch * a.seqlen, heads, a.d) for t in (q, k, v, dout)]
    seq = SeqInfo.dense(batch, a.seqlen, a.seqlen, q.device)
    params = AttnParams(a.d ** -0.5, MaskSpec(-1, 0 if causal else -1), 0.0, False)
    for _ in range(a.reps):
        out, lse = fwd.forward(*rows[:3], seq, params, None)
        if a.mode == "bwd":
            bwd.backward(rows[3], *rows[:3], out, lse, None, seq, params, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
