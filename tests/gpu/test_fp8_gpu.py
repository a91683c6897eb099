"""fp8 (e4m3) at realistic sizes on the GPU (marker `gpu`, skipped without CUDA).

Values against the fp64 reference of the dequantised tensors on slices whose answer does not
depend on the rest (single batch elements); the fp8 KV cache's decode time beside a bf16
cache of the same shape, printed (the issue's target is ~2x: half the bytes per token).
The sm90 fp8 forward kernel (`api.fp8.kernel_forward`, Hopper only) against the same
reference within the e4m3-P bound of fp8_cases.py, and its time beside the bf16 kernel's.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cases import (
    assert_fp8_close,
    assert_p_e4m3_close,
    check_fp8_result,
    expected,
    fp8_inputs,
    p_e4m3_bound,
    takes_fp8_kernel,
)
from helpers import forced

from asymflash import flash_attn_func, flash_attn_with_kvcache
from asymflash.api import fp8
from asymflash.core.fp8 import quantize
from asymflash.runtime.dispatch import backend_names

pytestmark = pytest.mark.gpu
BACKENDS = backend_names("cuda") if torch.cuda.is_available() else []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,causal", [
    ((2, 2048, 2048, 16, 16, 128, 128), False),
    ((2, 1000, 3001, 16, 4, 128, 128), True),
    ((1, 4096, 4096, 8, 1, 256, 256), True),
], ids=str)
def test_dense_realistic(backend, shape, causal):
    _, (q8, k8, v8), ds = fp8_inputs(*shape, outliers=True)
    with forced(backend):
        out, lse = flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0],
                                   k_descale=ds[1], v_descale=ds[2], return_lse=True)
        b = shape[0] - 1  # (checked under the forced backend: which path ran)
        # the fp8 kernel's scores: the error the same tensor cores give (outlier channels
        # take them past the 14-bit model, `hw_score_error`)
        s_error = hw_score_error(q8[b:], k8[b:], [d[b:] for d in ds]) if (
            backend == "sm90" and takes_fp8_kernel(q8, k8, v8)) else None
        check_fp8_result(out[b:], lse[b:], q8[b:], k8[b:], v8[b:], [d[b:] for d in ds],
                         s_error=s_error, causal=causal)


def _paged_cache(batch, tokens, hkv, d, dtype, page=64):
    pages = batch * tokens // page
    k = torch.randn(pages, page, hkv, d, device="cuda")
    v = torch.randn(pages, page, hkv, d, device="cuda")
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    if dtype != torch.float8_e4m3fn:
        return k.to(dtype), v.to(dtype), table, None, None
    # One scale for every (sequence, head), from the largest value: e4m3fn has no infinity,
    # a value past 448 casts to NaN (67M randn values reach past 5)
    kd = torch.full((batch, hkv), k.abs().max().item() / 448, device="cuda")
    vd = torch.full((batch, hkv), v.abs().max().item() / 448, device="cuda")
    return ((k / kd[0, 0]).to(dtype), (v / vd[0, 0]).to(dtype), table, kd, vd)


DECODE = dict(batch=32, hq=32, hkv=4, d=128, tokens=4096)


def _decode_case():
    c = DECODE
    lens = torch.full((c["batch"],), c["tokens"], dtype=torch.int32, device="cuda")
    q = torch.randn(c["batch"], 1, c["hq"], c["d"], device="cuda", dtype=torch.bfloat16)
    return q, lens


def test_fp8_cache_decode_values():
    q, lens = _decode_case()
    kc, vc, table, kd, vd = _paged_cache(DECODE["batch"], DECODE["tokens"], DECODE["hkv"],
                                         DECODE["d"], torch.float8_e4m3fn)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table,
                                  k_descale=kd, v_descale=vd)
    for b in (0, DECODE["batch"] - 1):
        keys = kc[table[b].long()].flatten(0, 1).unsqueeze(0)
        vals = vc[table[b].long()].flatten(0, 1).unsqueeze(0)
        assert_fp8_close(out[b:b + 1], None,
                         expected(q[b:b + 1], keys, vals, (None, kd[b:b + 1], vd[b:b + 1])))


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="e4m3 loads need sm_89+")
def test_decode_e4m3_conversion_of_every_byte():
    """The decode kernel's e4m3 -> fp16 conversion of value tiles
    (`portable.decode.e4m3_to_fp16_here`, PTX) on the GPU, every byte value against torch's
    cast, bit for bit (NaN bytes: NaN)."""
    import triton
    import triton.language as tl

    from asymflash.backends.portable.decode import e4m3_to_fp16_here

    @triton.jit
    def convert_all(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, e4m3_to_fp16_here(tl.load(X + offs)))

    x = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    y = torch.empty(256, dtype=torch.float16, device="cuda")
    convert_all[(1,)](x, y, N=256)
    want = x.to(torch.float16)
    finite = ~torch.isnan(want)
    assert torch.equal(y[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.isnan(y[~finite]).all() and (~finite).sum().item() == 2


# Timed eagerly, host time included (docs/tuning.md has the runs: 0.53x the bf16 cache's
# tokens/s on the H200 before the fp16 MMAs, 0.71x on an H100 after them, with the descales
# then still applied by tensor ops around the call); issue 43 wants >= 1.8x. Until it is not
# slower the test reports xfail with the times in its reason (gpu-check.sh shows it: -rx),
# so each run's numbers are in the log; passing is news.
@pytest.mark.timing
def test_fp8_cache_decode_is_not_slower_than_bf16():
    import triton.testing

    q, lens = _decode_case()
    c = DECODE
    kc, vc, table, kd, vd = _paged_cache(c["batch"], c["tokens"], c["hkv"], c["d"],
                                         torch.float8_e4m3fn)
    kb, vb, table_b, _, _ = _paged_cache(c["batch"], c["tokens"], c["hkv"], c["d"],
                                         torch.bfloat16)
    ms8 = triton.testing.do_bench(lambda: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd))
    ms16 = triton.testing.do_bench(lambda: flash_attn_with_kvcache(
        q, kb, vb, cache_seqlens=lens, page_table=table_b))
    gbs = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    times = (f"fp8 cache decode {c}: fp8 {ms8 * 1e3:.1f} us "
             f"({gbs(kc.nbytes + vc.nbytes, ms8):.0f} GB/s), bf16 {ms16 * 1e3:.1f} us "
             f"({gbs(kb.nbytes + vb.nbytes, ms16):.0f} GB/s): {ms16 / ms8:.2f}x tokens/s")
    print("\n" + times)
    if ms8 > 1.1 * ms16:  # an fp8 cache reads half the bytes: it must not be slower
        pytest.xfail(f"slower than the bf16 cache (issue 43): {times}")


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90_only = pytest.mark.skipif(not _sm90(), reason="the fp8 kernel is Hopper's (sm_90)")


def _scaled_inputs(batch, sq, sk, hq, hkv, d, seed=0):
    """e4m3 q, k, v whose descales differ by sequence and kv head (a mixed-up descale or
    sequence offset shows), with outlier channels; and the descales."""
    torch.manual_seed(seed)
    spread = torch.linspace(0.25, 4.0, batch * hkv, device="cuda").view(batch, 1, hkv, 1)
    q = torch.randn(batch, sq, hq, d, device="cuda")
    q = (q.view(batch, sq, hkv, hq // hkv, d) * spread[..., None]).view(batch, sq, hq, d)
    k = torch.randn(batch, sk, hkv, d, device="cuda") * spread.flip(2)
    v = torch.randn(batch, sk, hkv, d, device="cuda") * spread
    k[..., 1::17] *= 30.0  # outlier channels
    q8, qd = quantize(q, hkv)
    k8, kd = quantize(k)
    v8, vd = quantize(v)
    return (q8, k8, v8), (qd, kd, vd)


FP8_KERNEL_CASES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, mask
    (2, 2048, 2048, 16, 16, 128, {}),
    (2, 2048, 2048, 16, 16, 128, {"causal": True}),
    (2, 4096, 4096, 16, 4, 128, {}),  # GQA
    (2, 4096, 4096, 16, 4, 128, {"causal": True}),
    (2, 1000, 1000, 16, 16, 128, {"causal": True}),  # ragged last blocks, masked store
    (2, 1000, 3001, 16, 4, 128, {"causal": True}),  # bottom-right causal, 3001 % 32 != 0
    (2, 3001, 1000, 16, 4, 128, {}),
    (2, 2048, 2048, 16, 4, 128, {"window_size": (256, 0)}),
    (4, 384, 384, 16, 16, 128, {"causal": True}),  # the short-masked config (64-key blocks)
    (2, 4096, 4096, 16, 2, 64, {"causal": True}),
    (2, 2048, 2048, 16, 16, 64, {}),
    (2, 2048, 2048, 8, 8, 256, {}),  # O staged in a tile of its own
    (2, 1000, 1000, 8, 2, 256, {"causal": True}),
]


def hw_score_error(q8, k8, descales, margin=2.0):
    """Per row (batch, seqlen_q, heads_q), `margin` times the largest error of the scores
    softmax_scale·q·k (natural-log units) as cuBLAS's fp8 GEMM sums them on the same tensor
    cores (torch._scaled_mm, fast accumulation: no promotion, as the kernel's wgmma), against
    their fp64 value. Hopper's fp8 accumulation keeps fewer bits than fp32 (~14, DeepSeek-V3
    report): with outlier channels the error reaches ~2^-10 of |q|·|k|, past a fixed model's
    reach, so the bound of an fp8 kernel's scores is measured, not assumed."""
    batch, sq, hq, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    scale = d ** -0.5
    qd, kd = descales[0], descales[1]
    one = torch.ones((), device=q8.device)
    pad_q, pad_k = -sq % 16, -sk % 16
    err = torch.empty(batch, sq, hq, dtype=torch.float64, device=q8.device)
    for b in range(batch):
        for h in range(hq):
            hk = h // (hq // hkv)
            a = torch.nn.functional.pad(q8[b, :, h].view(torch.uint8), (0, 0, 0, pad_q))
            k = torch.nn.functional.pad(k8[b, :, hk].view(torch.uint8), (0, 0, 0, pad_k))
            a, k = a.view(torch.float8_e4m3fn), k.view(torch.float8_e4m3fn)
            hw = torch._scaled_mm(a, k.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                  use_fast_accum=True)[:sq, :sk].double()
            exact = q8[b, :, h].double() @ k8[b, :, hk].double().t()
            factor = scale * qd[b, hk].double() * kd[b, hk].double()
            err[b, :, h] = (hw - exact).abs().amax(dim=1) * factor
    return margin * err + 1e-6


