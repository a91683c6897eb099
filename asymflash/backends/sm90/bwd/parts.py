"""Gluon pieces shared by the sm90 backward bodies (`kernel.py`'s synchronous ones for d <= 128
and d = 256, `kernel_ws.py`'s warp-specialised one): loads, row statistics, the query range of
a key block, the masks, the dQ reduction with its deterministic turn, and the dK/dV stores.

Both kernels follow the same plan (see host.py's docstring): one CTA per key block, a walk over
(q head of the group, query block) steps, transposed products so the key dimension is the
wgmma M axis. They differ in how the two warpgroups share a step.
"""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from ..bounds import allowed, key_block_walk, step_needs_mask
    from ..common import (
        PIECE,
        copy_piece,
        copy_pieces,
        copy_rows,
        gl,
        gluon,
        leading_tile,
        tanh,
        thread_barrier,
        tile_layout,
        tma_store,
    )
    from ..sched import key_block, key_block_origin, walk_start
    from .dq_fragments import fragment_bases

    @gluon.constexpr_function
    def fragment_layout(rows, cols):
        """Shared layout of a dQ tile in the wgmma accumulator's order (`dq_fragments.py`)."""
        return gl.SharedLinearLayout(fragment_bases(int(cols), int(rows)))

    @gluon.constexpr_function
    def mma_layout(warp_rows, warp_cols, cols):
        """A wgmma accumulator's layout: instructions 16 rows by `cols` columns, the warps
        arranged warp_rows x warp_cols (four warps of a warpgroup along the rows)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warp_rows, warp_cols],
                                         instr_shape=[16, cols, 16])

    @gluon.constexpr_function
    def in_fragments(layout):
        """dQ tiles in the accumulator's order: the host gives their descriptor an unswizzled
        layout, the row-major tiles a swizzled one."""
        return layout.swizzle_byte_width == 0

    @gluon.jit
    def fragment_block(q_start, m0):
        """The fragment buffer's 64-row block holding query row m0 of this CTA's sequence
        (`dq_fragments.py`'s numbering: q_start // 64 + 2·sequence + m0 // 64). The sequence
        is the grid's third index (`key_block`), read here rather than kept live through the
        loop (one more live scalar cost ptxas spills)."""
        return q_start // 64 + 2 * gl.program_id(2) + m0 // 64

    @gluon.jit
    def stage_dq(dq_buf, dq, FRAG: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
        """Store a dQ tile (wgmma accumulator layout, ROWS x COLS) for its TMA reduce: as it
        is, or (FRAG) in fragment order through the same buffer reinterpreted."""
        if FRAG:
            dq_buf._reinterpret(gl.float32, [ROWS, COLS], fragment_layout(ROWS, COLS)).store(dq)
        else:
            dq_buf.store(dq)

    @builtin
    def tma_reduce_add(desc, coord, src, _semantic=None):
        """global[box at coord] += shared memory `src` (cp.reduce.async.bulk.tensor .add).

        A box wider than the 128-byte swizzle is split by the lowering into 128-byte column
        boxes, each issued by one elected thread of its own warp of the first warpgroup (four
        at d=128 fp32). Completion is tracked like a TMA store's (tma.store_wait, per issuing
        thread). Triton 3.6's Gluon Hopper `tma` module has no reduce; its IR builder does.
        """
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle,
                                                  coord, src.handle)

    # A dQ row index past any buffer's rows (TMA row coordinates are int32; the buffers'
    # rows stay below 2^29, dq_fragments.num_blocks): a box there is written nowhere.
    FAR_ROW = gl.constexpr(1 << 30)

    @gluon.jit
    def add_dq_tile(desc, row, col, src, FIRST_STORES: gl.constexpr, first):
        """dQ_acc[box at (row, col)] += the staged tile `src` (TMA reduce-add). FIRST_STORES
        (deterministic mode, `host.first_stores`: dQ_acc is not zeroed): where `first` (1 on
        a query block's first turn, else 0) the tile is stored instead. Branch-free: both a
        store and an add are issued, the one not wanted aimed FAR_ROW rows away, where the
        TMA unit writes nothing (a branch around them made ptxas spill in bwd_ws's compute
        warpgroups: 2 -> 32 local-memory instructions at d=128)."""
        if FIRST_STORES:
            tma_store(desc, [row + (1 - first) * FAR_ROW, col], src)
            tma_reduce_add(desc, [row + first * FAR_ROW, col], src)
        else:
            tma_reduce_add(desc, [row, col], src)

    @gluon.jit
    def load_kv(k_desc, v_desc, k_smem, v_smem, bar, row, hk, HEAD_DIM: gl.constexpr,
                HEAD_DIM_V: gl.constexpr):
        """TMA-load the CTA's K and V rows [row, row + BLOCK_N) of kv head hk (any of
        common.copy_rows's descriptors)."""
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        copy_rows(k_desc, row, hk, HEAD_DIM, bar, k_smem, True)
        copy_rows(v_desc, row, hk, HEAD_DIM_V, bar, v_smem, True)

    @gluon.jit
    def load_qdo(q_desc, do_desc, q_smem, do_smem, ready, slot, h, row,
                 HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, pred):
        """TMA-load the Q and dO rows [row, row + BLOCK_M) of q head h into ring slot `slot`."""
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes,
                        pred=pred)
        copy_rows(q_desc, row, h, HEAD_DIM, ready.index(slot), q_smem.index(slot), pred)
        copy_rows(do_desc, row, h, HEAD_DIM_V, ready.index(slot), do_smem.index(slot), pred)

    @gluon.jit
    def load_rows(desc, dst, bar, row, head, WIDTH: gl.constexpr, pred):
        """TMA-load the rows [row, row + box) of head `head` into `dst`, arriving on `bar`."""
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        copy_rows(desc, row, head, WIDTH, bar, dst, pred)

    @gluon.jit
    def load_qdo_pieces(q_desc, do_desc, q_smem, q_hi, do_smem, ready, slot, h, row,
                        ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                        pred):
        """`load_qdo` at kernel head dim 192: Q of ring slot `slot` in its pieces
        (`copy_pieces`), dO whole; one `expect` for all four boxes."""
        bar = ready.index(slot)
        mbarrier.expect(bar, 3 * q_desc.block_type.nbytes + do_desc.block_type.nbytes,
                        pred=pred)
        copy_pieces(q_desc, q_smem.index(slot), q_hi.index(slot), bar, row, h, ROWS, HEAD_DIM,
                    pred)
        copy_rows(do_desc, row, h, HEAD_DIM_V, bar, do_smem.index(slot), pred)

    @gluon.jit
    def key_operand_pieces(call, cfg, DO_BUFS: gl.constexpr):
        """`key_operands` at kernel head dim 192: K and the two-slot Q ring as a 128-wide and
        a 64-wide piece each (Gluon's tiles are powers of two): (k_lo, k_hi, v, q_lo, q_hi,
        do)."""
        dtype: gl.constexpr = call.q_desc.dtype
        LO: gl.constexpr = cfg.HEAD_DIM - PIECE
        k_layout: gl.constexpr = tile_layout(call.k_desc.layout)
        q_layout: gl.constexpr = tile_layout(call.q_desc.layout)
        k_lo = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, LO], k_layout)
        k_hi = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, PIECE], k_layout)
        v_smem = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, cfg.HEAD_DIM_V],
                                           tile_layout(call.v_desc.layout))
        q_lo = gl.allocate_shared_memory(dtype, [2, cfg.BLOCK_M, LO], q_layout)
        q_hi = gl.allocate_shared_memory(dtype, [2, cfg.BLOCK_M, PIECE], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [DO_BUFS, cfg.BLOCK_M, cfg.HEAD_DIM_V],
                                            tile_layout(call.do_desc.layout))
        return k_lo, k_hi, v_smem, q_lo, q_hi, do_smem

    @gluon.jit
    def load_kv_pieces(k_desc, v_desc, k_lo, k_hi, v_smem, bar, row, hk,
                       BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       HEAD_DIM_V: gl.constexpr):
        """`load_kv` at kernel head dim 192: K in its pieces (`load_pieces`), V whole."""
        mbarrier.expect(bar, 3 * k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        copy_pieces(k_desc, k_lo, k_hi, bar, row, hk, BLOCK_N, HEAD_DIM, True)
        copy_rows(v_desc, row, hk, HEAD_DIM_V, bar, v_smem, True)

    @gluon.jit
    def store_key_piece(ptr, tile, n0, k_start, seqlen_k, n_kv_heads, hk, WIDTH: gl.constexpr,
                        COL: gl.constexpr, COLS: gl.constexpr, BLOCK_N: gl.constexpr,
                        layout: gl.constexpr):
        """`store_key_rows` of the columns [COL, COL + COLS) of a WIDTH-wide dK (the 192
        build's pieces; TMA stores would need a 192-wide box)."""
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = COL + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        off = ((k_start + keys).to(gl.int64) * n_kv_heads + hk) * WIDTH
        gl.store(ptr + gl.expand_dims(off, 1) + gl.expand_dims(cols, 0),
                 tile.to(ptr.dtype.element_ty), mask=gl.expand_dims(keys < seqlen_k, 1))

    @gluon.jit
    def stage_stats(lse_ptr, delta_ptr, lse_smem, delta_smem, buf, h, m0, q_start, seqlen_q,
                    total_q, BLOCK_M: gl.constexpr, layout: gl.constexpr,
                    LOADS_FIRST: gl.constexpr = False):
        """Copy lse (as log2, +inf for empty rows) and delta of one query block into shared
        memory buffer `buf`.

        Loaded one value per thread and read back in the MMA layout only when needed, so the
        16 + 16 registers a thread would hold for them in that layout are not live across
        the MMA waits (at d=128 that decides between spilling and not). LOADS_FIRST: both
        loads before either store (one memory round trip instead of two; bwd_ws's load
        warp, whose registers are not the compute warps').
        """
        rows = m0 + gl.arange(0, BLOCK_M, layout=layout)
        ok = rows < seqlen_q
        off = h.to(gl.int64) * total_q + q_start + rows
        # Rows past the sequence read lse = +inf: P = 0 there, no mask needed.
        lse = gl.load(lse_ptr + off, mask=ok, other=float("inf"))
        if LOADS_FIRST:
            delta = gl.load(delta_ptr + off, mask=ok, other=0.0)
        lse_smem.index(buf).store(
            gl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634))
        if not LOADS_FIRST:
            delta = gl.load(delta_ptr + off, mask=ok, other=0.0)
        delta_smem.index(buf).store(delta)

    @gluon.jit
    def probabilities(s, lse2, qk_scale, softcap_pre, needs_mask, kloc, cols, n_valid, m0,
                      diag_right, diag_left, SOFTCAP: gl.constexpr, HAS_LEFT: gl.constexpr,
                      HAS_RIGHT: gl.constexpr, MASK_MODE: gl.constexpr = 0):
        """(Pᵀ, Pᵀ for dSᵀ) of one step from Sᵀ and the rows' log2 lse, masked when
        `needs_mask`. With softcap the second carries the chain-rule factor 1 − tanh², folded
        in now so that tanh does not stay live (32 registers at d=128) until dPᵀ arrives;
        without it, both are Pᵀ.

        MASK_MODE (bwd_ws; BwdConfig.step_cols, mask_scores): bit 0, `allowed`'s STEP_COLS;
        bit 1, without softcap, mask Sᵀ to -inf before the exponentials instead of Pᵀ to 0
        after them (the same P: lse is finite or +inf where it is read). sm_90a, causal step
        loops: the masked block's local-memory instructions d=128 12 + 24 -> 0, d=64 ~48 -> 8
        a loop, none added on the unmasked path."""
        STEP_COLS: gl.constexpr = (MASK_MODE & 1) != 0
        BEFORE_EXP: gl.constexpr = (MASK_MODE & 2) != 0 and not SOFTCAP
        if BEFORE_EXP:
            if needs_mask:
                ok = allowed(kloc, cols, n_valid, m0, diag_right, diag_left, HAS_LEFT,
                             HAS_RIGHT, STEP_COLS)
                s = gl.where(ok, s, float("-inf"))
        if SOFTCAP:
            t = tanh(s * softcap_pre)
            p = gl.exp2(t * qk_scale - gl.expand_dims(lse2, 0))
            p_ds = p * (1.0 - t * t)
        else:
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
            p_ds = p
        if not BEFORE_EXP:
            if needs_mask:
                ok = allowed(kloc, cols, n_valid, m0, diag_right, diag_left, HAS_LEFT,
                             HAS_RIGHT, STEP_COLS)
                p = gl.where(ok, p, 0.0)
                if SOFTCAP:
                    p_ds = gl.where(ok, p_ds, 0.0)
                else:
                    p_ds = p
        return p, p_ds

    @gluon.jit
    def dq_turn(sem_ptr, batch, n_heads, h, num_m_blocks, m0, n_blk, n_seq, shift,
                window_left, window_right, h_first, m_lo, group_blocks, stride,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr, STAGGER: gl.constexpr):
        """Deterministic mode: (turn counter of query block m0 of head h, the turn of key
        block n_blk there): it may add its dQ partial once the counter reads the turn.
        Turn 0 is the block's first contribution (with FIRST_STORES a plain store).

        Key blocks [n_first, n_last] see the query block; causal turns run from n_last down.
        Staggered walks (`walk_start`, stride > 0): the step index e of (h, m0) is visited
        first by key block j* = min(e // stride, n_seq - 1), then j* - 1, ..., 0, n_seq - 1,
        ..., j* + 1 (ascending start offsets, wrapped): turn (j* - n_blk) mod n_seq.
        """
        if HAS_RIGHT:
            n_last = gl.minimum((m0 + BLOCK_M - 1 + shift + window_right) // BLOCK_N, n_seq - 1)
            turn = n_last - n_blk
        else:
            n_first = 0
            if HAS_LEFT:
                n_first = gl.maximum(m0 + shift - window_left, 0) // BLOCK_N
            turn = n_blk - n_first
            if STAGGER:
                if stride > 0:
                    e = (h - h_first) * group_blocks + (m0 - m_lo) // BLOCK_M
                    first = gl.minimum(e // stride, n_seq - 1)
                    turn = (first - n_blk + n_seq) % n_seq
        sem = sem_ptr + (batch * n_heads + h) * num_m_blocks + m0 // BLOCK_M
        return sem, turn

    @gluon.jit
    def wait_dq_turn(sem_ptr, batch, n_heads, h, num_m_blocks, m0, n_blk, n_seq, shift,
                     window_left, window_right, h_first, m_lo, group_blocks, stride,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                     HAS_RIGHT: gl.constexpr, STAGGER: gl.constexpr, WARP_SPIN: gl.constexpr):
        """Deterministic mode: spin until key block n_blk may add its dQ partial of query
        block m0 of head h (`dq_turn`, host.py's docstring); return that block's turn counter
        and whether this is its first turn (1 or 0: `add_dq_tile`). WARP_SPIN: every warp
        polls (`spin_until_equal`), else thread 0 polls and broadcasts.
        """
        sem, turn = dq_turn(sem_ptr, batch, n_heads, h, num_m_blocks, m0, n_blk, n_seq, shift,
                            window_left, window_right, h_first, m_lo, group_blocks, stride,
                            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, STAGGER)
        if WARP_SPIN:
            spin_until_equal(sem, turn)
        else:
            while gl.atomic_add(sem, 0, sem="acquire") != turn:
                pass
        return sem, (turn == 0).to(gl.int32)

    @gluon.jit
    def spin_until_equal(ptr, value):
        """Spin until the int32 at `ptr` reads `value` (acquire loads, gpu scope), then wait
        for every thread of the CTA.

        Every warp polls on its own (one load per warp: its threads read the same word) and
        leaves the loop on a warp vote, so the loop is warp-uniform by construction. The
        obvious form, `while gl.atomic_add(ptr, 0, sem="acquire") != value`, has one thread
        poll and broadcast through shared memory; ptxas cannot prove that loop warp-uniform
        and, inside a step loop, then keeps the loop-invariant wgmma descriptors in vector
        registers: at d=256 they spilled (ptxas: 103 / 134 local-memory
        instructions non-causal / causal, 35 / 54 between the MMAs; 0 with this loop). One
        thread or one warp polling behind a branch on the thread index, or thread 0 with a
        predicated load, still spilled 60-77 in the non-causal build.
        """
        gl.inline_asm_elementwise(
            "{\n\t.reg .pred %spin_busy;\n\t.reg .b32 %spin_now;"
            "\nSPIN_POLL:\n\tld.acquire.gpu.global.b32 %spin_now, [$1];"
            "\n\tsetp.ne.s32 %spin_busy, %spin_now, $2;"
            "\n\tvote.sync.any.pred %spin_busy, %spin_busy, -1;"
            "\n\t@%spin_busy bra.uni SPIN_POLL;"
            "\n\tmov.b32 $0, 0;\n\t}",
            "=r,l,r", [ptr, value], dtype=gl.int32, is_pure=False, pack=1)
        thread_barrier()

    @gluon.jit
    def take_dq_turn(call, cfg, held, it, batch, h, m0, n_blk, n_seq, shift, h_first, m_lo,
                     group_blocks, stride, WARP_SPIN: gl.constexpr):
        """Deterministic mode, before step `it`'s dQ reduce: with RELEASE_AT == 2 first pass
        on the previous step's turn (`held`: a CTA never holds a turn while it waits for
        another), then wait for this step's; returns its counter and whether the turn is
        the query block's first (1 or 0: `add_dq_tile`)."""
        if cfg.RELEASE_AT == 2:
            if it > 0:
                release_dq_turn_after_tma(held, m0)
        return wait_dq_turn(call.sem_ptr, batch, call.n_heads, h, call.num_m_blocks, m0, n_blk,
                            n_seq, shift, call.window_left, call.window_right, h_first, m_lo,
                            group_blocks, stride, cfg.BLOCK_M, cfg.BLOCK_N, cfg.HAS_LEFT,
                            cfg.HAS_RIGHT, cfg.STAGGER, WARP_SPIN)

    @gluon.jit
    def after_dq_reduce(sem, x, RELEASE_AT: gl.constexpr):
        """Deterministic mode, right after this step's TMA reduce: pass the turn on now
        (RELEASE_AT == 0, once the reduce has landed) or keep holding it; returns the turn
        held (the same counter: read only when RELEASE_AT != 0)."""
        if RELEASE_AT == 0:
            release_dq_turn_after_tma(sem, x)
        return sem

    @gluon.constexpr_function
    def _landed_asm(from_warp):
        """PTX: wait until this thread's bulk reduces have written, fence the async proxy
        (and, from_warp, a warp barrier), then pass $1 through as $0."""
        warp = "bar.warp.sync -1;\n\t" if from_warp else ""
        return ("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\t" + warp
                + "mov.b32 $0, $1;")

    @gluon.jit
    def release_dq_turn_after_tma(sem, x, FROM_WARP: gl.constexpr = False):
        """Deterministic mode with TMA reduces: pass the turn on once this CTA's dQ adds are
        complete in global memory.

        tma.store_wait only waits until a reduce has *read* shared memory; `cp.async.bulk.
        wait_group 0` waits until it has written, and the proxy fence orders those async-proxy
        writes before the release (a generic-proxy atomic). `x` is any int32 scalar: inline
        asm needs an operand.

        FROM_WARP (BwdConfig.turn_release 3): no CTA barrier. One thread of warp 0 issued the
        reduces and thread 0 releases, so warp 0 alone waits for them to land and passes the
        turn on after a warp barrier (bar.warp.sync orders memory among the warp's threads);
        the release's fence (a MEMBAR) then holds up warp 0 only, until the next CTA
        barrier."""
        gl.inline_asm_elementwise(_landed_asm(FROM_WARP), "=r,r", [x], dtype=gl.int32,
                                  is_pure=False, pack=1)
        if not FROM_WARP:
            thread_barrier()
        gl.atomic_add(sem, 1, sem="release")

    @gluon.jit
    def store_key_rows(ptr, tile, n0, k_start, seqlen_k, n_kv_heads, hk, HEAD: gl.constexpr,
                       BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Store a [BLOCK_N, HEAD] dK or dV tile; rows past the sequence (other sequences'
        keys, or TMA zero fill) are not stored."""
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
        off = ((k_start + keys).to(gl.int64) * n_kv_heads + hk) * HEAD
        gl.store(ptr + gl.expand_dims(off, 1) + gl.expand_dims(cols, 0),
                 tile.to(ptr.dtype.element_ty), mask=gl.expand_dims(keys < seqlen_k, 1))

    @gluon.jit
    def store_key_tiles(dk_desc, dv_desc, dk, dv, dk_buf, dv_buf, row, hk,
                        HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr):
        """The dK and dV tiles through shared memory and one TMA store each, where every key
        block lies whole in its sequence or at the end of the tensor (the host decides:
        `kv_tma_store`). dk_buf / dv_buf alias the Q / dO rings, free once every warpgroup
        has retired its last MMA (the first barrier). The masked per-thread stores of
        `store_key_rows` are what the forward's O epilogue replaced (2316 -> 433 cycles a
        tile at d=128, H200)."""
        thread_barrier()
        if HEAD_DIM != 128:
            # Through a blocked layout (the conversion's scratch reuses the dead rings): stored
            # straight from the wgmma layout, ptxas spilled inside the main loop (sm_90a, d=64
            # causal: 40 local-memory instructions there; this way 0; d=256 deterministic
            # causal 2 -> 4).
            rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1],
                                                         [1, 0])
            dk_buf.store(gl.convert_layout(dk.to(dk_desc.dtype), rows_layout))
            dv_buf.store(gl.convert_layout(dv.to(dv_desc.dtype), rows_layout))
        else:
            # Straight from the wgmma layout: one shared-memory pass instead of three (the
            # conversion writes and reads a scratch tile first; see docs/tuning.md). Not at
            # d=256: its deterministic causal build spills in the loop.
            dk_buf.store(dk.to(dk_desc.dtype))
            dv_buf.store(dv.to(dv_desc.dtype))
        fence_async_shared()
        thread_barrier()
        tma_store(dk_desc, [row, hk * HEAD_DIM], dk_buf)
        tma_store(dv_desc, [row, hk * HEAD_DIM_V], dv_buf)
        tma.store_wait(0)  # shared memory must outlive the stores' reads

    @gluon.jit
    def store_key_grads(call, cfg, dk, dv, q_smem, do_smem, n0, k_start, seqlen_k, hk,
                        dk_layout: gl.constexpr, dv_layout: gl.constexpr):
        """The synchronous kernels' epilogue: the CTA's dK (already scaled) and dV tiles, by
        TMA through the Q and dO buffers (free once the loop is over: d <= 128 two 32 KB
        rings, d = 256 Q's 64 KB ring and dO's 32 KB buffer) where the host allows it
        (`kv_tma_store`), else by masked per-thread stores."""
        if cfg.KV_TMA_STORE:
            dtype: gl.constexpr = call.dk_desc.dtype
            key_row, key_head = key_block_origin(seqlen_k, cfg.BLOCK_N,
                                                 cfg.HAS_RIGHT and cfg.DETERMINISTIC,
                                                 cfg.HEADS_FIRST)
            store_key_tiles(call.dk_desc, call.dv_desc, dk, dv,
                            leading_tile(q_smem, dtype, [cfg.BLOCK_N, cfg.HEAD_DIM],
                                         call.dk_desc.layout),
                            leading_tile(do_smem, dtype, [cfg.BLOCK_N, cfg.HEAD_DIM_V],
                                         call.dv_desc.layout),
                            key_row, key_head, cfg.HEAD_DIM, cfg.HEAD_DIM_V)
        else:
            store_key_rows(call.dk_ptr, dk, n0, k_start, seqlen_k, call.n_kv_heads, hk,
                           cfg.HEAD_DIM, cfg.BLOCK_N, dk_layout)
            store_key_rows(call.dv_ptr, dv, n0, k_start, seqlen_k, call.n_kv_heads, hk,
                           cfg.HEAD_DIM_V, cfg.BLOCK_N, dv_layout)

    @gluon.jit
    def key_tile(call, cfg):
        """This CTA's key block (`sched.key_block` under the launch's grid order): (n_blk,
        n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k, n0), the lengths its
        sequence's own, n0 its first key. Top-first order (deterministic causal) numbers the
        key blocks down from the sequence's own count: grid columns beyond a shorter varlen
        sequence get n0 < 0 (or n0 >= seqlen_k): no work there."""
        n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k = key_block(
            call.cu_q_ptr, call.cu_k_ptr, call.used_k_ptr, call.seqlen_q, call.seqlen_k,
            cfg.BLOCK_N, cfg.UNIFORM, cfg.HAS_SEQUSED, cfg.HAS_RIGHT and cfg.DETERMINISTIC,
            cfg.HEADS_FIRST)
        return n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k, n_blk * cfg.BLOCK_N

    @gluon.jit
    def key_walk(call, cfg, n0, seqlen_q, seqlen_k):
        """`bounds.key_block_walk` of the key block at n0 under the launch's mask: (shift,
        m_lo, group_blocks, n_steps, keys_oob, m_full_lo, m_full_hi)."""
        return key_block_walk(n0, seqlen_q, seqlen_k, call.group, call.window_left,
                              call.window_right, cfg.BLOCK_M, cfg.BLOCK_N, cfg.HAS_LEFT,
                              cfg.HAS_RIGHT)

    @gluon.jit
    def key_operands(call, cfg, DO_BUFS: gl.constexpr):
        """The synchronous kernels' K and V tiles, their two-slot Q ring and DO_BUFS dO
        buffers, in that order in shared memory: (k_smem, v_smem, q_smem, do_smem)."""
        dtype: gl.constexpr = call.q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, cfg.HEAD_DIM],
                                           tile_layout(call.k_desc.layout))
        v_smem = gl.allocate_shared_memory(dtype, [cfg.BLOCK_N, cfg.HEAD_DIM_V],
                                           tile_layout(call.v_desc.layout))
        q_smem = gl.allocate_shared_memory(dtype, [2, cfg.BLOCK_M, cfg.HEAD_DIM],
                                           tile_layout(call.q_desc.layout))
        do_smem = gl.allocate_shared_memory(dtype, [DO_BUFS, cfg.BLOCK_M, cfg.HEAD_DIM_V],
                                            tile_layout(call.do_desc.layout))
        return k_smem, v_smem, q_smem, do_smem

    @gluon.jit
    def walk(call, cfg, hk, n_blk, n_seq, n_steps, group_blocks, m_lo):
        """The key block's walk over (q head of the group, query block) steps: (h_first, h,
        m0, stride, m_end), its first step (h, m0) from `sched.walk_start`; the steps carry
        (h, m0) from one to the next (`sched.next_step`) rather than divide them out of the
        step counter."""
        h_first = hk * call.group
        h, m0, stride = walk_start(n_blk, n_seq, n_steps, group_blocks, h_first, m_lo,
                                   cfg.STAGGER, cfg.BLOCK_M)
        return h_first, h, m0, stride, m_lo + group_blocks * cfg.BLOCK_M

    @gluon.jit
    def mask_coords(call, cfg, shift, n0, seqlen_k, key_layout: gl.constexpr,
                    col_layout: gl.constexpr):
        """What `probabilities` masks a step with: (kloc, n_valid, diag_right, diag_left,
        cols), the block's keys and a step's rows (Sᵀ's row and column slices), the valid
        keys, and the diagonals key <= row + shift + window_right and key >= row + shift -
        window_left relative to n0."""
        kloc = gl.arange(0, cfg.BLOCK_N, layout=key_layout)
        n_valid = seqlen_k - n0
        diag_right = shift + call.window_right - n0
        diag_left = shift - call.window_left - n0
        cols = gl.arange(0, cfg.BLOCK_M, layout=col_layout)
        return kloc, n_valid, diag_right, diag_left, cols

    @gluon.jit
    def stat_buffers(cfg):
        """The synchronous kernels' two buffers of row statistics, (lse, delta), each
        [2, BLOCK_M] (`step_stats`)."""
        layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [2, cfg.BLOCK_M], layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [2, cfg.BLOCK_M], layout)
        return lse_smem, delta_smem

    @gluon.jit
    def step_stats(call, cfg, lse_smem, delta_smem, buf, h, m0, q_start, seqlen_q):
        """`stage_stats` of the synchronous kernels (eight warps): query block m0 of head h
        into buffer `buf` of `stat_buffers`."""
        stage_stats(call.lse_ptr, call.delta_ptr, lse_smem, delta_smem, buf, h, m0, q_start,
                    seqlen_q, call.total_q, cfg.BLOCK_M, gl.BlockedLayout([1], [32], [8], [0]))

    @gluon.jit
    def finish_dq(cfg, held, n_steps):
        """After a synchronous kernel's step loop: pass on the turn still held (deterministic
        mode, turns released a step late), and wait until the last dQ reduce has read its
        staging buffer."""
        if cfg.DETERMINISTIC:
            if cfg.RELEASE_AT != 0:
                if n_steps > 0:
                    release_dq_turn_after_tma(held, n_steps)
        tma.store_wait(0)

    @gluon.jit
    def step_probabilities(call, cfg, s, lse2, m0, keys_oob, m_full_lo, m_full_hi, kloc, cols,
                           n_valid, diag_right, diag_left):
        """`probabilities` of a synchronous kernel's step, masked where the step's query
        block needs it (`bounds.step_needs_mask`)."""
        return probabilities(
            s, lse2, call.qk_scale, call.softcap_pre,
            step_needs_mask(m0, keys_oob, m_full_lo, m_full_hi, cfg.HAS_LEFT, cfg.HAS_RIGHT),
            kloc, cols, n_valid, m0, diag_right, diag_left, cfg.SOFTCAP, cfg.HAS_LEFT,
            cfg.HAS_RIGHT)
