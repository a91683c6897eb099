"""The normalised description of one attention call, shared by every backend.

The public API accepts dense BSHD tensors or packed varlen tensors; `api/dense.py` validates
them and turns both into the same packed form, so each backend implements one calling
convention:

    q: (total_q, nheads_q, head_dim)       k: (total_k, nheads_kv, head_dim)
    v: (total_k, nheads_kv, head_dim_v)    out: (total_q, nheads_q, head_dim_v)
    lse: (nheads_q, total_q) fp32, natural log

Sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and the first
seqlen_k(b) = seqused_k[b] (or cu_seqlens_k[b+1] - cu_seqlens_k[b]) rows from cu_seqlens_k[b] of
k and v. Dense inputs become cu_seqlens = arange(batch + 1) * seqlen with `uniform=True`, so a
backend may specialise on equal lengths without inspecting the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Plain Python on purpose: triton.cdiv is a constexpr
    function whose call costs ~10 us of host time, several per attention call."""
    return -(-a // b)


@dataclass(frozen=True)
class MaskSpec:
    """Which keys a query may see (semantics: `core.masks.allowed`).

    Masks are aligned to the bottom-right corner: query i of a sequence with seqlen_q queries
    and seqlen_k keys sits at key position i + seqlen_k - seqlen_q. `window_left` and
    `window_right` are -1 for unbounded; causal is stored as window_right = 0.
    """

    window_left: int = -1
    window_right: int = -1

    @property
    def causal(self) -> bool:
        return self.window_right == 0

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


@dataclass(frozen=True)
class AttnParams:
    """Scalars of one call; hashable so kernels can use it in a compile key."""

    softmax_scale: float
    mask: MaskSpec = MaskSpec()
    softcap: float = 0.0  # 0 disables; else s = softcap * tanh(s / softcap)
    deterministic: bool = False


@dataclass
class SeqInfo:
    """Where each sequence lives in the packed tensors."""

    cu_seqlens_q: torch.Tensor  # int32 (batch + 1,)
    cu_seqlens_k: torch.Tensor  # int32 (batch + 1,)
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[torch.Tensor] = None  # int32 (batch,) or None
    uniform: bool = False  # all sequences have max_seqlen_q queries and max_seqlen_k keys

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @classmethod
    def dense(cls, batch: int, seqlen_q: int, seqlen_k: int, device) -> "SeqInfo":
        key = (batch, seqlen_q, seqlen_k, str(device))
        offsets = None if torch.compiler.is_compiling() else _DENSE_OFFSETS.get(key)
        if offsets is None:
            ar = torch.arange(batch + 1, dtype=torch.int32, device=device)
            offsets = (ar * seqlen_q, ar * seqlen_k)
            if not torch.compiler.is_compiling():
                if len(_DENSE_OFFSETS) >= 64:  # a bound, not an LRU: shapes rarely vary much
                    _DENSE_OFFSETS.clear()
                _DENSE_OFFSETS[key] = offsets
        return cls(*offsets, seqlen_q, seqlen_k, None, True)


# Dense calls reuse their (never written) offset tensors: three tiny kernel launches per call
# otherwise, which at short sequence lengths cost as much host time as the attention kernel.
_DENSE_OFFSETS: dict = {}


@dataclass
class CacheSpec:
    """Where the keys of each sequence live.

    Sequence b attends to its first seqlens_k[b] + k_extra keys (k_extra: the tokens just
    appended, so no device op is spent adding them), from position leftpad[b] on if given.
    Paged (page_table given): k/v are (num_pages, page_size, nheads_kv, d) and key j is row
    j % page_size of page page_table[b, j // page_size]. Contiguous: k/v are (batch_cache,
    seqlen_cache, nheads_kv, d) and key j is k[batch_idx[b] (or b), leftpad[b] (or 0) + j].
    q is packed: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1], or b * max_seqlen_q
    onward when cu_seqlens_q is None.
    """

    k: Tensor
    v: Tensor
    seqlens_k: Tensor  # int32 (batch,)
    k_extra: int
    page_table: Tensor | None
    batch_idx: Tensor | None
    cu_seqlens_q: Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int  # the longest sequence, or an upper bound (sizes heuristics only)
    batch: int
    # The k_extra new keys/values (batch, k_extra, nheads_kv, d), for a backend that appends
    # them itself (KVCACHE_FUSED): not yet in the cache when it is called.
    k_new: Tensor | None = None
    v_new: Tensor | None = None
    # Contiguous caches: sequence b's cache starts at position leftpad[b] (int32 (batch,)):
    # its key j is position leftpad[b] + j, and it has seqlens_k[b] - leftpad[b] + k_extra.
    leftpad: Tensor | None = None
    # An e4m3 cache's descales, fp32 (batch, nheads_kv) contiguous, per sequence of q (FA3's
    # k_descale / v_descale; None: 1): the keys and values stand for cache * descale.
    k_descale: Tensor | None = None
    v_descale: Tensor | None = None


def split_unused_queries(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Tensor,
                         seqused_k: Tensor | None):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) of 2 * batch sequences computing seqused_q
    with plain varlen: sequence b becomes 2b, its first seqused_q[b] query rows with all of
    its keys, and 2b + 1, its remaining rows with no key at all. Rows that see no key give
    out = 0, lse = -inf and dq = 0 (the reference's rows with nothing to attend to), which
    is what seqused_q defines for unused rows; masks of 2b are aligned to seqused_q[b], as
    they must be. Device ops only: no value is read on the host, and every backend that
    computes varlen computes this.
    """
    starts = cu_seqlens_q[:-1]
    cu_q = torch.cat([torch.stack([starts, starts + seqused_q], 1).flatten(),
                      cu_seqlens_q[-1:]])
    cu_k = torch.cat([torch.stack([cu_seqlens_k[:-1], cu_seqlens_k[1:]], 1).flatten(),
                      cu_seqlens_k[-1:]])
    used_k = None if seqused_k is None else \
        torch.stack([seqused_k, torch.zeros_like(seqused_k)], 1).flatten()
    return cu_q, cu_k, used_k
