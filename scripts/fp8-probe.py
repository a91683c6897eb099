"""Where the sm90 fp8 forward's error comes from (H100/H200): the kernel's S precision, and
its result on inputs whose scores every accumulator holds exactly.

1. S precision: window_size=(0, 0) leaves each row one key (its own), so lse of row r is
   softmax_scale · q_r·k_r as the kernel's wgmma summed it. Printed against the fp64 dot and
   against cuBLAS's fp8 GEMM (torch._scaled_mm, fast accumulation, the same tensor cores):
   the error's size relative to |q|·|k| and to sum_i |q_i k_i|.
2. Exact scores: q and k small integers (|q·k| <= 2^9: every partial sum is exact in any
   accumulator), so only the rounding of P to e4m3 remains. The result must lie within
   fp8_cases.p_e4m3_bound; a layout, key-order or mask fault shows here whatever S's
   precision is.

    PYTHONPATH=.:tests python scripts/fp8-probe.py
"""

from __future__ import annotations

import torch
from fp8_cases import expected, p_e4m3_bound

from asymflash import flash_attn_func

E4M3 = torch.float8_e4m3fn


def s_precision(batch=2, seqlen=2048, heads=16, d=128, outliers=True):
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, heads, d, device="cuda")
    k = torch.randn(batch, seqlen, heads, d, device="cuda")
    if outliers:
        k[..., 1::17] *= 30.0
    q8 = (q / q.abs().amax() * 448).to(E4M3)
    k8 = (k / k.abs().amax() * 448).to(E4M3)
    v8 = torch.randn(batch, seqlen, heads, d, device="cuda").to(E4M3)
    scale = 1.0 / (448.0 * 448.0)
    ones = torch.ones(batch, heads, device="cuda")
    _, lse = flash_attn_func(q8, k8, v8, softmax_scale=scale, window_size=(0, 0),
                             q_descale=ones, k_descale=ones, v_descale=ones, return_lse=True)
    qd, kd = q8.double(), k8.double()
    exact = (qd * kd).sum(-1)  # (batch, seqlen, heads)
    got = lse.transpose(1, 2).double() / scale  # (batch, seqlen, heads)
    norm = qd.norm(dim=-1) * kd.norm(dim=-1)
    absdot = (qd * kd).abs().sum(-1)
    err = (got - exact).abs()
    # cuBLAS fp8 GEMM of one head's rows: the same hardware sums
    a = q8[0, :, 0].contiguous()
    b = k8[0, :, 0].contiguous()
    one = torch.ones((), device="cuda")
    mm = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                          use_fast_accum=True).double().diagonal()
    mm_err = (mm - exact[0, :, 0]).abs()
    print(f"S precision (d={d}, outliers={outliers}): kernel |ds| max {err.max():.4g}, "
          f"max |ds|/|q||k| {(err / norm).max():.3g} (2^{torch.log2((err / norm).max()):.1f}), "
          f"max |ds|/sum|q_i k_i| {(err / absdot).max():.3g}, mean signed ds/|q||k| "
          f"{((got - exact) / norm).mean():.3g}; cuBLAS fast-accum |ds| max {mm_err.max():.4g}, "
          f"/|q||k| {(mm_err / norm[0, :, 0]).max():.3g}")


CASES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, mask
    (2, 2048, 2048, 16, 16, 128, {}),
    (2, 2048, 2048, 16, 16, 128, {"causal": True}),
    (2, 2048, 2048, 16, 4, 128, {"window_size": (256, 0)}),
    (2, 1000, 3001, 16, 4, 128, {"causal": True}),
    (4, 384, 384, 16, 16, 128, {"causal": True}),
    (2, 2048, 2048, 16, 16, 64, {}),
]


def exact_scores():
    for case in CASES:
        batch, sq, sk, hq, hkv, d, mask = case
        torch.manual_seed(1)
        q8 = torch.randint(-2, 3, (batch, sq, hq, d), device="cuda").float().to(E4M3)
        k8 = torch.randint(-2, 3, (batch, sk, hkv, d), device="cuda").float().to(E4M3)
        v8 = (torch.randn(batch, sk, hkv, d, device="cuda") * 4).to(E4M3)
        ds = [torch.full((batch, hkv), 0.5, device="cuda")] * 2 + \
             [torch.linspace(0.5, 2, batch * hkv, device="cuda").view(batch, hkv)]
        out, lse = flash_attn_func(q8, k8, v8, softmax_scale=0.1, q_descale=ds[0],
                                   k_descale=ds[1], v_descale=ds[2], return_lse=True, **mask)
        worst = []
        for b in range(batch):
            sl = slice(b, b + 1)
            args = (q8[sl], k8[sl], v8[sl], [s[sl] for s in ds])
            out64, lse64 = expected(*args, softmax_scale=0.1, **mask)[:2]
            bound, _ = p_e4m3_bound(*args, softmax_scale=0.1, **mask)
            err = (out[sl].double() - out64).abs()
            worst.append(((err / bound).max().item(), err.max().item(),
                          (lse[sl].double() - lse64).abs().max().item()))
        ratio = max(w[0] for w in worst)
        print(f"exact S {case}: out err/bound max {ratio:.3f} ({'ok' if ratio <= 1 else 'WRONG'})"
              f", out err max {max(w[1] for w in worst):.4g}, lse err max "
              f"{max(w[2] for w in worst):.3g}")


if __name__ == "__main__":
    s_precision(d=128, outliers=True)
    s_precision(d=128, outliers=False)
    s_precision(d=64, outliers=False)
    exact_scores()
