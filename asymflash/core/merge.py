"""Merging partial attention results over disjoint key sets: the semantics of
`flash_attn_combine`, split-KV decoding and the ring forward of `asymflash.distributed`.

Attention over keys K = K_1 u ... u K_n (disjoint) is a weighted mean of the attention over
each part: with lse_i the log-sum-exp of the scores of one query row against K_i and out_i
its normalised output,

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

Both are computed relative to m = max_i lse_i, so no exponential overflows and the largest
weight is exactly 1 before normalisation. A part that saw no key of the row has lse_i = -inf
and weight 0 whatever its out_i holds; a row whose every part has lse_i = -inf saw no key at
all and gets out = 0, lse = -inf (the convention of the forward kernels), never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _safe_max(lse: Tensor, dim: int) -> Tensor:
    """Max over `dim`, with 0 for rows whose every entry is -inf: exp(-inf - 0) = 0 rather
    than exp(-inf - -inf) = NaN."""
    m = lse.amax(dim)
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def _wide(t: Tensor) -> Tensor:
    """fp32, or fp64 kept as it is (gradcheck, tests of the merge itself)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def merge_partials(out_partial: Tensor, lse_partial: Tensor) -> tuple[Tensor, Tensor]:
    """Merge n partial results stacked on dim 0: out_partial (n, *rows, dv), lse_partial
    (n, *rows), natural log. Returns (out, lse): (*rows, dv) and (*rows), fp32 (fp64 for
    fp64 inputs)."""
    lse_partial = _wide(lse_partial)
    if lse_partial.shape[0] == 0:  # no part at all: every row saw nothing
        return (out_partial.new_zeros(out_partial.shape[1:], dtype=torch.float32),
                lse_partial.new_full(lse_partial.shape[1:], float("-inf")))
    m = _safe_max(lse_partial, 0)
    w = torch.exp(lse_partial - m)  # (n, *rows), in [0, 1]
    total = w.sum(0)
    empty = total == 0
    lse = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, total)))
    # a part with weight 0 may hold anything finite or not (an empty chunk's out): mask it
    # out rather than multiply, since 0 * inf and 0 * NaN are NaN
    w = w / torch.where(empty, 1.0, total)
    terms = torch.where((w > 0).unsqueeze(-1), _wide(out_partial) * w.unsqueeze(-1), 0.0)
    return terms.sum(0), lse


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one more partial result into a running (out, lse) pair, in place.

    out: fp32 (*rows, dv); lse: fp32 (*rows); block_out/block_lse the same shapes (block_out
    any float dtype). The running pair starts as out = 0, lse = -inf (nothing seen). Folding
    in a fixed order gives the same bits on every run (the ring's deterministic mode)."""
    block_lse = block_lse.float()
    m = torch.maximum(lse, block_lse)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_old + w_new
    empty = total == 0
    safe = torch.where(empty, 1.0, total)
    a, b = (w_old / safe).unsqueeze(-1), (w_new / safe).unsqueeze(-1)
    new_part = torch.where(b > 0, block_out.float() * b, 0.0)
    out.mul_(a).add_(new_part)
    lse.copy_(torch.where(empty, float("-inf"), m + torch.log(safe)))
