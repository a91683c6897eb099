"""Hopper decode: a few query rows over a KV cache, the cache streamed by TMA (issue 6).

Decode reads every cached K/V byte once and does little arithmetic with it, so its speed is
the bandwidth it draws from HBM. The portable kernel (`backends/portable/decode.py`) loads
each block with per-thread copies; at batch 8 x 4k keys it reached 57-63 % of the copy
bandwidth per call (H200, session 8), the key loop of a program taking 20-24 us for what
the HBM delivers in ~15. Here one thread asks the TMA unit for whole K and V blocks,
`STAGES` blocks ahead in a shared-memory ring, from the program's first instructions: the
warps only wait for blocks and compute. The hypothesis was that the per-thread loads limited
the bytes in flight; on the H200 this kernel tied the portable one (`decode_enabled`), and
its timeline (`scripts/decode-timeline.py`) showed why: the memory system's ramp when every
SM starts at once, the splits finishing apart, and the merge. So it is off by default, kept
as the base for those (and tested: tests/test_sm90_decode.py).

Everything else follows the portable kernel, whose comments give the reasons:
- GQA packing: the rows of the one 64-row tile are (query position, q head) pairs of one kv
  head, so seqlen_q * group <= 64 (decode: 1 x 8 for GQA 8:1).
- Split-KV with a last-ticket merge in the same launch (partials and tickets in the portable
  kernel's workspace), num_splits 0 = the portable heuristic at one program per SM.
- The append in the same launch: the first split of each (sequence, kv head) copies the new
  rows into the cache; the attention reads them from k/v themselves. TMA reads only whole
  blocks below the cache length, so nothing reads a slot being written.
- The tail (the block holding the cache's end, and the new keys) is loaded by the threads,
  masked, and stored into a ring slot for the same MMAs.

One warpgroup per program, no warp specialisation: S = Q·Kᵀ and O += P·V are wgmmas over a
64-row tile of which decode uses 8 rows; at 64 KB per 128-key block (d=128) an SM receives a
block every ~2 us at full HBM speed and computes it in ~0.7, so the MMAs hide under the
loads and the wasted rows cost nothing measurable (checked on the H200: NOTES).

Covered (the rest goes to the portable kernel through `unsupported_decode`): fp16/bf16,
d = dv in (64, 128), q (batch, seqlen_q, heads, d) with seqlen_q * group <= 64, caches whose
(heads, dim) rows are dense and whose slots are evenly strided (any contiguous cache), pages
of 64 or a multiple of 128 keys, masks, softcap, sink, leftpad, batch_idx, lse.
"""

from __future__ import annotations

import functools
import os

import torch

from ...core.params import cdiv
from ...runtime.launch import DirectLaunch, sm_count
from ..portable.decode import _workspace, num_splits_heuristic
from . import fwd as _fwd
from .fwd import _GLUON_ERROR

if _GLUON_ERROR is None:  # fwd tried the import: Gluon is optional
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

NAME = "sm90"
# kvcache.flash_attn_with_kvcache: q stays (batch, seqlen_q, heads, d), the append is ours.
KVCACHE_FUSED = True
SWITCH = "ASYMFLASH_SM90_DECODE"
ROWS = 64  # one wgmma tile of (position, q head) rows
HEAD_DIMS = (64, 128)
# Shared memory for the K/V ring (the 64-row Q tile comes on top): 192 KB, 3 stages of
# 128-key blocks at d=128.
RING_BYTES = 192 * 1024
MAX_STAGES = 8


def decode_enabled() -> bool:
    """Off unless ASYMFLASH_SM90_DECODE=1: on the H200 it matched the portable kernel, not
    beaten it (2026-11-30, scripts/decode-bench.py, graph replay µs, sm90 vs portable: paged
    b8 4k 36.0 vs 36.5, 16k 87.8 vs 85.9, b32 4k 82.7 vs 83.9; contiguous b8 4k 35.2 vs
    33.0, 16k 83.9 vs 81.1, b32 alike): the per-thread loads were not what held decode at
    batch 8 back (benchmarks/NOTES.md)."""
    if _ENV_DATA is not None:  # every decode call asks: CPython's dict, ~0.1 us
        return _ENV_DATA.get(_SWITCH_KEY) == b"1"
    return os.environ.get(SWITCH) == "1"


