"""Warp-specialised sm90 backward: the two key warpgroups out of phase (d = 128; d = 64
unmasked, causal from 1k rows, and deterministic; d = 192 as a 128- and a 64-wide piece,
not deterministic), as a plain or a persistent grid (d <= 128).

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
`epilogue_buffers`). Stamped tiles (`scripts/bwd-ws-tiles.py`) put a tile's step 0
~1900 (d=64) / ~2500 (d=128) cycles after the previous tile's stores, its K/V (issued behind
the late warpgroup's last dQ, ~4000-6000 cycles in flight) the critical path.

Deterministic mode adds a dQ warp in the load warp's padded warpgroup: the warpgroups stage
their dQ tiles and hand them over (dq_full[w]); the dQ warp waits for the CTA's turn on the
step's query block (the synchronous kernel's order, `parts.wait_dq_turn`), adds both tiles,
hands them back once read (dq_empty[w]) and passes the turn on once the adds have landed. The
turn's round trips stay off the compute warpgroups; in `kernel.py`'s kernel they sit on every
step's critical path.

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

At d = 192 (`ws_roles.pieces`; d_v <= 128) Q, K and dK are a 128- and a 64-wide piece
(Gluon's tiles are powers of two), dQ leaves as 64-column pieces (warpgroup 0 columns 0-127
one after the other, warpgroup 1 columns 128-191), dV retires before dPᵀ is issued and dK's
A operand is read from the dSᵀ slot: dK and dV alone hold 160 of the 240 registers. dK
leaves by per-thread stores (no 192-wide TMA box); plain grid, no dQ warp.
"""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..bounds import (
        mask_edges,
        query_range,
    )
    from ..common import fence_async_shared, gl, gluon, mbarrier
    from .parts import (
        in_fragments,
        key_tile,
        key_walk,
        walk,
    )
    from .ws_roles import (
        COMPUTE_REGS,
        LOADER_REGS,
        epilogue_mode,
        ws_alloc,
        ws_compute,
        ws_dq_turns,
        ws_loader,
    )

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
                 cfg, TOP_FIRST: gl.constexpr):
        """Tile t of a persistent CTA's walk (dense lengths): the key block, kv head and
        sequence the grid's CTA number t would take (`key_block`'s order; TOP_FIRST: a
        sequence's key blocks from the last down, as deterministic causal grids run), and its
        steps: (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, n_blk,
        batch, group_blocks). dq_start is what the dQ reduces take for q_start: with
        fragment-order tiles, q_start + 128 · sequence, since `fragment_block` reads the
        sequence from the grid's third index, which a persistent grid does not have (its
        2 · sequence is 2 · 0 there)."""
        gl.static_assert(cfg.HEADS_FIRST <= 1, "chunked head order: plain grids only")
        if cfg.HEADS_FIRST:
            hk = t % n_kv_heads
            n_blk = (t // n_kv_heads) % n_blocks
        else:
            n_blk = t % n_blocks
            hk = (t // n_blocks) % n_kv_heads
        if TOP_FIRST:
            n_blk = n_blocks - 1 - n_blk
        batch = t // (n_blocks * n_kv_heads)
        n0 = n_blk * cfg.BLOCK_N
        m_lo, group_blocks = query_range(n0, seqlen_q, seqlen_k - seqlen_q, window_left,
                                         window_right, cfg.BLOCK_M, cfg.BLOCK_N, cfg.HAS_LEFT,
                                         cfg.HAS_RIGHT)
        return (n0, hk, batch * seqlen_q, batch * seqlen_k, group_blocks * group, hk * group,
                m_lo, m_lo + group_blocks * cfg.BLOCK_M, batch * (seqlen_q + 128), n_blk, batch,
                group_blocks)

    @gluon.jit
    def _ws_compute_tiles(shared, cfg, WG: gl.constexpr, DET: gl.constexpr,
                          TOP_FIRST: gl.constexpr):
        """A compute warpgroup of a persistent CTA: `ws_compute` per tile (DET: its dQ
        tiles go to the dQ warp)."""
        (smem, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, seqlen_q, seqlen_k, n_kv_heads, group,
         qk_scale, softmax_scale, softcap_pre, window_left, window_right, n_blocks, kv_free,
         epi_done, tile_smem, tile_full, tile_empty, dv_stage) = shared
        EPI: gl.constexpr = epilogue_mode(cfg.BLOCK_M, cfg.HEAD_DIM, cfg.HEAD_DIM_V, DET,
                                          cfg.KV_BUFS)
        it0 = 0
        tile = 0
        t = _take_tile(tile_smem, tile_full, tile_empty, 0, 4)
        while t >= 0:
            (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, _n_blk, _batch,
             _group_blocks) = _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k, group,
                                       window_left, window_right, cfg, TOP_FIRST)
            if not in_fragments(dq_desc.layout):  # row-major dQ: the rows themselves
                dq_start = q_start
            keys_oob, m_full_lo, m_full_hi = mask_edges(n0, seqlen_k, seqlen_k - seqlen_q,
                                                        window_left, window_right, cfg.BLOCK_M,
                                                        cfg.BLOCK_N)
            tile_shared = (smem.for_tile(tile, cfg.KV_BUFS), dq_desc, dk_desc, dv_desc, dk_ptr,
                           dv_ptr, dq_start, k_start, seqlen_q, seqlen_k, n_kv_heads, hk, n0,
                           n_steps, h_first, m_lo, m_lo, m_end, h_first, group, keys_oob,
                           m_full_lo, m_full_hi, qk_scale, softmax_scale, softcap_pre,
                           window_left, window_right)
            ws_compute(tile_shared, cfg, WG, DET, it0, tile, kv_free, epi_done, True, EPI,
                       dv_stage)
            it0 += n_steps
            tile += 1
            t = _take_tile(tile_smem, tile_full, tile_empty, tile, 4)

    @gluon.jit
    def _ws_loader_tiles(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, smem, kv_free,
                         epi_done, tile_smem, tile_full, tile_empty, counter_ptr, seqlen_q,
                         seqlen_k, total_q, n_kv_heads, group, window_left, window_right,
                         n_blocks, n_tiles, cfg, HAND_OVER: gl.constexpr,
                         TOP_FIRST: gl.constexpr):
        """The load warp of a persistent CTA: `ws_loader` per tile. Tiles after the first
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
                                       window_left, window_right, cfg, TOP_FIRST)
            ws_loader(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr,
                      smem.for_tile(tile, cfg.KV_BUFS), k_start + n0, hk, q_start, seqlen_q,
                      total_q, n_steps, h_first, m_lo, m_lo, m_end, h_first, group, cfg, it0,
                      tile, kv_free, epi_done, True,
                      epilogue_mode(cfg.BLOCK_M, cfg.HEAD_DIM, cfg.HEAD_DIM_V, HAND_OVER,
                                    cfg.KV_BUFS))
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
    def _ws_dq_tiles(smem, dq_desc, tile_smem, tile_full, tile_empty, sem_ptr, seqlen_q,
                     seqlen_k, n_heads, n_kv_heads, group, num_m_blocks, window_left,
                     window_right, n_blocks, cfg, TOP_FIRST: gl.constexpr):
        """The dQ warp of a persistent CTA per tile: the reduces (ws_dq_warp), or in
        deterministic mode the reduces in turn (`ws_dq_turns`, unstaggered: `_ws_tiles`)."""
        if cfg.DQ_WARP or cfg.DETERMINISTIC:
            it0 = 0
            tile = 0
            t = _take_tile(tile_smem, tile_full, tile_empty, 0, 1)
            while t >= 0:
                (n0, hk, q_start, k_start, n_steps, h_first, m_lo, m_end, dq_start, n_blk,
                 batch, group_blocks) = _ws_tile(t, n_blocks, n_kv_heads, seqlen_q, seqlen_k,
                                                 group, window_left, window_right, cfg, TOP_FIRST)
                if not in_fragments(dq_desc.layout):  # row-major dQ: the rows themselves
                    dq_start = q_start
                ws_dq_turns(smem, dq_desc, sem_ptr, dq_start, n_steps,
                            h_first, m_lo, m_lo, m_end, h_first, group, batch, n_heads,
                            num_m_blocks, n_blk, n_blocks, seqlen_k - seqlen_q, window_left,
                            window_right, group_blocks, 0, cfg, False, True, cfg.DETERMINISTIC,
                            it0)
                it0 += n_steps
                tile += 1
                t = _take_tile(tile_smem, tile_full, tile_empty, tile, 1)

    @gluon.jit
    def _ws_tiles(call, cfg):
        """A persistent CTA (BwdConfig.ws_persistent; dense lengths): the
        grid's (key block, kv head, sequence) tiles, the program's own number first and then
        the next of a counter's (`_ws_loader_tiles`, which hands each to the other roles),
        each as a CTA of the plain grid runs it, the roles looping over them. What a tile
        boundary adds: the load warp loads the next tile's K/V once both warpgroups are past
        their last MMA reading K/V (kv_free), while they finish dQ and store dK/dV, and the
        next tile's first Q/dO at once, or, where dK/dV stage through the ring
        (`epilogue_mode` 0: with the dQ warp), once those stores have read it (epi_done);
        every other barrier's phase runs on by step (ring, dSᵀ, dQ hand-over) or by tile
        (kv_bar, done).

        DETERMINISTIC: the dQ warp adds in turn (`ws_dq_turns`), and the turns must follow
        the order in which tiles are taken: each tile then waits only for tiles taken before
        it, so the lowest unfinished tile is always some CTA's current tile with every turn
        it needs passed, and no wait closes a cycle (a CTA holds its next tile before it ends
        its current one, so a turn order against the tile order could make a tile wait for
        one queued behind it on its own CTA). Hence no stagger (ascending turns, as the
        tiles number key blocks), and causal tiles numbered top-first (descending turns).
        The semaphores and the tile counter share one zeroed buffer: the counter is the word
        after the (sequence, q head, query block) semaphores."""
        # the dQ warp issues the reduces
        HAND_OVER: gl.constexpr = cfg.DQ_WARP or cfg.DETERMINISTIC
        TOP_FIRST: gl.constexpr = cfg.HAS_RIGHT and cfg.DETERMINISTIC
        smem = ws_alloc(call.q_desc, call.k_desc, call.v_desc, call.do_desc, call.dq_desc,
                        cfg.HEAD_DIM, cfg.HEAD_DIM_V, cfg.BLOCK_M, cfg.BLOCK_N, cfg.RING, HAND_OVER,
                        cfg.KV_BUFS)
        kv_free = gl.allocate_shared_memory(gl.int64, [cfg.KV_BUFS, 1],
                                            mbarrier.MBarrierLayout())
        epi_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(cfg.KV_BUFS):
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
        if epilogue_mode(cfg.BLOCK_M, cfg.HEAD_DIM, cfg.HEAD_DIM_V, HAND_OVER, cfg.KV_BUFS) == 2:
            dv_stage = gl.allocate_shared_memory(call.q_desc.dtype,
                                                 [2, cfg.BLOCK_N // 2, cfg.HEAD_DIM_V],
                                                 call.dv_desc.layout)
        else:
            dv_stage = smem.dq  # not read
        fence_async_shared()
        n_blocks = (call.seqlen_k + cfg.BLOCK_N - 1) // cfg.BLOCK_N
        n_seqs = call.total_q // gl.maximum(call.seqlen_q, 1)
        n_tiles = n_blocks * call.n_kv_heads * n_seqs
        counter_ptr = call.sem_ptr
        if cfg.DETERMINISTIC:
            counter_ptr = call.sem_ptr + n_seqs * call.n_heads * call.num_m_blocks
        shared = (smem, call.dq_desc, call.dk_desc, call.dv_desc, call.dk_ptr, call.dv_ptr,
                  call.seqlen_q, call.seqlen_k, call.n_kv_heads, call.group, call.qk_scale,
                  call.softmax_scale, call.softcap_pre, call.window_left, call.window_right,
                  n_blocks, kv_free, epi_done, tile_smem, tile_full, tile_empty, dv_stage)
        gl.warp_specialize([
            (_ws_compute_tiles, (shared, cfg, 0, HAND_OVER, TOP_FIRST)),
            (_ws_compute_tiles, (shared, cfg, 1, HAND_OVER, TOP_FIRST)),
            (_ws_loader_tiles, (call.q_desc, call.k_desc, call.v_desc, call.do_desc,
                                call.lse_ptr, call.delta_ptr, smem, kv_free, epi_done, tile_smem,
                                tile_full, tile_empty, counter_ptr, call.seqlen_q, call.seqlen_k,
                                call.total_q, call.n_kv_heads, call.group, call.window_left,
                                call.window_right, n_blocks, n_tiles, cfg, HAND_OVER,
                                TOP_FIRST)),
            (_ws_dq_tiles, (smem, call.dq_desc, tile_smem, tile_full, tile_empty, call.sem_ptr,
                            call.seqlen_q, call.seqlen_k, call.n_heads, call.n_kv_heads,
                            call.group, call.num_m_blocks, call.window_left, call.window_right,
                            n_blocks, cfg, TOP_FIRST)),
        ], [4, 1, 1], [COMPUTE_REGS, LOADER_REGS, LOADER_REGS])

    @gluon.jit
    def attn_bwd_ws(call, cfg):
        """The body `entry.attn_bwd_kernel` runs for the warp-specialised kernel."""
        # Of the launch's switches, DK_LATE, STATS_LATE, RELEASE_AT, DQ_IN_OPS and HI_LATE
        # belong to the synchronous kernels' schedules. DV_OVERLAP:
        # dV = Pᵀ·dO stays in flight while dSᵀ is formed (BwdConfig.dv_overlap).
        # DETERMINISTIC: the dQ warp adds the tiles in kernel.py's turn order (causal masks:
        # the grid runs from the top key block down, as there). DQ_WARP: without
        # DETERMINISTIC, the dQ warp still issues the reduces (BwdConfig.ws_dq_warp).
        # PERSISTENT: BwdConfig.ws_persistent (`_ws_tiles`); KV_BUFS: its K/V buffers
        # (BwdConfig.ws_kv_buffers). MASK_MODE: how masked steps mask (parts.probabilities;
        # BwdConfig.step_cols, mask_scores). FIRST_STORES: deterministic mode's first dQ turn
        # of each query block stores instead of adding (bwd.first_stores).
        if cfg.PERSISTENT:
            _ws_tiles(call, cfg)
        else:
            n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k, n0 = key_tile(call,
                                                                                          cfg)
            if (n0 >= 0) & (n0 < seqlen_k):
                (shift, m_lo, group_blocks, n_steps, keys_oob, m_full_lo,
                 m_full_hi) = key_walk(call, cfg, n0, seqlen_q, seqlen_k)
                h_first, h, m0, stride, m_end = walk(call, cfg, hk, n_blk, n_seq, n_steps,
                                                     group_blocks, m_lo)

                smem = ws_alloc(call.q_desc, call.k_desc, call.v_desc, call.do_desc, call.dq_desc,
                                cfg.HEAD_DIM, cfg.HEAD_DIM_V, cfg.BLOCK_M, cfg.BLOCK_N, cfg.RING,
                                cfg.DETERMINISTIC or cfg.DQ_WARP)
                fence_async_shared()

                # What the two compute warpgroups share travels as one tuple of runtime values;
                # the constexprs are written out in each role (held in a variable, Gluon would
                # turn them into runtime values). The dQ warp (deterministic mode) shares the
                # load warp's padded warpgroup and register count; without DETERMINISTIC it
                # returns at once.
                shared = (smem, call.dq_desc, call.dk_desc, call.dv_desc, call.dk_ptr,
                          call.dv_ptr, q_start, k_start, seqlen_q, seqlen_k, call.n_kv_heads, hk,
                          n0, n_steps, h, m0, m_lo, m_end, h_first, call.group, keys_oob,
                          m_full_lo, m_full_hi, call.qk_scale, call.softmax_scale,
                          call.softcap_pre, call.window_left, call.window_right)
                gl.warp_specialize([
                    (ws_compute, (shared, cfg, 0, cfg.DETERMINISTIC or cfg.DQ_WARP)),
                    (ws_compute, (shared, cfg, 1, cfg.DETERMINISTIC or cfg.DQ_WARP)),
                    (ws_loader, (call.q_desc, call.k_desc, call.v_desc, call.do_desc,
                                 call.lse_ptr, call.delta_ptr, smem, k_start + n0, hk, q_start,
                                 seqlen_q, call.total_q, n_steps, h, m0, m_lo, m_end, h_first,
                                 call.group, cfg)),
                    (ws_dq_turns, (smem, call.dq_desc, call.sem_ptr, q_start, n_steps, h, m0,
                                   m_lo, m_end, h_first, call.group, batch, call.n_heads,
                                   call.num_m_blocks, n_blk, n_seq, shift, call.window_left,
                                   call.window_right, group_blocks, stride, cfg, cfg.STAGGER,
                                   cfg.DETERMINISTIC or cfg.DQ_WARP, cfg.DETERMINISTIC, 0)),
                ], [4, 1, 1], [COMPUTE_REGS, LOADER_REGS, LOADER_REGS])
