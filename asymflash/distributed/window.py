"""Sliding windows in the ring: each step's block pair cut down to what the window reaches.

A window (left, right) lets the query at global position i see the keys at positions
i - left .. i + right (-1: unbounded on that side; causal is right = 0). A rank's shard of a
sequence is one run of consecutive positions (contiguous layout) or two (zigzag: chunks r
and 2W-1-r), so a ring step's block pair is one or four chunk pairs, each a rectangle of
global positions: queries [q0, q1) by keys [k0, k1).

`cut` trims a chunk pair to the rows and keys the window reaches in it. A pair entirely
outside the window is skipped: no compute, and its rows keep lse = -inf in the merge. With
a window of w tokens and chunks of c tokens, a query chunk meets about w / c + 2 key chunks,
so a 4k window over 128k tokens computes a few chunk pairs per rank instead of all of them;
the K/V still travel every step of the ring.

The trimmed rectangle's bottom-right corner (last query, last key) always lies inside the
window, which is what lets the kernels' bottom-right aligned window express it: with
e = last key - last query (global positions), the local window is (left + e, right - e),
both >= 0 (or -1 where the global side is unbounded). So every call is a plain window the
public API accepts; no negative window reaches a kernel.

Varlen sequences have their own chunk lengths, hence their own local windows: the pieces of
one step are grouped by (query chunk, key chunk, local window) and each group is one varlen
call over the gathered rows. Within a group every sequence has at most one piece, so the
rows gathered (and scattered back with index_add_) are distinct: the same bits on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api.backward import attention_backward
from ..api.dense import flash_attn_varlen_func
from ..core.merge import merge_into


def runs(rank: int, n: int, world: int, zigzag: bool):
    """(local start, length, global start) of each run of consecutive positions in rank
    `rank`'s shard of a sequence with n local tokens."""
    if zigzag and world > 1:
        c = n // 2
        return ((0, c, rank * c), (c, c, (2 * world - 1 - rank) * c))
    return ((0, n, rank * n),)


def cut(left: int, right: int, q0: int, q1: int, k0: int, k1: int):
    """The part of the chunk pair (queries [q0, q1), keys [k0, k1), global positions) that
    the window reaches: (qa, qb, ka, kb, local window) or None when it reaches nothing."""
    ka = k0 if left < 0 else max(k0, q0 - left)
    kb = k1 if right < 0 else min(k1, q1 + right)
    if ka >= kb:
        return None
    qa = q0 if right < 0 else max(q0, ka - right)  # the first query that sees key ka
    qb = q1 if left < 0 else min(q1, kb + left)  # one past the last that sees key kb - 1
    if qa >= qb:
        return None
    e = kb - qb  # last key - last query
    return qa, qb, ka, kb, (-1 if left < 0 else left + e, -1 if right < 0 else right - e)


@dataclass
class Group:
    """One varlen call of a step: rows of the local q, rows of the held k/v, offsets, window."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: tuple


def _group(pieces, window, device) -> Group:
    """pieces: (q row start, q row end, k row start, k row end) in local rows."""
    def index(spans):
        return torch.cat([torch.arange(a, z) for a, z in spans]).to(device)

    def offsets(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)

    q_lens = [z - a for a, z, _, _ in pieces]
    k_lens = [z - a for _, _, a, z in pieces]
    return Group(index([(a, z) for a, z, _, _ in pieces]),
                 index([(a, z) for _, _, a, z in pieces]),
                 offsets(q_lens), offsets(k_lens), max(q_lens), max(k_lens), window)


class WindowPlan:
    """The groups each ring step computes on this rank, made once per call.

    segments: (first row, local length) of each sequence in the packed rows (a dense batch:
    one per batch entry); the same on every rank."""

    def __init__(self, left: int, right: int, segments, rank: int, world: int, zigzag: bool,
                 device):
        self.left, self.right = left, right
        self.steps = [self._step((rank - s) % world, segments, rank, world, zigzag, device)
                      for s in range(world)]

    def _step(self, src, segments, rank, world, zigzag, device):
        found = {}  # (query run, key run, local window) -> pieces, in a fixed order
        for start, n in segments:
            q_runs, k_runs = runs(rank, n, world, zigzag), runs(src, n, world, zigzag)
            for i, (qs, qn, qg) in enumerate(q_runs):
                for j, (ks, kn, kg) in enumerate(k_runs):
                    part = cut(self.left, self.right, qg, qg + qn, kg, kg + kn)
                    if part is None:
                        continue
                    qa, qb, ka, kb, window = part
                    found.setdefault((i, j, window), []).append(
                        (start + qs + qa - qg, start + qs + qb - qg,
                         start + ks + ka - kg, start + ks + kb - kg))
        return [_group(p, key[2], device) for key, p in found.items()]

    def forward(self, step, q, k, v, out, lse, spec):
        """Fold this step's groups into the (rows, h, dv) / (rows, h) accumulators."""
        for g in self.steps[step]:
            ob, lb = flash_attn_varlen_func(
                q.index_select(0, g.q_idx), k.index_select(0, g.k_idx),
                v.index_select(0, g.k_idx), g.cu_q, g.cu_k, g.max_q, g.max_k,
                spec.softmax_scale, False, window_size=g.window, softcap=spec.softcap,
                return_lse=True)
            o, s = out.index_select(0, g.q_idx), lse.index_select(0, g.q_idx)
            merge_into(o, s, ob, lb.transpose(0, 1))
            out.index_copy_(0, g.q_idx, o)
            lse.index_copy_(0, g.q_idx, s)

    def backward(self, step, dout, q, k, v, out, lse, dlse, spec):
        """This step's gradient pieces (q rows, k rows, dq, dk, dv); lse/dlse (h, rows)."""
        grads = []
        for g in self.steps[step]:
            rows = [t.index_select(0, g.q_idx) for t in (dout, q, out)]
            lse_g, dlse_g = (None if t is None else t.index_select(1, g.q_idx)
                             for t in (lse, dlse))
            d = attention_backward(
                rows[0], rows[1], k.index_select(0, g.k_idx), v.index_select(0, g.k_idx),
                rows[2], lse_g, spec.softmax_scale, False, g.window, spec.softcap,
                spec.deterministic, cu_seqlens_q=g.cu_q, cu_seqlens_k=g.cu_k,
                max_seqlen_q=g.max_q, max_seqlen_k=g.max_k, dlse=dlse_g)
            grads.append((g.q_idx, g.k_idx, *d))
        return grads


def add_grads(grads, dq, dk, dv):
    """Scatter a step's pieces into the (rows, h, d) fp32 accumulators."""
    for q_idx, k_idx, gq, gk, gv in grads:
        dq.index_add_(0, q_idx, gq.to(dq.dtype))
        dk.index_add_(0, k_idx, gk.to(dk.dtype))
        dv.index_add_(0, k_idx, gv.to(dv.dtype))
