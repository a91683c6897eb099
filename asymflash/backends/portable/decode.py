"""Portable decode kernels: attention over a KV cache (paged or batch-indexed), split-KV.

Decode reads every cached K/V byte once per step and does little arithmetic with it, so it
is bound by memory bandwidth, and at small batch by the host time of issuing the call. The
choices that follow:

- GQA packing: the rows of a query tile are (query position, q head of the group) pairs of
  one kv head, so each K/V tile is loaded once for the whole group instead of once per q
  head (8x fewer bytes for GQA 8:1) and the tile is full even when seqlen_q is 1.
- Split-KV (flash-decoding): with few (batch, kv head) tiles the GPU would sit mostly idle,
  so each sequence's keys are cut into `num_splits` ranges processed by separate programs.
  Each writes its partial output, normalised by its own sum, and its log2-sum-exp to fp32
  scratch, then takes a ticket from a per-tile counter; the program that draws the last
  ticket merges the partials with weights exp2(lse_s - lse) and resets the counter to 0.
  One launch per call, no combine kernel and no memset.
- Append in the same launch: the new k/v of a call are read by the attention straight from
  the k/v tensors given (keys seqlens[b] .. seqlens[b] + n - 1), and one program per
  (sequence, kv head) copies them into the cache. No program reads the cache slots being
  written, so the copy needs no ordering against the attention.
- Paging: key j of sequence b lives in page page_table[b, j // page_size], row
  j % page_size; a contiguous cache is row cache_batch_idx[b] (or b), position j.

Calling convention (`decode` below): q is packed (total_q, nheads_q, d) like `core.params`,
or (batch, seqlen_q, nheads_q, d) when the cache has no cu_seqlens_q (then out has that
shape too); the cache is described by `core.params.CacheSpec`. The sink joins the denominator
once: in the kernel without splits, in the merge with them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...core.params import cdiv
from ...runtime.dispatch import interpreting
from ...runtime.launch import DirectLaunch, launch_fitting, sm_count
from . import pow2_block, unsupported_input
from .common import dot, finish_rows, key_block_range, log2_scores, online_softmax_step, tile_valid

NAME = "portable"
# kvcache.flash_attn_with_kvcache: this backend takes q as (batch, seqlen_q, nheads, d) and
# writes CacheSpec.k_new / v_new into the cache itself (in the attention launch).
KVCACHE_FUSED = True

# One query tile can hold at most this many (position, head) rows; decode needs 8 (GQA 8:1,
# seqlen_q 1), a short prefill a few hundred.
MAX_BLOCK_M = 64
MAX_SPLITS = 64
# A split must stream at least this many key blocks, or the fixed cost of a program and of
# its scratch row outweighs what it adds to the GPU's occupancy.
MIN_BLOCKS_PER_SPLIT = 4
# Programs per SM the split heuristic aims for (rounded down). H200 sweep, 128-key tiles,
# graph replay: paged caches want 2 (the page-table lookups add latency to hide; b8 4k: 8
# splits 37 us, 4 splits 41 us; b32 16k: 2 splits 268 us, none 388 us), contiguous ones 1
# (b8 4k: 4 splits 33 us, 8 splits 37 us; b32 4k: none 78 us, 2 splits 84 us).
PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM_CONTIGUOUS = 1


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
    block_m = min(MAX_BLOCK_M, pow2_block(rows))
    # H200 sweep (bf16, d 128, GQA 8:1, graph replay; block_n 32/64/128, 4/8 warps, 3/4
    # stages): 128-key tiles, 4 warps, 3 stages were best or within 2% in every case, paged
    # and contiguous, 4k-64k keys. Wide query tiles keep 64 (register pressure).
    if max(d, dv) > 128:
        block_n = 32
    else:
        block_n = 128 if block_m <= 32 else 64
    return DecodeConfig(block_m, block_n, pack, 4, 3)


def num_splits_heuristic(tiles: int, key_blocks: int, sms: int,
                         per_sm: int = PROGRAMS_PER_SM) -> int:
    """How many key ranges each (sequence, kv head, query tile) is cut into.

    `tiles` programs exist without splitting. Bandwidth needs several resident programs per
    SM to keep enough loads in flight; aim for about `per_sm` per SM, but never give
    a split fewer than MIN_BLOCKS_PER_SPLIT key blocks: past that the merge costs more than
    it gains.
    """
    if tiles <= 0 or key_blocks <= 0:
        return 1
    want = per_sm * sms // tiles
    most = max(1, key_blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


# The interpreter runs no PTX: there `e4m3_to_fp16_here` is a plain cast.
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


E4M3_TO_FP16_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.jit
def e4m3_to_fp16_here(x):
    """x (e4m3) in fp16, converted in the layout x was loaded in. As a plain cast, Triton
    moves the cast behind the tile's trip through shared memory to the MMA operand layout
    (moving 8-bit values is cheaper), and V, whose keys run down the MMA's K axis, is then
    read byte by byte (128 LDS.U8 a thread per 128-key tile at d=128, sm_90a); declared
    impure, the conversion stays here and the fp16 tile takes the transposing ldmatrix."""
    if _PTX:
        out = tl.inline_asm_elementwise(E4M3_TO_FP16_PTX, "=r,=r,r", [x], dtype=tl.float16,
                                        is_pure=False, pack=4)
    else:
        out = x.to(tl.float16)
    return out


@triton.jit
def key_operand(k, dtype: tl.constexpr):
    """A key tile as Q·Kᵀ's operand: a 16-bit cache's in q's dtype, an e4m3 cache's in
    fp16 (exact: e4m3 has 4 significant bits and exponents 2^-9 .. 2^8), cast where the
    MMA reads it (one unpack per two values)."""
    if k.dtype == tl.float8e4nv:
        out = k.to(tl.float16)
    else:
        out = k.to(dtype)
    return out


@triton.jit
def value_operand(v, dtype: tl.constexpr):
    """A value tile as P·V's operand, as `key_operand`; an e4m3 tile converted before its
    trip to the MMA layout (`e4m3_to_fp16_here`)."""
    if v.dtype == tl.float8e4nv:
        out = e4m3_to_fp16_here(v)
    else:
        out = v.to(dtype)
    return out


@triton.jit
def to_fp16_rows(q):
    """q (16-bit rows) in fp16 scaled per row by a power of two u^-1 that puts its largest
    value at 2^14 at most (bf16's 8 significant bits fit fp16's 11; the scale keeps them in
    fp16's range): q = q16 · u, exact for every element within 2^-27 of its row's largest."""
    qf = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30)
    e = tl.floor(tl.log2(16384.0 / amax))
    return (qf * tl.exp2(e)[:, None]).to(tl.float16), tl.exp2(-e)


@triton.jit
def key_pages(table_row, start_n, cols, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              mask):
    """(page, row in the page) of keys `cols` = start_n + 0..BLOCK_N-1, as int64 (start_n a
    multiple of BLOCK_N). Where pages hold whole tiles, the tile's page is one scalar read
    and its rows follow each other; where tiles hold whole pages, a key's row in its page
    is fixed by its slot in the tile; else each key works out both (mask: which keys may
    read the table)."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(table_row + start_n // PAGE_SIZE).to(tl.int64)
        in_page = (start_n % PAGE_SIZE + cols - start_n).to(tl.int64)
    elif BLOCK_N % PAGE_SIZE == 0 and mask is None:  # whole pages: rows fixed per tile slot
        offs = cols - start_n
        page = tl.load(table_row + start_n // PAGE_SIZE + offs // PAGE_SIZE).to(tl.int64)
        in_page = (offs % PAGE_SIZE).to(tl.int64)
    elif mask is None:
        page = tl.load(table_row + cols // PAGE_SIZE).to(tl.int64)
        in_page = (cols % PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(table_row + cols // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
        in_page = (cols % PAGE_SIZE).to(tl.int64)
    return page, in_page


@triton.jit
def _copy_new_rows(SRC, DST, table_row, PAGE_SIZE: tl.constexpr, dst_row, cache_len, n_new,
                   stride_st, stride_db, stride_dt,
                   W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGED: tl.constexpr):
    """Copy rows 0..n_new-1 of SRC (one kv head) to cache positions cache_len + j."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    for j0 in range(0, n_new, BLOCK_N):
        j = j0 + offs_n
        ok = j < n_new
        pos = cache_len + j
        if PAGED:
            page = tl.load(table_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            dst = page * stride_db + (pos % PAGE_SIZE).to(tl.int64) * stride_dt
        else:
            dst = dst_row * stride_db + pos.to(tl.int64) * stride_dt
        m = ok[:, None] & (offs_w[None, :] < W)
        x = tl.load(SRC + j.to(tl.int64)[:, None] * stride_st + offs_w[None, :], mask=m)
        tl.store(DST + dst[:, None] + offs_w[None, :], x, mask=m)


@triton.jit
def decode_kernel(
    Q, K, V, K_NEW, V_NEW, OUT, LSE, WORK, COUNTERS, SINK, CU_Q, SEQLENS_K, PAGE_TABLE,
    BATCH_IDX, LEFTPAD, K_DESCALE, V_DESCALE,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_nkb, stride_nkt, stride_nkh, stride_nvb, stride_nvt, stride_nvh,
    stride_ob, stride_ot, stride_oh, stride_lse_h, stride_table,
    seqlen_q_uniform, k_extra, head_tiles, heads_per_tile, group, num_m_blocks,
    work_lse_offset, softmax_scale, softcap, window_left, window_right,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN_Q: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_NEW: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr, LEFT: tl.constexpr,
    RIGHT: tl.constexpr, DESCALE_K: tl.constexpr, DESCALE_V: tl.constexpr,
):
    """One program: BLOCK_M (query position, q head) rows of sequence b, one key split.

    Axis 0 is (b, head tile): a head tile is `heads_per_tile` consecutive q heads of one kv
    head (the whole group when packing, else a single head). Row r of the tile is query
    position m0 + r // heads_per_tile of q head head0 + r % heads_per_tile.

    Keys 0 .. cache_len - 1 come from the cache; with HAS_NEW the k_extra keys after them
    come from K_NEW / V_NEW (batch, k_extra, nheads_kv, d), which the first program of each
    (sequence, kv head) also writes into the cache. HAS_LEFTPAD (contiguous caches): the
    sequence's cache starts at position LEFTPAD[b]; key j is position LEFTPAD[b] + j, and
    cache_len, seqlen_k count from there (the append still writes at SEQLENS_K[b]).
    DESCALE_K / DESCALE_V (an e4m3 cache): K_DESCALE / V_DESCALE, fp32 (batch, nheads_kv)
    contiguous, scale the scores and the output of sequence b (FA3's descales, applied here
    instead of as tensor ops around the call).
    """
    pid_bh = tl.program_id(0)
    m_block = num_m_blocks - 1 - tl.program_id(1)  # latest positions see the most keys
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = pid_bh // head_tiles
    head0 = (pid_bh % head_tiles) * heads_per_tile
    kv_head = head0 // group
    b64 = b.to(tl.int64)
    cache_len = tl.load(SEQLENS_K + b)
    seqlen_k = cache_len + k_extra
    if not HAS_NEW:
        cache_len = seqlen_k  # every key is already in the cache
    if PAGED:
        row = b64  # unused
    elif HAS_BATCH_IDX:
        row = tl.load(BATCH_IDX + b).to(tl.int64)
    else:
        row = b64
    table_row = PAGE_TABLE + b64 * stride_table

    if HAS_NEW:  # the append: once per (sequence, kv head), by a program that never exits
        if (tl.program_id(1) == 0) & (split == 0) & (head0 % group == 0):
            _copy_new_rows(K_NEW + b64 * stride_nkb + kv_head * stride_nkh,
                           K + kv_head * stride_kh, table_row, PAGE_SIZE, row, cache_len,
                           k_extra, stride_nkt, stride_kb, stride_kt, D, BLOCK_D, BLOCK_N,
                           PAGED)
            _copy_new_rows(V_NEW + b64 * stride_nvb + kv_head * stride_nvh,
                           V + kv_head * stride_vh, table_row, PAGE_SIZE, row, cache_len,
                           k_extra, stride_nvt, stride_vb, stride_vt, DV, BLOCK_DV, BLOCK_N,
                           PAGED)

    if HAS_LEFTPAD:  # the keys before the sequence's start are not its own
        left = tl.load(LEFTPAD + b)
        cache_len -= left
        seqlen_k -= left

    if VARLEN_Q:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        q_base = Q + q_start.to(tl.int64) * stride_qt
        o_base = OUT + q_start.to(tl.int64) * stride_ot
    else:
        q_start = b * seqlen_q_uniform
        seqlen_q = seqlen_q_uniform
        q_base = Q + b64 * stride_qb
        o_base = OUT + b64 * stride_ob
    if m_block * BLOCK_M >= seqlen_q * heads_per_tile:
        return
    offs_m = tl.arange(0, BLOCK_M)
    r = m_block * BLOCK_M + offs_m
    pos = r // heads_per_tile
    head = head0 + r % heads_per_tile
    row_ok = pos < seqlen_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos64 = pos.to(tl.int64)
    q = tl.load(q_base + pos64[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    # The keys any row of the tile may see, then this split's equal share of those blocks.
    pos_lo = (m_block * BLOCK_M) // heads_per_tile
    pos_hi = tl.minimum(((m_block + 1) * BLOCK_M - 1) // heads_per_tile + 1, seqlen_q)
    lo, hi = key_block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, window_left, window_right,
                             LEFT, RIGHT, BLOCK_N)
    n_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    start = lo + split * per_split * BLOCK_N
    end = tl.minimum(hi, start + per_split * BLOCK_N)
    # Blocks before `full_end` lie wholly in the cache: no key mask on their loads.
    full_end = tl.maximum(tl.minimum(end, (cache_len // BLOCK_N) * BLOCK_N), start)

    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    if not PAGED:  # one cache row per sequence: its base is fixed for the whole loop
        k_base += row * stride_kb
        v_base += row * stride_vb
        if HAS_LEFTPAD:
            k_base += left.to(tl.int64) * stride_kt
            v_base += left.to(tl.int64) * stride_vt
    d_ok = offs_d[None, :] < D
    dv_ok = offs_dv[None, :] < DV

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # An e4m3 cache meets q in fp16: q's rows scaled into fp16's range, the scores scaled
    # back (times the sequence's k descale).
    if K.dtype.element_ty == tl.float8e4nv:
        q_op, q_unscale = to_fp16_rows(q)
        q_unscale = q_unscale[:, None]
    else:
        q_op, q_unscale = q, 1.0
    nheads_kv = head_tiles * heads_per_tile // group
    if DESCALE_K:
        q_unscale = q_unscale * tl.load(K_DESCALE + b * nheads_kv + kv_head)
    if DESCALE_V:
        v_scale = tl.load(V_DESCALE + b * nheads_kv + kv_head)
    else:
        v_scale = 1.0
    for start_n in range(start, full_end, BLOCK_N):
        cols = start_n + offs_n
        if PAGED:
            page, in_page = key_pages(table_row, start_n, cols, PAGE_SIZE, BLOCK_N, None)
            k_off = page * stride_kb + in_page * stride_kt
            v_off = page * stride_vb + in_page * stride_vt
        else:
            k_off = cols.to(tl.int64) * stride_kt
            v_off = cols.to(tl.int64) * stride_vt
        if BLOCK_D == D:
            k = tl.load(k_base + k_off[:, None] + offs_d[None, :])
        else:
            k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=d_ok, other=0.0)
        s, _ = log2_scores(dot(q_op, tl.trans(key_operand(k, q.dtype)), None) * q_unscale,
                           softmax_scale, softcap, SOFTCAP)
        if LEFT or RIGHT:
            ok = tile_valid(pos, cols, seqlen_q, seqlen_k, window_left, window_right, LEFT,
                            RIGHT)
            s = tl.where(ok, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if BLOCK_DV == DV:
            v = tl.load(v_base + v_off[:, None] + offs_dv[None, :])
        else:
            v = tl.load(v_base + v_off[:, None] + offs_dv[None, :], mask=dv_ok, other=0.0)
        v = value_operand(v, q.dtype)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])

    # The last partial block of the cache and the new keys: masked, from either source.
    for start_n in tl.range(full_end, end, BLOCK_N, num_stages=1):
        cols = start_n + offs_n
        in_cache = cols < cache_len
        if PAGED:
            page, in_page = key_pages(table_row, start_n, cols, PAGE_SIZE, BLOCK_N, in_cache)
            k_off = page * stride_kb + in_page * stride_kt
            v_off = page * stride_vb + in_page * stride_vt
        else:
            k_off = cols.to(tl.int64) * stride_kt
            v_off = cols.to(tl.int64) * stride_vt
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :],
                    mask=in_cache[:, None] & d_ok, other=0.0)
        v = tl.load(v_base + v_off[:, None] + offs_dv[None, :],
                    mask=in_cache[:, None] & dv_ok, other=0.0)
        k, v = key_operand(k, q.dtype), value_operand(v, q.dtype)
        if HAS_NEW:
            is_new = (cols >= cache_len) & (cols < seqlen_k)
            j = tl.maximum(cols - cache_len, 0).to(tl.int64)
            k_new = tl.load(K_NEW + b64 * stride_nkb + kv_head * stride_nkh
                            + j[:, None] * stride_nkt + offs_d[None, :],
                            mask=is_new[:, None] & d_ok, other=0.0)
            v_new = tl.load(V_NEW + b64 * stride_nvb + kv_head * stride_nvh
                            + j[:, None] * stride_nvt + offs_dv[None, :],
                            mask=is_new[:, None] & dv_ok, other=0.0)
            k = tl.where(is_new[:, None], key_operand(k_new, q.dtype), k)
            v = tl.where(is_new[:, None], value_operand(v_new, q.dtype), v)
        s, _ = log2_scores(dot(q_op, tl.trans(k), None) * q_unscale, softmax_scale, softcap,
                           SOFTCAP)
        ok = tile_valid(pos, cols, seqlen_q, seqlen_k, window_left, window_right, LEFT, RIGHT)
        s = tl.where(ok, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])

    q_rows = (q_start + pos).to(tl.int64)
    o_ptrs = o_base + pos64[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    if SPLIT:
        # Partial result normalised by its own sum; lse in log2 units, no sink (the merge
        # adds it once). An empty split writes 0 and -inf, which the merge weighs as 0.
        # Scratch: tile-major, then split, then the tile's BLOCK_M rows (all of them).
        tile = pid_bh * num_m_blocks + tl.program_id(1)
        empty = l_i == 0.0
        part = (tile * num_splits).to(tl.int64) * BLOCK_M
        tl.store(WORK + (part + split * BLOCK_M + offs_m)[:, None] * BLOCK_DV
                 + offs_dv[None, :], acc / tl.where(empty, 1.0, l_i)[:, None])
        tl.store(WORK + work_lse_offset + part + split * BLOCK_M + offs_m,
                 tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))))
        # Every thread's stores come before the ticket (acq_rel: the last program then sees
        # them all); .cg loads below skip the SM's L1, which other programs' stores bypass.
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for s_idx in range(num_splits):
                rows = part + s_idx * BLOCK_M + offs_m
                lse_s = tl.load(WORK + work_lse_offset + rows, cache_modifier=".cg")
                o_s = tl.load(WORK + rows[:, None] * BLOCK_DV + offs_dv[None, :],
                              cache_modifier=".cg")
                m_new = tl.maximum(m_i, lse_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                w = tl.exp2(lse_s - m_safe)
                acc = acc * alpha[:, None] + w[:, None] * o_s
                l_i = l_i * alpha + w
                m_i = m_new
            acc, lse = finish_rows(acc, m_i, l_i, SINK, head, HAS_SINK)
            tl.store(o_ptrs, (acc * v_scale).to(OUT.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok)
            if WRITE_LSE:
                tl.store(LSE + head.to(tl.int64) * stride_lse_h + q_rows, lse, mask=row_ok)
            tl.atomic_xchg(COUNTERS + tile, 0)  # ready for the next call
    else:
        acc, lse = finish_rows(acc, m_i, l_i, SINK, head, HAS_SINK)
        tl.store(o_ptrs, (acc * v_scale).to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok)
        if WRITE_LSE:
            tl.store(LSE + head.to(tl.int64) * stride_lse_h + q_rows, lse, mask=row_ok)


def unsupported_decode(q, cache, params, sink):
    if cache.k.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"a {cache.k.dtype} cache beside {q.dtype} q (needs q's dtype or e4m3)"
    if cache.k.dtype != q.dtype and q.is_cuda and \
            torch.cuda.get_device_capability(q.device) < (8, 9):
        return "an e4m3 cache needs sm_89+ (Triton has no e4m3 loads before Ada)"
    return unsupported_input(q)


@functools.lru_cache(maxsize=256)
def _plan(hq, d, hkv, dv, max_seqlen_q, max_seqlen_k, batch, num_splits, sms, paged, config):
    group = hq // hkv
    cfg = select_config(max_seqlen_q, group, d, dv, config)
    heads_per_tile = group if cfg.pack_gqa else 1
    num_m = cdiv(max(max_seqlen_q * heads_per_tile, 1), cfg.block_m)
    key_blocks = cdiv(max(max_seqlen_k, 1), cfg.block_n)
    if num_splits <= 0:
        tiles = batch * (hq // heads_per_tile) * num_m
        num_splits = num_splits_heuristic(
            tiles, key_blocks, sms, PROGRAMS_PER_SM if paged else PROGRAMS_PER_SM_CONTIGUOUS)
    # Splits past the key-block count could only be empty.
    return cfg, heads_per_tile, num_m, max(1, min(num_splits, key_blocks, MAX_SPLITS))


def plan(q, cache, num_splits: int, config: DecodeConfig | None = None):
    """(config, heads_per_tile, num_m_blocks, splits) for a call; used by `decode` and the
    benchmark (which reports the split count it measured). Cached on the sizes."""
    return _plan(q.shape[-2], q.shape[-1], cache.k.shape[2], cache.v.shape[3],
                 cache.max_seqlen_q, cache.max_seqlen_k, cache.batch, num_splits,
                 sm_count(q.device), cache.page_table is not None, config)


# Split scratch and tickets, kept per (device, stream) between eager calls: the counters
# are left at 0 by every call, so only a new or larger workspace is ever allocated. Calls on
# one stream run in order, so they may share it; a call being captured into a CUDA graph
# gets buffers of its own instead (owned by the graph's pool, zeroed inside the graph).
_WORKSPACES: dict = {}


def _workspace(device: torch.device, n_work: int, n_tiles: int):
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return (torch.empty(n_work, dtype=torch.float32, device=device),
                    torch.zeros(n_tiles, dtype=torch.int32, device=device))
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    else:
        key = (None, 0)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < n_work or ws[1].numel() < n_tiles:
        old_work, old_tiles = (ws[0].numel(), ws[1].numel()) if ws is not None else (0, 0)
        ws = (torch.empty(max(n_work, old_work), dtype=torch.float32, device=device),
              torch.zeros(max(n_tiles, old_tiles), dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


# Decode calls are short: launched without Triton's per-call binding once compiled.
_DECODE = DirectLaunch(decode_kernel)


def decode(q, cache, params, sink, num_splits: int = 0, config: DecodeConfig | None = None,
           need_lse: bool = True):
    """(out, lse) for q over `cache` (a core.params.CacheSpec); num_splits 0 = heuristic.

    q is packed (total_q, hq, d), or (batch, seqlen_q, hq, d) when cache.cu_seqlens_q is
    None; out has q's layout with dv. With cache.k_new given, the kernel also appends it.
    need_lse=False skips the lse (None is returned in its place).
    """
    return DecodeRunner(q, cache, params, sink, num_splits, config, need_lse,
                        binds=False)(q, cache, sink)


def decode_runner(q, cache, params, sink, num_splits: int = 0, need_lse: bool = True):
    """A DecodeRunner for kvcache's call plans (runtime/plans.py)."""
    return DecodeRunner(q, cache, params, sink, num_splits, None, need_lse, binds=True)


def _dense_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class DecodeRunner:
    """`decode` for one call signature: what the shapes, strides and scalars decide (tiles,
    splits, grid, the kernel's integer arguments and constexprs) worked out once; a call then
    allocates, picks up its tensors and launches. After the first launch the compiled binary
    is bound (`launch.BoundLaunch`): later launches skip the specialisation key. kvcache's
    call plans keep one per signature, which fixes every integer argument below and the
    16-byte alignment of every tensor argument."""

    def __init__(self, q, cache, params, sink, num_splits, config, need_lse, binds):
        hq, d = q.shape[-2], q.shape[-1]
        hkv, dv = cache.k.shape[2], cache.v.shape[3]
        cfg, heads_per_tile, num_m, splits = plan(q, cache, num_splits, config)
        self.varlen = varlen = cache.cu_seqlens_q is not None
        self.total_q = q.shape[0] if varlen or q.dim() == 3 else q.shape[0] * q.shape[1]
        self.out_shape = (*q.shape[:-1], dv)
        self.need_lse, self.hq = need_lse, hq
        # (Each .stride(i) is a Python call: the tuples are read once.)
        qs = q.stride()
        os_ = _dense_strides(self.out_shape)
        if q.dim() == 4:
            q_strides, o_strides = qs[:3], os_[:3]
        else:  # packed: sequence b starts at row cu_seqlens_q[b], or b * max_seqlen_q
            step = 0 if varlen else cache.max_seqlen_q
            q_strides = (step * qs[0], qs[0], qs[1])
            o_strides = (step * os_[0], os_[0], os_[1])
        self.grid = (cache.batch * (hq // heads_per_tile), num_m, splits)
        block_dv = pow2_block(dv)
        self.splits = splits
        if splits > 1:
            self.n_tiles = self.grid[0] * num_m
            n_rows = self.n_tiles * splits * cfg.block_m
            self.n_work = n_rows * (block_dv + 1)
        else:
            n_rows = 0
        k_new = cache.k_new
        self.has_new = has_new = k_new is not None and cache.k_extra > 0
        new_strides = (k_new.stride()[:3] + cache.v_new.stride()[:3] if has_new
                       else (0, 0, 0, 0, 0, 0))
        kc, vc = cache.k, cache.v
        self.paged = paged = cache.page_table is not None
        mask = params.mask
        lse_stride = self.total_q if need_lse else 0  # lse is (hq, total_q), contiguous
        self.ints = (
            *q_strides, *kc.stride()[:3], *vc.stride()[:3], *new_strides, *o_strides,
            lse_stride, cache.page_table.stride(0) if paged else 0,
            cache.max_seqlen_q, cache.k_extra, hq // heads_per_tile,
            heads_per_tile, hq // hkv, num_m, n_rows * block_dv, params.softmax_scale,
            params.softcap, mask.window_left, mask.window_right)
        self.constexprs = dict(
            D=d, DV=dv, BLOCK_D=pow2_block(d), BLOCK_DV=block_dv, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, VARLEN_Q=varlen, PAGED=paged,
            # the page size a compile-time constant: the page and row of each key by shifts
            # (a runtime divisor cost ~170 instructions per 128-key tile, sm_90a)
            PAGE_SIZE=kc.shape[1] if paged else 0,
            HAS_BATCH_IDX=cache.batch_idx is not None, HAS_LEFTPAD=cache.leftpad is not None,
            HAS_NEW=has_new, SPLIT=splits > 1,
            SOFTCAP=params.softcap > 0, HAS_SINK=sink is not None, WRITE_LSE=need_lse,
            LEFT=mask.window_left >= 0, RIGHT=mask.window_right >= 0,
            DESCALE_K=cache.k_descale is not None, DESCALE_V=cache.v_descale is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.bound = None
        self.binds = binds  # kept by a call plan: bind the binary after the first launch

    def __call__(self, q, cache, sink):
        dev = q.device
        # Varlen q may hold rows that belong to no sequence; nothing writes them, so they
        # must start as "no key seen" (0 and -inf), as in the dense kernels.
        if self.varlen:
            out = torch.zeros(self.out_shape, dtype=q.dtype, device=dev)
            lse = torch.full((self.hq, self.total_q), float("-inf"), dtype=torch.float32,
                             device=dev) if self.need_lse else None
        else:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
            lse = torch.empty(self.hq, self.total_q, dtype=torch.float32, device=dev) \
                if self.need_lse else None
        if self.total_q == 0:
            return out, lse
        if self.splits > 1:
            work, counters = _workspace(dev, self.n_work, self.n_tiles)
        else:  # never touched with SPLIT off: any tensors serve as the arguments
            work = counters = out
        if self.has_new:
            k_new, v_new = cache.k_new, cache.v_new
        else:
            k_new = v_new = out
        seqlens = cache.seqlens_k
        args = (q, cache.k, cache.v, k_new, v_new, out, lse if lse is not None else out, work,
                counters, sink if sink is not None else out,
                cache.cu_seqlens_q if self.varlen else seqlens, seqlens,
                cache.page_table if self.paged else seqlens,
                cache.batch_idx if cache.batch_idx is not None else seqlens,
                cache.leftpad if cache.leftpad is not None else seqlens,
                cache.k_descale if cache.k_descale is not None else seqlens,
                cache.v_descale if cache.v_descale is not None else seqlens, *self.ints)
        bound = self.bound
        if bound is not None and bound(self.grid, args):
            return out, lse
        self.constexprs = launch_fitting(_DECODE, self.grid, args, self.constexprs)
        if self.binds:
            self.bound = _DECODE.bind(args, self.constexprs)
        return out, lse
