"""The warp-specialised backward's roles (`kernel_ws.py`): the load warp, the compute
warpgroups' step, the dQ warp (hand-over, deterministic turns), the shared-memory plan and
the epilogue's staging buffers."""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..bounds import (
        step_needs_mask,
    )
    from ..common import (
        aggregate,
        fence_async_shared,
        gl,
        gluon,
        leading_tile,
        mbarrier,
        row_tile,
        thread_barrier,
        tile_layout,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from ..sched import (
        next_step,
    )
    from .parts import (
        PIECE,
        add_dq_tile,
        fragment_block,
        in_fragments,
        load_kv,
        load_kv_pieces,
        load_qdo,
        load_qdo_pieces,
        mma_layout,
        probabilities,
        release_dq_turn_after_tma,
        stage_dq,
        stage_stats,
        store_key_piece,
        store_key_rows,
        store_key_tiles,
        tma_reduce_add,
        wait_dq_turn,
    )

    # setmaxnreg per compute warpgroup and for the load warp (padded to a warpgroup):
    # 240 * 256 + 24 * 128 = 64512 <= 64K registers.
    COMPUTE_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)

    @aggregate
    class WsSmem:
        """A bwd_ws CTA's shared memory and mbarriers (`ws_alloc`; the constructor takes the
        fields in order). Rings and their barriers are indexed by a step's slot; K and V hold
        one tile's keys (`for_tile`)."""

        q: gl.shared_memory_descriptor  # [RING, BLOCK_M, HEAD_DIM]
        k: gl.shared_memory_descriptor  # [BLOCK_N, HEAD_DIM] (persistent: [KV_BUFS, ...])
        v: gl.shared_memory_descriptor  # [BLOCK_N, HEAD_DIM_V] (likewise)
        do: gl.shared_memory_descriptor  # [RING, BLOCK_M, HEAD_DIM_V]
        ds: gl.shared_memory_descriptor  # dSᵀ [2, BLOCK_N, BLOCK_M], each warpgroup its keys
        dq: gl.shared_memory_descriptor  # fp32 dQ staging, [2 warpgroups] + the reduce box
        lse: gl.shared_memory_descriptor  # [RING, BLOCK_M] (log2 units)
        delta: gl.shared_memory_descriptor  # [RING, BLOCK_M]
        kv_bar: gl.shared_memory_descriptor  # K/V landed, per K/V buffer
        ready: gl.shared_memory_descriptor  # ring slot filled (TMA bytes + statistics)
        empty: gl.shared_memory_descriptor  # ring slot read by both warpgroups
        ds_ready: gl.shared_memory_descriptor  # [2 slots x 2 warpgroups] dSᵀ half written
        ds_free: gl.shared_memory_descriptor  # dSᵀ slot read by both dQ MMAs
        dq_full: gl.shared_memory_descriptor  # warpgroup w's dQ tile staged (dQ warp)
        dq_empty: gl.shared_memory_descriptor  # ... and read by the dQ warp's reduce
        done: gl.shared_memory_descriptor  # both warpgroups past their last MMA
        # Head dim 192 (`pieces`): q and k above hold columns 0-127, these 128-191 (Gluon's
        # tiles are powers of two). Otherwise q and k again, never read.
        q_hi: gl.shared_memory_descriptor  # [RING, BLOCK_M, 64]
        k_hi: gl.shared_memory_descriptor  # [BLOCK_N, 64]

        @gluon.jit
        def for_tile(self, tile, KV_BUFS: gl.constexpr):
            """The same buffers with K and V those of a persistent CTA's tile-th tile."""
            return WsSmem(self.q, kv_buffer(self.k, tile, KV_BUFS),
                          kv_buffer(self.v, tile, KV_BUFS), self.do, self.ds, self.dq,
                          self.lse, self.delta, self.kv_bar, self.ready, self.empty,
                          self.ds_ready, self.ds_free, self.dq_full, self.dq_empty, self.done,
                          self.q_hi, kv_buffer(self.k_hi, tile, KV_BUFS))

    @gluon.constexpr_function
    def pieces(head_dim):
        """Whether a build takes q and k as a 128- and a 64-wide piece (head dim 192: no MMA
        on zero columns, `parts.load_pieces`)."""
        return head_dim == 192

    @gluon.constexpr_function
    def dq_cols(head_dim, block_m):
        """Columns of a warpgroup's dQ accumulator (`ws_dq`): a 64-column piece at head dim
        192, half the columns with 64-row steps, all of them with 128-row steps."""
        if pieces(head_dim):
            return 64  # parts.PIECE
        return head_dim // 2 if block_m == 64 else head_dim

    @gluon.jit
    def ws_loader(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, smem, k_row, hk,
                  q_start, seqlen_q, total_q, n_steps, h, m0, m_lo, m_end, h_first, group, cfg,
                  it0=0, tile=0, kv_free=None, epi_done=None, PERSISTENT: gl.constexpr = False,
                  EPI: gl.constexpr = 0):
        """K and V, then per step the statistics and Q/dO into the ring. PERSISTENT: one
        tile of a persistent CTA (`_ws_tiles`), its steps numbered on from it0 (the ring's
        phases run on across tiles), the tile-th of this CTA, its K/V in buffer
        tile % KV_BUFS (smem's K and V: that buffer)."""
        kv = tile % cfg.KV_BUFS
        if PERSISTENT:
            if tile >= cfg.KV_BUFS:  # both warpgroups are done with this buffer's last tile
                mbarrier.wait(kv_free.index(kv), ((tile - cfg.KV_BUFS) // cfg.KV_BUFS) & 1)
        if pieces(cfg.HEAD_DIM):
            load_kv_pieces(k_desc, v_desc, smem.k, smem.k_hi, smem.v, smem.kv_bar.index(kv),
                           k_row, hk, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.HEAD_DIM_V)
        else:
            load_kv(k_desc, v_desc, smem.k, smem.v, smem.kv_bar.index(kv), k_row, hk,
                    cfg.HEAD_DIM, cfg.HEAD_DIM_V)
        if PERSISTENT and EPI == 0:  # `epilogue_buffers`
            if tile > 0:  # ... and past its dK/dV stores, staged through ring slots
                mbarrier.wait(epi_done.index(0), (tile - 1) & 1)
        stat_layout: gl.constexpr = gl.BlockedLayout([cfg.BLOCK_M // 32], [32], [1], [0])
        for it in range(n_steps):
            g = it0 + it  # the step's number in the CTA (all its tiles)
            slot = g % cfg.RING
            if g >= cfg.RING:  # both warpgroups are done with step g - RING
                mbarrier.wait(smem.empty.index(slot), ((g - cfg.RING) // cfg.RING) & 1)
            # Q and dO first, so that their TMA latency overlaps the statistics' loads (a
            # CTA's first step waits for both; faster for short calls). `ready` takes a second
            # arrive, behind the statistics' stores (release semantics, behind a barrier of
            # this warp).
            if pieces(cfg.HEAD_DIM):
                load_qdo_pieces(q_desc, do_desc, smem.q, smem.q_hi, smem.do, smem.ready, slot,
                                h, q_start + m0, cfg.BLOCK_M, cfg.HEAD_DIM, cfg.HEAD_DIM_V,
                                True)
            else:
                load_qdo(q_desc, do_desc, smem.q, smem.do, smem.ready, slot, h, q_start + m0,
                         cfg.HEAD_DIM, cfg.HEAD_DIM_V, True)
            stage_stats(lse_ptr, delta_ptr, smem.lse, smem.delta, slot, h, m0, q_start,
                        seqlen_q, total_q, cfg.BLOCK_M, stat_layout, True)
            mbarrier.arrive(smem.ready.index(slot), count=1)
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, cfg.BLOCK_M)

    @gluon.jit
    def dq_box(WG: gl.constexpr, h, m0, q_start, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr):
        """(row, column) of warpgroup WG's dQ box for the step at (h, m0): its half of the
        columns (64-row steps) or of the rows (128-row steps)."""
        if BLOCK_M == 64:
            return q_start + m0, h * HEAD_DIM + WG * (HEAD_DIM // 2)
        return q_start + m0 + WG * (BLOCK_M // 2), h * HEAD_DIM

    @gluon.jit
    def dq_coord(WG: gl.constexpr, h, m0, q_start, FRAG: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, TILE_ROWS: gl.constexpr):
        """(row, column) of warpgroup WG's dQ reduce for the step at (h, m0): its box in dQ's
        rows (`dq_box`), or its tile in the fragment buffer (FRAG: rows of block
        `fragment_block` (its column part), columns of head h; `dq_fragments.py`)."""
        if FRAG:
            block = fragment_block(q_start, m0)
            if BLOCK_M == 64:  # the warpgroups split dQ's columns: two tiles per block
                return (block * 2 + WG) * TILE_ROWS, h * 32
            return (block + WG) * TILE_ROWS, h * 32  # ... or its rows
        return dq_box(WG, h, m0, q_start, HEAD_DIM, BLOCK_M)

    @gluon.jit
    def ws_dq(smem, dq_buf, dq_desc, j, h, m0, q_start, softmax_scale, dq_zero,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              DET: gl.constexpr, dk=None, ds_op=None, q_s=None, WITH_DK: gl.constexpr = False):
        """This warpgroup's part of dQ = dS·K for step j: wait for the other half of dSᵀ,
        MMA, stage, reduce-add (retires every MMA this warpgroup has in flight but the dK
        that WITH_DK issues behind it). With
        64-row steps (d=128) the warpgroups split dQ's columns, with 128-row steps (d=64)
        its rows: one wgmma M either way; at head dim 192, 64-column pieces (`_dq_pieces`).
        DET (deterministic mode): the staged tile goes to
        the dQ warp (`ws_dq_turns`), which adds it in turn. WITH_DK
        (`BwdConfig.ws_dk_after_dq`): dK += dSᵀ·Q is issued right after the dQ MMA and left
        in flight while dQ is staged (FA4's order); returns its token."""
        js = j % 2
        mbarrier.wait(smem.ds_ready.index(2 * js + 1 - WG), (j // 2) & 1)
        if pieces(HEAD_DIM):
            gl.static_assert(not (DET or WITH_DK), "head dim 192: no dQ warp, dK before dQ")
            _dq_pieces(smem, dq_buf, dq_desc, js, q_start + m0, h * HEAD_DIM, softmax_scale,
                       dq_zero, WG)
        elif WITH_DK:
            dk = _dq_half(smem, dq_buf, dq_desc, j, js, h, m0, q_start, softmax_scale, dq_zero,
                          WG, HEAD_DIM, BLOCK_M, DET, dk, ds_op, q_s, True)
        else:
            _dq_half(smem, dq_buf, dq_desc, j, js, h, m0, q_start, softmax_scale, dq_zero, WG,
                     HEAD_DIM, BLOCK_M, DET, dk, ds_op, q_s, False)
        if WITH_DK:
            return dk

    @gluon.jit
    def _dq_half(smem, dq_buf, dq_desc, j, js, h, m0, q_start, softmax_scale, dq_zero,
                 WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 DET: gl.constexpr, dk, ds_op, q_s, WITH_DK: gl.constexpr):
        """`ws_dq`'s half of dQ (its columns or rows) once dSᵀ slot js is whole."""
        if BLOCK_M == 64:
            COLS: gl.constexpr = HEAD_DIM // 2
            dq_tok = warpgroup_mma(smem.ds.index(js).permute((1, 0)),
                                   smem.k.slice(WG * COLS, COLS, 1), dq_zero, use_acc=False,
                                   is_async=True)
        else:
            ROWS: gl.constexpr = BLOCK_M // 2
            dq_tok = warpgroup_mma(smem.ds.index(js).slice(WG * ROWS, ROWS, 1).permute((1, 0)),
                                   smem.k, dq_zero, use_acc=False, is_async=True)
        if WITH_DK:  # wgmma groups retire in order: waiting for dQ leaves dK running
            dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dq = warpgroup_mma_wait(1, deps=[dq_tok])
        else:
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(smem.ds_free.index(js))
        if DET:
            if j > 0:  # the dQ warp has read this warpgroup's tile of step j - 1
                mbarrier.wait(smem.dq_empty.index(WG), (j - 1) & 1)
        else:
            tma.store_wait(0)  # this warpgroup's previous reduce has read dq_buf
        FRAG: gl.constexpr = in_fragments(dq_desc.layout)
        stage_dq(dq_buf, dq * softmax_scale, FRAG, 64, dq_zero.shape[1])
        fence_async_shared()
        thread_barrier()
        if DET:
            mbarrier.arrive(smem.dq_full.index(WG), count=1)
        else:
            row, col = dq_coord(WG, h, m0, q_start, FRAG, HEAD_DIM, BLOCK_M,
                                 dq_desc.block_type.shape[0])
            tma_reduce_add(dq_desc, [row, col], dq_buf)
        if WITH_DK:
            return dk

    @gluon.jit
    def _dq_pieces(smem, dq_buf, dq_desc, js, row, col0, softmax_scale, dq_zero,
                   WG: gl.constexpr):
        """`ws_dq` at head dim 192, dQ's row block at (row, col0): 64-column pieces (half of
        192 columns is no power of two), warpgroup 0 columns 0-127 one piece after the other
        (both accumulators at once would not fit beside dK and dV), warpgroup 1 columns
        128-191."""
        if WG == 0:
            _dq_piece(smem, dq_buf, dq_desc, js, smem.k.slice(0, PIECE, 1), row, col0,
                      softmax_scale, dq_zero, False)
            _dq_piece(smem, dq_buf, dq_desc, js, smem.k.slice(PIECE, PIECE, 1), row,
                      col0 + PIECE, softmax_scale, dq_zero, True)
        else:
            _dq_piece(smem, dq_buf, dq_desc, js, smem.k_hi, row, col0 + 2 * PIECE,
                      softmax_scale, dq_zero, True)

    @gluon.jit
    def _dq_piece(smem, dq_buf, dq_desc, js, k_piece, row, col, softmax_scale, dq_zero,
                  LAST: gl.constexpr):
        """One 64-column piece of dQ = dS·K at head dim 192 (`ws_dq`): MMA over the dSᵀ
        slot js, stage in dq_buf once its previous reduce has read it, reduce-add at (row,
        col). LAST: the warpgroup's last read of the dSᵀ slot (ds_free)."""
        dq_tok = warpgroup_mma(smem.ds.index(js).permute((1, 0)), k_piece, dq_zero,
                               use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        if LAST:
            mbarrier.arrive(smem.ds_free.index(js))
        tma.store_wait(0)
        stage_dq(dq_buf, dq * softmax_scale, False, 64, PIECE)
        fence_async_shared()
        thread_barrier()
        tma_reduce_add(dq_desc, [row, col], dq_buf)

    @gluon.jit
    def ws_dq_turns(smem, dq_desc, sem_ptr, q_start, n_steps, h, m0, m_lo, m_end, h_first,
                    group, batch, n_heads, num_m_blocks, n_blk, n_seq, shift, window_left,
                    window_right, group_blocks, stride, cfg, STAGGER: gl.constexpr,
                    DET: gl.constexpr, TURNS: gl.constexpr, it0=0):
        """The dQ warp (DET: the compute warpgroups hand it their staged dQ tiles): per step,
        with TURNS (deterministic mode) wait for this CTA's dQ turn on the step's query block
        (parts.wait_dq_turn, the synchronous kernel's order), then for both warpgroups'
        tiles, reduce-add them, hand the tiles back once read, and (TURNS) pass the turn on
        once the adds have landed. The turn's round trips and the wait for the writes stay
        off the compute warpgroups, which only wait for their tile's hand-back (a step
        later). Without TURNS (BwdConfig.ws_dq_warp) it only takes the reduces off them.
        FIRST_STORES (with TURNS): turn 0 stores its tiles instead of adding them, the
        buffer being left unzeroed (`first_stores`)."""
        if not DET:
            return
        for j in range(n_steps):
            first = 0
            if TURNS:
                sem, first = wait_dq_turn(sem_ptr, batch, n_heads, h, num_m_blocks, m0, n_blk,
                                          n_seq, shift, window_left, window_right, h_first,
                                          m_lo, group_blocks, stride, cfg.BLOCK_M, cfg.BLOCK_N,
                                          cfg.HAS_LEFT, cfg.HAS_RIGHT, STAGGER, True)
            mbarrier.wait(smem.dq_full.index(0), (it0 + j) & 1)
            mbarrier.wait(smem.dq_full.index(1), (it0 + j) & 1)
            FRAG: gl.constexpr = in_fragments(dq_desc.layout)
            TILE_ROWS: gl.constexpr = dq_desc.block_type.shape[0]
            row, col = dq_coord(0, h, m0, q_start, FRAG, cfg.HEAD_DIM, cfg.BLOCK_M,
                                 TILE_ROWS)
            add_dq_tile(dq_desc, row, col, smem.dq.index(0), cfg.FIRST_STORES, first)
            row, col = dq_coord(1, h, m0, q_start, FRAG, cfg.HEAD_DIM, cfg.BLOCK_M,
                                 TILE_ROWS)
            add_dq_tile(dq_desc, row, col, smem.dq.index(1), cfg.FIRST_STORES, first)
            tma.store_wait(0)  # both reduces have read their tiles
            thread_barrier()
            mbarrier.arrive(smem.dq_empty.index(0), count=1)
            mbarrier.arrive(smem.dq_empty.index(1), count=1)
            if TURNS:
                release_dq_turn_after_tma(sem, m0)
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, cfg.BLOCK_M)

    @gluon.jit
    def ws_compute(shared, cfg, WG: gl.constexpr, DET: gl.constexpr, it0=0, tile=0,
                   kv_free=None, epi_done=None, PERSISTENT: gl.constexpr = False,
                   EPI: gl.constexpr = 0, dv_stage=None):
        # PERSISTENT: one tile of a persistent CTA, as in ws_loader (steps numbered on
        # from it0; the late warpgroup's previous step is always one of this tile's; K/V in
        # buffer tile % KV_BUFS, which `shared`'s smem holds).
        (smem, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, q_start, k_start, seqlen_q, seqlen_k,
         n_kv_heads, hk, n0, n_steps, h, m0, m_lo, m_end, h_first, group, keys_oob, m_full_lo,
         m_full_hi, qk_scale, softmax_scale, softcap_pre, window_left, window_right) = shared
        KEYS: gl.constexpr = cfg.BLOCK_N // 2
        # Head dim 192: q, k and dK as a 128- and a 64-wide piece (`pieces`), dQ by
        # 64-column pieces (`ws_dq`)
        PIECES: gl.constexpr = pieces(cfg.HEAD_DIM)
        DK_COLS: gl.constexpr = cfg.HEAD_DIM - PIECE if PIECES else cfg.HEAD_DIM
        DQ_ROWS: gl.constexpr = 64  # dQ = dS·K by halves of its columns or rows (ws_dq)
        DQ_COLS: gl.constexpr = dq_cols(cfg.HEAD_DIM, cfg.BLOCK_M)
        s_layout: gl.constexpr = mma_layout(4, 1, cfg.BLOCK_M)
        dk_layout: gl.constexpr = mma_layout(4, 1, DK_COLS)
        hi_layout: gl.constexpr = mma_layout(4, 1, PIECE)  # dK's high piece (PIECES)
        dv_layout: gl.constexpr = mma_layout(4, 1, cfg.HEAD_DIM_V)
        dq_layout: gl.constexpr = mma_layout(4, 1, DQ_COLS)
        pv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                         k_width=2)
        dsq_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                          k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = smem.k.dtype

        k_mine = smem.k.slice(WG * KEYS, KEYS)
        v_mine = smem.v.slice(WG * KEYS, KEYS)
        dq_buf = smem.dq.index(WG)
        kloc = WG * KEYS + gl.arange(0, KEYS, layout=key_layout)
        cols = gl.arange(0, cfg.BLOCK_M, layout=col_layout)
        shift = seqlen_k - seqlen_q
        n_valid = seqlen_k - n0
        diag_right = shift + window_right - n0
        diag_left = shift - window_left - n0
        dk = gl.zeros([KEYS, DK_COLS], gl.float32, dk_layout)
        if PIECES:
            gl.static_assert(not (cfg.DK_AFTER_DQ or cfg.PERSISTENT or cfg.KV_TMA_STORE),
                             "head dim 192: dK before dQ, plain grid, dK/dV stored by rows")
            k_hi_mine = smem.k_hi.slice(WG * KEYS, KEYS)
            dk_hi = gl.zeros([KEYS, PIECE], gl.float32, hi_layout)
        dv = gl.zeros([KEYS, cfg.HEAD_DIM_V], gl.float32, dv_layout)
        s_zero = gl.zeros([KEYS, cfg.BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, dq_layout)
        h_prev = h
        m0_prev = m0
        kv = tile % cfg.KV_BUFS
        mbarrier.wait(smem.kv_bar.index(kv), (tile // cfg.KV_BUFS) & 1)
        for it in range(n_steps):
            g = it0 + it  # the step's number in the CTA (all its tiles)
            slot = g % cfg.RING  # the Q/dO ring
            ds_slot = g % 2  # the dSᵀ buffers (ws_dq)
            mbarrier.wait(smem.ready.index(slot), (g // cfg.RING) & 1)
            q_s = smem.q.index(slot)
            do_s = smem.do.index(slot)
            s_tok = warpgroup_mma(k_mine, q_s.permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            if PIECES:  # the high piece's K-steps into the same Sᵀ
                q_hi_s = smem.q_hi.index(slot)
                s_tok = warpgroup_mma(k_hi_mine, q_hi_s.permute((1, 0)), s_tok, is_async=True)
            if cfg.DP_EARLY:
                dp_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
            else:
                s = warpgroup_mma_wait(0, deps=[s_tok])
            lse2 = smem.lse.index(slot).load(col_layout)
            p, p_ds = probabilities(
                s, lse2, qk_scale, softcap_pre,
                step_needs_mask(m0, keys_oob, m_full_lo, m_full_hi, cfg.HAS_LEFT, cfg.HAS_RIGHT),
                kloc, cols, n_valid, m0, diag_right, diag_left, cfg.SOFTCAP, cfg.HAS_LEFT,
                cfg.HAS_RIGHT, cfg.MASK_MODE)
            if PIECES:
                # dK and dV hold 160 registers: dV retires (and Pᵀ's operand with it) before
                # dPᵀ's accumulator is live beside Pᵀ (issued beside dV, sm_90a: 399
                # local-memory instructions against 179)
                gl.static_assert(not (cfg.DP_EARLY or cfg.DV_OVERLAP),
                                 "head dim 192: dPᵀ after dV")
                p_op = gl.convert_layout(p.to(dtype), pv_op_layout)
                dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
                dv, p_op = warpgroup_mma_wait(0, deps=[dv_tok, p_op])
                dp_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                dp = warpgroup_mma_wait(0, deps=[dp_tok])
            else:
                if not cfg.DP_EARLY:
                    dp_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), s_zero,
                                           use_acc=False, is_async=True)
                p_op = gl.convert_layout(p.to(dtype), pv_op_layout)
                dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
                if cfg.DV_OVERLAP:  # dSᵀ is formed while dV = Pᵀ·dO runs (retired with dK)
                    dp = warpgroup_mma_wait(1, deps=[dp_tok])
                else:
                    dp, dv, p_op = warpgroup_mma_wait(0, deps=[dp_tok, dv_tok, p_op])
            delta = smem.delta.index(slot).load(col_layout)
            ds16 = (p_ds * (dp - gl.expand_dims(delta, 0))).to(dtype)
            if g >= 2:  # both dQ MMAs of step g - 2 have read this dSᵀ slot
                mbarrier.wait(smem.ds_free.index(ds_slot), ((g - 2) // 2) & 1)
            smem.ds.index(ds_slot).slice(WG * KEYS, KEYS).store(ds16)
            fence_async_shared()
            mbarrier.arrive(smem.ds_ready.index(2 * ds_slot + WG), count=1)
            if PIECES:  # dK's A operand: this warpgroup's half of the slot (no registers)
                ds_op = smem.ds.index(ds_slot).slice(WG * KEYS, KEYS)
            else:
                ds_op = gl.convert_layout(ds16, dsq_op_layout)
            if cfg.DK_AFTER_DQ:  # dK issued inside ws_dq, behind the dQ MMA
                if WG == cfg.LATE_WG:
                    if it > 0:
                        dk_tok = ws_dq(smem, dq_buf, dq_desc, g - 1, h_prev, m0_prev, q_start,
                                       softmax_scale, dq_zero, WG, cfg.HEAD_DIM, cfg.BLOCK_M, DET,
                                       dk, ds_op, q_s, True)
                    else:
                        dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                else:
                    dk_tok = ws_dq(smem, dq_buf, dq_desc, g, h, m0, q_start, softmax_scale,
                                   dq_zero, WG, cfg.HEAD_DIM, cfg.BLOCK_M, DET, dk, ds_op, q_s,
                                   True)
            else:
                dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                if PIECES:
                    dk_hi_tok = warpgroup_mma(ds_op, q_hi_s, dk_hi, is_async=True)
                if WG == cfg.LATE_WG:  # one step late: the other half of this step is not there
                    if it > 0:
                        ws_dq(smem, dq_buf, dq_desc, g - 1, h_prev, m0_prev, q_start,
                              softmax_scale, dq_zero, WG, cfg.HEAD_DIM, cfg.BLOCK_M, DET)
                else:
                    ws_dq(smem, dq_buf, dq_desc, g, h, m0, q_start, softmax_scale, dq_zero, WG,
                          cfg.HEAD_DIM, cfg.BLOCK_M, DET)
            if PIECES:
                dk, dk_hi = warpgroup_mma_wait(0, deps=[dk_tok, dk_hi_tok])
            elif cfg.DV_OVERLAP:
                dk, dv, ds_op, p_op = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok, ds_op, p_op])
            else:
                dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
            mbarrier.arrive(smem.empty.index(slot))
            # `+ 0`: with a plain `h_prev = h` triton 3.6's frontend carried neither h nor
            # h_prev through the loop (its scf.for kept only dK and dV; found in the TTGIR)
            h_prev = h + 0
            m0_prev = m0 + 0
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, cfg.BLOCK_M)
        if WG == cfg.LATE_WG:
            if n_steps > 0:
                ws_dq(smem, dq_buf, dq_desc, it0 + n_steps - 1, h_prev, m0_prev, q_start,
                      softmax_scale, dq_zero, WG, cfg.HEAD_DIM, cfg.BLOCK_M, DET)
        if PERSISTENT and EPI != 3:  # this warpgroup's MMAs have read K and V for the last
            # time (before the reduce's wait: the load warp's next K/V are the tile's
            # critical path; EPI 3 stages dK/dV in this K/V buffer: freed after the stores)
            mbarrier.arrive(kv_free.index(kv), count=1)
        tma.store_wait(0)  # the last reduce reads dq_buf
        # The epilogue stages through the Q/dO ring, which the other warpgroup may still read.
        mbarrier.arrive(smem.done.index(0), count=1)
        mbarrier.wait(smem.done.index(0), tile & 1)
        dk = dk * softmax_scale  # S = scale·Q·Kᵀ
        if cfg.KV_TMA_STORE:
            dk_buf, dv_buf = epilogue_buffers(smem, dv_stage, dk_desc, dv_desc, WG, EPI)
            store_key_tiles(dk_desc, dv_desc, dk, dv, dk_buf, dv_buf,
                            k_start + n0 + WG * KEYS, hk, cfg.HEAD_DIM, cfg.HEAD_DIM_V)
        elif PIECES:  # dK's pieces into its 192-wide rows
            store_key_piece(dk_ptr, dk, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                            cfg.HEAD_DIM, 0, DK_COLS, KEYS, dk_layout)
            store_key_piece(dk_ptr, dk_hi * softmax_scale, n0 + WG * KEYS, k_start, seqlen_k,
                            n_kv_heads, hk, cfg.HEAD_DIM, DK_COLS, PIECE, KEYS, hi_layout)
            store_key_rows(dv_ptr, dv, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                           cfg.HEAD_DIM_V, KEYS, dv_layout)
        else:
            store_key_rows(dk_ptr, dk, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                           cfg.HEAD_DIM, KEYS, dk_layout)
            store_key_rows(dv_ptr, dv, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                           cfg.HEAD_DIM_V, KEYS, dv_layout)
        if PERSISTENT and EPI == 0:
            # the stores have read the ring slots: the next tile may load into them
            mbarrier.arrive(epi_done.index(0), count=1)
        if PERSISTENT and EPI == 3:  # ... have read this K/V buffer
            mbarrier.arrive(kv_free.index(kv), count=1)

    @gluon.constexpr_function
    def epilogue_mode(block_m, head_dim, head_dim_v, dq_warp, kv_bufs=1):
        """Where a persistent CTA's warpgroups stage dK and dV for their TMA stores
        (`epilogue_buffers`): 0 slots of the Q/dO ring (the load warp then waits for the
        stores before it loads the next tile's first Q/dO: epi_done); 1 the warpgroup's half
        of the dSᵀ buffers (d=64: BLOCK_M >= HEAD_DIM + HEAD_DIM_V); 2 its dQ staging tile
        for dK and a buffer of its own for dV (d=128; not with the dQ warp, which reads the
        dQ tiles); 3 the tile's own K/V buffer (two K/V buffers: BwdConfig.ws_kv_buffers; the
        load warp frees it after the stores, the next tile's K/V being in the other)."""
        if kv_bufs == 2:
            return 3
        if block_m >= head_dim + head_dim_v and head_dim == head_dim_v:
            return 1
        if not dq_warp and head_dim == 128 and head_dim_v == 128:
            return 2
        return 0

    @gluon.jit
    def epilogue_buffers(smem, dv_stage, dk_desc, dv_desc, WG: gl.constexpr,
                         EPI: gl.constexpr):
        """Where warpgroup WG stages its dK and dV tiles (`epilogue_mode` EPI), once both
        warpgroups have retired their last MMA. Outside the ring (EPI 1, 2: buffers only
        this warpgroup writes), the load warp fills the ring with the next tile's first
        Q/dO while the stores go out (a tile's step 0 then begins ~1900 instead of ~3200
        cycles after the previous tile's stores at d=64)."""
        dtype: gl.constexpr = smem.q.dtype
        KEYS: gl.constexpr = dk_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = dk_desc.block_type.shape[1]
        HEAD_DIM_V: gl.constexpr = dv_desc.block_type.shape[1]
        if EPI == 1:
            # ds_smem [2, 2·KEYS, BLOCK_M]: warpgroup WG's half of slot 0, as KEYS-row tiles
            # of HEAD_DIM columns (two per half)
            BLOCK_M: gl.constexpr = smem.q.shape[1]
            tiles = smem.ds._reinterpret(dtype, [4 * BLOCK_M // HEAD_DIM, KEYS, HEAD_DIM],
                                         dk_desc.layout)
            return tiles.index(2 * WG), tiles.index(2 * WG + 1)
        elif EPI == 3:  # the keys this warpgroup owns, in the tile's K and V buffers
            return (row_tile(smem.k, WG * KEYS, KEYS, dtype, dk_desc.layout),
                    row_tile(smem.v, WG * KEYS, KEYS, dtype, dv_desc.layout))
        elif EPI == 2:  # dQ's staging tile is 16 KB: 64 keys x 128 columns of dK
            gl.static_assert(smem.dq.shape[1] * smem.dq.shape[2] * 4 == KEYS * HEAD_DIM * 2)
            return (smem.dq.index(WG)._reinterpret(dtype, [KEYS, HEAD_DIM], dk_desc.layout),
                    dv_stage.index(WG))
        else:  # (one return per mode: a slice's type differs from a reinterpretation's)
            return (leading_tile(smem.q.index(WG), dtype, [KEYS, HEAD_DIM], dk_desc.layout),
                    leading_tile(smem.do.index(WG), dtype, [KEYS, HEAD_DIM_V],
                                 dv_desc.layout))

    @gluon.jit
    def ws_alloc(q_desc, k_desc, v_desc, do_desc, dq_desc, HEAD_DIM: gl.constexpr,
                  HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  RING: gl.constexpr, DQ_BARS: gl.constexpr,
                  KV_BUFS: gl.constexpr = 1):
        """The kernel's shared memory and barriers (the module docstring's), initialised.
        DQ_BARS: the dQ warp's hand-over barriers (deterministic mode, ws_dq_warp). KV_BUFS
        (persistent grids, BwdConfig.ws_kv_buffers): K and V as that many buffers (one:
        plain tiles; `kv_buffer`)."""
        dtype: gl.constexpr = q_desc.dtype
        PIECES: gl.constexpr = pieces(HEAD_DIM)
        QK_LO: gl.constexpr = HEAD_DIM - PIECE if PIECES else HEAD_DIM  # (`WsSmem.q_hi`)
        if KV_BUFS == 1:
            k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, QK_LO],
                                               tile_layout(k_desc.layout))
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_V],
                                               tile_layout(v_desc.layout))
        else:
            gl.static_assert(not PIECES, "head dim 192: one K/V buffer")
            k_smem = gl.allocate_shared_memory(dtype, [KV_BUFS, BLOCK_N, HEAD_DIM],
                                               tile_layout(k_desc.layout))
            v_smem = gl.allocate_shared_memory(dtype, [KV_BUFS, BLOCK_N, HEAD_DIM_V],
                                               tile_layout(v_desc.layout))
        q_smem = gl.allocate_shared_memory(dtype, [RING, BLOCK_M, QK_LO],
                                           tile_layout(q_desc.layout))
        if PIECES:
            q_hi = gl.allocate_shared_memory(dtype, [RING, BLOCK_M, PIECE],
                                             tile_layout(q_desc.layout))
            k_hi = gl.allocate_shared_memory(dtype, [BLOCK_N, PIECE],
                                             tile_layout(k_desc.layout))
        else:
            q_hi = q_smem
            k_hi = k_smem
        do_smem = gl.allocate_shared_memory(dtype, [RING, BLOCK_M, HEAD_DIM_V],
                                            tile_layout(do_desc.layout))
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                       dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                            dq_desc.layout)
        stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [RING, BLOCK_M], stat_smem_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [RING, BLOCK_M],
                                               stat_smem_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # deterministic mode: warpgroup w's staged dQ tile is full / read by the dQ warp
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(KV_BUFS):
            mbarrier.init(kv_bar.index(st), count=1)
        mbarrier.init(done.index(0), count=2)
        for st in gl.static_range(RING):
            # two arrives: the TMA bytes' expect and the statistics' stores (ws_loader)
            mbarrier.init(ready.index(st), count=2)
            mbarrier.init(empty.index(st), count=2)
        for st in gl.static_range(2):
            mbarrier.init(ds_free.index(st), count=2)
            if DQ_BARS:
                mbarrier.init(dq_full.index(st), count=1)
                mbarrier.init(dq_empty.index(st), count=1)
        for st in gl.static_range(4):
            mbarrier.init(ds_ready.index(st), count=1)
        return WsSmem(q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem,
                      kv_bar, ready, empty, ds_ready, ds_free, dq_full, dq_empty, done, q_hi,
                      k_hi)

    @gluon.jit
    def kv_buffer(kv_smem, tile, KV_BUFS: gl.constexpr):
        """The K (or V) buffer of a persistent CTA's tile-th tile (`ws_alloc`)."""
        if KV_BUFS == 1:
            buf = kv_smem
        else:
            buf = kv_smem.index(tile % KV_BUFS)
        return buf
