"""FlashAttention backward for Hopper (sm_90a), written in Gluon.

This module's kernel runs d=64 with softcap, a sliding window, or a causal mask below 2k
rows, and d=128 with softcap (or with ws_deterministic=False, deterministic=True); other
d=64 and d=128 calls run `bwd_ws.py`'s warp-specialised version of the same plan
(warpgroups out of phase, BwdConfig.split_warpgroups), d=256 `bwd_wide.py`. The host
side here serves all three.

One CTA owns BLOCK_N keys of one (sequence, kv head) and keeps K, V (shared memory) and the
dK, dV accumulators (registers) for its whole life. It walks every query block, of every q
head of the GQA group, that can see those keys. Per query block (two warpgroups, each owning
BLOCK_N / 2 of the keys, 8 warps in all):

    Sᵀ  = K·Qᵀ            (wgmma, A = K and B = Qᵀ from shared memory)
    dPᵀ = V·dOᵀ           (wgmma, issued right behind Sᵀ, overlaps the exponentials)
    Pᵀ  = exp2(Sᵀ·scale·log2 e − lse₂)               lse₂ = +inf for rows with lse = −inf
    dV += Pᵀ·dO           (wgmma, Pᵀ stays in registers as the A operand)
    dSᵀ = Pᵀ ∘ (dPᵀ − delta)  [softcap: ∘ (1 − tanh²)]
    dK += dSᵀ·Q           (wgmma, dSᵀ in registers)
    dQ  = dS·K            (wgmma, dSᵀ staged in shared memory and read transposed)
    dQ_acc += dQ          (fp32, staged in shared memory, one TMA reduce-add into a
                           (total_q, Hq, D) buffer)

Computing the transposed products puts the key dimension on the wgmma M axis, so Pᵀ and dSᵀ
come out of their MMAs already in the accumulator layout the dV and dK MMAs take as register
A operands (FA3/FA4 trick): only dSᵀ makes a trip through shared memory, for dQ, whose M axis
is the query rows.

Q and dO stream through a two-slot TMA ring (one mbarrier per slot). The kernel is not
warp-specialised: every thread runs the loop, the loads of the next query block are issued
right after the CTA-wide barrier that publishes dSᵀ (at that point every warp has retired the
previous block's MMAs, so its slot is free), and dSᵀ is double-buffered so one warpgroup can
write block i while the other still reads block i-1 in its dQ MMA. lse and delta of the next
block are staged through shared memory one step ahead (loaded while the MMAs run, read back in
the MMA layout only where needed: at d=128 every live register counts, the kernel sits at the
255-register limit).

Masks (bottom-right aligned, `core/params.py`) are applied only on the query blocks that cut
the causal diagonal or window edges, or when the key block runs past the sequence; query rows
past the sequence end need no mask (their lse reads as +inf, so P = 0 there).

dQ partials of all key blocks meet in dQ_acc. Per-thread fp32 atomics (`dq_tma=False`) cost
+40 % at d=128 16k in L2 reduction traffic (measured with them predicated off); one TMA
reduce-add per step (cp.reduce.async.bulk.tensor, issued from the staged tile by one thread
per warp of the first warpgroup, one 32-column box each) moves the same bytes as whole lines:
d=128 16k 391 -> 501 TFLOP/s. Rows past the sequence add exact zeros (P = 0), so the box needs
no mask; the staging tile is rewritten after `tma.store_wait` and the step's main barrier.
Either way the summation order is whatever order the CTAs arrive in.

`deterministic=True` fixes it with one semaphore per (sequence, q head, query block)
(FA3/FA4's scheme): the CTA of key block j adds its dQ partial for a query block only after
the key blocks before it in a fixed order have added theirs, then bumps the counter.
The key blocks that see a query block form one contiguous range [n_first, n_last] (a band
mask), so "my turn" is counter == j - n_first (ascending order), or n_last - j for causal
masks (descending: there the top key block reaches each query block first, so ascending turns
would serialise the CTAs into a wavefront; measured +110-130 % vs +20-35 % for non-causal).
The grid runs in turn order (x), so every CTA waited on has started earlier: no deadlock.
Masks without a window walk staggered instead (BwdConfig.stagger, bwd_parts.walk_start): key
block j starts at step j·(steps // key blocks), and a query block's turns follow the order in
which that schedule visits it, so CTAs running at the same pace never wait; a CTA then may
wait for one launched after it, so this needs every key block of a sequence resident at once
(key blocks <= SMs; else ascending turns). With TMA reduces a turn passes on only once the
reduce has written (bwd_parts.release_dq_turn_after_tma), in the same step or one step later
(BwdConfig.turn_release), and a CTA waits for its turn while its last MMAs run. fp32 sums in
a fixed order make dQ bitwise reproducible; dK and dV are written once anyway. Cost, H200
2026-11-29: +28-46 % at d=64/128, +60-80 % at d=256 (the semaphore round trips and barriers
sit on every step's critical path: taking them off needs a warp of its own for the dQ
reduce, which the 255-register budget of d=128/256 does not leave room for).

The postprocess (dQ_acc -> q.dtype; the softmax scale is applied before the reduction) and the
preprocess (delta = rowsum(dO∘O) − dlse, the portable tl kernel) are separate small launches.
Lengths, head counts, windows and scales are runtime arguments: one compile per (dtype, head
dim, config, feature switches).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from asymflash.core.params import AttnParams, SeqInfo, cdiv

from ...runtime.launch import DirectLaunch, LaunchSite, sm_count
from . import bwd_wide, bwd_ws, dq_fragments
from . import fwd as _fwd
from .bwd_config import (  # noqa: F401 - re-exported: tests and scripts read them here
    _DEFAULT_CONFIGS,
    HEADS_FIRST_L2_BYTES,
    BwdConfig,
    _splits_warpgroups,
    head_chunk,
    heads_first,
    select_config,
)
from .fwd import _GLUON_ERROR

if _GLUON_ERROR is None:
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

    from .bwd_parts import (
        add_dq,
        after_dq_reduce,
        fragment_block,
        in_fragments,
        key_block,
        load_kv,
        load_qdo,
        mask_edges,
        next_step,
        probabilities,
        query_range,
        release_dq_turn_after_tma,
        stage_dq,
        stage_stats,
        step_needs_mask,
        store_key_grads,
        take_dq_turn,
        tma_reduce_add,
        walk_start,
    )
    from .fwd import _tile_layout

# 64 and 128 run `_attn_bwd_kernel` below, 256 `bwd_wide` (the warpgroups split the head dim).
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@functools.lru_cache(maxsize=None)
def _launcher_for(head_dim: int, split: bool = False) -> DirectLaunch:
    """The backward kernel, launched without Triton's per-call binding once compiled."""
    return DirectLaunch(_kernel_for(head_dim, split))


