"""Where the ring's blocks live in the tensors: dense (batch, seqlen, ...) or packed rows.

The ring's schedule (`ring.py`) asks for the queries' late half, the keys' early half (the
zigzag causal steps), one block's attention and backward, and writes into accumulators by
rows; these classes answer for either layout. Dense: tokens on dim 1 (lse: dim 2), each half
a slice. Packed (varlen): tokens on dim 0 (lse: dim 1), each sequence's local shard is its
own two halves, so a half is an index over rows, computed once per call.
"""

from __future__ import annotations

import torch

from ..api.backward import attention_backward
from ..api.dense import flash_attn_func, flash_attn_varlen_func
from ..core.merge import merge_into


class DenseRows:
    tok = 1  # q, k, v, out, dout; the accumulators (b, s, h, dv) and (b, s, h) too
    lse_tok = 2  # lse as flash_attn_func returns it: (b, h, s)

    def __init__(self, seqlen: int):
        self.half = seqlen // 2

    def take(self, t, which: str, dim: int):
        """The late (second) or early (first) half of each sequence's tokens."""
        sl = slice(self.half, None) if which == "late" else slice(None, self.half)
        return t[(slice(None),) * dim + (sl,)].contiguous()

    def merge(self, out, lse, block_out, block_lse, late: bool):
        """Fold a block's (out, lse (b, h, s)) into the accumulators, in place."""
        if late:
            out, lse = out[:, self.half:], lse[:, self.half:]
        merge_into(out, lse, block_out, block_lse.transpose(1, 2))

    def add(self, acc, grad, which):
        """acc += grad on all rows (which None) or on one half."""
        if which is None:
            acc += grad
        elif which == "late":
            acc[:, self.half:] += grad
        else:
            acc[:, :self.half] += grad

    def final_lse(self, lse):
        """(b, s, h) accumulator rows -> lse's layout (b, h, s)."""
        return lse.transpose(1, 2).contiguous()

    def lse_rows(self, lse):
        """lse (b, h, s) -> (h, b * s), the rows of the flattened batch."""
        return lse.transpose(0, 1).reshape(lse.shape[1], -1)

    def per_head(self, sink):
        return sink.float().view(1, -1, 1)

    def head_sum(self, x):
        return x.sum((0, 2))

    def attend(self, q, k, v, causal, q_half, k_half, spec):
        return flash_attn_func(q, k, v, spec.softmax_scale, causal, softcap=spec.softcap,
                               return_lse=True)

    def backward(self, dout, q, k, v, out, lse, dlse, causal, q_half, k_half, spec):
        return attention_backward(dout, q, k, v, out, lse, spec.softmax_scale, causal,
                                  softcap=spec.softcap, deterministic=spec.deterministic,
                                  dlse=dlse)


class PackedRows:
    tok = 0
    lse_tok = 1  # (h, total)

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int):
        cu = cu_seqlens.tolist()
        early, late = [], []
        for a, z in zip(cu, cu[1:]):
            mid = a + (z - a) // 2
            early.append(torch.arange(a, mid))
            late.append(torch.arange(mid, z))
        device = cu_seqlens.device
        self.idx = {"early": torch.cat(early).to(device) if early else None,
                    "late": torch.cat(late).to(device) if late else None}
        self.cu, self.max = cu_seqlens, max_seqlen
        # each local sequence has an even length here (zigzag causal), so the halves'
        # offsets are the offsets halved; otherwise they are never used
        self.cu_half, self.max_half = torch.div(cu_seqlens, 2, rounding_mode="floor"), \
            max_seqlen // 2

    def take(self, t, which: str, dim: int):
        return t.index_select(dim, self.idx[which])

    def merge(self, out, lse, block_out, block_lse, late: bool):
        if not late:
            merge_into(out, lse, block_out, block_lse.transpose(0, 1))
            return
        idx = self.idx["late"]
        o, s = out.index_select(0, idx), lse.index_select(0, idx)
        merge_into(o, s, block_out, block_lse.transpose(0, 1))
        out.index_copy_(0, idx, o)
        lse.index_copy_(0, idx, s)

    def add(self, acc, grad, which):
        if which is None:
            acc += grad
        else:  # distinct rows, each added once: the same bits on every run
            acc.index_add_(0, self.idx[which], grad.to(acc.dtype))

    def final_lse(self, lse):
        """(total, h) accumulator rows -> lse's layout (h, total)."""
        return lse.transpose(0, 1).contiguous()

    def lse_rows(self, lse):
        return lse

    def per_head(self, sink):
        return sink.float().view(-1, 1)

    def head_sum(self, x):
        return x.sum(1)

    def _offsets(self, q_half, k_half):
        cu_q, max_q = (self.cu_half, self.max_half) if q_half else (self.cu, self.max)
        cu_k, max_k = (self.cu_half, self.max_half) if k_half else (self.cu, self.max)
        return cu_q, cu_k, max_q, max_k

    def attend(self, q, k, v, causal, q_half, k_half, spec):
        return flash_attn_varlen_func(q, k, v, *self._offsets(q_half, k_half),
                                      spec.softmax_scale, causal, softcap=spec.softcap,
                                      return_lse=True)

    def backward(self, dout, q, k, v, out, lse, dlse, causal, q_half, k_half, spec):
        cu_q, cu_k, max_q, max_k = self._offsets(q_half, k_half)
        return attention_backward(dout, q, k, v, out, lse, spec.softmax_scale, causal,
                                  softcap=spec.softcap, deterministic=spec.deterministic,
                                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                  max_seqlen_k=max_k, dlse=dlse)
