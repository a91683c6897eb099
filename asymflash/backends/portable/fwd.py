"""Portable forward kernel: one program = one block of BLOCK_M queries of one q head.

FlashAttention-2's loop: stream K/V blocks, keep the running row max m and sum l in fp32,
rescale the accumulator when m grows, normalise once at the end. Only the key blocks the
mask allows are visited (causal and local skip the rest).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    dot,
    finish_rows,
    key_block_range,
    load_rows,
    log2_scores,
    online_softmax_step,
    query_tile,
    query_tile_operands,
    store_rows,
    tile_valid,
)


@triton.jit
def _fwd_block(state, q, k_base, v_base, k_start, cols, rows, offs_d, offs_dv, seqlen_q,
               seqlen_k, stride_kt, stride_vt, softmax_scale, softcap, window_left,
               window_right, D: tl.constexpr, DV: tl.constexpr, SOFTCAP: tl.constexpr,
               LEFT: tl.constexpr, RIGHT: tl.constexpr, MASKED: tl.constexpr):
    """Fold one key block into (acc, row max, row sum); MASKED=False for full blocks."""
    acc, m_i, l_i = state
    k = load_rows(k_base, k_start, cols, seqlen_k, stride_kt, offs_d, D)
    s, _ = log2_scores(dot(q, tl.trans(k), None), softmax_scale, softcap, SOFTCAP)
    if MASKED:
        ok = tile_valid(rows, cols, seqlen_q, seqlen_k, window_left, window_right, LEFT, RIGHT)
        s = tl.where(ok, s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
    v = load_rows(v_base, k_start, cols, seqlen_k, stride_vt, offs_dv, DV)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, LSE, SINK, CU_Q, CU_K, USED_K,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, nheads_q, group, max_seqlen_q,
    softmax_scale, softcap, window_left, window_right,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_USED_K: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr,
):
    h, m_lo, q_start, seqlen_q, k_start, seqlen_k = query_tile(
        CU_Q, CU_K, USED_K, nheads_q, max_seqlen_q, BLOCK_M, HAS_USED_K)
    if m_lo >= seqlen_q:
        return
    rows, offs_n, offs_d, offs_dv, q, k_base, v_base = query_tile_operands(
        Q, K, V, h, group, q_start, m_lo, seqlen_q, stride_qt, stride_qh, stride_kh,
        stride_vh, D, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = key_block_range(m_lo, m_lo + BLOCK_M, seqlen_q, seqlen_k, window_left,
                             window_right, LEFT, RIGHT, BLOCK_N)
    state = (acc, m_i, l_i)
    for start_n in range(lo, hi, BLOCK_N):
        state = _fwd_block(state, q, k_base, v_base, k_start, start_n + offs_n, rows,
                           offs_d, offs_dv, seqlen_q, seqlen_k, stride_kt, stride_vt,
                           softmax_scale, softcap, window_left, window_right, D, DV,
                           SOFTCAP, LEFT, RIGHT, True)
    acc, m_i, l_i = state

    acc, lse = finish_rows(acc, m_i, l_i, SINK, h, HAS_SINK)
    store_rows(Out + h * stride_oh, q_start, rows, seqlen_q, stride_ot, offs_dv, DV,
               acc.to(Out.dtype.element_ty))
    lse_ptrs = LSE + h.to(tl.int64) * stride_lse_h + q_start + rows
    tl.store(lse_ptrs, lse, mask=rows < seqlen_q)