_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_SWITCH_KEY = os.fsencode(SWITCH)


def block_n(paged_page_size: int | None) -> int:
    """Keys per block: 128, or a 64-key page (a block must lie within one page)."""
    return 64 if paged_page_size == 64 else 128


def stages(d: int, block: int) -> int:
    return min(MAX_STAGES, RING_BYTES // (2 * block * d * 2))


if _GLUON_ERROR is None:

    # The accumulator layouts of one warpgroup's 64-row wgmma tile are the forward's: S
    # (_fwd._s_layout), O (_fwd._o_layout), P as P·V's register operand (_fwd._p_layout).

    @gluon.constexpr_function
    def _rows_layout(width):
        """Threads along a row 8 elements (16 bytes) at a time: coalesced row loads."""
        cols = min(32, int(width) // 8)
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // cols, cols],
                                warps_per_cta=[4, 1], order=[1, 0])

    @gluon.jit
    def _issue_block(k_desc, v_desc, k_smem, v_smem, ready, slot, row, kv_col):
        """TMA-load K and V rows [row, row + BLOCK_N) of one kv head into ring slot `slot`."""
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        row = row.to(gl.int32)  # TMA coordinates (the host keeps the rows below 2^31)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], bar, k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], bar, v_smem.index(slot))

    @gluon.jit
    def _block_row(n0, table_row, page_size, row_base, PAGED: gl.constexpr):
        """The cache row (of the (slots, heads * dim) view) of key n0 of the sequence."""
        if PAGED:
            page = gl.load(table_row + n0 // page_size)
            return page * page_size + n0 % page_size
        else:
            return row_base + n0

    @gluon.jit
    def _attend(s, acc, m_i, l_i, n0, p_dtype: gl.constexpr, v_tile, seqlen_k, shift, group,
                qk_scale, softcap_pre, window_left, window_right, BLOCK_N: gl.constexpr,
                D: gl.constexpr, MASK_END: gl.constexpr, SOFTCAP: gl.constexpr,
                LEFT: gl.constexpr, RIGHT: gl.constexpr):
        """One key block: scores s = q·k (fp32, 64 x BLOCK_N) into the running softmax, then
        acc += P·V with V from shared memory."""
        s_layout: gl.constexpr = _fwd._s_layout(BLOCK_N)
        o_layout: gl.constexpr = _fwd._o_layout(D)
        if SOFTCAP:
            s = _fwd._tanh(s * softcap_pre) * qk_scale
        else:
            s = s * qk_scale
        if MASK_END or LEFT or RIGHT:
            cols = gl.expand_dims(
                n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
            pos = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)) // group,
                                 1)
            ok = cols < seqlen_k
            if RIGHT:
                ok = ok & (cols <= pos + shift + window_right)
            if LEFT:
                ok = ok & (cols >= pos + shift - window_left)
            s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(_fwd._to_16bit(p, p_dtype), _fwd._p_layout(D))
        tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=[tok, p_op])
        return acc, m_new, l_i

    @gluon.jit
    def _copy_new_rows(src, s_stride_t, k_ptr, table_row, page_size, row_base, kv_col,
                       stride_row, cache_len, n_new, D: gl.constexpr, BLOCK_N: gl.constexpr,
                       PAGED: gl.constexpr):
        """Write rows 0..n_new-1 of src (one kv head) at cache positions cache_len + j."""
        layout: gl.constexpr = _rows_layout(D)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        offs_d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, layout)), 0)
        for j0 in range(0, n_new, BLOCK_N):
            j = j0 + offs_n
            ok = j < n_new
            pos = cache_len + j
            if PAGED:
                page = gl.load(table_row + pos // page_size, mask=ok, other=0).to(gl.int64)
                row = page * page_size + pos % page_size
            else:
                row = row_base + pos
            m = gl.expand_dims(ok, 1)
            x = gl.load(src + gl.expand_dims(j.to(gl.int64) * s_stride_t, 1) + offs_d, mask=m)
            gl.store(k_ptr + gl.expand_dims(row * stride_row + kv_col, 1) + offs_d, x, mask=m)

    @gluon.jit
    def _tail_tile(dst, ptr, new_ptr, new_stride_t, table_row, page_size, row_base, kv_col,
                   stride_row, n0, cache_len, seqlen_k, D: gl.constexpr,
                   BLOCK_N: gl.constexpr, PAGED: gl.constexpr, HAS_NEW: gl.constexpr):
        """Store keys n0 .. n0 + BLOCK_N - 1 into dst, loaded by the threads: from the cache
        below cache_len, from the new rows up to seqlen_k, zeros past it (an unwritten cache
        slot may hold NaN, and 0 x NaN would reach the output). 32 rows at a time: a whole
        block in registers spills (sm_90a, d=128: 769 local-memory instructions)."""
        layout: gl.constexpr = _rows_layout(D)
        CHUNK: gl.constexpr = 32
        offs_d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, layout)), 0)
        for c in gl.static_range(BLOCK_N // CHUNK):
            keys = n0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            in_cache = keys < cache_len
            if PAGED:
                page = gl.load(table_row + keys // page_size, mask=in_cache,
                               other=0).to(gl.int64)
                row = page * page_size + keys % page_size
            else:
                row = row_base + keys
            x = gl.load(ptr + gl.expand_dims(row * stride_row + kv_col, 1) + offs_d,
                        mask=gl.expand_dims(in_cache, 1), other=0.0)
            if HAS_NEW:
                is_new = (keys >= cache_len) & (keys < seqlen_k)
                j = gl.maximum(keys - cache_len, 0).to(gl.int64)
                y = gl.load(new_ptr + gl.expand_dims(j * new_stride_t, 1) + offs_d,
                            mask=gl.expand_dims(is_new, 1), other=0.0)
                x = gl.where(gl.expand_dims(is_new, 1), y, x)
            dst.slice(c * CHUNK, CHUNK).store(x)

    @gluon.jit
    def _stamp(stamps_ptr, k: gl.constexpr, after, TIMELINE: gl.constexpr):
        """TIMELINE (scripts/decode-timeline.py): %globaltimer (ns, one clock for all SMs)
        at point k of this program, read after `after` (an int32 it orders behind)."""
        if TIMELINE:
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after],
                                          dtype=gl.int64, is_pure=False, pack=1)
            prog = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
            gl.store(stamps_ptr + prog * 8 + k, t)

    @gluon.jit
    def _finish(acc, m_i, l_i, sink_ptr, heads, HAS_SINK: gl.constexpr):
        """Fold in the sink, normalise: (out fp32, lse natural log); empty rows 0, -inf."""
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads) * 1.4426950408889634
            m_new = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.exp2(sink - m_new)
            acc = acc * gl.expand_dims(alpha, 1)
            m_i = m_new
        empty = l_i == 0.0
        acc = acc / gl.expand_dims(gl.where(empty, 1.0, l_i), 1)
        lse = gl.where(empty, float("-inf"),
                       (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        return acc, lse

    @gluon.jit
    def _decode_kernel(
            q_ptr, k_desc, v_desc, k_ptr, v_ptr, k_new_ptr, v_new_ptr, out_ptr, lse_ptr,
            work_ptr, counters_ptr, sink_ptr, seqlens_ptr, table_ptr, batch_idx_ptr,
            leftpad_ptr, stride_qb, stride_qt, stride_qh, stride_k_row, stride_v_row,
            stride_nkb, stride_nkt, stride_nkh, stride_nvb, stride_nvt, stride_nvh,
            stride_ob, stride_ot, stride_oh, stride_lse_h, stride_table, seqlen_q, k_extra,
            page_size, n_kv_heads, group, work_lse_offset, qk_scale, softcap_pre,
            window_left, window_right, stamps_ptr, D: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, PAGED: gl.constexpr, HAS_BATCH_IDX: gl.constexpr,
            HAS_LEFTPAD: gl.constexpr, HAS_NEW: gl.constexpr, SPLIT: gl.constexpr,
            SOFTCAP: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
            LEFT: gl.constexpr, RIGHT: gl.constexpr, TIMELINE: gl.constexpr):
        """Program (b·n_kv_heads + kv head, split): the tile's rows over one key range.

        Contiguous caches: row_base = (cache row)·page_size + leftpad, page_size being the
        cache's slots per sequence; paged: key j is row page·page_size + j % page_size of
        page table_row[j // page_size]. Rows of the (slots, heads·dim) view."""
        dtype: gl.constexpr = k_desc.dtype
        s_layout: gl.constexpr = _fwd._s_layout(BLOCK_N)
        o_layout: gl.constexpr = _fwd._o_layout(D)
        ld_layout: gl.constexpr = _rows_layout(D)
        pid = gl.program_id(0)
        split = gl.program_id(1)
        num_splits = gl.num_programs(1)
        _stamp(stamps_ptr, 0, pid, TIMELINE)  # 0 start
        b = pid // n_kv_heads
        kv_head = pid % n_kv_heads
        b64 = b.to(gl.int64)
        kv_col = kv_head * D
        cache_len = gl.load(seqlens_ptr + b)
        seqlen_k = cache_len + k_extra
        if not HAS_NEW:
            cache_len = seqlen_k  # every key is already in the cache
        table_row = table_ptr + b64 * stride_table
        if PAGED:
            row_base = b64 * 0
        elif HAS_BATCH_IDX:
            row_base = gl.load(batch_idx_ptr + b).to(gl.int64) * page_size
        else:
            row_base = b64 * page_size

        if HAS_NEW:  # the append, once per (sequence, kv head)
            if split == 0:
                _copy_new_rows(k_new_ptr + b64 * stride_nkb + kv_head * stride_nkh,
                               stride_nkt, k_ptr, table_row, page_size, row_base, kv_col,
                               stride_k_row, cache_len, k_extra, D, BLOCK_N, PAGED)
                _copy_new_rows(v_new_ptr + b64 * stride_nvb + kv_head * stride_nvh,
                               stride_nvt, v_ptr, table_row, page_size, row_base, kv_col,
                               stride_v_row, cache_len, k_extra, D, BLOCK_N, PAGED)
        if HAS_LEFTPAD:  # the slots before the sequence's start are not its keys
            left = gl.load(leftpad_ptr + b)
            cache_len -= left
            seqlen_k -= left
            row_base += left.to(gl.int64)

        # The keys any row may see, then this split's equal share of their blocks.
        shift = seqlen_k - seqlen_q
        lo = 0
        hi = seqlen_k
        if LEFT:
            lo = gl.maximum(shift - window_left, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        if RIGHT:
            hi = gl.minimum(seqlen_q + shift + window_right, seqlen_k)
        n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        per_split = gl.cdiv(n_blocks, num_splits)
        start = lo + split * per_split * BLOCK_N
        end = gl.minimum(hi, start + per_split * BLOCK_N)
        # Whole blocks below the cache length come by TMA; the rest through the threads.
        full_end = gl.maximum(gl.minimum(end, (cache_len // BLOCK_N) * BLOCK_N), start)
        n_full = (full_end - start) // BLOCK_N

        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [64, D], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
        fence_async_shared()
        # The ring fills first: the loads are in flight while Q is gathered.
        for i in gl.static_range(STAGES):
            if i < n_full:
                n0 = start + i * BLOCK_N
                _issue_block(k_desc, v_desc, k_smem, v_smem, ready, i,
                             _block_row(n0, table_row, page_size, row_base, PAGED), kv_col)

        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_layout))
        offs_d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout)), 0)
        row_ok = gl.expand_dims(rows < seqlen_q * group, 1)
        q_rows = gl.expand_dims((rows // group).to(gl.int64) * stride_qt
                                + (kv_head * group + rows % group) * stride_qh, 1)
        q = gl.load(q_ptr + b64 * stride_qb + q_rows + offs_d, mask=row_ok, other=0.0)
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()

        _stamp(stamps_ptr, 1, n_full, TIMELINE)  # 1 Q in shared memory, the ring's loads out
        if TIMELINE:
            gl.store(stamps_ptr + (pid * num_splits + split) * 8 + 7, n_full.to(gl.int64))
        m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([64, D], gl.float32, o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        for i in range(n_full):
            slot = i % STAGES
            # The page of the block this slot takes next, looked up now (its latency hides
            # under this block's MMAs).
            nxt = start + (i + STAGES) * BLOCK_N
            more = i + STAGES < n_full
            if PAGED:
                nxt_page = gl.load(table_row + nxt // page_size, mask=more, other=0)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if TIMELINE:
                if i == 0:
                    _stamp(stamps_ptr, 2, i, TIMELINE)  # 2 the first block has landed
            tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero,
                                use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[tok])
            acc, m_i, l_i = _attend(s, acc, m_i, l_i, start + i * BLOCK_N, dtype,
                                    v_smem.index(slot), seqlen_k, shift, group, qk_scale,
                                    softcap_pre, window_left, window_right, BLOCK_N, D, False,
                                    SOFTCAP, LEFT, RIGHT)
            gl.thread_barrier()  # every warp's MMAs have read the slot
            if more:
                if PAGED:
                    nxt_row = nxt_page * page_size + nxt % page_size
                else:
                    nxt_row = row_base + nxt
                _issue_block(k_desc, v_desc, k_smem, v_smem, ready, slot, nxt_row, kv_col)

        _stamp(stamps_ptr, 3, n_full, TIMELINE)  # 3 the TMA blocks done
        # The tail: the cache's last partial block and the new keys, through slot 0 (free:
        # every TMA load has landed and been read).
        for n0 in range(full_end, end, BLOCK_N):
            _tail_tile(k_smem.index(0), k_ptr, k_new_ptr + b64 * stride_nkb
                       + kv_head * stride_nkh, stride_nkt, table_row, page_size, row_base,
                       kv_col, stride_k_row, n0, cache_len, seqlen_k, D, BLOCK_N, PAGED,
                       HAS_NEW)
            _tail_tile(v_smem.index(0), v_ptr, v_new_ptr + b64 * stride_nvb
                       + kv_head * stride_nvh, stride_nvt, table_row, page_size, row_base,
                       kv_col, stride_v_row, n0, cache_len, seqlen_k, D, BLOCK_N, PAGED,
                       HAS_NEW)
            fence_async_shared()
            gl.thread_barrier()
            tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero,
                                use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[tok])
            acc, m_i, l_i = _attend(s, acc, m_i, l_i, n0, dtype, v_smem.index(0), seqlen_k,
                                    shift, group, qk_scale, softcap_pre, window_left,
                                    window_right, BLOCK_N, D, True, SOFTCAP, LEFT, RIGHT)
            gl.thread_barrier()  # the next tail block overwrites the slot

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
        _stamp(stamps_ptr, 4, n_full, TIMELINE)  # 4 the tail done

        # Epilogue, in the accumulator's layout: rows r = (position r // group, head ...).
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        r_o = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        c_o = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)), 0)
        pos_o = r_o // group
        heads_o = kv_head * group + r_o % group
        ok_o = r_o < seqlen_q * group
        o_ptrs = out_ptr + b64 * stride_ob + gl.expand_dims(
            pos_o.to(gl.int64) * stride_ot + heads_o * stride_oh, 1) + c_o
        lse_ptrs = lse_ptr + heads_o.to(gl.int64) * stride_lse_h + b64 * seqlen_q + pos_o
        if SPLIT:
            # Partial result normalised by its own sum, its lse in log2 units, no sink (the
            # merge adds it once); an empty split writes 0 and -inf. Scratch rows: tile, then
            # split, then the tile's 64 rows.
            empty = l_o == 0.0
            part = (pid * num_splits).to(gl.int64) * 64
            mine = gl.expand_dims(part + split * 64 + r_o, 1)
            gl.store(work_ptr + mine * D + c_o,
                     acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 1),
                     mask=gl.expand_dims(ok_o, 1))
            gl.store(work_ptr + work_lse_offset + part + split * 64 + r_o,
                     gl.where(empty, float("-inf"), m_o + gl.log2(gl.where(empty, 1.0, l_o))),
                     mask=ok_o)
            # Every thread's stores before the ticket (acq_rel: the last program sees them
            # all); the merge's .cg loads skip L1, which other SMs' stores never reach.
            gl.thread_barrier()
            ticket = gl.atomic_add(counters_ptr + pid, 1, sem="acq_rel", scope="gpu")
            _stamp(stamps_ptr, 5, ticket, TIMELINE)  # 5 partial stored, ticket drawn
            if ticket == num_splits - 1:
                r_m = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_layout))
                ok_m = r_m < seqlen_q * group
                m_m = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, ld_layout))
                l_m = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld_layout))
                o_m = gl.zeros([64, D], gl.float32, ld_layout)
                for sp in range(num_splits):
                    rows_s = part + sp * 64 + r_m
                    lse_s = gl.load(work_ptr + work_lse_offset + rows_s, mask=ok_m,
                                    other=float("-inf"), cache_modifier=".cg")
                    o_s = gl.load(work_ptr + gl.expand_dims(rows_s, 1) * D + offs_d,
                                  mask=gl.expand_dims(ok_m, 1), other=0.0,
                                  cache_modifier=".cg")
                    m_up = gl.maximum(m_m, lse_s)
                    m_safe = gl.where(m_up == float("-inf"), 0.0, m_up)
                    a_m = gl.exp2(m_m - m_safe)
                    w = gl.exp2(lse_s - m_safe)
                    o_m = o_m * gl.expand_dims(a_m, 1) + gl.expand_dims(w, 1) * o_s
                    l_m = l_m * a_m + w
                    m_m = m_up
                heads_m = kv_head * group + r_m % group
                pos_m = r_m // group
                o_m, lse_m = _finish(o_m, m_m, l_m, sink_ptr, heads_m, HAS_SINK)
                gl.store(out_ptr + b64 * stride_ob + gl.expand_dims(
                    pos_m.to(gl.int64) * stride_ot + heads_m * stride_oh, 1) + offs_d,
                    o_m.to(dtype), mask=gl.expand_dims(ok_m, 1))
                if WRITE_LSE:
                    gl.store(lse_ptr + heads_m.to(gl.int64) * stride_lse_h + b64 * seqlen_q
                             + pos_m, lse_m, mask=ok_m)
                gl.atomic_xchg(counters_ptr + pid, 0)  # ready for the next call
                _stamp(stamps_ptr, 6, ticket, TIMELINE)  # 6 merged (the last split only)
        else:
            acc, lse = _finish(acc, m_o, l_o, sink_ptr, heads_o, HAS_SINK)
            gl.store(o_ptrs, acc.to(dtype), mask=gl.expand_dims(ok_o, 1))
            if WRITE_LSE:
                gl.store(lse_ptrs, lse, mask=ok_o)
            _stamp(stamps_ptr, 6, n_full, TIMELINE)  # 6 output stored


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


