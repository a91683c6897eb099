"""The forward's register layouts (S, O, P, row statistics) and its epilogue: where O is
staged (`o_staging`: a tile of its own, Q's buffer, or the turn-shared tile), the
normalisation, lse and sink, and the store (TMA or masked rows)."""

from __future__ import annotations

from ..common import GLUON_ERROR

# fp8: P is quantised to e4m3 as 2^P_SHIFT * exp2(s - m), in [0, 256] (e4m3's largest
# value is 448). Unscaled, as FA3 keeps it, probabilities below 2^-6 of the row's max would
# be e4m3 subnormals (fewer than 3 mantissa bits) and those below 2^-10 would round to 0;
# scaled, that floor falls to 2^-18, so the many small weights of long rows still count in
# P·V, as they do in the fp32 row sum. A power of two: it costs nothing (it is subtracted
# from each row's max, `online_softmax`), cancels exactly in O / l and comes out of lse
# exactly. Needs the exact running max (no stale-max rescale: P would reach 2^(8 + t)).
P_SHIFT = 8

if GLUON_ERROR is None:
    from ..common import (
        PIECE_HI,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        thread_barrier,
        tma,
        tma_store,
        to_16bit,
    )
    from .state import descale_index

    P_SHIFT_FP8 = gl.constexpr(float(P_SHIFT))

    # Layouts of a consumer warpgroup's 64-row tile: S (64 x BLOCK_N), O (64 x HEAD_DIM_V),
    # P as the register operand of P·V, and one value per row of S.
    # fp8: the wgmma instruction's K is 32 (e4m3 operands) instead of 16; the registers of
    # the accumulator are laid out the same.
    @gluon.constexpr_function
    def make_s_layout(block_n, fp8=False):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, int(block_n), 32 if fp8 else 16])

    @gluon.constexpr_function
    def make_o_layout(head_dim_v, fp8=False):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, int(head_dim_v), 32 if fp8 else 16])

    @gluon.constexpr_function
    def make_p_layout(head_dim_v):
        return gl.DotOperandLayout(operand_index=0, parent=make_o_layout(head_dim_v), k_width=2)

    @gluon.constexpr_function
    def make_p_layout_fp8(head_dim_v):
        # 8-bit A operand: four consecutive k (keys) per 32-bit register
        return gl.DotOperandLayout(operand_index=0, parent=make_o_layout(head_dim_v, True),
                                   k_width=4)

    # fp8 P·V: wgmma takes an 8-bit A operand as four consecutive k per register, columns
    # 4t..4t+3 and 16+4t..16+4t+3 of each 32-column slice (t = lane % 4), while the S
    # accumulator gives a thread the column pairs 2t, 2t+1 of each 8-column slice. Rather
    # than move P between threads (shuffles), the key order inside each 32-key group is
    # redefined: A column 16h + 4t + 2a + b holds S column 8(2h + a) + 2t + b, i.e. column
    # bits (b, t, a, h) of S become (b, a, t, h) of A, which keeps every value in the
    # thread that has it (`fp8_key_order` on the host stores V's keys in the same order,
    # so P·V sums the same products).
    #
    # P crosses the key loop as fp16 pairs (cvt.rn.f16x2.f32, 32 registers) and becomes e4m3
    # at the wgmma's issue (`kernel._step`: cvt.rn.satfinite.e4m3x2.f16x2, merged into the
    # operand register). Made at the end of the step, the e4m3 bytes were loop-carried one
    # by one (Triton keeps 8-bit elements apart) and cost ~110 byte permutes (PRMT) per key
    # block to unpack and repack, against none this way (sm_90a SASS, d=128). The double
    # rounding (fp32 -> fp16 -> e4m3) differs from a single one only where the fp16 value
    # falls exactly on an e4m3 midpoint, by one e4m3 step there.

    @gluon.jit
    def p_operand_fp8(p, HEAD_DIM_V: gl.constexpr):
        """P (fp32, S's layout) as fp16 in the layout of the e4m3 A operand of P·V, in the
        key order above; the P·V's issue casts it to e4m3."""
        BLOCK_N: gl.constexpr = p.shape[1]
        x = gl.reshape(p, [64, BLOCK_N // 32, 2, 2, 4, 2])  # (.., h, a, t, b)
        x = gl.permute(x, [0, 1, 2, 4, 3, 5])  # (.., h, t, a, b)
        x = gl.reshape(x, [64, BLOCK_N])
        # a renaming of registers only: the compile fails if it would move data
        x = gl.convert_layout(x, make_p_layout_fp8(HEAD_DIM_V), assert_trivial=True)
        return to_16bit(x, gl.float16)

    @gluon.jit
    def p_operand(p, dtype: gl.constexpr, HEAD_DIM_V: gl.constexpr, FP8: gl.constexpr):
        """P (fp32, S's layout) as the P·V MMA's A operand: `p_operand_fp8`'s for fp8
        builds, else in q's 16-bit type."""
        if FP8:
            return p_operand_fp8(p, HEAD_DIM_V)
        else:
            return gl.convert_layout(to_16bit(p, dtype), make_p_layout(HEAD_DIM_V))

    @gluon.constexpr_function
    def make_row_layout(block_n, fp8=False):
        return gl.SliceLayout(1, make_s_layout(block_n, fp8))

    @gluon.jit
    def tile_store(acc, m_i, l_i, rows, bufs, call, cfg, tile, WG: gl.constexpr):
        """Epilogue: normalise O, write lse and O of `rows` (m0 + 64·WG + 0 ... 63; rows at or
        past seqlen_q are not written). The sink is one more logit in the denominator with no
        value row. bufs, call, cfg, tile: the kernel's aggregates (`kernel.py`)."""
        HEAD_DIM_V: gl.constexpr = cfg.HEAD_DIM_V
        out_ptr = call.out_ptr
        o_desc = call.o_desc
        q_start = tile.q_start
        m0 = tile.m0
        seqlen_q = tile.seqlen_q
        head = tile.head
        o_layout: gl.constexpr = make_o_layout(HEAD_DIM_V, cfg.FP8)
        row_layout: gl.constexpr = make_row_layout(cfg.BLOCK_N, cfg.FP8)
        if cfg.HAS_SINK:
            sink = gl.load(call.sink_ptr + head) * 1.4426950408889634
            m_fin = gl.maximum(m_i, sink)
            m_sub = gl.where(m_fin == -float("inf"), 0.0, m_fin)
            o_scale = gl.exp2(m_i - m_sub)
            l_i = l_i * o_scale + gl.exp2(sink - m_sub)
            m_i = m_fin
        else:
            o_scale = gl.full([64], 1.0, gl.float32, row_layout)
        has_mass = l_i > 0.0
        if cfg.FP8:
            # P (and so l_i and O) carry the factor 2^P_SHIFT_FP8 (`online_softmax`): it
            # cancels in O / l, and leaves lse exactly; v's descale scales O (P (v vd) =
            # vd (P v)), one multiply per row here instead of one per element of V.
            o_scale = o_scale * gl.load(call.v_descale_ptr + descale_index(call, tile))
            inv_l = gl.where(has_mass, o_scale / gl.where(has_mass, l_i, 1.0), 0.0)
            lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))
                                      - P_SHIFT_FP8) * 0.6931471805599453, -float("inf"))
        else:
            inv_l = gl.where(has_mass, o_scale / gl.where(has_mass, l_i, 1.0), 0.0)
            lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0)))
                           * 0.6931471805599453, -float("inf"))
        valid = rows < seqlen_q
        lse_off = head.to(gl.int64) * call.total_q + q_start + rows
        gl.store(call.lse_ptr + lse_off, lse, mask=valid)

        out = (acc * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1))
        out = out.to(out_ptr.dtype.element_ty)
        if full_width(o_desc.block_shape, HEAD_DIM_V):
            # Every sequence's rows fill whole 64-row tiles (the host checked): O leaves
            # through shared memory and one TMA store. Issuing the masked per-thread stores
            # below took ~2300 of a ~16600-cycle tile at d=128, 512 rows
            # (scripts/fwd-timeline.py, H200). A warpgroup whose rows all lie past the
            # sequence (192-row tiles) stores nothing.
            # Wide rows on the persistent grid: one staging tile, the warpgroups take turns
            # (`o_staging`); the turn barrier sits after the Q (and ping-pong) barriers.
            SHARED: gl.constexpr = o_staging(o_desc.block_shape, cfg.HEAD_DIM, HEAD_DIM_V,
                                             cfg.PERSISTENT, cfg.FP8) == 2
            o_tile = bufs.o.index(0 if SHARED else WG)
            if SHARED:
                # Warpgroup w's k-th turn follows 2k + w arrivals: parity 1 - w every time.
                # The turn barrier is q_bar's last (`q_bar_count`), whatever the number of
                # Q buffers (a fixed index once fell on a second Q buffer's barrier).
                o_turn = bufs.q_bar.index(bufs.q_bar.shape[0] - 1)
                mbarrier.wait(o_turn, 1 - WG)
            if m0 + WG * 64 < seqlen_q:
                tma.store_wait(0)  # this warpgroup's previous store has read o_smem
                thread_barrier()
                o_tile.store(out)
                fence_async_shared()
                thread_barrier()
                tma_store(
                    o_desc, [q_start + m0 + WG * 64, head * HEAD_DIM_V], o_tile)
            if not cfg.PERSISTENT:  # a one-tile CTA: the store must finish before it exits
                tma.store_wait(0)
            elif SHARED:  # the other warpgroup's turn once the store has read the tile
                tma.store_wait(0)
                thread_barrier()
                mbarrier.arrive(o_turn, count=1)
        else:
            store_rows(out_ptr, out, rows, q_start, seqlen_q, head, call.n_heads, HEAD_DIM_V,
                        o_layout)

    @gluon.jit
    def store_rows(out_ptr, out, rows, q_start, seqlen_q, head, n_heads,
                    HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
        """O rows of a tile, rows at or past seqlen_q masked off (per-thread stores)."""
        o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        row_off = ((q_start + o_rows).to(gl.int64) * n_heads + head) * HEAD_DIM_V
        offs = gl.expand_dims(row_off, 1) + gl.expand_dims(o_cols, 0)
        gl.store(out_ptr + offs, out, mask=gl.expand_dims(o_rows < seqlen_q, 1))

    @gluon.constexpr_function
    def stacked(n, block_shape):
        return [n] + [int(x) for x in block_shape]

    @gluon.constexpr_function
    def full_width(block_shape, width):
        """Whether the output descriptor's box spans a whole row of O (TMA-store epilogue);
        a narrower box only carries the layout of an unused buffer (see `forward`)."""
        return block_shape[1] == width

    @gluon.constexpr_function
    def o_staging(block_shape, head_dim, width, persistent, fp8=False):
        """Where the TMA-store epilogue stages O: 0, one tile per warpgroup of its own
        (dv <= 128, or no TMA store at all); wide rows (d = dv = 256: a tile each does not
        fit next to the 192 KB of Q and the K/V rings; the host gives such a box only where
        dv = d, `output_box_width`), and q·k 192 wide (two 16 KB tiles do not fit next to
        the 208 KB of Q and the 128-key rings) 1: in the warpgroup's Q buffer on the plain
        grid, where Q is dead after the last S (at 192 its 128-wide piece, O's shape); 2: on
        the persistent grid, in one tile the warpgroups take turns at (there the next tile's
        Q lands during the epilogue; staged in the Q buffer it had to wait for the store, at
        half the speed for short causal calls at d = 256). fp8 (e4m3 Q, half the bytes: a bf16
        O tile does not fit its buffer, and a tile of its own does fit) 0."""
        if block_shape[1] != width or fp8 or (width <= 128 and head_dim != 128 + PIECE_HI):
            return 0
        return 2 if persistent else 1

    @gluon.constexpr_function
    def o_turn_index(pingpong, num_wg, q_bufs):
        """Index in q_bar of the staging turn barrier (`o_staging` 2: two warpgroups, one Q
        buffer each): after the Q barriers and the ping-pong turn barriers (`pingpong`: the
        number of warpgroups taking turns, 0 without)."""
        return num_wg * q_bufs + int(pingpong)

    @gluon.constexpr_function
    def q_bar_count(num_wg, pingpong, o_staging, q_bufs):
        return o_turn_index(pingpong, num_wg, q_bufs) + (1 if o_staging == 2 else 0)
