"""Device-side tile orders: the forward's tile of a (query block, head, sequence) and the
persistent grid's waves and scheduling slots; the backward's walk over query blocks."""

from __future__ import annotations

from .common import GLUON_ERROR

if GLUON_ERROR is None:
    from .common import gl, gluon, mbarrier, sequence, thread_barrier

    @gluon.jit
    def tile_of(tile, n_heads, n_batch, num_m_blocks, hb_chunk, LPT: gl.constexpr,
                 CHUNKED: gl.constexpr):
        """(query block, head, sequence) of a tile index.

        CHUNKED (persistent grid): (sequence, head) pairs, heads of one sequence adjacent, are
        cut into chunks of hb_chunk pairs whose K/V fit in L2 together; a chunk's tiles are
        consecutive, query blocks outer (last block first with LPT: it sees the most keys under
        a causal mask), pairs inner. Otherwise the one-CTA-per-tile orders of the plain grid.
        """
        n_hb = n_heads * n_batch
        if CHUNKED:
            per_chunk = hb_chunk * num_m_blocks
            chunk = tile // per_chunk
            hb0 = chunk * hb_chunk
            width = gl.minimum(hb_chunk, n_hb - hb0)
            r = tile - chunk * per_chunk
            m_blk = r // width
            if LPT:
                m_blk = num_m_blocks - 1 - m_blk
            hb = hb0 + r % width
        elif LPT:
            # Later query tiles see more keys under a causal/local mask: start them first and
            # spread each wave over all heads and sequences.
            m_blk = num_m_blocks - 1 - tile // n_hb
            hb = tile % n_hb
        else:
            # Neighbouring CTAs share a head, so its K/V stays hot in L2.
            m_blk = tile % num_m_blocks
            hb = tile // num_m_blocks
        return m_blk, hb % n_heads, hb // n_heads

    # Sequences searched at once by `packed_tile` (one per thread of the CTA's 4 warps).
    SEARCH_SPAN = gl.constexpr(128)

    @gluon.jit
    def packed_tile(tile, n_heads, n_batch, cu_q_ptr, BLOCK_M: gl.constexpr):
        """(query block, head, sequence) of a tile of the plain grid over packed sequences.

        The grid holds no tile for query blocks past a sequence's end (a grid sized by the
        longest sequence left most of its CTAs empty on packed documents). Sequence b owns
        the tiles [H·s(b), H·s(b + 1)) with s(b) = (cu_q[b] - cu_q[0]) // BLOCK_M + b: its
        ceil(len_b / BLOCK_M) query blocks for each of the H heads, heads outer (a head's
        K/V stays hot in L2 while its blocks run), and H tiles to spare at most, which are
        empty (returned with the query block past the sequence's end). s is monotone, so
        the sequence is the last b with s(b) <= tile // H: counted over SEARCH_SPAN
        sequences at once, in two levels (every stride-th sequence, then the stride-1 after
        the last one counted), from cu_seqlens_q alone: no host pass. The host sizes the
        grid H·(total_q // BLOCK_M + batch) (`host.packed_grid`), which covers s(batch).
        """
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        c = tile // n_heads
        base = gl.load(cu_q_ptr)
        idx = gl.arange(0, SEARCH_SPAN, layout=layout)
        stride = gl.maximum((n_batch - 2) // SEARCH_SPAN + 1, 1)
        at = 1 + idx * stride
        ok = at < n_batch
        s_at = (gl.load(cu_q_ptr + at, mask=ok, other=0) - base) // BLOCK_M + at
        counted = gl.sum((ok & (s_at <= c)).to(gl.int32), 0)
        last = 1 + gl.maximum(counted - 1, 0) * stride
        more = 0
        for f in range(0, stride - 1, SEARCH_SPAN):
            at = last + 1 + f + idx
            ok = (f + idx < stride - 1) & (at < n_batch)
            s_at = (gl.load(cu_q_ptr + at, mask=ok, other=0) - base) // BLOCK_M + at
            more += gl.sum((ok & (s_at <= c)).to(gl.int32), 0)
        batch = gl.where(counted > 0, last + more, 0)
        q_start = gl.load(cu_q_ptr + batch)
        n_blocks = gl.maximum((gl.load(cu_q_ptr + batch + 1) - q_start + BLOCK_M - 1)
                              // BLOCK_M, 1)
        r = tile - n_heads * ((q_start - base) // BLOCK_M + batch)
        head = r // n_blocks
        m_blk = gl.where(head < n_heads, r - head * n_blocks, n_blocks)
        return m_blk, gl.minimum(head, n_heads - 1), batch

    @gluon.jit
    def wave_tile(wave, pid, nprog):
        """Tile of CTA pid in a wave of nprog consecutive tiles: CTA order reversed on odd
        waves, so that a CTA given a heavy tile (longest-first order) next gets a light one."""
        odd = wave & 1
        return wave * nprog + pid + odd * (nprog - 1 - 2 * pid)

    @gluon.jit
    def persistent_tile(wave, num_tiles, n_heads, n_batch, num_m_blocks, hb_chunk, seqlen_q,
                         seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr, LPT: gl.constexpr,
                         UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                         BLOCK_M: gl.constexpr):
        """This CTA's tile in `wave`, as both roles see it: (live, first query row m0, q head,
        packed q/k start rows, q/k lengths); live is False past the last tile or sequence."""
        tile = wave_tile(wave, gl.program_id(0), gl.num_programs(0))
        m_blk, head, batch = tile_of(gl.minimum(tile, num_tiles - 1), n_heads, n_batch,
                                      num_m_blocks, hb_chunk, LPT, True)
        q_start, k_start, sq, sk = sequence(batch, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr,
                                             used_k_ptr, UNIFORM, HAS_SEQUSED)
        m0 = m_blk * BLOCK_M
        return (tile < num_tiles) & (m0 < sq), m0, head, q_start, k_start, sq, sk

    @gluon.constexpr_function
    def sched_layout(num_warps):
        return gl.BlockedLayout([4], [32], [num_warps], [0])

    @gluon.jit
    def publish_tile(sched, q_empty, tc, m0, head, q_start, NUM_WG: gl.constexpr,
                      Q_BUFS: gl.constexpr):
        """Loader, uniform lengths: hand this tile's (m0, head, q_start) to the consumers in
        shared memory slot tc % 2, so they need not work out the schedule's integer divisions
        between two tiles (~600 cycles, d=128 512 rows, scripts/fwd-timeline.py). The slot was
        last read at the start of tile tc - 2, before its Q was released: wait until every
        warpgroup has released tile tc - Q_BUFS's Q (tc - 1 or tc - 2). The Q barriers'
        arrivals (after the stores, and a warp barrier) publish it."""
        slot0 = (tc % Q_BUFS) * NUM_WG
        for wg in gl.static_range(NUM_WG):
            mbarrier.wait(q_empty.index(slot0 + wg), ((tc // Q_BUFS) & 1) ^ 1)
        idx = gl.arange(0, 4, layout=sched_layout(gl.num_warps()))
        sched.index(tc & 1).store(gl.where(idx == 0, m0, gl.where(idx == 1, head, q_start)))
        thread_barrier()

    @gluon.jit
    def read_tile(sched, tc):
        """Consumer side of `publish_tile`, once the tile's Q barrier has completed."""
        layout: gl.constexpr = sched_layout(gl.num_warps())
        idx = gl.arange(0, 4, layout=layout)
        v = sched.index(tc & 1).load(layout)
        return (gl.sum(gl.where(idx == 0, v, 0), 0), gl.sum(gl.where(idx == 1, v, 0), 0),
                gl.sum(gl.where(idx == 2, v, 0), 0))

    @gluon.jit
    def key_block(cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr,
                  UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr, TOP_FIRST: gl.constexpr,
                  HEADS_FIRST: gl.constexpr = 0):
        """This CTA's key block, kv head and sequence: (n_blk, n_seq, hk, batch, q_start,
        k_start, seqlen_q, seqlen_k); n_seq key blocks in the sequence.

        TOP_FIRST (causal masks, in deterministic mode): each CTA walks its query blocks
        upward from its diagonal, so the highest key block reaches a query block first. It
        takes the first turn there, and the grid runs from the top key block down, so a CTA
        only ever waits for CTAs launched before it.

        HEADS_FIRST (BwdConfig.heads_first): 1, the grid is (kv heads, key blocks,
        sequences), so the hardware hands out key block 0 of every head of a sequence, then
        block 1, ...: longest first under a causal mask, where the (key blocks, ...) order
        ends each head with its shortest blocks and the call with a wave of long and short
        CTAs mixed. c >= 2 (BwdConfig.heads_chunk, dense lengths): the same in chunks of c kv
        heads, the grid (c, chunks x key blocks, sequences).
        """
        n_blk = gl.program_id(1 if HEADS_FIRST else 0)
        hk = gl.program_id(0 if HEADS_FIRST else 1)
        batch = gl.program_id(2)
        q_start, k_start, seqlen_q, seqlen_k = sequence(
            batch, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr, UNIFORM, HAS_SEQUSED)
        n_seq = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        n_blk, hk = head_chunk_split(n_blk, hk, n_seq, HEADS_FIRST)
        if TOP_FIRST:
            n_blk = n_seq - 1 - n_blk
        return n_blk, n_seq, hk, batch, q_start, k_start, seqlen_q, seqlen_k

    @gluon.jit
    def head_chunk_split(y, x, n_seq, HEADS_FIRST: gl.constexpr):
        """(key block, kv head) from the grid's (y, x) = (key block, kv head) where the grid
        is not chunked, or (chunk x key blocks + key block, head in the chunk) where
        HEADS_FIRST = c >= 2 kv heads per chunk (BwdConfig.heads_chunk)."""
        if HEADS_FIRST > 1:
            x += y // n_seq * HEADS_FIRST
            y = y % n_seq
        return y, x

    @gluon.jit
    def next_step(h, m0, m_lo, m_end, h_first, h_end, BLOCK_M: gl.constexpr):
        """The (q head, query block start) after (h, m0): blocks first, then heads, wrapping
        from the last head to the first (a staggered walk starts mid-way)."""
        h_next = h
        m0_next = m0 + BLOCK_M
        if m0_next >= m_end:
            h_next = h + 1
            m0_next = m_lo
            if h_next >= h_end:
                h_next = h_first
        return h_next, m0_next

    @gluon.jit
    def walk_start(n_blk, n_seq, n_steps, group_blocks, h_first, m_lo, STAGGER: gl.constexpr,
                   BLOCK_M: gl.constexpr):
        """(h, m0, stride): the first step of this key block's walk, and the stagger stride.

        STAGGER (masks without a window: every key block walks the same n_steps steps): key
        block j starts at step j·stride, stride = n_steps // n_seq, so at any time the CTAs of
        one sequence work on different query blocks. Without it they all start at block 0 and
        (deterministic mode) queue for its dQ turn one after the other; with it each query
        block's visits are `stride` steps apart in the ideal schedule, and the turn order
        (`wait_dq_turn`) follows that schedule. stride = 0: no stagger (n_steps < n_seq).
        """
        stride = 0
        h = h_first
        m0 = m_lo
        if STAGGER:
            stride = n_steps // n_seq
            e0 = stride * n_blk
            blocks = gl.maximum(group_blocks, 1)  # 0 for an empty query sequence
            h = h_first + e0 // blocks
            m0 = m_lo + (e0 % blocks) * BLOCK_M
        return h, m0, stride

    @gluon.constexpr_function
    def _ctaid_asm(axis):
        return f"mov.u32 $0, %ctaid.{'xyz'[axis]};"

    @gluon.jit
    def _ctaid_again(x, AXIS: gl.constexpr):
        """program_id(AXIS) read anew (x: any int32 operand, unused). The compiler cannot
        merge this read with the prologue's, so nothing derived from it is kept in a register
        through the main loop."""
        return gl.inline_asm_elementwise(_ctaid_asm(AXIS), "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def key_block_origin(seqlen_k, BLOCK_N: gl.constexpr, TOP_FIRST: gl.constexpr,
                         HEADS_FIRST: gl.constexpr = 0):
        """(first packed key row, kv head) of this CTA's key block in a uniform call,
        recomputed for the epilogue (`key_block`'s values, derived again). Reusing the
        prologue's would keep them live through the loop: at d <= 128 the kernels run at
        the 255-register limit and ptxas spilled inside the loop (sm_90a, up to 40 local
        instructions)."""
        n_blk = _ctaid_again(seqlen_k, 1 if HEADS_FIRST else 0)
        hk = _ctaid_again(seqlen_k, 0 if HEADS_FIRST else 1)
        batch = _ctaid_again(seqlen_k, 2)
        n_seq = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        n_blk, hk = head_chunk_split(n_blk, hk, n_seq, HEADS_FIRST)
        if TOP_FIRST:
            n_blk = n_seq - 1 - n_blk
        return batch * seqlen_k + n_blk * BLOCK_N, hk
