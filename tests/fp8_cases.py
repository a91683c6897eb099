"""fp8 test inputs and checks shared by tests/unit/test_fp8.py and the interpreted kernels.

The ground truth is reference.attention_fp8_ref in fp64: attention of the dequantised
tensors. The tolerance is the FA rule of helpers.py with the same-dtype baseline computed in
bf16 on the dequantised tensors: an fp8 call may be off by what a bf16 computation of the
same values is, not by the quantisation (that is the input's, not the kernel's).
"""

from __future__ import annotations

import torch
from helpers import assert_fa_close, max_err

from asymflash.core.fp8 import dequantize, quantize
from asymflash.reference import attention_fp8_ref, attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def activations(*shape, outliers=False):
    """randn, or with outlier channels: a few head-dim channels 30x larger, in every token
    and head, as the key/query activations of real models have (what per-head scales
    handle worst: the outliers set the scale, the rest lose precision)."""
    x = torch.randn(*shape, device=DEVICE)
    if outliers:
        x[..., 1::17] *= 30.0
    return x


def fp8_inputs(batch, sq, sk, hq, hkv, d, dv, outliers=False, q_fp8=True):
    """(originals fp32 (q, k, v), fp8 (q8, k8, v8), descales (qd, kd, vd)); with q_fp8=False
    q stays bf16 (an fp8 KV cache beside 16-bit queries) and qd is None."""
    q = activations(batch, sq, hq, d, outliers=outliers)
    k = activations(batch, sk, hkv, d, outliers=outliers)
    v = activations(batch, sk, hkv, dv)
    k8, kd = quantize(k)
    v8, vd = quantize(v)
    if q_fp8:
        q8, qd = quantize(q, hkv)
    else:
        q8, qd = q.to(torch.bfloat16), None
    return (q, k, v), (q8, k8, v8), (qd, kd, vd)


def expected(q8, k8, v8, descales, **kw):
    """(out fp64, lse fp64, out of a bf16 computation of the dequantised tensors)."""
    out64, lse64 = attention_fp8_ref(q8, k8, v8, *descales, compute_dtype=torch.float64, **kw)
    deq = [dequantize(t, s).to(torch.bfloat16) for t, s in zip((q8, k8, v8), descales)]
    low, low_lse = attention_ref(*deq, upcast=False, **kw)
    return out64, lse64, low, low_lse


def assert_fp8_close(out, lse, ref):
    """out (and lse unless None) within the FA rule of expected()'s results."""
    out64, lse64, low, low_lse = ref
    assert_fa_close("out", out, out64, low, atol=1e-3)
    if lse is None:
        return
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    finite = ~torch.isinf(lse64)
    if finite.any():
        bound = 2 * max_err(low_lse[finite], lse64[finite]) + 1e-3
        assert max_err(lse[finite], lse64[finite]) <= bound


# The sm90 fp8 kernel (`api.fp8.kernel_forward`) rounds P to e4m3 for P·V, as FA3 does,
# where the bf16 computation of the FA rule rounds P to 8 bits: that rule's baseline cannot
# bound it. P is scaled by 2^8 (the row max's weight is 256) and reaches e4m3 through fp16:
# - a normal weight (>= 2^-6 scaled) is off by at most 2^-4 of itself (half a step of the
#   3-bit mantissa) plus 2^-10 (the fp16 rounding before it: double rounding);
# - a subnormal one by at most 2^-10 absolute (half of e4m3's 2^-9 spacing), i.e. 2^-18 of
#   the row sum l >= 256, whatever the running max was when it was rounded (alpha <= 1);
# - the scores themselves: the fp8 wgmma's accumulator keeps ~14 bits of mantissa
#   (DeepSeek-V3 report, H800), so |ds| <= 2^-12 scale |q| |k| (Cauchy-Schwarz, 4x margin),
#   which moves each weight by a factor exp(+-ds), and so the row sum too: a normalised
#   weight w_j = p_j / l moves by a factor within exp(+-2 e_s), and sum_j |w'_j - w_j| |v_j|
#   <= (exp(2 e_s) - 1) sum_j w_j |v_j|. Not linearised: with outlier channels the
#   measured e_s reaches ~1 (logits of several hundred, ~2^-10 of them off).
# Per element: |out - ref| <= ((1 + 2^-4 + 2^-10) exp(2 e_s) - 1) sum_j p_j |v_j| / l
#   + 2^-18 sum_j |v_j|
#   + bf16 rounding of out + 1e-3, sum_j p_j |v_j| / l being attention of |v| with the same
# weights (fp64). lse comes from the fp32 sum of unrounded P: off by at most max |ds|.
P_E4M3_REL = 2.0 ** -4 + 2.0 ** -10
P_E4M3_SUBNORMAL = 2.0 ** -18
S_ACC_REL = 2.0 ** -12