@sm90_only
@pytest.mark.parametrize("case", FP8_KERNEL_CASES, ids=str)
def test_sm90_fp8_kernel_matches_reference(case):
    """Realistic inputs (outlier channels, descales per sequence and kv head): within the
    e4m3-P bound with the score error measured on the same tensor cores (`hw_score_error`)."""
    batch, sq, sk, hq, hkv, d, mask = case
    (q8, k8, v8), ds = _scaled_inputs(batch, sq, sk, hq, hkv, d)
    assert fp8.kernel_reason(q8, k8, v8) is None, fp8.kernel_reason(q8, k8, v8)
    out, lse = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                               return_lse=True, **mask)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    s_error = hw_score_error(q8, k8, ds)
    for b in range(batch):  # every sequence: its descales and its own Vᵀ columns
        sl = slice(b, b + 1)
        args = (q8[sl], k8[sl], v8[sl], [s[sl] for s in ds])
        assert_p_e4m3_close(out[sl], lse[sl], expected(*args, **mask),
                            p_e4m3_bound(*args, s_error=s_error[sl], **mask))


@sm90_only
@pytest.mark.parametrize("case", FP8_KERNEL_CASES, ids=str)
def test_sm90_fp8_kernel_exact_scores(case):
    """q and k small integers: every partial sum of q·k is exact in any accumulator, so the
    only error left is P's rounding to e4m3; a layout, key-order, descale or mask fault
    shows here whatever the tensor cores' accumulation precision."""
    batch, sq, sk, hq, hkv, d, mask = case
    g = torch.Generator(device="cuda").manual_seed(1)
    q8 = torch.randint(-2, 3, (batch, sq, hq, d), generator=g, device="cuda").float()
    k8 = torch.randint(-2, 3, (batch, sk, hkv, d), generator=g, device="cuda").float()
    v8 = torch.randn(batch, sk, hkv, d, generator=g, device="cuda") * 8
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q8, k8, v8))
    spread = torch.linspace(0.5, 2.0, batch * hkv, device="cuda").view(batch, hkv)
    ds = [spread * 0.5, spread.flip(1) * 0.25, spread]
    out, lse = flash_attn_func(q8, k8, v8, softmax_scale=0.3, q_descale=ds[0],
                               k_descale=ds[1], v_descale=ds[2], return_lse=True, **mask)
    for b in range(batch):
        sl = slice(b, b + 1)
        args = (q8[sl], k8[sl], v8[sl], [s[sl] for s in ds])
        assert_p_e4m3_close(out[sl], lse[sl], expected(*args, softmax_scale=0.3, **mask),
                            p_e4m3_bound(*args, softmax_scale=0.3, s_error=0.0, **mask))