def _cache_reason(t: torch.Tensor, name: str) -> str | None:
    """Why TMA cannot read a cache (slots, per-slot rows, heads, dim) as a (slots·rows,
    heads·dim) matrix, or None."""
    n, rows, heads, dim = t.shape
    st = t.stride()
    if st[3] != 1 or (heads > 1 and st[2] != dim):
        return f"{name}'s (heads, dim) rows are not dense"
    if n > 1 and st[0] != rows * st[1]:
        return f"{name}'s slots are not evenly strided across its first dim"
    if t.data_ptr() % 16 or (st[1] * t.element_size()) % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    return None


def unsupported_decode(q, cache, params, sink) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if not decode_enabled():
        return f"off unless {SWITCH}=1 (it ties the portable kernel)"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs an sm_90 GPU"
    if q.dtype not in (torch.float16, torch.bfloat16) or cache.k.dtype != q.dtype or \
            cache.v.dtype != q.dtype:
        return "fp16/bf16 only, q and cache alike"
    if cache.cu_seqlens_q is not None or q.dim() != 4:
        return "varlen q (the paged prefill path)"
    d, dv = q.shape[-1], cache.v.shape[-1]
    if d != dv or d not in HEAD_DIMS:
        return f"head dims {HEAD_DIMS} with d = dv; got {d}/{dv}"
    hq, hkv = q.shape[2], cache.k.shape[2]
    if cache.max_seqlen_q * (hq // hkv) > ROWS:
        return f"seqlen_q x GQA group above {ROWS} rows"
    if q.stride(-1) != 1:
        return "q's head dim is not contiguous"
    for t, name in ((cache.k, "k_cache"), (cache.v, "v_cache")):
        why = _cache_reason(t, name)
        if why is not None:
            return why
    if cache.k.shape[0] * cache.k.shape[1] >= 2**31 - 256:
        return "cache slots exceed int32 TMA coordinates"
    if cache.page_table is not None:
        page = cache.k.shape[1]
        if page != 64 and page % 128:
            return f"page size {page} (64 or a multiple of 128 here)"
    if cache.k_new is not None and (cache.k_new.stride(-1) != 1 or cache.v_new.stride(-1) != 1):
        return "new k/v with a strided head dim"
    return None


@functools.lru_cache(maxsize=256)
def _plan(batch, hkv, max_seqlen_k, page_size, paged, d, num_splits, sms):
    """(block_n, stages, splits) for a call."""
    bn = block_n(page_size if paged else None)
    blocks = cdiv(max(max_seqlen_k, 1), bn)
    if num_splits <= 0:
        num_splits = num_splits_heuristic(batch * hkv, blocks, sms, 1)
    return bn, stages(d, bn), max(1, min(num_splits, blocks))


def plan(q, cache, num_splits: int = 0):
    return _plan(cache.batch, cache.k.shape[2], cache.max_seqlen_k, cache.k.shape[1],
                 cache.page_table is not None, q.shape[-1], num_splits, sm_count(q.device))


_LAUNCH = DirectLaunch(_decode_kernel) if _GLUON_ERROR is None else None


def _descriptor(t: torch.Tensor, bn: int):
    """The cache as a (slots, heads·dim) matrix (`_cache_reason` has checked it is one)."""
    n, rows, heads, dim = t.shape
    return _fwd.tma_rows(t.view(n * rows, heads, dim), [bn, dim])


def decode(q, cache, params, sink, num_splits: int = 0, need_lse: bool = True,
           stamps: torch.Tensor | None = None):
    """(out, lse) of q (batch, seqlen_q, hq, d) over `cache` (kvcache.CacheSpec), appending
    cache.k_new / v_new in the same launch; lse (hq, batch·seqlen_q) or None. stamps: int64
    (programs · 8,) for scripts/decode-timeline.py (the kernel's TIMELINE build)."""
    batch, seqlen_q, hq, d = q.shape
    kc, vc = cache.k, cache.v
    hkv = kc.shape[2]
    dev = q.device
    bn, n_stages, splits = plan(q, cache, num_splits)
    out = torch.empty((batch, seqlen_q, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty(hq, batch * seqlen_q, dtype=torch.float32, device=dev) \
        if need_lse else None
    if batch * seqlen_q == 0:
        return out, lse
    paged = cache.page_table is not None
    tiles = batch * hkv
    if splits > 1:
        work, counters = _workspace(dev, tiles * splits * ROWS * (d + 1), tiles)
    else:  # never touched with SPLIT off
        work = counters = out
    k_new = cache.k_new
    has_new = k_new is not None and cache.k_extra > 0
    if has_new:
        v_new = cache.v_new
        new_strides = k_new.stride()[:3] + v_new.stride()[:3]
    else:
        k_new = v_new = out
        new_strides = (0,) * 6
    seqlens = cache.seqlens_k
    table = cache.page_table if paged else seqlens
    mask = params.mask
    qk_scale, softcap_pre = _fwd.exp2_scales(params)
    qs, os_ = q.stride(), out.stride()
    _LAUNCH[(tiles, splits)](
        q, _descriptor(kc, bn), _descriptor(vc, bn), kc, vc, k_new, v_new, out,
        lse if lse is not None else out, work, counters, sink if sink is not None else out,
        seqlens, table, cache.batch_idx if cache.batch_idx is not None else seqlens,
        cache.leftpad if cache.leftpad is not None else seqlens,
        qs[0], qs[1], qs[2], kc.stride(1), vc.stride(1), *new_strides,
        os_[0], os_[1], os_[2], lse.stride(0) if lse is not None else 0,
        table.stride(0) if paged else 0, seqlen_q, cache.k_extra, kc.shape[1], hkv, hq // hkv,
        tiles * splits * ROWS * d, qk_scale, softcap_pre, mask.window_left, mask.window_right,
        out if stamps is None else stamps,
        D=d, BLOCK_N=bn, STAGES=n_stages, PAGED=paged, HAS_BATCH_IDX=cache.batch_idx is not None,
        HAS_LEFTPAD=cache.leftpad is not None, HAS_NEW=has_new, SPLIT=splits > 1,
        SOFTCAP=params.softcap > 0, HAS_SINK=sink is not None, WRITE_LSE=lse is not None,
        LEFT=mask.window_left >= 0, RIGHT=mask.window_right >= 0, TIMELINE=stamps is not None,
        num_warps=4)
    return out, lse


def compile_for_target(head_dim=128, dtype=torch.bfloat16, paged=False, page_size=None,
                       arch=90, **features):
    """Compile the decode kernel without a GPU (CI check); returns triton's CompiledKernel."""
    if _GLUON_ERROR is not None:
        raise RuntimeError(_GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bn = block_n(page_size if paged else None)
    ty = _fwd._SIG_DTYPES[dtype]
    desc = f"tensordesc<{ty}[{bn}, {head_dim}],{_fwd._smem_layout([bn, head_dim], dtype)!r}>"
    signature = {"q_ptr": f"*{ty}", "k_desc": desc, "v_desc": desc}
    for name in ("k_ptr", "v_ptr", "k_new_ptr", "v_new_ptr", "out_ptr"):
        signature[name] = f"*{ty}"
    for name in ("lse_ptr", "work_ptr", "sink_ptr"):
        signature[name] = "*fp32"
    for name in ("counters_ptr", "seqlens_ptr", "table_ptr", "batch_idx_ptr", "leftpad_ptr"):
        signature[name] = "*i32"
    for name in ("stride_qb", "stride_qt", "stride_qh", "stride_k_row", "stride_v_row",
                 "stride_nkb", "stride_nkt", "stride_nkh", "stride_nvb", "stride_nvt",
                 "stride_nvh", "stride_ob", "stride_ot", "stride_oh", "stride_lse_h",
                 "stride_table", "seqlen_q", "k_extra", "page_size", "n_kv_heads", "group",
                 "work_lse_offset", "window_left", "window_right"):
        signature[name] = "i32"
    signature["qk_scale"] = signature["softcap_pre"] = "fp32"
    signature["stamps_ptr"] = "*i64"
    constexprs = {"D": head_dim, "BLOCK_N": bn, "STAGES": stages(head_dim, bn), "PAGED": paged,
                  "HAS_BATCH_IDX": False, "HAS_LEFTPAD": False, "HAS_NEW": False,
                  "SPLIT": True, "SOFTCAP": False, "HAS_SINK": False, "WRITE_LSE": True,
                  "LEFT": False, "RIGHT": False, "TIMELINE": False}
    unknown = set(features) - set(constexprs)
    if unknown:
        raise TypeError(f"unknown decode features {sorted(unknown)}")
    constexprs.update(features)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(_decode_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4})
