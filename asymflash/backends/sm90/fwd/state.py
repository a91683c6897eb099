"""The forward kernel's state as Gluon aggregates: every role of `kernel.py` gets the CTA's
shared memory, the launch's runtime arguments and its compile-time switches as three
arguments, (bufs, call, cfg), and a query tile as one."""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..common import PIECE_HI, aggregate, gl, gluon, tma

    # Every role gets the CTA's state as three aggregates, (bufs, call, cfg): an argument
    # tuple held in a variable would turn its constexpr entries into runtime values, so
    # each `gl.warp_specialize` role list is written out, and aggregates keep those lists
    # short. Values that are a constant on one grid and a runtime value on the other (ring
    # position 0, a Q slot equal to the warpgroup, n_lo without a left window) stay
    # separate arguments: an aggregate's field has one type.

    @aggregate
    class FwdSmem:
        """The CTA's shared memory and mbarriers (allocated by `attn_fwd_kernel`)."""

        q: gl.shared_memory_descriptor  # [Q_BUFS * NUM_WG, 64, HEAD_DIM] (192: 128, `q_hi`)
        k: gl.shared_memory_descriptor  # K ring [STAGES, BLOCK_N, HEAD_DIM] (192: 128)
        v: gl.shared_memory_descriptor  # V ring [STAGES, BLOCK_N, HEAD_DIM_V]
        # Q landed, per Q buffer; then the ping-pong turn barriers and the staging tile's
        # turn barrier (`q_bar_count`)
        q_bar: gl.shared_memory_descriptor
        q_empty: gl.shared_memory_descriptor  # Q buffer released (persistent grid)
        k_ready: gl.shared_memory_descriptor  # ring slot filled (TMA transaction count)
        k_empty: gl.shared_memory_descriptor  # ring slot read by every consumer warpgroup
        v_ready: gl.shared_memory_descriptor
        v_empty: gl.shared_memory_descriptor
        sched: gl.shared_memory_descriptor  # the persistent loader's tiles (`publish_tile`)
        o: gl.shared_memory_descriptor  # O staging (`o_staging`)
        # Head dim 192 (FwdConsts.PIECES): Q's and K's 64-wide pieces (columns 128-191; q and
        # k above hold columns 0-127). Other widths: q and k again, never read.
        q_hi: gl.shared_memory_descriptor  # [Q_BUFS * NUM_WG, 64, 64]
        k_hi: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, 64]

    @aggregate
    class FwdCall:
        """The runtime arguments of one launch (`attn_fwd_kernel`'s, unchanged)."""

        q_desc: tma.tensor_descriptor
        k_desc: tma.tensor_descriptor
        v_desc: tma.tensor_descriptor
        o_desc: tma.tensor_descriptor
        out_ptr: gl.tensor
        lse_ptr: gl.tensor
        cu_q_ptr: gl.tensor
        cu_k_ptr: gl.tensor
        used_k_ptr: gl.tensor
        sink_ptr: gl.tensor
        seqlen_q: gl.tensor  # the longest sequence's (varlen) or every sequence's length
        seqlen_k: gl.tensor
        total_q: gl.tensor
        n_heads: gl.tensor
        n_batch: gl.tensor
        num_m_blocks: gl.tensor
        group: gl.tensor
        qk_scale: gl.tensor
        softcap_pre: gl.tensor
        window_left: gl.tensor
        window_right: gl.tensor
        num_tiles: gl.tensor
        hb_chunk: gl.tensor
        # fp8 only (FP8; unused placeholders otherwise): the descales, fp32 (batch, nheads_kv),
        # and the key columns of one sequence in the transposed V (`fwd/host.py`,
        # `transpose_v_fp8`)
        q_descale_ptr: gl.tensor
        k_descale_ptr: gl.tensor
        v_descale_ptr: gl.tensor
        v_cols: gl.tensor

    @aggregate
    class FwdConsts:
        """The compile-time switches of one build (`attn_fwd_kernel`'s constexprs, the
        launch's register counts aside) and BLOCK_M, the query rows of a tile."""

        HEAD_DIM: gl.constexpr
        HEAD_DIM_V: gl.constexpr
        BLOCK_N: gl.constexpr
        STAGES: gl.constexpr
        UNIFORM: gl.constexpr
        HAS_SEQUSED: gl.constexpr
        HAS_LEFT: gl.constexpr
        HAS_RIGHT: gl.constexpr
        SOFTCAP: gl.constexpr
        HAS_SINK: gl.constexpr
        LPT: gl.constexpr
        EMU_EVERY: gl.constexpr
        RESCALE_THRESHOLD: gl.constexpr
        # the persistent grid; also: consumers release their Q buffer (q_empty), the loader
        # waits for it, and the last O store may stay in flight past the tile
        PERSISTENT: gl.constexpr
        PINGPONG: gl.constexpr  # warpgroups taking turns at their wgmmas (0: none)
        NUM_WG: gl.constexpr
        Q_BUFS: gl.constexpr
        TAIL_SKIP: gl.constexpr
        # e4m3 q, k and a transposed e4m3 V (`fwd/host.py`, `forward_fp8`): fp8 wgmmas, P
        # quantised to e4m3 in registers, the descales folded in per tile
        FP8: gl.constexpr
        BLOCK_M: gl.constexpr  # 64 * NUM_WG
        # HEAD_DIM 192: Q and K held as a 128- and a 64-wide piece (Gluon's tensors are
        # powers of two), S = Q_lo·K_loᵀ + Q_hi·K_hiᵀ (two wgmmas into one accumulator)
        PIECES: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM, HAS_SEQUSED,
                     HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_SINK, LPT, EMU_EVERY, RESCALE_THRESHOLD,
                     PERSISTENT, PINGPONG, NUM_WG, Q_BUFS, TAIL_SKIP, FP8):
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.HEAD_DIM_V = gl.constexpr(HEAD_DIM_V)
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.STAGES = gl.constexpr(STAGES)
            self.UNIFORM = gl.constexpr(UNIFORM)
            self.HAS_SEQUSED = gl.constexpr(HAS_SEQUSED)
            self.HAS_LEFT = gl.constexpr(HAS_LEFT)
            self.HAS_RIGHT = gl.constexpr(HAS_RIGHT)
            self.SOFTCAP = gl.constexpr(SOFTCAP)
            self.HAS_SINK = gl.constexpr(HAS_SINK)
            self.LPT = gl.constexpr(LPT)
            self.EMU_EVERY = gl.constexpr(EMU_EVERY)
            self.RESCALE_THRESHOLD = gl.constexpr(RESCALE_THRESHOLD)
            self.PERSISTENT = gl.constexpr(PERSISTENT)
            self.PINGPONG = gl.constexpr(PINGPONG)
            self.NUM_WG = gl.constexpr(NUM_WG)
            self.Q_BUFS = gl.constexpr(Q_BUFS)
            self.TAIL_SKIP = gl.constexpr(TAIL_SKIP)
            self.FP8 = gl.constexpr(FP8)
            self.BLOCK_M = gl.constexpr(64 * NUM_WG)
            self.PIECES = gl.constexpr(HEAD_DIM == 128 + PIECE_HI)

    @aggregate
    class QTile:
        """A query tile of one (sequence, head): the sequence's first packed query row, the
        tile's first row m0 within the sequence, the sequence's lengths, the head. Its key
        blocks (`key_blocks`) stay separate arguments: n_lo is the constant 0 without a
        left window."""

        q_start: gl.tensor
        m0: gl.tensor
        seqlen_q: gl.tensor
        seqlen_k: gl.tensor
        head: gl.tensor

    @gluon.jit
    def with_qk_scale(call, qk_scale):
        """`call` with another softmax scale (the fp8 kernel's, with one tile's descales)."""
        return FwdCall(call.q_desc, call.k_desc, call.v_desc, call.o_desc, call.out_ptr,
                       call.lse_ptr, call.cu_q_ptr, call.cu_k_ptr, call.used_k_ptr,
                       call.sink_ptr, call.seqlen_q, call.seqlen_k, call.total_q,
                       call.n_heads, call.n_batch, call.num_m_blocks, call.group, qk_scale,
                       call.softcap_pre, call.window_left, call.window_right, call.num_tiles,
                       call.hb_chunk, call.q_descale_ptr, call.k_descale_ptr,
                       call.v_descale_ptr, call.v_cols)

    @gluon.jit
    def descale_index(call, tile):
        """Index of a tile's (sequence, kv head) in the fp8 descales, fp32 (batch, nheads_kv):
        dense sequences only (q_start = batch * seqlen_q)."""
        return ((tile.q_start // tile.seqlen_q) * (call.n_heads // call.group)
                + tile.head // call.group)
