"""The backward kernel for d <= 128 (the synchronous form; `kernel_ws.py` is the
warp-specialised one, `kernel_wide.py` the d=256 one). The algorithm: `host.py`."""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..common import (
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        thread_barrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from ..sched import (
        next_step,
    )
    from .parts import (
        after_dq_reduce,
        finish_dq,
        fragment_block,
        in_fragments,
        key_operands,
        key_tile,
        key_walk,
        load_kv,
        load_qdo,
        mask_coords,
        mma_layout,
        release_dq_turn_after_tma,
        stage_dq,
        stat_buffers,
        step_probabilities,
        step_stats,
        store_key_grads,
        take_dq_turn,
        tma_reduce_add,
        walk,
    )


if GLUON_ERROR is None:

    @gluon.constexpr_function
    def _dq_mma_layout(block_m, head_dim):
        """Accumulator layout of dQ = dS·K [block_m rows, head_dim]: with 64 rows (one wgmma
        M) the two warpgroups split its columns, with 128 its rows."""
        if block_m == 64:
            return mma_layout(4, 2, head_dim // 2)
        return mma_layout(8, 1, head_dim)

    @gluon.jit
    def attn_bwd_sync(call, cfg):
        """The body `entry.attn_bwd_kernel` runs for d <= 128 without warp specialisation."""
        # Keys on the M axis: warpgroup w owns keys [w·64, w·64 + 64) of the block.
        s_layout: gl.constexpr = mma_layout(8, 1, cfg.BLOCK_M)
        dk_layout: gl.constexpr = mma_layout(8, 1, cfg.HEAD_DIM)
        dv_layout: gl.constexpr = mma_layout(8, 1, cfg.HEAD_DIM_V)
        dq_layout: gl.constexpr = _dq_mma_layout(cfg.BLOCK_M, cfg.HEAD_DIM)
        pv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                         k_width=2)
        dsq_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                          k_width=2)
        # Deterministic mode, how the dQ turn is polled (parts.wait_dq_turn): by every
        # warp at d=128 (local-memory instructions, ptxas: causal 47 -> 6,
        # non-causal 18 -> 0), by thread 0 at d=64 (there the windowed build went 22 -> 30).
        WARP_SPIN: gl.constexpr = cfg.HEAD_DIM == 128
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = call.q_desc.dtype

        n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k, n0 = key_tile(call, cfg)
        if (n0 >= 0) & (n0 < seqlen_k):
            (shift, m_lo, group_blocks, n_steps, keys_oob, m_full_lo,
             m_full_hi) = key_walk(call, cfg, n0, seqlen_q, seqlen_k)

            k_smem, v_smem, q_smem, do_smem = key_operands(call, cfg, 2)
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [cfg.BLOCK_N, cfg.BLOCK_M], dtype)
            ds_smem = gl.allocate_shared_memory(dtype, [2, cfg.BLOCK_N, cfg.BLOCK_M], ds_layout)
            # dQ partials leave through one TMA reduce-add per step from here.
            dq_smem = gl.allocate_shared_memory(gl.float32, call.dq_desc.block_type.shape,
                                                call.dq_desc.layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar.index(0), count=1)
            for st in gl.static_range(2):
                mbarrier.init(ready.index(st), count=1)
            fence_async_shared()

            load_kv(call.k_desc, call.v_desc, k_smem, v_smem, kv_bar.index(0), k_start + n0, hk,
                    cfg.HEAD_DIM, cfg.HEAD_DIM_V)
            h_first, h, m0, stride, m_end = walk(call, cfg, hk, n_blk, n_seq, n_steps,
                                                 group_blocks, m_lo)
            held = call.sem_ptr  # deferred release: the dQ turn this CTA still holds
            load_qdo(call.q_desc, call.do_desc, q_smem, do_smem, ready, 0, h, q_start + m0,
                     cfg.HEAD_DIM, cfg.HEAD_DIM_V, n_steps > 0)

            kloc, n_valid, diag_right, diag_left, cols = mask_coords(call, cfg, shift, n0, seqlen_k,
                                                                     key_layout, col_layout)
            dk = gl.zeros([cfg.BLOCK_N, cfg.HEAD_DIM], gl.float32, dk_layout)
            dv = gl.zeros([cfg.BLOCK_N, cfg.HEAD_DIM_V], gl.float32, dv_layout)
            s_zero = gl.zeros([cfg.BLOCK_N, cfg.BLOCK_M], gl.float32, s_layout)
            dq_zero = gl.zeros([cfg.BLOCK_M, cfg.HEAD_DIM], gl.float32, dq_layout)
            lse_smem, delta_smem = stat_buffers(cfg)
            if n_steps > 0:
                step_stats(call, cfg, lse_smem, delta_smem, 0, h, m0, q_start, seqlen_q)
            thread_barrier()
            mbarrier.wait(kv_bar.index(0), 0)

            for it in range(n_steps):
                slot = it % 2
                h_next, m0_next = next_step(h, m0, m_lo, m_end, h_first, h_first + call.group,
                                            cfg.BLOCK_M)
                mbarrier.wait(ready.index(slot), (it // 2) & 1)
                q_s = q_smem.index(slot)
                do_s = do_smem.index(slot)
                s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                if cfg.DP_EARLY:
                    # dPᵀ runs on the tensor cores while this warpgroup computes Pᵀ.
                    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                           is_async=True)

                if not cfg.STATS_LATE:
                    # Next step's row statistics, while the two MMAs run. Its buffer was last
                    # read in step it-1, before the barrier every warp has passed since.
                    if it + 1 < n_steps:
                        step_stats(call, cfg, lse_smem, delta_smem, 1 - slot, h_next, m0_next,
                                   q_start, seqlen_q)
                if cfg.DP_EARLY:
                    s = warpgroup_mma_wait(1, deps=[s_tok])
                else:
                    s = warpgroup_mma_wait(0, deps=[s_tok])
                lse2 = lse_smem.index(slot).load(col_layout)
                p, p_ds = step_probabilities(call, cfg, s, lse2, m0, keys_oob, m_full_lo, m_full_hi,
                                            kloc, cols, n_valid, diag_right, diag_left)
                if not cfg.DP_EARLY:
                    # Issued only now so that its 32 accumulator registers are not live while
                    # Pᵀ is formed; the other warpgroup keeps the tensor cores busy meanwhile.
                    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                           is_async=True)
                p_op = gl.convert_layout(p.to(dtype), pv_op_layout)
                dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
                p = p_ds

                if cfg.DV_OVERLAP:
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
                if not cfg.DK_LATE:
                    dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                # dQ reads both warpgroups' halves of dSᵀ: make the stores visible to the
                # async proxy, then wait for every warp. Past this barrier every warp has also
                # retired all MMAs of step it-1, so that step's ring slot can be refilled, and
                # the issuing thread has seen step it-1's dQ reduce read dq_smem.
                fence_async_shared()
                if cfg.DETERMINISTIC:
                    if cfg.RELEASE_AT == 1:
                        if it > 0:  # the previous step's turn (see the reduce below)
                            release_dq_turn_after_tma(held, m0)
                tma.store_wait(0)
                thread_barrier()
                load_qdo(call.q_desc, call.do_desc, q_smem, do_smem, ready, 1 - slot, h_next,
                         q_start + m0_next, cfg.HEAD_DIM, cfg.HEAD_DIM_V, it + 1 < n_steps)
                dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, dq_zero, use_acc=False,
                                       is_async=True)
                if cfg.DK_LATE:
                    dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                if cfg.STATS_LATE:
                    # Next step's row statistics, while dQ runs (the warps would only wait for
                    # it). Past this step's first barrier no warp reads buffer 1 - slot any
                    # more; the barrier before the dQ reduce publishes it.
                    if it + 1 < n_steps:
                        step_stats(call, cfg, lse_smem, delta_smem, 1 - slot, h_next, m0_next,
                                   q_start, seqlen_q)
                if cfg.DETERMINISTIC:  # the semaphore's round trip under the dK/dQ MMAs
                    sem, _ = take_dq_turn(call, cfg, held, it, batch, h, m0, n_blk, n_seq, shift,
                                          h_first, m_lo, group_blocks, stride, WARP_SPIN)
                if cfg.DK_LATE:  # groups retire in order: dQ (and dV) now, dK in flight
                    if cfg.DV_OVERLAP:
                        dv, dq, p_op = warpgroup_mma_wait(1, deps=[dv_tok, dq_tok, p_op])
                    else:
                        dq = warpgroup_mma_wait(1, deps=[dq_tok])
                elif cfg.DV_OVERLAP:
                    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(
                        0, deps=[dv_tok, dk_tok, dq_tok, p_op, ds_op])
                else:
                    dk, dq, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, dq_tok, ds_op])

                # Rows past this sequence get exact zeros (P = 0 there): no row mask. Rows past
                # the tensor are clipped by the TMA unit.
                FRAG: gl.constexpr = in_fragments(call.dq_desc.layout)
                stage_dq(dq_smem, dq * call.softmax_scale, FRAG, cfg.BLOCK_M, cfg.HEAD_DIM)
                fence_async_shared()
                thread_barrier()
                if FRAG:  # rows of the two 64-row blocks from `fragment_block` in the fragment
                    # buffer, columns of head h (dq_fragments.py)
                    block = fragment_block(q_start, m0)
                    tma_reduce_add(call.dq_desc, [block * (2 * cfg.HEAD_DIM), h * 32], dq_smem)
                else:
                    tma_reduce_add(call.dq_desc, [q_start + m0, h * cfg.HEAD_DIM], dq_smem)
                if cfg.DETERMINISTIC:
                    held = after_dq_reduce(sem, m0, cfg.RELEASE_AT)
                if cfg.DK_LATE:
                    dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
                h = h_next
                m0 = m0_next

            finish_dq(cfg, held, n_steps)  # (the last reduce reads dq_smem)
            for st in gl.static_range(2):
                mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(kv_bar.index(0))

            # Epilogue: dK carries the softmax scale of S = scale·Q·Kᵀ.
            store_key_grads(call, cfg, dk * call.softmax_scale, dv, q_smem, do_smem, n0, k_start,
                            seqlen_k, hk, dk_layout, dv_layout)