def _kernel_for(head_dim: int, split: bool = False):
    if split:
        return bwd_ws.attn_bwd_ws_kernel
    return bwd_wide.attn_bwd_wide_kernel if head_dim == 256 else _attn_bwd_kernel


def _launch_options(split: bool, cfg: BwdConfig) -> dict:
    # bwd_ws: 4 warps per compute warpgroup (the default partition is one), the load warp
    # padded to a warpgroup; maxnreg is the pool the partitions' setmaxnreg draw from
    # (168 * 384 = 64512 <= 64K registers).
    return {"num_warps": 4, "maxnreg": 168} if split else {"num_warps": cfg.num_warps}


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------

if _GLUON_ERROR is None:

    @gluon.constexpr_function
    def _dq_mma_layout(block_m, head_dim):
        """Accumulator layout of dQ = dS·K [block_m rows, head_dim]: with 64 rows (one wgmma
        M) the two warpgroups split its columns, with 128 its rows."""
        if block_m == 64:
            return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                             instr_shape=[16, head_dim // 2, 16])
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                         instr_shape=[16, head_dim, 16])

    # Lengths, head counts and windows stay runtime values: Triton would otherwise compile a
    # variant per value 1 (and per divisibility by 16), and with seqlen_q = group = 1 folded
    # to constants the step loop collapses into a form triton 3.6's LLVM lowering crashes on
    # (found on the H200, 2026-11-29; tests/test_sm90_bwd_compile.py).
    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_kv_heads",
                                  "group", "window_left", "window_right", "num_m_blocks"])
    def _attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                         delta_ptr, dq_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr,
                         sem_ptr, seqlen_q,
                         seqlen_k, total_q, n_heads, n_kv_heads, group, num_m_blocks, qk_scale,
                         softmax_scale, softcap_pre, window_left, window_right,
                         HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         SOFTCAP: gl.constexpr, DV_OVERLAP: gl.constexpr,
                         DP_EARLY: gl.constexpr, DETERMINISTIC: gl.constexpr,
                         REVERSE_N: gl.constexpr, DQ_TMA: gl.constexpr,
                         STAGGER: gl.constexpr, RELEASE_AT: gl.constexpr,
                         WAIT_EARLY: gl.constexpr, KV_TMA_STORE: gl.constexpr,
                         DK_LATE: gl.constexpr, STATS_LATE: gl.constexpr,
                         HEADS_FIRST: gl.constexpr):
        # Keys on the M axis: warpgroup w owns keys [w·64, w·64 + 64) of the block.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                            instr_shape=[16, HEAD_DIM_V, 16])
        dq_layout: gl.constexpr = _dq_mma_layout(BLOCK_M, HEAD_DIM)
        pv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                         k_width=2)
        dsq_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                          k_width=2)
        # Deterministic mode, how the dQ turn is polled (bwd_parts.wait_dq_turn): by every
        # warp at d=128 (local-memory instructions, ptxas 2026-11-29: causal 47 -> 6,
        # non-causal 18 -> 0), by thread 0 at d=64 (there the windowed build went 22 -> 30).
        WARP_SPIN: gl.constexpr = HEAD_DIM == 128
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = q_desc.dtype

        n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k = key_block(
            cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q, seqlen_k, BLOCK_N, UNIFORM, HAS_SEQUSED,
            HAS_RIGHT and (DETERMINISTIC or REVERSE_N), HEADS_FIRST)
        n0 = n_blk * BLOCK_N
        if (n0 >= 0) & (n0 < seqlen_k):
            shift = seqlen_k - seqlen_q
            m_lo, group_blocks = query_range(n0, seqlen_q, shift, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            n_steps = group_blocks * group
            keys_oob, m_full_lo, m_full_hi = mask_edges(n0, seqlen_k, shift, window_left,
                                                        window_right, BLOCK_M, BLOCK_N)

            k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM],
                                               _tile_layout(k_desc.layout))
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_V],
                                               _tile_layout(v_desc.layout))
            q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM],
                                               _tile_layout(q_desc.layout))
            do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM_V],
                                                _tile_layout(do_desc.layout))
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                           dtype)
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
            if DQ_TMA:
                # dQ partials leave through one TMA reduce-add per step from here.
                dq_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape,
                                                    dq_desc.layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar.index(0), count=1)
            for st in gl.static_range(2):
                mbarrier.init(ready.index(st), count=1)
            fence_async_shared()

            load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(0), k_start + n0, hk, HEAD_DIM,
                    HEAD_DIM_V)
            # Steps walk (q head of the group, query block) in order; (h, m0) is the current
            # step's pair, carried rather than divided out of the step counter.
            h_first = hk * group
            h, m0, stride = walk_start(n_blk, n_seq, n_steps, group_blocks, h_first, m_lo,
                                       STAGGER, BLOCK_M)
            m_end = m_lo + group_blocks * BLOCK_M
            held = sem_ptr  # deferred release: the dQ turn this CTA still holds
            load_qdo(q_desc, do_desc, q_smem, do_smem, ready, 0, h, q_start + m0, HEAD_DIM,
                      HEAD_DIM_V, n_steps > 0)

            kloc = gl.arange(0, BLOCK_N, layout=key_layout)
            n_valid = seqlen_k - n0
            diag_right = shift + window_right - n0  # key <= row + shift + window_right
            diag_left = shift - window_left - n0  # key >= row + shift - window_left
            cols = gl.arange(0, BLOCK_M, layout=col_layout)
            dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, dk_layout)
            dv = gl.zeros([BLOCK_N, HEAD_DIM_V], gl.float32, dv_layout)
            s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
            dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
            stat_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
            stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            lse_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], stat_smem_layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], stat_smem_layout)
            if n_steps > 0:
                stage_stats(lse_ptr, delta_ptr, lse_smem, delta_smem, 0, h, m0, q_start,
                             seqlen_q, total_q, BLOCK_M, stat_layout)
            gl.thread_barrier()
            mbarrier.wait(kv_bar.index(0), 0)

            for it in range(n_steps):
                slot = it % 2
                h_next, m0_next = next_step(h, m0, m_lo, m_end, h_first, h_first + group,
                                            BLOCK_M)
                mbarrier.wait(ready.index(slot), (it // 2) & 1)
                q_s = q_smem.index(slot)
                do_s = do_smem.index(slot)
                s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                if DP_EARLY:
                    # dPᵀ runs on the tensor cores while this warpgroup computes Pᵀ.
                    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                           is_async=True)

                if not STATS_LATE:
                    # Next step's row statistics, while the two MMAs run. Its buffer was last
                    # read in step it-1, before the barrier every warp has passed since.
                    if it + 1 < n_steps:
                        stage_stats(lse_ptr, delta_ptr, lse_smem, delta_smem, 1 - slot, h_next,
                                     m0_next, q_start, seqlen_q, total_q, BLOCK_M, stat_layout)
                if DP_EARLY:
                    s = warpgroup_mma_wait(1, deps=[s_tok])
                else:
                    s = warpgroup_mma_wait(0, deps=[s_tok])
                lse2 = lse_smem.index(slot).load(col_layout)
                p, p_ds = probabilities(
                    s, lse2, qk_scale, softcap_pre,
                    step_needs_mask(m0, keys_oob, m_full_lo, m_full_hi, HAS_LEFT, HAS_RIGHT),
                    kloc, cols, n_valid, m0, diag_right, diag_left, SOFTCAP, HAS_LEFT, HAS_RIGHT)
                if not DP_EARLY:
                    # Issued only now so that its 32 accumulator registers are not live while
                    # Pᵀ is formed; the other warpgroup keeps the tensor cores busy meanwhile.
                    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                           is_async=True)
                p_op = gl.convert_layout(p.to(dtype), pv_op_layout)
                dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
                p = p_ds

                if DV_OVERLAP:
                    # Groups retire in order: with dV left in flight, dPᵀ is complete.
                    dp = warpgroup_mma_wait(1, deps=[dp_tok])
                else:
                    # Retire dV too: frees the 16-bit Pᵀ operand registers before dSᵀ is
                    # formed (at d=128 the overlap would cost spills).
                    dp, dv, p_op = warpgroup_mma_wait(0, deps=[dp_tok, dv_tok, p_op])
                delta = delta_smem.index(slot).load(col_layout)
                ds = p * (dp - gl.expand_dims(delta, 0))
                ds16 = ds.to(dtype)
                ds_buf = ds_smem.index(slot)
                ds_buf.store(ds16)
                ds_op = gl.convert_layout(ds16, dsq_op_layout)
                if not DK_LATE:
                    dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                # dQ reads both warpgroups' halves of dSᵀ: make the stores visible to the
                # async proxy, then wait for every warp. Past this barrier every warp has also
                # retired all MMAs of step it-1, so that step's ring slot can be refilled, and
                # (DQ_TMA) the issuing thread has seen step it-1's dQ reduce read dq_smem.
                fence_async_shared()
                if DQ_TMA:
                    if DETERMINISTIC:
                        if RELEASE_AT == 1:
                            if it > 0:  # the previous step's turn (see the reduce below)
                                release_dq_turn_after_tma(held, m0)
                    tma.store_wait(0)
                gl.thread_barrier()
                load_qdo(q_desc, do_desc, q_smem, do_smem, ready, 1 - slot, h_next,
                          q_start + m0_next, HEAD_DIM, HEAD_DIM_V, it + 1 < n_steps)
                dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, dq_zero, use_acc=False,
                                       is_async=True)
                if DK_LATE:
                    dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                if STATS_LATE:
                    # Next step's row statistics, while dQ runs (the warps would only wait for
                    # it). Past this step's first barrier no warp reads buffer 1 - slot any
                    # more; the barrier before the dQ reduce publishes it.
                    if it + 1 < n_steps:
                        stage_stats(lse_ptr, delta_ptr, lse_smem, delta_smem, 1 - slot, h_next,
                                     m0_next, q_start, seqlen_q, total_q, BLOCK_M, stat_layout)
                if DETERMINISTIC:
                    if WAIT_EARLY:  # the semaphore's round trip under the dK/dQ MMAs
                        sem, _ = take_dq_turn(held, it, sem_ptr, batch, n_heads, h, num_m_blocks,
                                              m0, n_blk, n_seq, shift, window_left, window_right,
                                              h_first, m_lo, group_blocks, stride, BLOCK_M, BLOCK_N,
                                              HAS_LEFT, HAS_RIGHT, STAGGER, RELEASE_AT, WARP_SPIN)
                if DK_LATE:  # groups retire in order: dQ (and dV) now, dK in flight
                    if DV_OVERLAP:
                        dv, dq, p_op = warpgroup_mma_wait(1, deps=[dv_tok, dq_tok, p_op])
                    else:
                        dq = warpgroup_mma_wait(1, deps=[dq_tok])
                elif DV_OVERLAP:
                    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(
                        0, deps=[dv_tok, dk_tok, dq_tok, p_op, ds_op])
                else:
                    dk, dq, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, dq_tok, ds_op])

                if DQ_TMA:
                    # Rows past this sequence get exact zeros (P = 0 there): no row mask. Rows
                    # past the tensor are clipped by the TMA unit.
                    FRAG: gl.constexpr = in_fragments(dq_desc.layout)
                    stage_dq(dq_smem, dq * softmax_scale, FRAG, BLOCK_M, HEAD_DIM)
                    fence_async_shared()
                    if DETERMINISTIC:
                        if not WAIT_EARLY:
                            sem, _ = take_dq_turn(held, it, sem_ptr, batch, n_heads, h,
                                                  num_m_blocks, m0, n_blk, n_seq, shift,
                                                  window_left, window_right, h_first, m_lo,
                                                  group_blocks, stride, BLOCK_M, BLOCK_N, HAS_LEFT,
                                                  HAS_RIGHT, STAGGER, RELEASE_AT, WARP_SPIN)
                    gl.thread_barrier()
                    if FRAG:  # rows of the two 64-row blocks from `fragment_block` in the
                        # fragment buffer, columns of head h (dq_fragments.py)
                        block = fragment_block(q_start, m0)
                        tma_reduce_add(dq_desc, [block * (2 * HEAD_DIM), h * 32], dq_smem)
                    else:
                        tma_reduce_add(dq_desc, [q_start + m0, h * HEAD_DIM], dq_smem)
                    if DETERMINISTIC:
                        held = after_dq_reduce(sem, m0, RELEASE_AT)
                else:
                    if DETERMINISTIC:  # atomics: each turn is released in its own step
                        sem, _ = take_dq_turn(held, it, sem_ptr, batch, n_heads, h, num_m_blocks,
                                              m0, n_blk, n_seq, shift, window_left, window_right,
                                              h_first, m_lo, group_blocks, stride, BLOCK_M, BLOCK_N,
                                              HAS_LEFT, HAS_RIGHT, STAGGER, 0, WARP_SPIN)
                    add_dq(dq_ptr, dq * softmax_scale, m0, q_start, seqlen_q, n_heads, h, 0,
                           HEAD_DIM, BLOCK_M, HEAD_DIM, dq_layout)
                    if DETERMINISTIC:
                        # Every thread's adds are issued before the next block starts its own.
                        gl.thread_barrier()
                        gl.atomic_add(sem, 1, sem="release")
                if DK_LATE:
                    dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
                h = h_next
                m0 = m0_next

            if DQ_TMA:
                if DETERMINISTIC:
                    if RELEASE_AT != 0:
                        if n_steps > 0:
                            release_dq_turn_after_tma(held, n_steps)
                tma.store_wait(0)  # the last reduce reads dq_smem
            for st in gl.static_range(2):
                mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(kv_bar.index(0))

            # Epilogue: dK carries the softmax scale of S = scale·Q·Kᵀ.
            store_key_grads(dk_desc, dv_desc, dk_ptr, dv_ptr, dk * softmax_scale, dv, q_smem,
                            do_smem, n0, k_start, seqlen_k, n_kv_heads, hk, HEAD_DIM, HEAD_DIM_V,
                            BLOCK_N, KV_TMA_STORE, HAS_RIGHT and (DETERMINISTIC or REVERSE_N),
                            dk_layout, dv_layout, HEADS_FIRST)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


