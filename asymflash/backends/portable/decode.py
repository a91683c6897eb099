"""Portable decode kernels: attention over a KV cache (paged or batch-indexed), split-KV.

Decode reads every cached K/V byte once per step and does little arithmetic with it, so it
is bound by memory bandwidth; three choices follow from that:

- GQA packing: the rows of a query tile are (query position, q head of the group) pairs of
  one kv head, so each K/V tile is loaded once for the whole group instead of once per q
  head (8x fewer bytes for GQA 8:1) and the tile is full even when seqlen_q is 1.
- Split-KV (flash-decoding): with few (batch, kv head) tiles the GPU would sit mostly idle,
  so each sequence's keys are cut into `num_splits` ranges processed by separate programs.
  Each writes its partial output, normalised by its own sum, and its log2-sum-exp to fp32
  scratch; `combine_kernel` merges them with weights exp2(lse_s - lse).
- Paging: key j of sequence b lives in page page_table[b, j // page_size], row
  j % page_size; a contiguous cache is row cache_batch_idx[b] (or b), position j.

Calling convention (`decode` below): q is packed (total_q, nheads_q, d) like `core.params`;
the cache is described by `kvcache.CacheSpec`. The sink joins the denominator once: in the
kernel without splits, in the combine step with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...dispatch import interpreting
from . import unsupported_input
from .common import dot, finish_rows, key_block_range, log2_scores, online_softmax_step, tile_valid

NAME = "portable"

# One query tile can hold at most this many (position, head) rows; decode needs 8 (GQA 8:1,
# seqlen_q 1), a short prefill a few hundred.
MAX_BLOCK_M = 64
MAX_SPLITS = 64
# A split must stream at least this many key blocks, or the fixed cost of a program and of
# its scratch row outweighs what it adds to the GPU's occupancy.
MIN_BLOCKS_PER_SPLIT = 4


@dataclass(frozen=True)
class DecodeConfig:
    block_m: int
    block_n: int
    pack_gqa: bool
    num_warps: int
    num_stages: int


def select_config(seqlen_q: int, group: int, d: int, dv: int,
                  override: DecodeConfig | None = None) -> DecodeConfig:
    """Tile sizes for one call; `override` replaces the heuristic (tests, tuning).

    Packing pays when the packed tile (seqlen_q * group rows) is small: then one K/V load
    serves every q head of the group. For long prefills each q head fills tiles on its own
    and packing only narrows the query span a tile covers, so it is left off.
    """
    if override is not None:
        return override
    pack = group > 1 and seqlen_q * group <= 4 * MAX_BLOCK_M
    rows = seqlen_q * (group if pack else 1)
    if interpreting():  # the interpreter's cost grows with tile area: smallest legal tiles
        return DecodeConfig(16, 16, pack, 4, 1)
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    # Untuned first guess (no H200 measurement yet): 64-key tiles, 3 stages of cp.async so
    # the next tiles' loads are in flight while this one is reduced.
    block_n = 64 if max(d, dv) <= 128 else 32
    return DecodeConfig(block_m, block_n, pack, 4, 3)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter has no SMs: pretend to be an H200 so splitting is exercised


def num_splits_heuristic(tiles: int, key_blocks: int, sms: int) -> int:
    """How many key ranges each (sequence, kv head, query tile) is cut into.

    `tiles` programs exist without splitting. Bandwidth needs several resident programs per
    SM to keep enough loads in flight; aim for about 4 per SM, but never give a split fewer
    than MIN_BLOCKS_PER_SPLIT key blocks: past that the combine costs more than it gains.
    """
    if tiles <= 0 or key_blocks <= 0:
        return 1
    want = math.ceil(4 * sms / tiles)
    most = max(1, key_blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


@triton.jit
def decode_kernel(
    Q, K, V, OUT, LSE, O_PART, LSE_PART, SINK, CU_Q, SEQLENS_K, PAGE_TABLE, BATCH_IDX,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lse_h, stride_ps, stride_pt, stride_ph, stride_ls,
    stride_lh, stride_table,
    seqlen_q_uniform, k_extra, page_size, head_tiles, heads_per_tile, group, num_m_blocks,
    softmax_scale, softcap, window_left, window_right,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN_Q: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr,
):
    """One program: BLOCK_M (query position, q head) rows of sequence b, one key split.

    Axis 0 is (b, head tile): a head tile is `heads_per_tile` consecutive q heads of one kv
    head (the whole group when packing, else a single head). Row r of the tile is query
    position m0 + r // heads_per_tile of q head head0 + r % heads_per_tile.
    """
    pid_bh = tl.program_id(0)
    m_block = num_m_blocks - 1 - tl.program_id(1)  # latest positions see the most keys
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = pid_bh // head_tiles
    head0 = (pid_bh % head_tiles) * heads_per_tile
    if VARLEN_Q:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
    else:
        q_start = b * seqlen_q_uniform
        seqlen_q = seqlen_q_uniform
    # k_extra: the new tokens just appended, not yet counted in cache_seqlens
    seqlen_k = tl.load(SEQLENS_K + b) + k_extra
    if m_block * BLOCK_M >= seqlen_q * heads_per_tile:
        return
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = r // heads_per_tile
    head = head0 + r % heads_per_tile
    row_ok = pos < seqlen_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q_start + pos).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    # The keys any row of the tile may see, then this split's equal share of those blocks.
    pos_lo = (m_block * BLOCK_M) // heads_per_tile
    pos_hi = tl.minimum(((m_block + 1) * BLOCK_M - 1) // heads_per_tile + 1, seqlen_q)
    lo, hi = key_block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, window_left, window_right,
                             LEFT, RIGHT, BLOCK_N)
    n_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    start = lo + split * per_split * BLOCK_N
    end = tl.minimum(hi, start + per_split * BLOCK_N)

    kv_head = head0 // group
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    if not PAGED:  # one cache row per sequence: its base is fixed for the whole loop
        if HAS_BATCH_IDX:
            row = tl.load(BATCH_IDX + b).to(tl.int64)
        else:
            row = b.to(tl.int64)
        k_base += row * stride_kb
        v_base += row * stride_vb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < seqlen_k
        if PAGED:
            page = tl.load(PAGE_TABLE + b.to(tl.int64) * stride_table + cols // page_size,
                           mask=col_ok, other=0).to(tl.int64)
            in_page = (cols % page_size).to(tl.int64)
            k_off = page * stride_kb + in_page * stride_kt
            v_off = page * stride_vb + in_page * stride_vt
        else:
            k_off = cols.to(tl.int64) * stride_kt
            v_off = cols.to(tl.int64) * stride_vt
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :],
                    mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        s, _ = log2_scores(dot(q, tl.trans(k), None), softmax_scale, softcap, SOFTCAP)
        ok = tile_valid(pos, cols, seqlen_q, seqlen_k, window_left, window_right, LEFT, RIGHT)
        s = tl.where(ok, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v = tl.load(v_base + v_off[:, None] + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])

    if SPLIT:
        # Partial result normalised by its own sum; lse in log2 units, no sink (the combine
        # adds it once). An empty split writes 0 and -inf, which the combine weighs as 0.
        empty = l_i == 0.0
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        part = O_PART + split.to(tl.int64) * stride_ps + q_rows[:, None] * stride_pt
        tl.store(part + head[:, None] * stride_ph + offs_dv[None, :], acc,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE_PART + split.to(tl.int64) * stride_ls + head.to(tl.int64) * stride_lh
                 + q_rows, lse2, mask=row_ok)
    else:
        acc, lse = finish_rows(acc, m_i, l_i, SINK, head, HAS_SINK)
        tl.store(OUT + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + head.to(tl.int64) * stride_lse_h + q_rows, lse, mask=row_ok)


@triton.jit
def combine_kernel(
    O_PART, LSE_PART, OUT, LSE, SINK, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lh, stride_ot, stride_oh, stride_lse_h,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """out = sum_s w_s O_s with w_s = exp2(lse_s - lse), lse = log2(sum_s exp2(lse_s) [+ sink]).

    One program per (query row, q head). A split whose lse is -inf saw no key: its weight is
    0 and its partial output is not read.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(LSE_PART + offs_s * stride_ls + h * stride_lh + t,
                    mask=offs_s < num_splits, other=float("-inf"))
    if HAS_SINK:
        sink = tl.load(SINK + h) * 1.4426950408889634
    else:  # a logit of -inf adds exp2(-inf) = 0: no sink
        sink = float("-inf")
    m = tl.maximum(tl.max(lse_s, 0), sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_safe)
    total = tl.sum(w, 0) + tl.exp2(sink - m_safe)
    live = lse_s > float("-inf")
    o = tl.load(O_PART + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph
                + offs_dv[None, :], mask=live[:, None] & (offs_dv[None, :] < DV), other=0.0)
    empty = total == 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(empty, 1.0, total)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_dv, out.to(OUT.dtype.element_ty),
             mask=offs_dv < DV)
    lse = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total)))
                   * 0.6931471805599453)
    tl.store(LSE + h * stride_lse_h + t, lse)


