"""Warp-specialised sm90 backward: the two key warpgroups out of phase (d = 128; d = 64
unmasked, causal from 1k rows, and deterministic), as a plain or a persistent grid.

`kernel.py`'s kernel runs both warpgroups through every step together: a CTA-wide barrier
publishes dSᵀ for dQ = dS·K, another stages dQ for its TMA reduce, and Triton adds its own
around shared-memory reuse. Both warpgroups then form Pᵀ and dSᵀ at the same moments while
the tensor cores wait, and wait for the tensor cores at the same moments (H200 timeline,
d=128 16k: ~4700 cycles per step against ~2560 of MMA work).

Here the roles are `gl.warp_specialize` partitions that only meet through mbarriers:

* a load warp: K and V once; then per step the row statistics (lse in log2 units, delta) by
  ordinary loads into shared memory, and Q and dO by TMA, into a ring of RING slots
  (`BwdConfig.ring_slots`, two by default; the dSᵀ buffers stay two). The statistics' load
  latency is off the compute warps' path.
* two compute warpgroups, warpgroup w owning keys [64·w, 64·w + 64) of the block: Sᵀ, dPᵀ,
  Pᵀ, dV, dSᵀ and dK as in `kernel.py`, and dQ[:, 64·w : 64·w + 64] = dS·K[:, cols], which needs
  both halves of dSᵀ. Warpgroup 1 computes it for the current step (warpgroup 0's half is
  a half step old by then); warpgroup 0 computes it one step late, for the previous step
  (so it never waits for warpgroup 1's current half). Each warpgroup stages its own dQ
  columns and issues its own TMA reduce-add (same bytes as one reduce of the whole tile).

Barriers (all mbarriers, phases counted per use of a slot):
ready[s]  Q/dO (TMA bytes) and the statistics of the step in slot s have landed;
empty[s]  both warpgroups have retired the MMAs that read Q/dO of slot s (count 2);
ds_ready[2s + w]  warpgroup w's half of dSᵀ for the step in slot s is in shared memory;
ds_free[s]  both warpgroups' dQ MMAs have read dSᵀ slot s (count 2);
dq_full[w], dq_empty[w]  (deterministic mode) warpgroup w's dQ tile staged / read by the
           dQ warp;
done  both warpgroups are past their last MMA: the epilogue may reuse the Q/dO ring.

A persistent grid (`BwdConfig.ws_persistent`, dense lengths; deterministic turns in tile
order: `_ws_tiles`)
runs one CTA per SM over the plain grid's tiles: the load warp takes them in the grid's
order from a counter (a zeroed word after dQ_acc) and hands each tile's number to the other
roles through shared memory (tile_full / tile_empty); every ring and dSᵀ phase runs on
across tiles by a step count. A tile boundary: the load warp loads the next K/V once both
warpgroups are past their last MMA reading them (kv_free), and the next Q/dO at once, dK/dV
staging outside the ring (the dSᵀ halves at d=64, the dQ tile and a dV buffer at d=128;
`_epilogue_buffers`). Stamped tiles (`scripts/bwd-ws-tiles.py`) put a tile's step 0
~1900 (d=64) / ~2500 (d=128) cycles after the previous tile's stores, its K/V (issued behind
the late warpgroup's last dQ, ~4000-6000 cycles in flight) the critical path.

Deterministic mode (`BwdConfig.ws_deterministic`) adds a dQ warp in
the load warp's padded warpgroup: the warpgroups stage their dQ tiles and hand them over
(dq_full[w]); the dQ warp waits for the CTA's turn on the step's query block (the synchronous
kernel's order, `parts.wait_dq_turn`), adds both tiles, hands them back once read
(dq_empty[w]) and passes the turn on once the adds have landed. The turn's round trips stay
off the compute warpgroups; in `kernel.py`'s kernel they sit on every step's critical path.

Covers what `kernel.py` covers except softcap and per-thread dQ atomics (and deterministic mode
unless asked for): `config._splits_warpgroups` keeps those on the synchronous kernel.

Faster than the synchronous kernel at d=128 (see docs/tuning.md). At d=64 (128-row steps:
dQ split by rows) a partition's 240 registers spilled (46-95 local-memory instructions) while
each warpgroup issued its own reduce, and it lost at 512 rows and causal. With the dQ warp
issuing both warpgroups' reduces (deterministic mode's hand-over: BwdConfig.ws_dq_warp, and
the turns in deterministic mode) it spills 6 unmasked and wins where `config.select_config`
takes it. d=64 with 64-row steps (dQ split by columns, as d=128) compiles without spills,
with two or three ring slots, and is slower than 128-row steps. Deterministic turns per
warpgroup (a counter per dQ half) were not worth a second turn scheme.
"""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from ..bounds import (
        mask_edges,
        query_range,
        step_needs_mask,
    )
    from ..common import tile_layout
    from ..sched import (
        key_block,
        next_step,
        walk_start,
    )
    from .parts import (
        add_dq_tile,
        fragment_block,
        in_fragments,
        load_kv,
        load_qdo,
        probabilities,
        release_dq_turn_after_tma,
        stage_dq,
        stage_stats,
        store_key_rows,
        store_key_tiles,
        tma_reduce_add,
        wait_dq_turn,
    )

    # setmaxnreg per compute warpgroup and for the load warp (padded to a warpgroup):
    # 240 * 256 + 24 * 128 = 64512 <= 64K registers.
    COMPUTE_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)

    @gluon.jit
    def _ws_loader(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, q_smem, k_smem,
                   v_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, k_row, hk,
                   q_start, seqlen_q, total_q, n_steps, h, m0, m_lo, m_end, h_first, group,
                   HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
                   RING: gl.constexpr, it0=0, tile=0, kv_free=None, epi_done=None,
                   PERSISTENT: gl.constexpr = False, EPI: gl.constexpr = 0,
                   KV_BUFS: gl.constexpr = 1):
        """K and V, then per step the statistics and Q/dO into the ring. PERSISTENT: one
        tile of a persistent CTA (`_ws_tiles`), its steps numbered on from it0 (the ring's
        phases run on across tiles), the tile-th of this CTA, its K/V in buffer
        tile % KV_BUFS (k_smem, v_smem: that buffer)."""
        kv = tile % KV_BUFS
        if PERSISTENT:
            if tile >= KV_BUFS:  # both warpgroups are done with this buffer's last tile
                mbarrier.wait(kv_free.index(kv), ((tile - KV_BUFS) // KV_BUFS) & 1)
        load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(kv), k_row, hk, HEAD_DIM,
                HEAD_DIM_V)
        if PERSISTENT and EPI == 0:  # `_epilogue_buffers`
            if tile > 0:  # ... and past its dK/dV stores, staged through ring slots
                mbarrier.wait(epi_done.index(0), (tile - 1) & 1)
        stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        for it in range(n_steps):
            g = it0 + it  # the step's number in the CTA (all its tiles)
            slot = g % RING
            if g >= RING:  # both warpgroups are done with step g - RING
                mbarrier.wait(empty.index(slot), ((g - RING) // RING) & 1)
            # Q and dO first, so that their TMA latency overlaps the statistics' loads (a
            # CTA's first step waits for both; faster for short calls). `ready` takes a second
            # arrive, behind the statistics' stores (release semantics, behind a barrier of
            # this warp).
            load_qdo(q_desc, do_desc, q_smem, do_smem, ready, slot, h, q_start + m0, HEAD_DIM,
                     HEAD_DIM_V, True)
            stage_stats(lse_ptr, delta_ptr, lse_smem, delta_smem, slot, h, m0, q_start,
                        seqlen_q, total_q, BLOCK_M, stat_layout, True)
            mbarrier.arrive(ready.index(slot), count=1)
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, BLOCK_M)

    @gluon.jit
    def _dq_box(WG: gl.constexpr, h, m0, q_start, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr):
        """(row, column) of warpgroup WG's dQ box for the step at (h, m0): its half of the
        columns (64-row steps) or of the rows (128-row steps)."""
        if BLOCK_M == 64:
            return q_start + m0, h * HEAD_DIM + WG * (HEAD_DIM // 2)
        return q_start + m0 + WG * (BLOCK_M // 2), h * HEAD_DIM

    @gluon.jit
    def _dq_coord(WG: gl.constexpr, h, m0, q_start, FRAG: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, TILE_ROWS: gl.constexpr):
        """(row, column) of warpgroup WG's dQ reduce for the step at (h, m0): its box in dQ's
        rows (`_dq_box`), or its tile in the fragment buffer (FRAG: rows of block
        `fragment_block` (its column part), columns of head h; `dq_fragments.py`)."""
        if FRAG:
            block = fragment_block(q_start, m0)
            if BLOCK_M == 64:  # the warpgroups split dQ's columns: two tiles per block
                return (block * 2 + WG) * TILE_ROWS, h * 32
            return (block + WG) * TILE_ROWS, h * 32  # ... or its rows
        return _dq_box(WG, h, m0, q_start, HEAD_DIM, BLOCK_M)

    @gluon.jit
    def _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free, dq_full, dq_empty, j, h,
               m0, q_start, softmax_scale, dq_zero, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, DET: gl.constexpr, dk=None, ds_op=None, q_s=None,
               WITH_DK: gl.constexpr = False):
        """This warpgroup's part of dQ = dS·K for step j: wait for the other half of dSᵀ,
        MMA, stage, reduce-add (retires every MMA this warpgroup has in flight but the dK
        that WITH_DK issues behind it). With
        64-row steps (d=128) the warpgroups split dQ's columns, with 128-row steps (d=64)
        its rows: one wgmma M either way. DET (deterministic mode): the staged tile goes to
        the dQ warp (`_ws_dq_turns`), which adds it in turn. WITH_DK
        (`BwdConfig.ws_dk_after_dq`): dK += dSᵀ·Q is issued right after the dQ MMA and left
        in flight while dQ is staged (FA4's order); returns its token."""
        js = j % 2
        mbarrier.wait(ds_ready.index(2 * js + 1 - WG), (j // 2) & 1)
        if BLOCK_M == 64:
            COLS: gl.constexpr = HEAD_DIM // 2
            dq_tok = warpgroup_mma(ds_smem.index(js).permute((1, 0)),
                                   k_smem.slice(WG * COLS, COLS, 1), dq_zero, use_acc=False,
                                   is_async=True)
        else:
            ROWS: gl.constexpr = BLOCK_M // 2
            dq_tok = warpgroup_mma(ds_smem.index(js).slice(WG * ROWS, ROWS, 1).permute((1, 0)),
                                   k_smem, dq_zero, use_acc=False, is_async=True)
        if WITH_DK:  # wgmma groups retire in order: waiting for dQ leaves dK running
            dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dq = warpgroup_mma_wait(1, deps=[dq_tok])
        else:
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(ds_free.index(js))
        if DET:
            if j > 0:  # the dQ warp has read this warpgroup's tile of step j - 1
                mbarrier.wait(dq_empty.index(WG), (j - 1) & 1)
        else:
            tma.store_wait(0)  # this warpgroup's previous reduce has read dq_buf
        FRAG: gl.constexpr = in_fragments(dq_desc.layout)
        stage_dq(dq_buf, dq * softmax_scale, FRAG, 64, dq_zero.shape[1])
        fence_async_shared()
        gl.thread_barrier()
        if DET:
            mbarrier.arrive(dq_full.index(WG), count=1)
        else:
            row, col = _dq_coord(WG, h, m0, q_start, FRAG, HEAD_DIM, BLOCK_M,
                                 dq_desc.block_type.shape[0])
            tma_reduce_add(dq_desc, [row, col], dq_buf)
        if WITH_DK:
            return dk

    @gluon.jit
    def _ws_dq_turns(dq_smem, dq_desc, dq_full, dq_empty, sem_ptr, q_start, n_steps, h, m0,
                     m_lo, m_end, h_first, group, batch, n_heads, num_m_blocks, n_blk, n_seq,
                     shift, window_left, window_right, group_blocks, stride,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGGER: gl.constexpr,
                     DET: gl.constexpr, TURNS: gl.constexpr, it0=0,
                     FIRST_STORES: gl.constexpr = False):
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
                                          m_lo, group_blocks, stride, BLOCK_M, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT, STAGGER, True)
            mbarrier.wait(dq_full.index(0), (it0 + j) & 1)
            mbarrier.wait(dq_full.index(1), (it0 + j) & 1)
            FRAG: gl.constexpr = in_fragments(dq_desc.layout)
            TILE_ROWS: gl.constexpr = dq_desc.block_type.shape[0]
            row, col = _dq_coord(0, h, m0, q_start, FRAG, HEAD_DIM, BLOCK_M,
                                 TILE_ROWS)
            add_dq_tile(dq_desc, row, col, dq_smem.index(0), FIRST_STORES, first)
            row, col = _dq_coord(1, h, m0, q_start, FRAG, HEAD_DIM, BLOCK_M,
                                 TILE_ROWS)
            add_dq_tile(dq_desc, row, col, dq_smem.index(1), FIRST_STORES, first)
            tma.store_wait(0)  # both reduces have read their tiles
            gl.thread_barrier()
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
            if TURNS:
                release_dq_turn_after_tma(sem, m0)
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, BLOCK_M)

    @gluon.jit
    def _ws_compute(shared, WG: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, DP_EARLY: gl.constexpr,
                    KV_TMA_STORE: gl.constexpr, LATE_WG: gl.constexpr, RING: gl.constexpr,
                    DET: gl.constexpr, DV_OVERLAP: gl.constexpr, DK_AFTER_DQ: gl.constexpr,
                    MASK_MODE: gl.constexpr, it0=0, tile=0,
                    kv_free=None, epi_done=None, PERSISTENT: gl.constexpr = False,
                    EPI: gl.constexpr = 0, dv_stage=None, KV_BUFS: gl.constexpr = 1):
        # PERSISTENT: one tile of a persistent CTA, as in _ws_loader (steps numbered on
        # from it0; the late warpgroup's previous step is always one of this tile's; K/V in
        # buffer tile % KV_BUFS, which `shared` holds).
        (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, ready,
         empty, ds_ready, ds_free, done, dq_full, dq_empty, dq_desc, dk_desc, dv_desc, dk_ptr,
         dv_ptr, q_start, k_start, seqlen_q, seqlen_k, n_kv_heads, hk, n0, n_steps, h, m0, m_lo,
         m_end, h_first, group, keys_oob, m_full_lo, m_full_hi, qk_scale, softmax_scale,
         softcap_pre, window_left, window_right) = shared
        KEYS: gl.constexpr = BLOCK_N // 2
        DQ_ROWS: gl.constexpr = 64  # dQ = dS·K by halves of its columns or rows (_ws_dq)
        DQ_COLS: gl.constexpr = HEAD_DIM // 2 if BLOCK_M == 64 else HEAD_DIM
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM_V, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        pv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                         k_width=2)
        dsq_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                          k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = k_smem.dtype

        k_mine = k_smem.slice(WG * KEYS, KEYS)
        v_mine = v_smem.slice(WG * KEYS, KEYS)
        dq_buf = dq_smem.index(WG)
        kloc = WG * KEYS + gl.arange(0, KEYS, layout=key_layout)
        cols = gl.arange(0, BLOCK_M, layout=col_layout)
        shift = seqlen_k - seqlen_q
        n_valid = seqlen_k - n0
        diag_right = shift + window_right - n0
        diag_left = shift - window_left - n0
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, dk_layout)
        dv = gl.zeros([KEYS, HEAD_DIM_V], gl.float32, dv_layout)
        s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, dq_layout)
        h_prev = h
        m0_prev = m0
        kv = tile % KV_BUFS
        mbarrier.wait(kv_bar.index(kv), (tile // KV_BUFS) & 1)
        for it in range(n_steps):
            g = it0 + it  # the step's number in the CTA (all its tiles)
            slot = g % RING  # the Q/dO ring
            ds_slot = g % 2  # the dSᵀ buffers (_ws_dq)
            mbarrier.wait(ready.index(slot), (g // RING) & 1)
            q_s = q_smem.index(slot)
            do_s = do_smem.index(slot)
            s_tok = warpgroup_mma(k_mine, q_s.permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            if DP_EARLY:
                dp_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
            else:
                s = warpgroup_mma_wait(0, deps=[s_tok])
            lse2 = lse_smem.index(slot).load(col_layout)
            p, p_ds = probabilities(
                s, lse2, qk_scale, softcap_pre,
                step_needs_mask(m0, keys_oob, m_full_lo, m_full_hi, HAS_LEFT, HAS_RIGHT),
                kloc, cols, n_valid, m0, diag_right, diag_left, SOFTCAP, HAS_LEFT, HAS_RIGHT,
                MASK_MODE)
            if not DP_EARLY:
                dp_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
            p_op = gl.convert_layout(p.to(dtype), pv_op_layout)
            dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
            if DV_OVERLAP:  # dSᵀ is formed while dV = Pᵀ·dO runs (retired with dK below)
                dp = warpgroup_mma_wait(1, deps=[dp_tok])
            else:
                dp, dv, p_op = warpgroup_mma_wait(0, deps=[dp_tok, dv_tok, p_op])
            delta = delta_smem.index(slot).load(col_layout)
            ds16 = (p_ds * (dp - gl.expand_dims(delta, 0))).to(dtype)
            if g >= 2:  # both dQ MMAs of step g - 2 have read this dSᵀ slot
                mbarrier.wait(ds_free.index(ds_slot), ((g - 2) // 2) & 1)
            ds_smem.index(ds_slot).slice(WG * KEYS, KEYS).store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(2 * ds_slot + WG), count=1)
            ds_op = gl.convert_layout(ds16, dsq_op_layout)
            if DK_AFTER_DQ:  # dK issued inside _ws_dq, behind the dQ MMA
                if WG == LATE_WG:
                    if it > 0:
                        dk_tok = _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free,
                                        dq_full, dq_empty, g - 1, h_prev, m0_prev, q_start,
                                        softmax_scale, dq_zero, WG, HEAD_DIM, BLOCK_M, DET,
                                        dk, ds_op, q_s, True)
                    else:
                        dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                else:
                    dk_tok = _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free,
                                    dq_full, dq_empty, g, h, m0, q_start, softmax_scale,
                                    dq_zero, WG, HEAD_DIM, BLOCK_M, DET, dk, ds_op,
                                    q_s, True)
            else:
                dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
                if WG == LATE_WG:  # one step late: the other half of this step is not there
                    if it > 0:
                        _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free, dq_full,
                               dq_empty, g - 1, h_prev, m0_prev, q_start, softmax_scale,
                               dq_zero, WG, HEAD_DIM, BLOCK_M, DET)
                else:
                    _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free, dq_full,
                           dq_empty, g, h, m0, q_start, softmax_scale, dq_zero, WG, HEAD_DIM,
                           BLOCK_M, DET)
            if DV_OVERLAP:
                dk, dv, ds_op, p_op = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok, ds_op, p_op])
            else:
                dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
            mbarrier.arrive(empty.index(slot))
            # `+ 0`: with a plain `h_prev = h` triton 3.6's frontend carried neither h nor
            # h_prev through the loop (its scf.for kept only dK and dV; found in the TTGIR)
            h_prev = h + 0
            m0_prev = m0 + 0
            h, m0 = next_step(h, m0, m_lo, m_end, h_first, h_first + group, BLOCK_M)
        if WG == LATE_WG:
            if n_steps > 0:
                _ws_dq(ds_smem, k_smem, dq_buf, dq_desc, ds_ready, ds_free, dq_full, dq_empty,
                       it0 + n_steps - 1, h_prev, m0_prev, q_start, softmax_scale, dq_zero, WG,
                       HEAD_DIM, BLOCK_M, DET)
        if PERSISTENT and EPI != 3:  # this warpgroup's MMAs have read K and V for the last
            # time (before the reduce's wait: the load warp's next K/V are the tile's
            # critical path; EPI 3 stages dK/dV in this K/V buffer: freed after the stores)
            mbarrier.arrive(kv_free.index(kv), count=1)
        tma.store_wait(0)  # the last reduce reads dq_buf
        # The epilogue stages through the Q/dO ring, which the other warpgroup may still read.
        mbarrier.arrive(done.index(0), count=1)
        mbarrier.wait(done.index(0), tile & 1)
        dk = dk * softmax_scale  # S = scale·Q·Kᵀ
        if KV_TMA_STORE:
            dk_buf, dv_buf = _epilogue_buffers(q_smem, do_smem, ds_smem, dq_smem, dv_stage,
                                               k_smem, v_smem, dk_desc, dv_desc, WG, EPI)
            store_key_tiles(dk_desc, dv_desc, dk, dv, dk_buf, dv_buf,
                            k_start + n0 + WG * KEYS, hk, HEAD_DIM, HEAD_DIM_V)
        else:
            store_key_rows(dk_ptr, dk, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                           HEAD_DIM, KEYS, dk_layout)
            store_key_rows(dv_ptr, dv, n0 + WG * KEYS, k_start, seqlen_k, n_kv_heads, hk,
                           HEAD_DIM_V, KEYS, dv_layout)
        if PERSISTENT and EPI == 0:
            # the stores have read the ring slots: the next tile may load into them
            mbarrier.arrive(epi_done.index(0), count=1)
        if PERSISTENT and EPI == 3:  # ... have read this K/V buffer
            mbarrier.arrive(kv_free.index(kv), count=1)

    @gluon.constexpr_function
    def _epilogue_mode(block_m, head_dim, head_dim_v, dq_warp, kv_bufs=1):
        """Where a persistent CTA's warpgroups stage dK and dV for their TMA stores
        (`_epilogue_buffers`): 0 slots of the Q/dO ring (the load warp then waits for the
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
    def _epilogue_buffers(q_smem, do_smem, ds_smem, dq_smem, dv_stage, k_smem, v_smem,
                          dk_desc, dv_desc, WG: gl.constexpr, EPI: gl.constexpr):
        """Where warpgroup WG stages its dK and dV tiles (`_epilogue_mode` EPI), once both
        warpgroups have retired their last MMA. Outside the ring (EPI 1, 2: buffers only
        this warpgroup writes), the load warp fills the ring with the next tile's first
        Q/dO while the stores go out (a tile's step 0 then begins ~1900 instead of ~3200
        cycles after the previous tile's stores at d=64)."""
        dtype: gl.constexpr = q_smem.dtype
        KEYS: gl.constexpr = dk_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = dk_desc.block_type.shape[1]
        HEAD_DIM_V: gl.constexpr = dv_desc.block_type.shape[1]
        if EPI == 1:
            # ds_smem [2, 2·KEYS, BLOCK_M]: warpgroup WG's half of slot 0, as KEYS-row tiles
            # of HEAD_DIM columns (two per half)
            BLOCK_M: gl.constexpr = q_smem.shape[1]
            tiles = ds_smem._reinterpret(dtype, [4 * BLOCK_M // HEAD_DIM, KEYS, HEAD_DIM],
                                         dk_desc.layout)
            return tiles.index(2 * WG), tiles.index(2 * WG + 1)
        elif EPI == 3:  # the keys this warpgroup owns, in the tile's K and V buffers
            return (k_smem.slice(WG * KEYS, KEYS)._reinterpret(dtype, [KEYS, HEAD_DIM],
                                                                dk_desc.layout),
                    v_smem.slice(WG * KEYS, KEYS)._reinterpret(dtype, [KEYS, HEAD_DIM_V],
                                                                dv_desc.layout))
        elif EPI == 2:  # dQ's staging tile is 16 KB: 64 keys x 128 columns of dK
            gl.static_assert(dq_smem.shape[1] * dq_smem.shape[2] * 4 == KEYS * HEAD_DIM * 2)
            return (dq_smem.index(WG)._reinterpret(dtype, [KEYS, HEAD_DIM], dk_desc.layout),
                    dv_stage.index(WG))
        return (q_smem.index(WG)._reinterpret(dtype, [KEYS, HEAD_DIM], dk_desc.layout),
                do_smem.index(WG)._reinterpret(dtype, [KEYS, HEAD_DIM_V], dv_desc.layout))

    @gluon.jit
    def _ws_alloc(q_desc, k_desc, v_desc, do_desc, dq_desc, HEAD_DIM: gl.constexpr,
                  HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  RING: gl.constexpr, DQ_BARS: gl.constexpr,
                  KV_BUFS: gl.constexpr = 1):
        """The kernel's shared memory and barriers (the module docstring's), initialised.
        DQ_BARS: the dQ warp's hand-over barriers (deterministic mode, ws_dq_warp). KV_BUFS
        (persistent grids, BwdConfig.ws_kv_buffers): K and V as that many buffers (one:
        plain tiles; `_kv_buffer`)."""
        dtype: gl.constexpr = q_desc.dtype
        if KV_BUFS == 1:
            k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM],
                                               tile_layout(k_desc.layout))
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_V],
                                               tile_layout(v_desc.layout))
        else:
            k_smem = gl.allocate_shared_memory(dtype, [KV_BUFS, BLOCK_N, HEAD_DIM],
                                               tile_layout(k_desc.layout))
            v_smem = gl.allocate_shared_memory(dtype, [KV_BUFS, BLOCK_N, HEAD_DIM_V],
                                               tile_layout(v_desc.layout))
        q_smem = gl.allocate_shared_memory(dtype, [RING, BLOCK_M, HEAD_DIM],
                                           tile_layout(q_desc.layout))
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
            # two arrives: the TMA bytes' expect and the statistics' stores (_ws_loader)
            mbarrier.init(ready.index(st), count=2)
            mbarrier.init(empty.index(st), count=2)
        for st in gl.static_range(2):
            mbarrier.init(ds_free.index(st), count=2)
            if DQ_BARS:
                mbarrier.init(dq_full.index(st), count=1)
                mbarrier.init(dq_empty.index(st), count=1)
        for st in gl.static_range(4):
            mbarrier.init(ds_ready.index(st), count=1)
        return (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar,
                ready, empty, ds_ready, ds_free, dq_full, dq_empty, done)

    @gluon.jit
    def _kv_buffer(kv_smem, tile, KV_BUFS: gl.constexpr):
        """The K (or V) buffer of a persistent CTA's tile-th tile (`_ws_alloc`)."""
        if KV_BUFS == 1:
            buf = kv_smem
        else:
            buf = kv_smem.index(tile % KV_BUFS)
        return buf

    @gluon.jit
    def _give_tile(tile_smem, tile_full, tile_empty, i, t):
        """The load warp hands its CTA's i-th tile number t to the other roles (-1: none
        left, so that they need not hold the tile count). Two slots: the slot of tile i - 2
        is free once every role has read it, which each does as it begins tile i - 2 (the
        load warp hands out tile i once it has issued tile i - 1's loads: by then the compute
        warpgroups are at least in tile i - 2, and the dQ warp follows them)."""
        slot = i % 2
        if i >= 2:
            mbarrier.wait(tile_empty.index(slot), ((i - 2) // 2) & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        tile_smem.index(slot).store(gl.zeros([1], gl.int32, layout) + t)
        mbarrier.arrive(tile_full.index(slot), count=1)

    @gluon.jit
    def _take_tile(tile_smem, tile_full, tile_empty, i, WARPS: gl.constexpr):
        """A role's i-th tile number, from the load warp (`_give_tile`)."""
        slot = i % 2
        mbarrier.wait(tile_full.index(slot), (i // 2) & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        t = gl.max(tile_smem.index(slot).load(layout), axis=0)
        mbarrier.arrive(tile_empty.index(slot), count=1)
        return t

    @gluon.jit
    def _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k, group, window_left, window_right,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, HEADS_FIRST: gl.constexpr,
                 TOP_FIRST: gl.constexpr = False):
        """Tile t of a persistent CTA's walk (dense lengths): the key block, kv head and
        sequence the grid's CTA number t would take (`key_block`'s order; TOP_FIRST: a
        sequence's key blocks from the last down, as deterministic causal grids run), and its
        steps: (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, n_blk,
        batch, group_blocks). dq_start is what the dQ reduces take for q_start: with
        fragment-order tiles, q_start + 128 · sequence, since `fragment_block` reads the
        sequence from the grid's third index, which a persistent grid does not have (its
        2 · sequence is 2 · 0 there)."""
        gl.static_assert(HEADS_FIRST <= 1, "chunked head order: plain grids only")
        if HEADS_FIRST:
            hk = t % n_kv_heads
            n_blk = (t // n_kv_heads) % n_blocks
        else:
            n_blk = t % n_blocks
            hk = (t // n_blocks) % n_kv_heads
        if TOP_FIRST:
            n_blk = n_blocks - 1 - n_blk
        batch = t // (n_blocks * n_kv_heads)
        n0 = n_blk * BLOCK_N
        m_lo, group_blocks = query_range(n0, seqlen_q, seqlen_k - seqlen_q, window_left,
                                         window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        return (n0, hk, batch * seqlen_q, batch * seqlen_k, group_blocks * group, hk * group,
                m_lo, m_lo + group_blocks * BLOCK_M, batch * (seqlen_q + 128), n_blk, batch,
                group_blocks)

    @gluon.jit
    def _ws_compute_tiles(shared, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                          HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                          HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                          DP_EARLY: gl.constexpr, KV_TMA_STORE: gl.constexpr,
                          LATE_WG: gl.constexpr, RING: gl.constexpr, DET: gl.constexpr,
                          DV_OVERLAP: gl.constexpr, DK_AFTER_DQ: gl.constexpr,
                          HEADS_FIRST: gl.constexpr,
                          TOP_FIRST: gl.constexpr, KV_BUFS: gl.constexpr,
                          MASK_MODE: gl.constexpr):
        """A compute warpgroup of a persistent CTA: `_ws_compute` per tile (DET: its dQ
        tiles go to the dQ warp)."""
        (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, ready,
         empty, ds_ready, ds_free, done, dq_full, dq_empty, dq_desc, dk_desc, dv_desc, dk_ptr,
         dv_ptr, seqlen_q, seqlen_k, n_kv_heads, group, qk_scale, softmax_scale, softcap_pre,
         window_left, window_right, n_blocks, kv_free, epi_done, tile_smem, tile_full,
         tile_empty, dv_stage) = shared
        EPI: gl.constexpr = _epilogue_mode(BLOCK_M, HEAD_DIM, HEAD_DIM_V, DET, KV_BUFS)
        it0 = 0
        tile = 0
        t = _take_tile(tile_smem, tile_full, tile_empty, 0, 4)
        while t >= 0:
            (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, _n_blk, _batch,
             _group_blocks) = _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k, group,
                                       window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                       HAS_RIGHT, HEADS_FIRST, TOP_FIRST)
            if not in_fragments(dq_desc.layout):  # row-major dQ: the rows themselves
                dq_start = q_start
            keys_oob, m_full_lo, m_full_hi = mask_edges(n0, seqlen_k, seqlen_k - seqlen_q,
                                                        window_left, window_right, BLOCK_M,
                                                        BLOCK_N)
            tile_shared = (q_smem, _kv_buffer(k_smem, tile, KV_BUFS),
                           _kv_buffer(v_smem, tile, KV_BUFS), do_smem, ds_smem, dq_smem,
                           lse_smem, delta_smem, kv_bar, ready, empty, ds_ready, ds_free,
                           done, dq_full, dq_empty, dq_desc, dk_desc, dv_desc, dk_ptr,
                           dv_ptr, dq_start, k_start, seqlen_q, seqlen_k, n_kv_heads, hk, n0,
                           n_steps, h_first, m_lo, m_lo, m_end, h_first, group, keys_oob,
                           m_full_lo, m_full_hi, qk_scale, softmax_scale, softcap_pre,
                           window_left, window_right)
            _ws_compute(tile_shared, WG, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                        HAS_RIGHT, SOFTCAP, DP_EARLY, KV_TMA_STORE, LATE_WG, RING, DET,
                        DV_OVERLAP, DK_AFTER_DQ, MASK_MODE, it0, tile, kv_free,
                        epi_done, True, EPI, dv_stage, KV_BUFS)
            it0 += n_steps
            tile += 1
            t = _take_tile(tile_smem, tile_full, tile_empty, tile, 4)

    @gluon.jit
    def _ws_loader_tiles(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, q_smem, k_smem,
                         v_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, kv_free,
                         epi_done, tile_smem, tile_full, tile_empty, counter_ptr, seqlen_q,
                         seqlen_k, total_q, n_kv_heads, group, window_left,
                         window_right, n_blocks, n_tiles, HEAD_DIM: gl.constexpr,
                         HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, RING: gl.constexpr,
                         HEADS_FIRST: gl.constexpr, HAND_OVER: gl.constexpr,
                         TOP_FIRST: gl.constexpr, KV_BUFS: gl.constexpr):
        """The load warp of a persistent CTA: `_ws_loader` per tile. Tiles after the first
        (the program's number) come from a counter (zeroed by the preprocess) in the grid's
        order, as the hardware hands out a plain grid's CTAs: uneven causal tiles balance
        themselves, and the CTAs at work at one time share heads (Q, dO and dQ in L2)."""
        it0 = 0
        tile = 0
        t = gl.program_id(0)
        _give_tile(tile_smem, tile_full, tile_empty, 0, gl.where(t < n_tiles, t, -1))
        while t < n_tiles:
            (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, _n_blk, _batch,
             _group_blocks) = _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k, group,
                                       window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                       HAS_RIGHT, HEADS_FIRST, TOP_FIRST)
            _ws_loader(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, q_smem,
                       _kv_buffer(k_smem, tile, KV_BUFS), _kv_buffer(v_smem, tile, KV_BUFS),
                       do_smem, lse_smem, delta_smem, kv_bar, ready, empty, k_start + n0,
                       hk, q_start, seqlen_q, total_q, n_steps, h_first, m_lo, m_lo, m_end,
                       h_first, group, HEAD_DIM, HEAD_DIM_V, BLOCK_M, RING, it0, tile, kv_free,
                       epi_done, True,
                       _epilogue_mode(BLOCK_M, HEAD_DIM, HEAD_DIM_V, HAND_OVER, KV_BUFS),
                       KV_BUFS)
            # The next tile is taken once this one's loads are issued, not when it starts:
            # the tile a CTA holds but has not begun then waits only the ring's steps and
            # this tile's end (deterministic turns wait on tiles in the order taken).
            t_next = gl.num_programs(0) + gl.atomic_add(counter_ptr, 1, sem="relaxed")
            it0 += n_steps
            tile += 1
            _give_tile(tile_smem, tile_full, tile_empty, tile,
                       gl.where(t_next < n_tiles, t_next, -1))
            t = t_next

    @gluon.jit
    def _ws_dq_tiles(dq_smem, dq_desc, dq_full, dq_empty, tile_smem, tile_full, tile_empty,
                     sem_ptr, seqlen_q, seqlen_k, n_heads, n_kv_heads, group, num_m_blocks,
                     window_left, window_right, n_blocks, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                     HAS_RIGHT: gl.constexpr, DQ_WARP: gl.constexpr, HEADS_FIRST: gl.constexpr,
                     DETERMINISTIC: gl.constexpr, TOP_FIRST: gl.constexpr,
                     FIRST_STORES: gl.constexpr):
        """The dQ warp of a persistent CTA per tile: the reduces (ws_dq_warp), or in
        deterministic mode the reduces in turn (`_ws_dq_turns`, unstaggered: `_ws_tiles`)."""
        if DQ_WARP or DETERMINISTIC:
            it0 = 0
            tile = 0
            t = _take_tile(tile_smem, tile_full, tile_empty, 0, 1)
            while t >= 0:
                (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, n_blk,
                 batch, group_blocks) = _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k,
                                                 group, window_left, window_right, BLOCK_M,
                                                 BLOCK_N, HAS_LEFT, HAS_RIGHT, HEADS_FIRST,
                                                 TOP_FIRST)
                if not in_fragments(dq_desc.layout):  # row-major dQ: the rows themselves
                    dq_start = q_start
                _ws_dq_turns(dq_smem, dq_desc, dq_full, dq_empty, sem_ptr, dq_start, n_steps,
                             h_first, m_lo, m_lo, m_end, h_first, group, batch, n_heads,
                             num_m_blocks, n_blk, n_blocks, seqlen_k - seqlen_q, window_left,
                             window_right, group_blocks, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                             HAS_LEFT, HAS_RIGHT, False, True, DETERMINISTIC, it0,
                             FIRST_STORES)
                it0 += n_steps
                tile += 1
                t = _take_tile(tile_smem, tile_full, tile_empty, tile, 1)

    @gluon.jit
    def _ws_tiles(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                  delta_ptr, dk_ptr, dv_ptr, sem_ptr, seqlen_q, seqlen_k, total_q, n_heads,
                  n_kv_heads, group, num_m_blocks, qk_scale, softmax_scale, softcap_pre,
                  window_left, window_right, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, DV_OVERLAP: gl.constexpr,
                  DP_EARLY: gl.constexpr, KV_TMA_STORE: gl.constexpr, LATE_WG: gl.constexpr,
                  RING: gl.constexpr, DK_AFTER_DQ: gl.constexpr,
                  HEADS_FIRST: gl.constexpr, DQ_WARP: gl.constexpr,
                  DETERMINISTIC: gl.constexpr, KV_BUFS: gl.constexpr = 1,
                  MASK_MODE: gl.constexpr = 0, FIRST_STORES: gl.constexpr = False):
        """A persistent CTA (BwdConfig.ws_persistent; dense lengths): the
        grid's (key block, kv head, sequence) tiles, the program's own number first and then
        the next of a counter's (`_ws_loader_tiles`, which hands each to the other roles),
        each as a CTA of the plain grid runs it, the roles looping over them. What a tile
        boundary adds: the load warp loads the next tile's K/V once both warpgroups are past
        their last MMA reading K/V (kv_free), while they finish dQ and store dK/dV, and the
        next tile's first Q/dO at once, or, where dK/dV stage through the ring
        (`_epilogue_mode` 0: with the dQ warp), once those stores have read it (epi_done);
        every other barrier's phase runs on by step (ring, dSᵀ, dQ hand-over) or by tile
        (kv_bar, done).

        DETERMINISTIC: the dQ warp adds in turn (`_ws_dq_turns`), and the turns must follow
        the order in which tiles are taken: each tile then waits only for tiles taken before
        it, so the lowest unfinished tile is always some CTA's current tile with every turn
        it needs passed, and no wait closes a cycle (a CTA holds its next tile before it ends
        its current one, so a turn order against the tile order could make a tile wait for
        one queued behind it on its own CTA). Hence no stagger (ascending turns, as the
        tiles number key blocks), and causal tiles numbered top-first (descending turns).
        The semaphores and the tile counter share one zeroed buffer: the counter is the word
        after the (sequence, q head, query block) semaphores."""
        HAND_OVER: gl.constexpr = DQ_WARP or DETERMINISTIC  # the dQ warp issues the reduces
        TOP_FIRST: gl.constexpr = HAS_RIGHT and DETERMINISTIC
        (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar,
         ready, empty, ds_ready, ds_free, dq_full, dq_empty, done) = _ws_alloc(
            q_desc, k_desc, v_desc, do_desc, dq_desc, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N,
            RING, HAND_OVER, KV_BUFS)
        kv_free = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
        epi_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(KV_BUFS):
            mbarrier.init(kv_free.index(st), count=2)
        mbarrier.init(epi_done.index(0), count=2)
        # the tile numbers the load warp hands out (_give_tile): two slots
        tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(
            1, 1, 1, [0]))
        tile_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2):
            mbarrier.init(tile_full.index(st), count=1)
            mbarrier.init(tile_empty.index(st), count=3 if HAND_OVER else 2)
        if _epilogue_mode(BLOCK_M, HEAD_DIM, HEAD_DIM_V, HAND_OVER, KV_BUFS) == 2:
            dv_stage = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N // 2, HEAD_DIM_V],
                                                 dv_desc.layout)
        else:
            dv_stage = dq_smem  # not read
        fence_async_shared()
        n_blocks = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        n_seqs = total_q // gl.maximum(seqlen_q, 1)
        n_tiles = n_blocks * n_kv_heads * n_seqs
        counter_ptr = sem_ptr
        if DETERMINISTIC:
            counter_ptr = sem_ptr + n_seqs * n_heads * num_m_blocks
        shared = (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem,
                  kv_bar, ready, empty, ds_ready, ds_free, done, dq_full, dq_empty, dq_desc,
                  dk_desc, dv_desc, dk_ptr, dv_ptr, seqlen_q, seqlen_k, n_kv_heads, group,
                  qk_scale, softmax_scale, softcap_pre, window_left, window_right, n_blocks,
                  kv_free, epi_done, tile_smem, tile_full, tile_empty, dv_stage)
        gl.warp_specialize([
            (_ws_compute_tiles, (shared, 0, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                                 HAS_RIGHT, SOFTCAP, DP_EARLY, KV_TMA_STORE, LATE_WG, RING,
                                 HAND_OVER, DV_OVERLAP, DK_AFTER_DQ, HEADS_FIRST,
                                 TOP_FIRST, KV_BUFS, MASK_MODE)),
            (_ws_compute_tiles, (shared, 1, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                                 HAS_RIGHT, SOFTCAP, DP_EARLY, KV_TMA_STORE, LATE_WG, RING,
                                 HAND_OVER, DV_OVERLAP, DK_AFTER_DQ, HEADS_FIRST,
                                 TOP_FIRST, KV_BUFS, MASK_MODE)),
            (_ws_loader_tiles, (q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, q_smem,
                                k_smem, v_smem, do_smem, lse_smem, delta_smem, kv_bar, ready,
                                empty, kv_free, epi_done, tile_smem, tile_full, tile_empty,
                                counter_ptr, seqlen_q, seqlen_k, total_q,
                                n_kv_heads, group, window_left, window_right, n_blocks,
                                n_tiles, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                                HAS_RIGHT, RING, HEADS_FIRST, HAND_OVER, TOP_FIRST,
                                KV_BUFS)),
            (_ws_dq_tiles, (dq_smem, dq_desc, dq_full, dq_empty, tile_smem, tile_full,
                            tile_empty, sem_ptr, seqlen_q, seqlen_k, n_heads, n_kv_heads,
                            group, num_m_blocks, window_left, window_right, n_blocks, HEAD_DIM,
                            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, DQ_WARP, HEADS_FIRST,
                            DETERMINISTIC, TOP_FIRST, FIRST_STORES)),
        ], [4, 1, 1], [COMPUTE_REGS, LOADER_REGS, LOADER_REGS])

    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_kv_heads",
                                  "group", "window_left", "window_right", "num_m_blocks"])
    def attn_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                           delta_ptr, dq_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr,
                           sem_ptr, seqlen_q, seqlen_k, total_q, n_heads, n_kv_heads, group,
                           num_m_blocks, qk_scale, softmax_scale, softcap_pre, window_left,
                           window_right, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           SOFTCAP: gl.constexpr, DV_OVERLAP: gl.constexpr,
                           DP_EARLY: gl.constexpr, DETERMINISTIC: gl.constexpr,
                           REVERSE_N: gl.constexpr, DQ_TMA: gl.constexpr,
                           STAGGER: gl.constexpr, RELEASE_AT: gl.constexpr,
                           WAIT_EARLY: gl.constexpr, KV_TMA_STORE: gl.constexpr,
                           DK_LATE: gl.constexpr, STATS_LATE: gl.constexpr,
                           LATE_WG: gl.constexpr, RING: gl.constexpr, DK_AFTER_DQ: gl.constexpr,
                           HEADS_FIRST: gl.constexpr, DQ_WARP: gl.constexpr,
                           PERSISTENT: gl.constexpr = False, KV_BUFS: gl.constexpr = 1,
                           MASK_MODE: gl.constexpr = 0, FIRST_STORES: gl.constexpr = False):
        # Same arguments as bwd._attn_bwd_kernel (one host path); DK_LATE, STATS_LATE,
        # RELEASE_AT, WAIT_EARLY and dq_ptr belong to that kernel's schedule. DV_OVERLAP:
        # dV = Pᵀ·dO stays in flight while dSᵀ is formed (BwdConfig.dv_overlap).
        # DETERMINISTIC: the dQ warp adds the tiles in kernel.py's turn order (causal masks:
        # the grid runs from the top key block down, as there). DQ_WARP: without
        # DETERMINISTIC, the dQ warp still issues the reduces (BwdConfig.ws_dq_warp).
        # PERSISTENT: BwdConfig.ws_persistent (`_ws_tiles`); KV_BUFS: its K/V buffers
        # (BwdConfig.ws_kv_buffers). MASK_MODE: how masked steps mask (parts.probabilities;
        # BwdConfig.step_cols, mask_scores). FIRST_STORES: deterministic mode's first dQ turn
        # of each query block stores instead of adding (bwd.first_stores).
        if PERSISTENT:
            _ws_tiles(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                      delta_ptr, dk_ptr, dv_ptr, sem_ptr, seqlen_q, seqlen_k, total_q, n_heads,
                      n_kv_heads, group, num_m_blocks, qk_scale, softmax_scale, softcap_pre,
                      window_left, window_right, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                      HAS_LEFT, HAS_RIGHT, SOFTCAP, DV_OVERLAP, DP_EARLY, KV_TMA_STORE, LATE_WG,
                      RING, DK_AFTER_DQ, HEADS_FIRST, DQ_WARP, DETERMINISTIC,
                      KV_BUFS, MASK_MODE, FIRST_STORES)
        else:
            n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k = key_block(
                cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q, seqlen_k, BLOCK_N, UNIFORM, HAS_SEQUSED,
                HAS_RIGHT and DETERMINISTIC, HEADS_FIRST)
            n0 = n_blk * BLOCK_N
            # Top-first order (deterministic causal) numbers the key blocks down from the
            # sequence's own count: grid columns beyond a shorter varlen sequence get n0 < 0.
            if (n0 >= 0) & (n0 < seqlen_k):
                shift = seqlen_k - seqlen_q
                m_lo, group_blocks = query_range(n0, seqlen_q, shift, window_left, window_right,
                                                 BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
                n_steps = group_blocks * group
                keys_oob, m_full_lo, m_full_hi = mask_edges(n0, seqlen_k, shift, window_left,
                                                            window_right, BLOCK_M, BLOCK_N)
                h_first = hk * group
                h, m0, stride = walk_start(n_blk, n_seq, n_steps, group_blocks, h_first, m_lo,
                                           STAGGER, BLOCK_M)
                m_end = m_lo + group_blocks * BLOCK_M

                (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar,
                 ready, empty, ds_ready, ds_free, dq_full, dq_empty, done) = _ws_alloc(
                    q_desc, k_desc, v_desc, do_desc, dq_desc, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                    BLOCK_N, RING, DETERMINISTIC or DQ_WARP)
                fence_async_shared()

                # What the two compute warpgroups share travels as one tuple of runtime values;
                # the constexprs are written out in each role (held in a variable, Gluon would
                # turn them into runtime values). The dQ warp (deterministic mode) shares the
                # load warp's padded warpgroup and register count; without DETERMINISTIC it
                # returns at once.
                shared = (q_smem, k_smem, v_smem, do_smem, ds_smem, dq_smem, lse_smem, delta_smem,
                          kv_bar, ready, empty, ds_ready, ds_free, done, dq_full, dq_empty, dq_desc,
                          dk_desc, dv_desc, dk_ptr, dv_ptr, q_start, k_start, seqlen_q, seqlen_k,
                          n_kv_heads, hk, n0, n_steps, h, m0, m_lo, m_end, h_first, group,
                          keys_oob, m_full_lo, m_full_hi, qk_scale, softmax_scale, softcap_pre,
                          window_left, window_right)
                gl.warp_specialize([
                    (_ws_compute, (shared, 0, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                                   HAS_RIGHT, SOFTCAP, DP_EARLY, KV_TMA_STORE, LATE_WG, RING,
                                   DETERMINISTIC or DQ_WARP, DV_OVERLAP, DK_AFTER_DQ,
                                   MASK_MODE)),
                    (_ws_compute, (shared, 1, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, HAS_LEFT,
                                   HAS_RIGHT, SOFTCAP, DP_EARLY, KV_TMA_STORE, LATE_WG, RING,
                                   DETERMINISTIC or DQ_WARP, DV_OVERLAP, DK_AFTER_DQ,
                                   MASK_MODE)),
                    (_ws_loader, (q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, q_smem,
                                  k_smem, v_smem, do_smem, lse_smem, delta_smem, kv_bar, ready,
                                  empty, k_start + n0, hk, q_start, seqlen_q, total_q, n_steps, h,
                                  m0, m_lo, m_end, h_first, group, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                                  RING)),
                    (_ws_dq_turns, (dq_smem, dq_desc, dq_full, dq_empty, sem_ptr, q_start,
                                    n_steps, h, m0, m_lo, m_end, h_first, group, batch, n_heads,
                                    num_m_blocks, n_blk, n_seq, shift, window_left, window_right,
                                    group_blocks, stride, HEAD_DIM, BLOCK_M, BLOCK_N, HAS_LEFT,
                                    HAS_RIGHT, STAGGER, DETERMINISTIC or DQ_WARP, DETERMINISTIC,
                                    0, FIRST_STORES)),
                ], [4, 1, 1], [COMPUTE_REGS, LOADER_REGS, LOADER_REGS])
