"""Pieces shared by the portable forward and backward kernels (triton.language only).

Everything works in log2 units: scores are multiplied by log2(e) once so the softmax uses
exp2, the instruction the hardware has (MUFU ex2), and lse is converted at the boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime.dispatch import interpreting

# Triton 3.6's interpreter multiplies bf16 tiles wrongly in tl.dot (fp16 is fine): there the
# operands are widened to fp32 first, after any rounding the kernel itself does, so the
# interpreted kernel computes what the compiled one does.
_WIDEN_DOT = tl.constexpr(interpreting())

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def dot(a, b, acc):
    """acc + a @ b with fp32 accumulation."""
    if _WIDEN_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly to +-1 for large |x| (e^{2x} -> inf or 0).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def seq_bounds(CU_Q, CU_K, USED_K, b, HAS_USED_K: tl.constexpr):
    """Start rows and lengths of sequence b in the packed q and k/v tensors."""
    q_start = tl.load(CU_Q + b)
    seqlen_q = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    if HAS_USED_K:
        seqlen_k = tl.load(USED_K + b)
    else:
        seqlen_k = tl.load(CU_K + b + 1) - k_start
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def query_tile(CU_Q, CU_K, USED_K, nheads_q, max_seqlen_q, BLOCK_M: tl.constexpr,
               HAS_USED_K: tl.constexpr):
    """The q head and first query row this program owns, and its sequence's bounds.

    Highest query blocks are launched first: under a causal mask they see the most keys
    (longest-first scheduling, so the last wave of programs is short).
    """
    pid_bh = tl.program_id(0)
    m_block = tl.cdiv(max_seqlen_q, BLOCK_M) - 1 - tl.program_id(1)
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_Q, CU_K, USED_K, pid_bh // nheads_q,
                                                      HAS_USED_K)
    return pid_bh % nheads_q, m_block * BLOCK_M, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def query_tile_operands(Q, K, V, h, group, q_start, m_lo, seqlen_q, stride_qt, stride_qh,
                        stride_kh, stride_vh, D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a query tile's program loads first: its rows, the key/dim offsets, its Q tile
    and the bases of its kv head's K and V."""
    rows = m_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(Q + h * stride_qh, q_start, rows, seqlen_q, stride_qt, offs_d, D)
    return rows, offs_n, offs_d, offs_dv, q, K + (h // group) * stride_kh, \
        V + (h // group) * stride_vh


@triton.jit
def key_block_range(m_lo, m_hi, seqlen_q, seqlen_k, window_left, window_right,
                    LEFT: tl.constexpr, RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks [lo, hi) that queries [m_lo, m_hi) may see (core.masks.key_range)."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    if LEFT:
        lo = tl.maximum(m_lo + shift - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if RIGHT:
        hi = tl.minimum(m_hi + shift + window_right, seqlen_k)
    return lo, hi


@triton.jit
def query_block_range(n_lo, n_hi, seqlen_q, seqlen_k, window_left, window_right,
                      LEFT: tl.constexpr, RIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query blocks [lo, hi) that may see keys [n_lo, n_hi) (core.masks.query_range): the
    key range of the transposed mask (queries and keys, left and right swapped)."""
    return key_block_range(n_lo, n_hi, seqlen_k, seqlen_q, window_right, window_left, RIGHT,
                           LEFT, BLOCK_M)


@triton.jit
def tile_valid(rows, cols, seqlen_q, seqlen_k, window_left, window_right,
               LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """Boolean tile: query rows[i] may attend to key cols[j] (core.masks.allowed)."""
    shift = seqlen_k - seqlen_q
    ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    if RIGHT:
        ok = ok & (cols[None, :] <= rows[:, None] + shift + window_right)
    if LEFT:
        ok = ok & (cols[None, :] >= rows[:, None] + shift - window_left)
    return ok


@triton.jit
def log2_scores(qk, softmax_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in log2 units from raw q.k; with softcap also returns tanh for the backward."""
    if SOFTCAP:
        t = tanh(qk * (softmax_scale / softcap))
        s = t * (softcap * 1.4426950408889634)
    else:
        t = qk
        s = qk * (softmax_scale * 1.4426950408889634)
    return s, t


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """Fold one block of log2-unit scores into the running row max and sum.

    Returns p = exp2(s - new max), alpha (the factor the running sum and the output
    accumulator are rescaled by), the new max and the new sum.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no allowed key yet has max -inf: shift by 0 so exp2 gives 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finish_rows(acc, m_i, l_i, SINK, sink_index, HAS_SINK: tl.constexpr):
    """Fold in the sink (one more logit in the denominator, with no value row) and normalise.

    Returns (out in fp32, lse in natural log); a row with nothing to attend to gets 0, -inf.
    """
    if HAS_SINK:
        sink = tl.load(SINK + sink_index) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    log2_l = tl.log2(tl.where(empty, 1.0, l_i))
    return acc, tl.where(empty, float("-inf"), (m_i + log2_l) * 0.6931471805599453)


@triton.jit
def load_rows(base, row0, rows, n_rows, stride_row, cols, n_cols):
    """Load a (rows, cols) tile of a (token, [head,] dim) tensor; rows past n_rows read 0."""
    ptrs = base + (row0 + rows)[:, None].to(tl.int64) * stride_row + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def store_rows(base, row0, rows, n_rows, stride_row, cols, n_cols, value):
    ptrs = base + (row0 + rows)[:, None].to(tl.int64) * stride_row + cols[None, :]
    tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
