"""The synchronous backward bodies (every thread runs the whole step; `kernel_ws.py` is the
warp-specialised form): `attn_bwd_sync` for d <= 128, `attn_bwd_wide` for d = 256, where the
two warpgroups split the head dim instead of the keys. The algorithm: `host.py`."""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..common import (
        fence_async_shared,
        gl,
        gluon,
        load_pieces,
        mbarrier,
        piece_col,
        thread_barrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from ..sched import (
        next_step,
    )
    from .flex_parts import flex_probabilities, flex_step, flex_steps
    from .parts import (
        add_dq_tile,
        after_dq_reduce,
        finish_dq,
        fragment_block,
        in_fragments,
        key_operand_pieces,
        key_operands,
        key_tile,
        key_walk,
        load_kv,
        load_kv_pieces,
        load_qdo,
        load_rows,
        mask_coords,
        mma_layout,
        release_dq_turn_after_tma,
        stage_dq,
        stat_buffers,
        step_probabilities,
        step_stats,
        store_key_grads,
        store_key_piece,
        store_key_rows,
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
    def attn_bwd_sync(call, cfg, flex=None):
        """The body `entry.attn_bwd_kernel` runs for d <= 128 without warp specialisation.
        flex: a flex call's lists and mods (`flex_parts`; `entry.attn_bwd_flex_kernel`), or
        None."""
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
            if flex is not None:  # the BlockMask's query blocks instead of a range
                n_steps = flex_steps(flex[0], batch, n0, hk * call.group, call.group)

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
            if flex is not None:
                h, m0, masked = flex_step(flex[0], batch, n0, h_first, call.group, 0,
                                          cfg.BLOCK_M)
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
                if flex is not None:
                    h_next, m0_next, masked_next = flex_step(flex[0], batch, n0, h_first,
                                                             call.group, it + 1, cfg.BLOCK_M)
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
                if flex is not None:
                    p, p_ds = flex_probabilities(s, lse2, flex, batch, h, m0, n0, masked, kloc,
                                                 cols, seqlen_q, seqlen_k)
                else:
                    p, p_ds = step_probabilities(call, cfg, s, lse2, m0, keys_oob, m_full_lo,
                                                 m_full_hi, kloc, cols, n_valid, diag_right,
                                                 diag_left)
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
                if flex is not None:
                    masked = masked_next

            finish_dq(cfg, held, n_steps)  # (the last reduce reads dq_smem)
            for st in gl.static_range(2):
                mbarrier.invalidate(ready.index(st))
            mbarrier.invalidate(kv_bar.index(0))

            # Epilogue: dK carries the softmax scale of S = scale·Q·Kᵀ.
            store_key_grads(call, cfg, dk * call.softmax_scale, dv, q_smem, do_smem, n0, k_start,
                            seqlen_k, hk, dk_layout, dv_layout)

    # The d = 256 body (`attn_bwd_wide`).
    #
    # The d <= 128 body (attn_bwd_sync) gives each warpgroup its own 64 keys and keeps its
    # warpgroup's
    # dK and dV rows in registers. At d = 256 one warpgroup's 64 × 256 dK and dV would take 256
    # fp32 registers per thread, so here the two warpgroups share one block of 64 keys and split the
    # head dim instead (FA3's hdim-256 shape):
    #
    #     Sᵀ, dPᵀ  [64 keys, 64 rows]    warpgroup w computes rows [32w, 32w + 32)
    #     Pᵀ, dSᵀ                        each warpgroup writes its half to shared memory
    #     dV += Pᵀ·dO   [64, 256]        warpgroup w owns columns [128w, 128w + 128)
    #     dK += dSᵀ·Q   [64, 256]        likewise
    #     dQ  = dS·K    [64, 256]        in two 128-column chunks, each split the same way
    #
    # so a thread holds 64 + 64 registers of dK/dV, 16 + 16 of Sᵀ/dPᵀ and 2 × 32 of dQ. The price
    # is that Pᵀ and dSᵀ, formed in halves, go through shared memory before the dV/dK products read
    # them whole, which takes two CTA barriers per step instead of one:
    #
    #     barrier 1 (Pᵀ published): every warpgroup has finished the previous step, so the next Q
    #         is loaded into the free slot of its two-slot ring and dSᵀ's single buffer may be
    #         rewritten;
    #     barrier 2 (dSᵀ published): every warpgroup has retired its dPᵀ and dV products, so Pᵀ's
    #         single buffer may be rewritten in the next step, and the next dO is loaded into its
    #         single buffer (it lands while dK and dQ run).
    #
    # The 32 KB saved by that single dO buffer hold the fp32 staging tile of the dQ reduce (smem:
    # 214 KB of 227): each 128-column half of dQ is stored there and added into dQ_acc by one TMA
    # reduce-add, which takes three more CTA barriers per step (publish the low half, wait for its
    # reduce to read the tile, publish the high half).
    #
    # `BwdConfig.dq_in_operands` (the d = 256 default where dv = 256) drops that tile: dO gets two
    # buffers (the next one loads at barrier 1, half a step earlier), and each step stages its low
    # dQ half in its own dO buffer (free after barrier 2) and its high half in its own Q slot (free
    # once dK has retired), so the high half no longer waits for the TMA unit to read the low one
    # out; barrier 1 waits for both reads before those buffers load again. With
    # `BwdConfig.dq_hi_late` the high half's reduce is issued only in the next step, after its
    # first MMAs: issued right behind the low one, its command waited in the TMA unit's queue.
    #
    # Everything else (the step walk over the GQA group's query blocks, masks only on edge blocks,
    # lse/delta staging, the deterministic turns) is attn_bwd_sync's, through parts.py.
    #
    # Head dim 192 (PIECES; d_v <= 128, DeepSeek-V3's 128 + 64 rope): Gluon's tiles are powers
    # of two, so K and each Q slot are a 128-wide and a 64-wide piece (each head read as three
    # 64-column TMA boxes, `common.load_pieces`), Sᵀ = K·Qᵀ is two MMAs into one accumulator
    # (K-steps over 128 and 64 columns), dK and dQ a 128- and a 64-column accumulator each.
    # No MMA runs on zero columns (the 256/128 build it replaces did 1024 units of MMA work
    # per step for 832). dQ leaves row-major as 64-column boxes, the high piece staged in a
    # tile of its own (the 24 KB the pieces save), so it needs no wait for the low piece's
    # reduce to read a shared tile; dK leaves by per-thread stores (a TMA box of 192 columns
    # does not exist).

    @gluon.jit
    def _dq_tile_in(buf, dq_desc):
        """A 32 KB bf16 operand buffer (a dO buffer or Q slot) seen as the fp32 dQ staging
        tile of `dq_desc`'s reduce (BwdConfig.dq_in_operands)."""
        return buf._reinterpret(gl.float32, dq_desc.block_type.shape, dq_desc.layout)

    @gluon.jit
    def attn_bwd_wide(call, cfg):
        """The body `entry.attn_bwd_kernel` runs for d = 256."""
        # dPᵀ is always issued with Sᵀ here (DP_EARLY is attn_bwd_sync's register trade-off), and dV
        # is always retired before dSᵀ is published (barrier 2 relies on it); DV_OVERLAP keeps
        # it in flight while dSᵀ is formed. dQ leaves by TMA reduce-add in two 128-column
        # halves (dq_desc's box).
        PIECES: gl.constexpr = cfg.HEAD_DIM == 192  # a 128- and a 64-wide piece (above)
        HI: gl.constexpr = 64  # the high piece's columns (PIECES)
        LO: gl.constexpr = cfg.HEAD_DIM - HI if PIECES else cfg.HEAD_DIM
        DQ_COLS: gl.constexpr = LO if PIECES else cfg.HEAD_DIM // 2
        # All four tiles split over the warpgroups by columns (warps_per_cta [4, 2]).
        s_layout: gl.constexpr = mma_layout(4, 2, cfg.BLOCK_M // 2)
        dk_layout: gl.constexpr = mma_layout(4, 2, LO // 2)
        hi_layout: gl.constexpr = mma_layout(4, 2, HI // 2)  # dK's and dQ's high pieces
        dv_layout: gl.constexpr = mma_layout(4, 2, cfg.HEAD_DIM_V // 2)
        dq_layout: gl.constexpr = mma_layout(4, 2, DQ_COLS // 2)
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = call.q_desc.dtype

        n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k, n0 = key_tile(call, cfg)
        if (n0 >= 0) & (n0 < seqlen_k):
            (shift, m_lo, group_blocks, n_steps, keys_oob, m_full_lo,
             m_full_hi) = key_walk(call, cfg, n0, seqlen_q, seqlen_k)

            # Without DQ_IN_OPS dO has one buffer: its readers (dPᵀ, dV) are retired by
            # barrier 2, so the next step's dO lands while dK and dQ run, and the 32 KB saved
            # hold the dQ staging tile. With it (BwdConfig.dq_in_operands) two dO buffers and
            # no staging tile: each step stages its dQ halves in its own dO buffer and Q slot.
            DO_BUFS: gl.constexpr = 2 if cfg.DQ_IN_OPS else 1
            if PIECES:  # k_smem, q_smem: the 128-wide pieces
                k_smem, k_hi, v_smem, q_smem, q_hi, do_smem = key_operand_pieces(call, cfg,
                                                                                  DO_BUFS)
            else:
                k_smem, v_smem, q_smem, do_smem = key_operands(call, cfg, DO_BUFS)
            pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [cfg.BLOCK_N, cfg.BLOCK_M], dtype)
            pt_smem = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, cfg.BLOCK_M], pt_layout)
            ds_smem = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, cfg.BLOCK_M], pt_layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            if PIECES:  # the low piece's two 64-column boxes, and the high piece's own tile
                dq_smem = gl.allocate_shared_memory(gl.float32,
                                                    [2] + call.dq_desc.block_type.shape,
                                                    call.dq_desc.layout)
                dq_hi_smem = gl.allocate_shared_memory(gl.float32,
                                                       call.dq_desc.block_type.shape,
                                                       call.dq_desc.layout)
            elif not cfg.DQ_IN_OPS:
                dq_smem = gl.allocate_shared_memory(gl.float32, call.dq_desc.block_type.shape,
                                                    call.dq_desc.layout)
            q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            do_ready = gl.allocate_shared_memory(gl.int64, [DO_BUFS, 1],
                                                 mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar.index(0), count=1)
            for st in gl.static_range(DO_BUFS):
                mbarrier.init(do_ready.index(st), count=1)
            for st in gl.static_range(2):
                mbarrier.init(q_ready.index(st), count=1)
            fence_async_shared()

            if PIECES:
                load_kv_pieces(call.k_desc, call.v_desc, k_smem, k_hi, v_smem, kv_bar.index(0),
                               k_start + n0, hk, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.HEAD_DIM_V)
            else:
                load_kv(call.k_desc, call.v_desc, k_smem, v_smem, kv_bar.index(0), k_start + n0,
                        hk, cfg.HEAD_DIM, cfg.HEAD_DIM_V)
            h_first, h, m0, stride, m_end = walk(call, cfg, hk, n_blk, n_seq, n_steps,
                                                 group_blocks, m_lo)
            held = call.sem_ptr  # deferred release: the dQ turn this CTA still holds
            if PIECES:
                load_pieces(call.q_desc, q_smem.index(0), q_hi.index(0), q_ready.index(0),
                            q_start + m0, h, cfg.BLOCK_M, cfg.HEAD_DIM, n_steps > 0)
            else:
                load_rows(call.q_desc, q_smem.index(0), q_ready.index(0), q_start + m0, h,
                          cfg.HEAD_DIM, n_steps > 0)
            load_rows(call.do_desc, do_smem.index(0), do_ready.index(0), q_start + m0, h,
                      cfg.HEAD_DIM_V, n_steps > 0)

            kloc, n_valid, diag_right, diag_left, cols = mask_coords(call, cfg, shift, n0, seqlen_k,
                                                                     key_layout, col_layout)
            dk = gl.zeros([cfg.BLOCK_N, LO], gl.float32, dk_layout)
            dv = gl.zeros([cfg.BLOCK_N, cfg.HEAD_DIM_V], gl.float32, dv_layout)
            s_zero = gl.zeros([cfg.BLOCK_N, cfg.BLOCK_M], gl.float32, s_layout)
            dq_zero = gl.zeros([cfg.BLOCK_M, DQ_COLS], gl.float32, dq_layout)
            if PIECES:  # dK's high piece, and the zero of dQ's
                dk_hi = gl.zeros([cfg.BLOCK_N, HI], gl.float32, hi_layout)
                dq_hi_zero = gl.zeros([cfg.BLOCK_M, HI], gl.float32, hi_layout)
            lse_smem, delta_smem = stat_buffers(cfg)
            if n_steps > 0:
                step_stats(call, cfg, lse_smem, delta_smem, 0, h, m0, q_start, seqlen_q)
            thread_barrier()
            mbarrier.wait(kv_bar.index(0), 0)
            # HI_LATE (BwdConfig.dq_hi_late): the previous step's high dQ half, staged in its Q
            # slot, is reduced from there once this step's first MMAs are issued
            pend_row = 0
            pend_first = 0  # (FIRST_STORES: whether that half is its query block's first)
            pend_col = 0

            for it in range(n_steps):
                first = 0  # (deterministic mode: 1 on the query block's first dQ turn)
                slot = it % 2
                h_next, m0_next = next_step(h, m0, m_lo, m_end, h_first, h_first + call.group,
                                            cfg.BLOCK_M)
                mbarrier.wait(q_ready.index(slot), (it // 2) & 1)
                do_slot = it % DO_BUFS
                mbarrier.wait(do_ready.index(do_slot), (it // DO_BUFS) & 1)
                q_s = q_smem.index(slot)
                do_s = do_smem.index(do_slot)
                s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                if PIECES:  # the high piece's K-steps into the same accumulator
                    q_hi_s = q_hi.index(slot)
                    s_tok = warpgroup_mma(k_hi, q_hi_s.permute((1, 0)), s_tok, is_async=True)
                dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                if cfg.HI_LATE:
                    if it > 0:  # barrier 1 below waits for its read before Q's next load
                        add_dq_tile(call.dq_desc, pend_row, pend_col,
                                    _dq_tile_in(q_smem.index(1 - slot), call.dq_desc),
                                    cfg.FIRST_STORES, pend_first)
                if not cfg.STATS_LATE:  # next step's statistics (published by barrier 1)
                    if it + 1 < n_steps:
                        step_stats(call, cfg, lse_smem, delta_smem, 1 - slot, h_next, m0_next,
                                   q_start, seqlen_q)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                lse2 = lse_smem.index(slot).load(col_layout)
                p, p_ds = step_probabilities(call, cfg, s, lse2, m0, keys_oob, m_full_lo, m_full_hi,
                                            kloc, cols, n_valid, diag_right, diag_left)
                pt_smem.store(p.to(dtype))
                p = p_ds
                fence_async_shared()
                if cfg.DETERMINISTIC:
                    if cfg.RELEASE_AT == 1:
                        if it > 0:  # the previous step's turn (attn_bwd_sync)
                            release_dq_turn_after_tma(held, m0)
                # the previous step's dQ reduces have read their staging (dq_smem, or with
                # DQ_IN_OPS that step's dO buffer and Q slot, loaded next)
                tma.store_wait(0)
                thread_barrier()  # barrier 1
                if PIECES:
                    load_pieces(call.q_desc, q_smem.index(1 - slot), q_hi.index(1 - slot),
                                q_ready.index(1 - slot), q_start + m0_next, h_next, cfg.BLOCK_M,
                                cfg.HEAD_DIM, it + 1 < n_steps)
                else:
                    load_rows(call.q_desc, q_smem.index(1 - slot), q_ready.index(1 - slot),
                              q_start + m0_next, h_next, cfg.HEAD_DIM, it + 1 < n_steps)
                if cfg.DQ_IN_OPS:  # half a step earlier than a single buffer allows
                    load_rows(call.do_desc, do_smem.index(1 - do_slot), do_ready.index(1 - do_slot),
                              q_start + m0_next, h_next, cfg.HEAD_DIM_V, it + 1 < n_steps)
                dv_tok = warpgroup_mma(pt_smem, do_s, dv, is_async=True)
                if cfg.DETERMINISTIC:
                    if cfg.RELEASE_AT == 3:
                        if it > 0:  # the previous step's turn, under the dV and dPᵀ MMAs
                            release_dq_turn_after_tma(held, m0, True)
                if cfg.DV_OVERLAP:
                    # dV stays in flight while dSᵀ is formed (groups retire in order).
                    dp = warpgroup_mma_wait(1, deps=[dp_tok])
                else:
                    dp, dv = warpgroup_mma_wait(0, deps=[dp_tok, dv_tok])
                delta = delta_smem.index(slot).load(col_layout)
                ds = p * (dp - gl.expand_dims(delta, 0))
                ds_smem.store(ds.to(dtype))
                if cfg.DV_OVERLAP:
                    dv = warpgroup_mma_wait(0, deps=[dv_tok])  # before barrier 2 (Pᵀ reuse)
                fence_async_shared()
                thread_barrier()  # barrier 2
                if not cfg.DQ_IN_OPS:
                    load_rows(call.do_desc, do_s, do_ready.index(0), q_start + m0_next, h_next,
                              cfg.HEAD_DIM_V, it + 1 < n_steps)
                dk_tok = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
                if PIECES:
                    dk_hi_tok = warpgroup_mma(ds_smem, q_hi_s, dk_hi, is_async=True)
                    dq_lo_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero,
                                              use_acc=False, is_async=True)
                    dq_hi_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_hi, dq_hi_zero,
                                              use_acc=False, is_async=True)
                else:
                    dq_lo_tok = warpgroup_mma(ds_smem.permute((1, 0)),
                                              k_smem.slice(0, DQ_COLS, 1), dq_zero,
                                              use_acc=False, is_async=True)
                    dq_hi_tok = warpgroup_mma(ds_smem.permute((1, 0)),
                                              k_smem.slice(DQ_COLS, DQ_COLS, 1), dq_zero,
                                              use_acc=False, is_async=True)
                if cfg.STATS_LATE:
                    # Next step's statistics under the dK/dQ MMAs (bwd.BwdConfig.stats_late):
                    # buffer 1 - slot was last read before barrier 2.
                    if it + 1 < n_steps:
                        step_stats(call, cfg, lse_smem, delta_smem, 1 - slot, h_next, m0_next,
                                   q_start, seqlen_q)
                if cfg.DETERMINISTIC:  # the semaphore's round trip under the MMAs (attn_bwd_sync)
                    sem, first = take_dq_turn(call, cfg, held, it, batch, h, m0, n_blk, n_seq,
                                              shift, h_first, m_lo, group_blocks, stride, True)
                # Groups retire in order: the low dQ half is added while the high one runs.
                if PIECES:
                    dk, dk_hi, dq_lo = warpgroup_mma_wait(1, deps=[dk_tok, dk_hi_tok, dq_lo_tok])
                else:
                    dk, dq_lo = warpgroup_mma_wait(1, deps=[dk_tok, dq_lo_tok])
                if PIECES:
                    # Row-major 64-column boxes (rows past the sequence add exact zeros, as
                    # below): the low piece from two boxes of one tile, then the high piece
                    # from its own tile, staged while the low one's reduces read theirs.
                    dq_row = q_start + m0
                    lo_buf = dq_smem._reinterpret(gl.float32, [cfg.BLOCK_M, LO],
                                                  call.dq_desc.layout)
                    lo_buf.store(dq_lo * call.softmax_scale)
                    fence_async_shared()
                    thread_barrier()
                    add_dq_tile(call.dq_desc, dq_row, piece_col(h, 0, cfg.HEAD_DIM),
                                dq_smem.index(0), cfg.FIRST_STORES, first)
                    add_dq_tile(call.dq_desc, dq_row, piece_col(h, HI, cfg.HEAD_DIM),
                                dq_smem.index(1), cfg.FIRST_STORES, first)
                    dq_hi = warpgroup_mma_wait(0, deps=[dq_hi_tok])
                    dq_hi_smem.store(dq_hi * call.softmax_scale)
                    fence_async_shared()
                    thread_barrier()
                    add_dq_tile(call.dq_desc, dq_row, piece_col(h, LO, cfg.HEAD_DIM),
                                dq_hi_smem, cfg.FIRST_STORES, first)
                else:
                    # One staging tile for both halves (attn_bwd_sync: rows past the sequence add
                    # exact zeros): three more barriers, but no per-thread atomics.
                    # FRAG: the halves as tiles in the accumulator's order (dq_fragments.py:
                    # parts 0 and 1 of the 64-row block `fragment_block`)
                    FRAG: gl.constexpr = in_fragments(call.dq_desc.layout)
                    if FRAG:
                        TILE_ROWS: gl.constexpr = call.dq_desc.block_type.shape[0]
                        dq_row = fragment_block(q_start, m0) * 2 * TILE_ROWS
                        lo_col = h * 32
                        hi_row = dq_row + TILE_ROWS
                        hi_col = lo_col
                    else:
                        dq_row = q_start + m0
                        lo_col = h * cfg.HEAD_DIM
                        hi_row = dq_row
                        hi_col = lo_col + DQ_COLS
                    if cfg.DQ_IN_OPS:
                        # dO's readers (dPᵀ, dV) retired in every thread before barrier 2
                        lo_buf = _dq_tile_in(do_s, call.dq_desc)
                    else:
                        lo_buf = dq_smem
                    stage_dq(lo_buf, dq_lo * call.softmax_scale, FRAG, cfg.BLOCK_M, DQ_COLS)
                    fence_async_shared()
                    thread_barrier()
                    add_dq_tile(call.dq_desc, dq_row, lo_col, lo_buf, cfg.FIRST_STORES, first)
                    dq_hi = warpgroup_mma_wait(0, deps=[dq_hi_tok])
                    if cfg.DQ_IN_OPS:
                        # Q's last reader, dK = dSᵀ·Q, retired in every thread before the
                        # barrier above: nothing waits for the low half's reduce here.
                        hi_buf = _dq_tile_in(q_s, call.dq_desc)
                    else:
                        hi_buf = dq_smem
                        tma.store_wait(0)  # the low half's reduce has read dq_smem
                        thread_barrier()
                    stage_dq(hi_buf, dq_hi * call.softmax_scale, FRAG, cfg.BLOCK_M, DQ_COLS)
                    fence_async_shared()
                    thread_barrier()
                    if cfg.HI_LATE:
                        pend_row = hi_row + 0  # (`+ 0`: see bwd_ws's h_prev)
                        pend_first = first + 0
                        pend_col = hi_col + 0
                    else:
                        add_dq_tile(call.dq_desc, hi_row, hi_col, hi_buf, cfg.FIRST_STORES, first)
                if cfg.DETERMINISTIC:
                    held = after_dq_reduce(sem, m0, cfg.RELEASE_AT)
                h = h_next
                m0 = m0_next

            if cfg.HI_LATE:
                if n_steps > 0:  # the last step's high half
                    add_dq_tile(call.dq_desc, pend_row, pend_col,
                                _dq_tile_in(q_smem.index((n_steps - 1) % 2), call.dq_desc),
                                cfg.FIRST_STORES, pend_first)
            finish_dq(cfg, held, n_steps)
            for st in gl.static_range(2):
                mbarrier.invalidate(q_ready.index(st))
            for st in gl.static_range(DO_BUFS):
                mbarrier.invalidate(do_ready.index(st))
            mbarrier.invalidate(kv_bar.index(0))
            if PIECES:  # (host: KV_TMA_STORE is off) dK's pieces into its 192-wide rows
                store_key_piece(call.dk_ptr, dk * call.softmax_scale, n0, k_start, seqlen_k,
                                call.n_kv_heads, hk, cfg.HEAD_DIM, 0, LO, cfg.BLOCK_N,
                                dk_layout)
                store_key_piece(call.dk_ptr, dk_hi * call.softmax_scale, n0, k_start,
                                seqlen_k, call.n_kv_heads, hk, cfg.HEAD_DIM, LO, HI,
                                cfg.BLOCK_N, hi_layout)
                store_key_rows(call.dv_ptr, dv, n0, k_start, seqlen_k, call.n_kv_heads, hk,
                               cfg.HEAD_DIM_V, cfg.BLOCK_N, dv_layout)
            else:
                store_key_grads(call, cfg, dk * call.softmax_scale, dv, q_smem, do_smem, n0,
                                k_start, seqlen_k, hk, dk_layout, dv_layout)