def _constexprs(head_dim, head_dim_v, cfg: BwdConfig, *, uniform, has_seqused, has_left,
                has_right, softcap, deterministic=False, max_key_blocks=1, resident_ctas=1,
                kv_tma_store=False, split=False, heads_first_grid=0, first_stores=False):
    # A staggered deterministic walk makes key block j wait for j + 1 at some query blocks, so
    # every key block of a sequence must be resident at once (one CTA per SM): otherwise
    # ascending turns, where a CTA only waits for CTAs launched before it.
    stagger = (cfg.stagger and not has_left and not has_right
               and (not deterministic or max_key_blocks <= resident_ctas))
    consts = {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim_v, "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n, "UNIFORM": uniform,
            "HAS_SEQUSED": has_seqused, "HAS_LEFT": has_left, "HAS_RIGHT": has_right,
            "SOFTCAP": softcap, "DV_OVERLAP": cfg.dv_overlap,
            "DP_EARLY": cfg.dp_early, "DETERMINISTIC": deterministic,
            "REVERSE_N": cfg.reverse_causal, "DQ_TMA": cfg.dq_tma,
            "STAGGER": stagger, "RELEASE_AT": cfg.turn_release if cfg.dq_tma else 0,
            "WAIT_EARLY": cfg.turn_wait_early and cfg.dq_tma, "KV_TMA_STORE": kv_tma_store,
            "HEADS_FIRST": heads_first_grid}
    if head_dim != 256:  # bwd_wide splits dK/dQ by columns: its schedule has no such choice
        consts["DK_LATE"] = cfg.dk_late
    else:
        # the dO buffer holds a 32 KB half of dQ only at dv = 256 (192/128 runs dv = 128)
        consts["DQ_IN_OPS"] = cfg.dq_in_operands and cfg.dq_tma and head_dim_v == head_dim
        # Deterministic mode: a turn released in its own step (RELEASE_AT 0) must see both
        # halves land there; released in the next step (1, 2, 3), after the late high half's
        # issue, it waits for that reduce too (wait_group 0 covers every reduce issued).
        consts["HI_LATE"] = cfg.dq_hi_late and consts["DQ_IN_OPS"] and not (
            deterministic and consts["RELEASE_AT"] == 0)
    consts["STATS_LATE"] = cfg.stats_late
    if split:
        consts["LATE_WG"] = cfg.late_warpgroup
        consts["RING"] = cfg.ring_slots
        consts["DK_AFTER_DQ"] = cfg.ws_dk_after_dq
        consts["DQ_WARP"] = cfg.ws_dq_warp and not deterministic
        step_cols = head_dim == 64 if cfg.step_cols is None else cfg.step_cols
        consts["MASK_MODE"] = int(step_cols) | (2 if cfg.mask_scores else 0)
        consts["PERSISTENT"] = persists(cfg, uniform and not has_seqused, softcap)
        consts["KV_BUFS"] = cfg.ws_kv_buffers if consts["PERSISTENT"] else 1
    if split or head_dim == 256:  # bwd_ws, bwd_wide (bwd.py's kernel for d <= 128 always adds)
        # Passed even where False: a defaulted parameter left out would send every launch
        # down Triton's own launch path (DirectLaunch keeps binaries of full calls only).
        consts["FIRST_STORES"] = first_stores and deterministic
    return consts