@sm90_only
def test_sm90_fp8_kernel_descales_default_to_one_and_out_dtype():
    """Without descales the e4m3 values are the tensors' (here randn, so the scores stay
    moderate: raw values scaled to 448 made every row's softmax one-hot, where any two
    summation orders may pick different keys)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q8, k8, v8 = (torch.randn(1, 512, 8, 128, generator=g, device="cuda")
                  .to(torch.float8_e4m3fn) for _ in range(3))
    out = flash_attn_func(q8, k8, v8, causal=True, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    ones = [torch.ones(1, 8, device="cuda")] * 3
    assert_p_e4m3_close(out, None, expected(q8, k8, v8, [None] * 3, causal=True),
                        p_e4m3_bound(q8, k8, v8, ones, causal=True,
                                     s_error=hw_score_error(q8, k8, ones)))


@sm90_only
@pytest.mark.timing
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fp8_kernel_time(causal):
    """The issue's target: >= 1000 TFLOP/s at d=128 (printed); fp8 must beat bf16."""
    import triton.testing

    batch, seqlen, heads, d = 2, 16384, 16, 128
    (q8, k8, v8), ds = _scaled_inputs(batch, seqlen, seqlen, heads, heads, d)
    q, k, v = (t.to(torch.bfloat16) for t in (q8, k8, v8))
    run8 = lambda: flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0],  # noqa: E731
                                   k_descale=ds[1], v_descale=ds[2])
    ms8 = triton.testing.do_bench(run8)
    ms16 = triton.testing.do_bench(lambda: flash_attn_func(q, k, v, causal=causal))
    flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
    print(f"\nfp8 forward d={d} {batch}x{seqlen} {heads} heads causal={causal}: "
          f"{ms8:.3f} ms = {flops / ms8 / 1e9:.0f} TFLOP/s (incl. the Vᵀ copy); "
          f"bf16 {ms16:.3f} ms = {flops / ms16 / 1e9:.0f} TFLOP/s")
    assert ms8 < ms16
