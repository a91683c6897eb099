"""Which keys a query may see: the one definition of causal and local masks.

Masks are aligned to the bottom-right corner (flash-attn >= 2.1): with seqlen_q queries and
seqlen_k keys, query i sits at key position i + (seqlen_k - seqlen_q). Key j is allowed iff

    j <= i + shift + window_right   (when window_right >= 0; causal is window_right = 0)
    j >= i + shift - window_left    (when window_left >= 0)

Everything here is plain Python/torch; kernels re-derive the same bounds per tile.
"""

from __future__ import annotations

import torch

from .params import MaskSpec


def normalize_window(causal: bool, window_size) -> MaskSpec:
    """Turn the public (causal, window_size) pair into a MaskSpec (causal = right window 0)."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:  # as flash-attn: causal overrides the right window
        right = 0
    return MaskSpec(left, right)


def allowed(seqlen_q: int, seqlen_k: int, mask: MaskSpec, device=None,
            q_range=None, k_range=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) matrix: True where query i may attend to key j.

    q_range / k_range = (lo, hi) restrict it to one tile of the full matrix.
    """
    q_lo, q_hi = q_range or (0, seqlen_q)
    k_lo, k_hi = k_range or (0, seqlen_k)
    i = torch.arange(q_lo, q_hi, device=device).unsqueeze(1)
    j = torch.arange(k_lo, k_hi, device=device).unsqueeze(0)
    pos = i + (seqlen_k - seqlen_q)
    ok = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool, device=device)
    if mask.window_right >= 0:
        ok &= j <= pos + mask.window_right
    if mask.window_left >= 0:
        ok &= j >= pos - mask.window_left
    return ok


def key_range(q_lo: int, q_hi: int, seqlen_q: int, seqlen_k: int, mask: MaskSpec):
    """Keys [k_lo, k_hi) that any query in [q_lo, q_hi) may see (empty when k_lo >= k_hi)."""
    shift = seqlen_k - seqlen_q
    k_lo, k_hi = 0, seqlen_k
    if mask.window_left >= 0:
        k_lo = max(k_lo, q_lo + shift - mask.window_left)
    if mask.window_right >= 0:
        k_hi = min(k_hi, q_hi - 1 + shift + mask.window_right + 1)
    return k_lo, k_hi


def query_range(k_lo: int, k_hi: int, seqlen_q: int, seqlen_k: int, mask: MaskSpec):
    """Queries [q_lo, q_hi) that may see any key in [k_lo, k_hi) (the backward's view)."""
    shift = seqlen_k - seqlen_q
    q_lo, q_hi = 0, seqlen_q
    if mask.window_right >= 0:
        q_lo = max(q_lo, k_lo - shift - mask.window_right)
    if mask.window_left >= 0:
        q_hi = min(q_hi, k_hi - 1 - shift + mask.window_left + 1)
    return q_lo, q_hi


def tile_is_full(q_lo: int, q_hi: int, k_lo: int, k_hi: int, seqlen_q: int, seqlen_k: int,
                 mask: MaskSpec) -> bool:
    """True when every pair of the tile is allowed, so it needs no masking at all."""
    shift = seqlen_k - seqlen_q
    if mask.window_right >= 0 and k_hi - 1 > q_lo + shift + mask.window_right:
        return False
    if mask.window_left >= 0 and k_lo < q_hi - 1 + shift - mask.window_left:
        return False
    return True