# Rows of dQ_acc's buffer past its own that a persistent bwd_ws gets zeroed by the preprocess:
# its tile counter in the first word (scripts may ask for more: clock stamps after it).
PERSISTENT_ROWS = 1


def persists(cfg: BwdConfig, dense: bool, softcap: bool = False) -> bool:
    """Whether bwd_ws runs as a persistent grid (BwdConfig.ws_persistent): dense lengths
    only (every CTA's tile holds keys), not with softcap (not tested on the GPU). In
    deterministic mode too (the turns then follow the tile order: `bwd_ws._ws_tiles`)."""
    return cfg.ws_persistent and dense and not softcap


def first_stores(cfg: BwdConfig, deterministic: bool, dense: bool, seqlen_q: int,
                 seqlen_k: int, window_right: int, fragments: bool) -> bool:
    """Deterministic mode on bwd_ws and bwd_wide: may each query block's first dQ turn store
    instead of adding it, so that the preprocess need not zero dQ_acc (half its traffic:
    model dim 2048, 16k tokens: 134 MB of fp32 writes beside 134 MB of reads)?

    Only where every query row sees a key, so that every query block has a turn 0 (no block
    is left unwritten): dense lengths, seqlen_k >= 1, and no right bound or one that keeps
    the first row's keys (seqlen_k - seqlen_q + right >= 0; a left bound never empties a
    row here). And only where a stored box holds no other sequence's rows: fragment-order
    tiles never do (dq_fragments.py), row-major ones where the blocks tile each sequence."""
    if not (deterministic and cfg.first_stores and cfg.dq_tma and dense and seqlen_q >= 1
            and seqlen_k >= 1):
        return False
    if window_right >= 0 and seqlen_k - seqlen_q + window_right < 0:
        return False
    # What it saves is fixed per token (the zeroing's 134 MB at model dim 2048); what it
    # costs grows with the keys each query block meets: the unwanted store or add per tile
    # (aimed past the buffer) still takes the TMA unit ~3 % of the kernel. H200 2026-12-02
    # session 26 (sm90-bwd-probe, deterministic TFLOP/s, three interleaved rounds, zeroing ->
    # first stores): d=64 512 / 2k / 16k 263 / 422 / 493 -> 287 / 423 / 480, causal 173 /
    # 348 / 475 -> 202 / 364 / 484; d=128 302 / 459 / 516 -> 335 / 446 / 501, causal 195 /
    # 391 / 532 -> 217 / 407 / 519. So only while a query block meets at most
    # FIRST_STORES_MAX_KEYS keys (causal: half of seqlen_k on average).
    keys = seqlen_k // 2 if window_right >= 0 else seqlen_k
    if keys > FIRST_STORES_MAX_KEYS:
        return False
    return fragments or seqlen_q % cfg.block_m == 0