def p_e4m3_bound(q8, k8, v8, descales, softmax_scale=None, s_error=None, **kw):
    """(out bound, lse bound) for the sm90 fp8 kernel's result, as above; q8, k8, v8 BSHD,
    kw the call's mask (causal, window_size). s_error: a bound on each row's score error
    (batch, seqlen_q, heads, natural-log units) where known (0 for exactly summed scores,
    or measured on the same tensor cores: test_fp8_gpu.hw_score_error), else the 14-bit
    accumulator model above."""
    qd, kd, vd = (dequantize(t, s, dtype=torch.float64)
                  for t, s in zip((q8, k8, v8), descales))
    scale = softmax_scale or qd.shape[-1] ** -0.5
    absv, _ = attention_ref(qd, kd, vd.abs(), softmax_scale=softmax_scale,
                            compute_dtype=torch.float64, **kw)
    group = qd.shape[2] // kd.shape[2]
    if s_error is not None:
        e_s = torch.as_tensor(s_error, dtype=torch.float64, device=qd.device).expand(
            qd.shape[:3])
    else:
        # per row: |q_r| * max_j |k_j| of the row's kv head (natural-log units)
        k_norm = kd.norm(dim=-1).amax(dim=1).repeat_interleave(group, dim=1)  # (batch, heads)
        e_s = S_ACC_REL * scale * qd.norm(dim=-1) * k_norm[:, None, :]  # (batch, sq, heads)
    v_sum = vd.abs().sum(dim=1).repeat_interleave(group, dim=1)[:, None]  # every key
    weights = (1 + P_E4M3_REL) * torch.exp(2 * e_s[..., None]) - 1
    out_bound = weights * absv + P_E4M3_SUBNORMAL * v_sum + 1e-3
    return out_bound, e_s.transpose(1, 2) + 1e-4


def assert_p_e4m3_close(out, lse, ref, bound):
    """out (and lse unless None) within `p_e4m3_bound` of the fp64 reference (`expected`)."""
    out64, lse64 = ref[0], ref[1]
    out_bound, lse_bound = bound
    rounding = (out64.to(torch.bfloat16).double() - out64).abs()
    err = (out.double() - out64).abs()
    assert not torch.isnan(out).any(), "out has NaN"
    excess = (err - out_bound - 2 * rounding).max().item()
    assert excess <= 0, f"out: error beyond the e4m3 P bound by {excess:.3g}"
    # the bound is a worst case (every rounding one way): the typical error is far below it
    assert rms(out, out64) <= 0.5 * out_bound.pow(2).mean().sqrt().item()
    if lse is None:
        return
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    finite = ~torch.isinf(lse64)
    if finite.any():
        lse_err = (lse.double() - lse64).abs()[finite]
        assert (lse_err <= lse_bound[finite]).all(), f"lse: error {lse_err.max():.3g}"


def takes_fp8_kernel(q8, k8, v8, softcap=0.0, **_):
    """Whether flash_attn_func runs these inputs on the sm90 fp8 kernel (e4m3 P)."""
    from asymflash.api import fp8

    return fp8.kernel_reason(q8, k8, v8, softcap) is None


def check_fp8_result(out, lse, q8, k8, v8, descales, s_error=None, **kw):
    """out/lse of a flash_attn_func fp8 call: the e4m3-P bound where the sm90 fp8 kernel
    ran (s_error: its score error, as `p_e4m3_bound` takes it), else the FA rule of
    `assert_fp8_close`."""
    ref = expected(q8, k8, v8, descales, **kw)
    if takes_fp8_kernel(q8, k8, v8, **kw):
        assert_p_e4m3_close(out, lse, ref, p_e4m3_bound(q8, k8, v8, descales,
                                                        s_error=s_error, **kw))
    else:
        assert_fp8_close(out, lse, ref)


def rms(a, b):
    return ((a.double() - b.double()) ** 2).mean().sqrt().item()


def page(cache, page_size, perm):
    """A contiguous (batch, capacity, ...) cache as pages in the order perm (a page table)."""
    batch, cap = cache.shape[:2]
    pages = cache.reshape(batch * cap // page_size, page_size, *cache.shape[2:])
    out = torch.empty_like(pages)
    out[perm.long().flatten()] = pages
    return out