def unsupported_decode(q, cache, params, sink):
    return unsupported_input(q)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def plan(q, cache, num_splits: int, config: DecodeConfig | None = None):
    """(config, heads_per_tile, num_m_blocks, splits) for a call; used by `decode` and the
    benchmark (which reports the split count it measured)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = cache.k.shape[2], cache.v.shape[3]
    group = hq // hkv
    cfg = select_config(cache.max_seqlen_q, group, d, dv, config)
    heads_per_tile = group if cfg.pack_gqa else 1
    num_m = triton.cdiv(max(cache.max_seqlen_q * heads_per_tile, 1), cfg.block_m)
    key_blocks = triton.cdiv(max(cache.max_seqlen_k, 1), cfg.block_n)
    if num_splits <= 0:
        tiles = cache.batch * (hq // heads_per_tile) * num_m
        num_splits = num_splits_heuristic(tiles, key_blocks, sm_count(q.device))
    # Splits past the key-block count could only be empty.
    return cfg, heads_per_tile, num_m, max(1, min(num_splits, key_blocks, MAX_SPLITS))


def decode(q, cache, params, sink, num_splits: int = 0, config: DecodeConfig | None = None):
    """(out, lse) for packed q over `cache` (a kvcache.CacheSpec); num_splits 0 = heuristic."""
    total_q, hq, d = q.shape
    hkv, dv = cache.k.shape[2], cache.v.shape[3]
    cfg, heads_per_tile, num_m, splits = plan(q, cache, num_splits, config)
    varlen = cache.cu_seqlens_q is not None
    # Varlen q may hold rows that belong to no sequence; nothing writes them, so they must
    # start as "no key seen" (0 and -inf), as in the dense kernels.
    out = (torch.zeros if varlen else torch.empty)(total_q, hq, dv, dtype=q.dtype,
                                                   device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device) \
        if varlen else torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    if splits > 1:
        o_part = torch.empty(splits, total_q, hq, dv, dtype=torch.float32, device=q.device)
        lse_part = torch.full((splits, hq, total_q), float("-inf"), dtype=torch.float32,
                              device=q.device) if varlen else \
            torch.empty(splits, hq, total_q, dtype=torch.float32, device=q.device)
    else:  # never touched with SPLIT off: any fp32 tensor serves as the argument
        o_part, lse_part = lse, lse
    sink_arg = sink if sink is not None else lse
    kc, vc = cache.k, cache.v
    paged = cache.page_table is not None
    table = cache.page_table if paged else lse
    cu_q = cache.cu_seqlens_q if varlen else cache.seqlens_k
    batch_idx = cache.batch_idx if cache.batch_idx is not None else cache.seqlens_k
    mask = params.mask
    grid = (cache.batch * (hq // heads_per_tile), num_m, splits)
    decode_kernel[grid](
        q, kc, vc, out, lse, o_part, lse_part, sink_arg, cu_q, cache.seqlens_k, table,
        batch_idx,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), out.stride(0), out.stride(1), lse.stride(0),
        o_part.stride(0), o_part.stride(1) if splits > 1 else 0,
        o_part.stride(2) if splits > 1 else 0, lse_part.stride(0),
        lse_part.stride(1) if splits > 1 else 0, table.stride(0),
        cache.max_seqlen_q, cache.k_extra, kc.shape[1], hq // heads_per_tile, heads_per_tile,
        hq // hkv, num_m, params.softmax_scale, params.softcap, mask.window_left,
        mask.window_right,
        D=d, DV=dv, BLOCK_D=_block(d), BLOCK_DV=_block(dv), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, VARLEN_Q=varlen, PAGED=paged,
        HAS_BATCH_IDX=cache.batch_idx is not None, SPLIT=splits > 1,
        SOFTCAP=params.softcap > 0, HAS_SINK=sink is not None and splits == 1,
        LEFT=mask.window_left >= 0, RIGHT=mask.window_right >= 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        combine_kernel[(total_q, hq)](
            o_part, lse_part, out, lse, sink_arg, splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
            lse_part.stride(1), out.stride(0), out.stride(1), lse.stride(0),
            DV=dv, BLOCK_DV=_block(dv), BLOCK_S=triton.next_power_of_2(splits),
            HAS_SINK=sink is not None, num_warps=4,
        )
    return out, lse