FIRST_STORES_MAX_KEYS = 1024


def kv_tma_store(uniform: bool, max_seqlen_k: int, batch: int, block_n: int) -> bool:
    """Whether dK and dV can leave by TMA stores of whole key blocks: no block may hold
    keys of two sequences (dense lengths, a multiple of block_n), except the tensor's last,
    whose rows past the end the TMA unit clips."""
    return uniform and (max_seqlen_k % block_n == 0 or batch == 1)


def _dq_tile(head_dim: int, cfg: BwdConfig, split: bool) -> tuple[int, int]:
    """(rows, columns) of dQ one reduce adds: the whole row block, or half of its columns at
    d=256 (bwd_wide); in bwd_ws each warpgroup's half, of the columns (64-row steps) or the
    rows."""
    if split:
        return (64, head_dim // 2) if cfg.block_m == 64 else (cfg.block_m // 2, head_dim)
    return cfg.block_m, head_dim // 2 if head_dim == 256 else head_dim


def _dq_block(head_dim: int, cfg: BwdConfig, split: bool = False) -> tuple[int, int]:
    """The dQ reduce box: `_dq_tile`, or that tile in fragment order as 32-column rows
    (`BwdConfig.dq_fragment`)."""
    rows, cols = _dq_tile(head_dim, cfg, split)
    return (rows * cols // 32, 32) if _fragments(cfg, split, head_dim) else (rows, cols)


def _fragments(cfg: BwdConfig, split: bool, head_dim: int) -> bool:
    """Whether dQ leaves in fragment order (`dq_fragments.py`): TMA reduces of bwd_ws's
    tiles, of bwd.py's 128-row ones (two warpgroups of 64 rows; d=64), or of bwd_wide's
    128-column halves (the warpgroups' 64 columns each; d=256)."""
    return cfg.dq_fragment and cfg.dq_tma and (split or cfg.block_m == 128 or head_dim == 256)


def _dq_box_and_layout(head_dim: int, cfg: BwdConfig, split: bool) -> tuple[tuple, object]:
    """(box, shared layout) of the dQ reduce; unswizzled in fragment order (the kernel tells
    the two apart by the swizzle)."""
    block = _dq_block(head_dim, cfg, split)
    return block, _dq_layout(block, 0 if _fragments(cfg, split, head_dim) else cfg.dq_swizzle)


def _key_rows(cfg: BwdConfig, split: bool) -> int:
    """Rows of the dK/dV TMA-store box: the key block, or one warpgroup's half (bwd_ws)."""
    return cfg.block_n // 2 if split else cfg.block_n


@functools.lru_cache(maxsize=None)
def _dq_layout(block: tuple, swizzle: int = 128):
    """Shared layout of the fp32 dQ staging tile (`BwdConfig.dq_swizzle`); cached (building
    one cost ~30 us of host time per backward call, H200 profile 2026-11-29)."""
    if swizzle == 128:
        return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)


@functools.lru_cache(maxsize=None)
def _unused_semaphore(device: torch.device) -> torch.Tensor:
    """The semaphore argument of calls that are not deterministic (never read): one per
    device instead of a fresh zeroed tensor (an allocation and a fill launch) per call."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def compile_for_target(head_dim=128, head_dim_v=None, dtype=torch.bfloat16,
                       cfg: BwdConfig | None = None, arch=90, heads_axis=False, **features):
    """Compile the backward kernel without a GPU (CI check); returns triton's CompiledKernel.
    heads_axis: with the (rows, heads, dim) descriptors of head dims between the widths."""
    if _GLUON_ERROR is not None:
        raise RuntimeError(_GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
             "softcap": False, "deterministic": False}
    feats.update(features)
    cfg = select_config(head_dim, cfg, feats["softcap"], feats["deterministic"],
                        feats["has_left"] or feats["has_right"], window=feats["has_left"])
    feats.setdefault("kv_tma_store", cfg.kv_tma_store and feats["uniform"]
                     and not feats["has_seqused"])
    ty = _fwd._SIG_DTYPES[dtype]

    def rows_desc(block):
        dims = ", ".join(map(str, block))
        return f"tensordesc<{ty}[{dims}],{_fwd._smem_layout(block, dtype)!r}>"

    def desc(block):
        if heads_axis:  # q, k, v, dO through fwd.tma_heads (head dims between the widths)
            return rows_desc([block[0], 1, block[1]])
        return rows_desc(block)

    split = _splits_warpgroups(head_dim, cfg, feats["deterministic"], feats["softcap"])
    dq_block, dq_layout = _dq_box_and_layout(head_dim, cfg, split)
    signature = {
        "q_desc": desc([cfg.block_m, head_dim]), "k_desc": desc([cfg.block_n, head_dim]),
        "v_desc": desc([cfg.block_n, head_dim_v]), "do_desc": desc([cfg.block_m, head_dim_v]),
        "dq_desc": f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{dq_layout!r}>",
        "dk_desc": rows_desc([_key_rows(cfg, split), head_dim]),
        "dv_desc": rows_desc([_key_rows(cfg, split), head_dim_v]),
        "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": "*fp32", "dk_ptr": f"*{ty}",
        "dv_ptr": f"*{ty}", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "used_k_ptr": "*i32",
        "sem_ptr": "*i32", "seqlen_q": "i32", "seqlen_k": "i32", "total_q": "i32",
        "n_heads": "i32", "n_kv_heads": "i32", "group": "i32", "num_m_blocks": "i32",
        "qk_scale": "fp32", "softmax_scale": "fp32",
        "softcap_pre": "fp32", "window_left": "i32", "window_right": "i32"}
    constexprs = _constexprs(head_dim, head_dim_v, cfg, split=split, **feats)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(_kernel_for(head_dim, split), signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=_launch_options(split, cfg))


def unsupported_backward(q, k, v, seq: SeqInfo, params: AttnParams, sink) -> str | None:
    """None when this kernel computes the gradients exactly, else why not (for dispatch)."""
    d, dv = q.shape[-1], v.shape[-1]
    if _fwd.kernel_head_dim(d, dv) is None:
        return (f"sm90 backward supports head dims 64/64, 128/128, 256/256 and (zero-padded) "
                f"any d, dv with 64 < max(d, dv) <= 256; got {d}/{dv}")
    why = _fwd.hopper_input_reason(q, k, v, sink, None, "backward")
    if why is not None:
        return why
    if seq.batch > 65535 or k.shape[1] > 65535:
        return "grid dimensions y/z (kv heads, batch) are limited to 65535"
    if max(q.shape[0], k.shape[0]) >= 2**31 - 1024:
        return "sequence rows exceed int32 TMA coordinates"
    return None


def backward(dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink,
             cfg: BwdConfig | None = None):
    """(dq, dk, dv, dsink) for out = attention(q, k, v); shapes as in `core/params.py`."""
    d, dvd = q.shape[-1], v.shape[-1]
    width, width_v = _fwd.forward_widths(d, dvd)  # 192/128 runs 256/128, as the forward
    # As the forward: zero columns add nothing to q·k, dO·vᵀ or rowsum(dO∘O), and the
    # gradients' padded columns are dropped. q, k, v and dO are read through (rows, heads,
    # dim) TMA boxes that zero-fill them (fwd.tma_heads), or, for dims TMA cannot address
    # per head (not multiples of 8), padded copies.
    padded = (d, dvd) != (width, width_v)
    if padded and (d % 8 or dvd % 8):
        pad = _fwd.pad_head_dim
        dq, dk, dv, dsink = backward(pad(dout, width_v), pad(q, width), pad(k, width),
                                     pad(v, width_v), pad(out, width_v), lse, dlse, seq, params,
                                     sink, cfg)
        return (dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :dvd].contiguous(),
                dsink)
    q, k, v = _fwd.tma_ready(q), _fwd.tma_ready(k), _fwd.tma_ready(v)
    plan = _plan_of(width, width_v, q, k, seq, params, cfg)
    dq, dk, dv, dsink = _run(plan, width, width_v, padded, dout, q, k, v, out, lse, dlse, seq,
                             params, sink)
    if padded:
        dk, dv = dk[..., :d].contiguous(), dv[..., :dvd].contiguous()
    return dq, dk, dv, dsink


def _plan_of(width, width_v, q, k, seq: SeqInfo, params: AttnParams, cfg) -> LaunchPlan:
    """launch_plan for kernel widths (width, width_v) and this call."""
    wl, wr = params.mask.window_left, params.mask.window_right
    has_seqused = seq.seqused_k is not None
    return launch_plan(width, width_v, seq.max_seqlen_q, seq.max_seqlen_k,
                       bool(seq.uniform and not has_seqused), has_seqused, wl, wr,
                       params.softcap > 0, params.deterministic, seq.batch, k.shape[1],
                       sm_count(q.device), cfg, q.shape[1])


def _run(plan: LaunchPlan, width, width_v, padded, dout, q, k, v, out, lse, dlse,
         seq: SeqInfo, params: AttnParams, sink, sites: BackwardSites | None = None):
    """(dq, dk, dv, dsink) of one backward: allocate, build the descriptors, launch the
    preprocess, the main kernel and the dQ postprocess (through `sites`, a call plan
    runner's bound launches, where given). dk and dv are `width` (width_v) wide: `backward`
    cuts padded ones. q, k, v: `tma_ready`; dout and lse as the caller has them."""
    # The portable preprocess and the sink gradient are shared with the portable backend.
    from ..cpu import sink_grad
    from ..portable import _delta

    d, dvd = q.shape[-1], v.shape[-1]
    total_q, hq, _ = q.shape
    hkv = k.shape[1]
    wl, wr = params.mask.window_left, params.mask.window_right
    has_seqused = seq.seqused_k is not None
    cfg = plan.cfg
    # The dO descriptor shares Q's compiled element type and needs TMA-friendly strides.
    # (Each no-op conversion still costs host time: convert only what needs it.)
    if dout.dtype != q.dtype or not dout.is_contiguous() or dout.data_ptr() % 16:
        dout = dout.to(q.dtype).clone(memory_format=torch.contiguous_format)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.float().contiguous()
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()
    if sites is not None and not sites.admits(out, lse, dlse):
        sites = None
    # The kernel's tensors are `width` (V side: width_v) wide: dQ_acc, dK, dV are cut below.
    # The preprocess (delta) zeroes dQ_acc: one launch instead of two (unless FIRST_STORES).
    extra = PERSISTENT_ROWS if plan.persistent and not params.deterministic else 0
    if plan.dq_fragment:
        dq_acc = dq_fragments.fragment_buffer(total_q, seq.batch, hq, width, q.device,
                                              extra_rows=extra)
    else:
        dq_acc = torch.empty((total_q + extra, hq, width), dtype=torch.float32,
                             device=q.device)
    # Deterministic mode's first turns may store instead (`first_stores`): no zeroing then.
    delta = _delta(out, dout, dlse,
                   zero=None if plan.constexprs.get("FIRST_STORES") else dq_acc,
                   site=None if sites is None else sites.of_dlse(dlse))
    if extra:  # its tile counter: zeroed rows past dQ_acc's (bwd_ws._ws_tiles)
        dq_acc, tile_counter = dq_acc[:-extra], dq_acc[-extra:].view(torch.int32)
    # Varlen rows that belong to no sequence are never written: they must read as zero.
    alloc = torch.empty if seq.uniform and not has_seqused else torch.zeros
    dk = alloc((k.shape[0], hkv, width), dtype=k.dtype, device=k.device)
    dv = alloc((v.shape[0], hkv, width_v), dtype=v.dtype, device=v.device)

    if padded or not (_fwd.rows_dense(q) and _fwd.rows_dense(k) and _fwd.rows_dense(v)):
        q_desc = _fwd.tma_heads(q, cfg.block_m, width)
        do_desc = _fwd.tma_heads(dout, cfg.block_m, width_v)
        k_desc = _fwd.tma_heads(k, cfg.block_n, width)
        v_desc = _fwd.tma_heads(v, cfg.block_n, width_v)
    else:
        q_desc = _fwd.tma_rows(q, (cfg.block_m, d))
        do_desc = _fwd.tma_rows(dout, (cfg.block_m, dvd))
        k_desc = _fwd.tma_rows(k, (cfg.block_n, d))
        v_desc = _fwd.tma_rows(v, (cfg.block_n, dvd))
    dq_desc = _fwd.tma_rows(dq_fragments.tiles_view(dq_acc) if plan.dq_fragment else dq_acc,
                            plan.dq_block, plan.dq_layout)
    dk_desc = _fwd.tma_rows(dk, (_key_rows(cfg, plan.split), width))
    dv_desc = _fwd.tma_rows(dv, (_key_rows(cfg, plan.split), width_v))

    qk_scale, softcap_pre = _fwd.exp2_scales(params)
    # One dQ turn counter per (sequence, q head, query block); only read when deterministic.
    # A persistent grid's tile counter: the word after them, or dQ_acc's extra row.
    if params.deterministic:
        sem = torch.zeros((seq.batch * hq * plan.num_m_blocks + plan.persistent,),
                          dtype=torch.int32, device=q.device)
    elif plan.persistent:
        sem = tile_counter
    else:
        sem = _unused_semaphore(q.device)
    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse, delta, dq_acc,
            dk, dv, seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.seqused_k if has_seqused else seq.cu_seqlens_k, sem,
            seq.max_seqlen_q, seq.max_seqlen_k, total_q, hq, hkv, hq // hkv, plan.num_m_blocks,
            qk_scale, params.softmax_scale, softcap_pre, wl, wr)
    if sites is None:
        _launcher_for(width, plan.split)[plan.grid](*args, **plan.constexprs)
    else:
        sites.main(_launcher_for(width, plan.split), plan.grid, args, plan.constexprs)
    # The kernel folded softmax_scale into its dQ partial sums.
    if plan.dq_fragment:
        cols = _dq_tile(width, cfg, plan.split)[1]
        dq = dq_fragments.dq_from_fragments(dq_acc, seq.cu_seqlens_q, seq.max_seqlen_q,
                                            total_q, hq, d, width, cols, q.dtype,
                                            site=None if sites is None else sites.post)
    else:
        dq = dq_acc[..., :d].to(q.dtype, memory_format=torch.contiguous_format)
    return dq, dk, dv, sink_grad(sink, lse, delta)


class BackwardSites:
    """A backward runner's bound launches (`launch.LaunchSite`): the main kernel's, the dQ
    postprocess's, and the preprocess's per dlse kind (its HAS_DLSE binary). They stand for
    one specialisation class of the tensors the caller passes: `admits` checks the ones a
    call plan's key does not fix (out, lse and dlse come from autograd)."""

    __slots__ = ("main", "post", "pre", "pre_dlse")

    def __init__(self):
        self.main, self.post = LaunchSite(), LaunchSite()
        self.pre, self.pre_dlse = LaunchSite(), LaunchSite()

    def of_dlse(self, dlse) -> LaunchSite:
        return self.pre if dlse is None else self.pre_dlse

    @staticmethod
    def admits(out, lse, dlse) -> bool:
        """Whether this call's autograd tensors fall in the class the sites were bound for:
        out contiguous (its strides are the preprocess's int arguments), all 16-byte aligned
        (dO and lse are already contiguous, dO aligned: `_run` converts them)."""
        ptrs = out.data_ptr() | lse.data_ptr() | (0 if dlse is None else dlse.data_ptr())
        return ptrs % 16 == 0 and out.is_contiguous()


class BackwardRunner:
    """`backward` for one call signature with its launch plan made once: the dispatcher's call
    plans (`asymflash.runtime.plans`) keep one per signature and call it as `backward` (the plan's
    seq and params). The launches bind their binaries at the first call and go through them
    from the second (`BackwardSites`): no specialisation keys, no plan lookup per call."""

    def __init__(self, q, k, v, seq: SeqInfo, params: AttnParams):
        self.width, self.width_v = q.shape[-1], v.shape[-1]
        self.plan = _plan_of(self.width, self.width_v, q, k, seq, params, None)
        self.sites = BackwardSites()

    def __call__(self, dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink):
        q, k, v = _fwd.tma_ready(q), _fwd.tma_ready(k), _fwd.tma_ready(v)
        return _run(self.plan, self.width, self.width_v, False, dout, q, k, v, out, lse, dlse,
                    seq, params, sink, self.sites)


def backward_runner(q, k, v, seq: SeqInfo, params: AttnParams, sink):
    """A BackwardRunner for calls with this signature, or None where `backward` does more
    than the plain launches (padded head dims): those keep calling `backward`."""
    if _fwd.forward_widths(q.shape[-1], v.shape[-1]) != (q.shape[-1], v.shape[-1]):
        return None
    return BackwardRunner(q, k, v, seq, params)


@dataclass(frozen=True)
class LaunchPlan:
    """What a backward launch needs that depends on shapes and switches only (as the
    forward's `fwd.LaunchPlan`): built once per distinct call by `launch_plan`."""

    cfg: BwdConfig
    grid: tuple
    num_m_blocks: int
    constexprs: dict  # and num_warps
    dq_block: tuple
    dq_layout: object
    split: bool  # bwd_ws's kernel

    @property
    def dq_fragment(self) -> bool:
        return _fragments(self.cfg, self.split, self.constexprs["HEAD_DIM"])

    @property
    def persistent(self) -> bool:
        """Whether bwd_ws runs as a persistent grid (its tile counter rides with dQ_acc)."""
        return self.split and self.constexprs.get("PERSISTENT", False)


@functools.lru_cache(maxsize=4096)
def launch_plan(width: int, width_v: int, max_seqlen_q: int, max_seqlen_k: int,
                uniform: bool, has_seqused: bool, window_left: int, window_right: int,
                softcap: bool, deterministic: bool, batch: int, hkv: int, sms: int,
                cfg: BwdConfig | None, hq: int = 0) -> LaunchPlan:
    """Config, grid and constexprs of one backward call (cfg: an override, or None; hq:
    query heads, 0 for hkv)."""
    cfg = select_config(width, cfg, softcap, deterministic,
                        window_left >= 0 or window_right >= 0, max_seqlen_q, window_left >= 0)
    key_blocks = cdiv(max(max_seqlen_k, 1), cfg.block_n)
    split = _splits_warpgroups(width, cfg, deterministic, softcap)
    dense = uniform and not has_seqused
    chunk = head_chunk(cfg, window_right >= 0 and window_left < 0, dense, deterministic,
                       split and persists(cfg, dense, softcap), hq or hkv, hkv, batch,
                       max_seqlen_q, max_seqlen_k, window_right, width, width_v, sms)
    # the kernels' HEADS_FIRST (bwd_parts.key_block): 0 one head after another, 1 all heads
    # first, c >= 2 chunks of c kv heads
    first = 1 if chunk == hkv else chunk
    grid = ((chunk, hkv // chunk * key_blocks, batch) if chunk
            else (key_blocks, hkv, batch))
    consts = _constexprs(width, width_v, cfg, split=split, uniform=uniform,
                         has_seqused=has_seqused,
                         has_left=window_left >= 0, has_right=window_right >= 0,
                         softcap=softcap, deterministic=deterministic,
                         max_key_blocks=key_blocks, resident_ctas=sms,
                         heads_first_grid=first,
                         kv_tma_store=cfg.kv_tma_store and kv_tma_store(
                             uniform, max_seqlen_k, batch, cfg.block_n),
                         first_stores=first_stores(cfg, deterministic, dense, max_seqlen_q,
                                                   max_seqlen_k, window_right,
                                                   _fragments(cfg, split, width)))
    consts.update(_launch_options(split, cfg))
    if split and consts["PERSISTENT"]:  # one CTA per SM, walking the grid's tiles
        grid = (max(1, min(grid[0] * grid[1] * grid[2], sms)),)
    dq_block, dq_layout = _dq_box_and_layout(width, cfg, split)
    return LaunchPlan(cfg, grid, cdiv(max(max_seqlen_q, 1), cfg.block_m), consts, dq_block,
                      dq_layout, split)
