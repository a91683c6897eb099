"""Online softmax with conditional rescaling: the torch model of the forward loop over key blocks.

Each query row keeps a running max m (log2 units), a running sum l and an unnormalised output
O. Classic FlashAttention-2 sets m to the new row max after every key block and multiplies O
and l by 2^(m_old - m_new). FA4's observation is that m only has to be *a* reference point,
not the true max: the final out = O / l and lse = m + log2(l) are exact for any m, as long as
p = 2^(s - m) neither overflows nor loses precision. So the max is updated (and O, l
rescaled) only when it grew by more than `threshold` = 8, i.e. when p could exceed 2^8 = 256.
After the first block that rarely happens, which removes most of the FMULs on O and, in the
kernels, the synchronisation between the softmax and the correction warps.

Why p <= 2^threshold is safe:
* fp32: p <= 256 and l <= 256 * seqlen_k (< 2^40 for a million keys), far below fp32's 2^128;
  relative rounding of floating point does not depend on magnitude, so sums lose nothing.
  Small p lose nothing either: a stale m is *lower* than the true max, so p is larger, not
  closer to underflow; and the element holding the running max has p >= 1, so l >= 1.
* bf16 P (the operand of P @ V): bf16 has fp32's 8-bit exponent, so values up to 256 are as
  precise (8 mantissa bits) as values up to 1; l is summed from the fp32 p before rounding,
  exactly as with a fresh max. (fp16 would be fine too, max 65504; fp8 e4m3 tops at 448.)
* exp2 itself: arguments are s - m <= threshold, inside the polynomial's range (core/exp2.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .exp2 import emulated_mask, exp2_poly_torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
RESCALE_THRESHOLD = 8.0  # log2 units: rescale when the max grew by more than 2^8


@dataclass
class SoftmaxStats:
    """What the loop did, so tests can show that rescaling is rare.

    steps: (row, block) updates in all. rescales: updates that multiplied a non-empty O and l
    (the first block that sets a row's max needs no multiply and is not counted). p_max: the
    largest exponential computed, <= 2^threshold by construction.
    """

    steps: int = 0
    rescales: int = 0
    p_max: float = 0.0


def online_softmax(
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    block_n: int = 128,
    threshold: float = RESCALE_THRESHOLD,
    use_poly_share: float = 0.0,
    sink: torch.Tensor | None = None,
    p_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, SoftmaxStats]:
    """softmax(s) @ v computed block by block, for scores already in log2 units.

    s: (..., seqlen_q, seqlen_k) fp32, masked entries -inf. v: (..., seqlen_k, head_dim_v).
    sink: optional extra logit per row (log2 units, broadcastable to (..., seqlen_q)) that
    joins the normalisation but carries no value; it seeds the state as m = sink, l = 1, O = 0.
    use_poly_share: share of each block's columns (rule: `emulated_mask`) whose exponentials use
    the polynomial exp2; rescale factors always use exp2 (MUFU). p_dtype: precision of P in the
    P @ V product (bf16 as in the kernels, or fp32); l always sums the fp32 p.
    Returns out (fp32), lse (fp32, natural log, -inf for rows with nothing to attend to), stats.
    """
    if not 0.0 <= threshold <= 64.0:
        raise ValueError(f"online_softmax: threshold must be in [0, 64], got {threshold}")
    if block_n < 1:
        raise ValueError(f"online_softmax: block_n must be >= 1, got {block_n}")
    s = s.float()
    rows = s.shape[:-1]
    m = torch.full(rows, -math.inf, device=s.device)
    l_sum = torch.zeros(rows, device=s.device)
    o = torch.zeros(*rows, v.shape[-1], device=s.device)
    if sink is not None:
        m = torch.broadcast_to(sink.float(), rows).clone()
        l_sum = torch.where(m > -math.inf, 1.0, 0.0)
    stats = SoftmaxStats()
    poly_cols = torch.from_numpy(emulated_mask(block_n, use_poly_share)).to(s.device)
    for start in range(0, s.shape[-1], block_n):
        sb = s[..., start : start + block_n]
        vb = v[..., start : start + block_n, :].float()
        m_cand = torch.maximum(m, sb.amax(-1))
        # -inf - -inf is NaN, which compares False: a row with nothing seen yet keeps m = -inf
        grow = (m_cand - m) > threshold
        stats.steps += grow.numel()
        stats.rescales += int((grow & (m > -math.inf)).sum())
        m_new = torch.where(grow, m_cand, m)
        alpha = torch.where(grow, torch.exp2(m - m_new), 1.0)
        o = o * alpha[..., None]
        l_sum = l_sum * alpha
        # subtract 0 instead of -inf for empty rows: then every p is exp2(-inf) = 0, not NaN
        x = sb - torch.where(m_new > -math.inf, m_new, 0.0)[..., None]
        p = torch.exp2(x)
        if use_poly_share > 0.0:
            cols = poly_cols[: sb.shape[-1]]
            p[..., cols] = exp2_poly_torch(x[..., cols].contiguous())
        stats.p_max = max(stats.p_max, float(p.max()) if p.numel() else 0.0)
        l_sum = l_sum + p.sum(-1)
        o = o + (p.to(p_dtype).float() @ vb)
        m = m_new
    empty = l_sum == 0.0
    out = o / torch.where(empty, 1.0, l_sum)[..., None]
    lse = torch.where(empty, -math.inf, (m + torch.log2(l_sum)) * LN2)
    return out, lse, stats


def online_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    block_n: int = 128,
    threshold: float = RESCALE_THRESHOLD,
    use_poly_share: float = 0.0,
    p_dtype: torch.dtype = torch.float32,
    return_stats: bool = False,
):
    """Attention forward through `online_softmax`: returns (out, lse) or (out, lse, stats).

    q: (..., seqlen_q, d), k: (..., seqlen_k, d), v: (..., seqlen_k, dv), any float dtype,
    computed in fp32. Scores are s = softmax_scale * q @ k^T (default scale d^-0.5), then
    softcap * tanh(s / softcap) if softcap > 0, then masked (mask: bool, broadcastable to
    (..., seqlen_q, seqlen_k), True = attend), then converted to log2 units. sink: natural-log
    logit per row, broadcastable to (..., seqlen_q) (for one per head of (b, h, sq, d) inputs
    pass sink[:, None]); it is neither scaled nor softcapped. lse is natural log.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap > 0.0:
        s = torch.tanh(s / softcap) * softcap
    s = s * LOG2E
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    sink2 = None if sink is None else sink.float() * LOG2E
    out, lse, stats = online_softmax(
        s,
        v,
        block_n=block_n,
        threshold=threshold,
        use_poly_share=use_poly_share,
        sink=sink2,
        p_dtype=p_dtype,
    )
    return (out, lse, stats) if return_stats else (out, lse)


def sink_grad(sink, lse, d_rows):
    """d loss / d sink[h] = -sum over rows of P_sink * D (the sink carries no value); None
    without a sink (no zeros made per backward call: the eager path drops it, the custom op,
    which must return a tensor, makes the zeros itself)."""
    if sink is None:
        return None
    p_sink = torch.exp(sink.float().unsqueeze(1) - lse)
    return -(p_sink * d_rows).sum(1)
