"""FlexAttention's forward on the warp-specialised Hopper kernel (`kernel.py`): the same
roles, rings and softmax, with a tile's key blocks taken from the BlockMask's lists instead
of a range, and the user's score_mod and mask_mod inlined where the scores are formed
(`softmax.flex_scores`).

One CTA owns 128 query rows (one BlockMask query block) of one (batch, q head). The loader
and both consumer warpgroups walk the same sequence of key blocks: the block's partial
blocks, then its full ones (each BlockMask block is SUB kernel blocks of BLOCK_N keys).
Partial blocks apply mask_mod and the sequence bounds; full blocks skip mask_mod, and the
key bound too unless the last block is ragged (EVEN_K). A query block with no key block
stores O = 0 and lse = -inf without starting the pipeline.

The mods are Triton functions emitted from their traced expression trees
(`portable/flex_emit.py`), passed as constexprs: each mod compiles into the kernel.
"""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..common import aggregate, gl, gluon
    from .epilogue import make_o_layout, make_row_layout, store_rows, tile_store
    from .kernel import (
        _first_block,
        _last_pv,
        _load_kv,
        _load_q,
        _step,
        _tile_begin,
        _tile_finish,
        allocate_smem,
        init_tile_barriers,
    )
    from .state import FwdCall, FwdConsts, QTile

    @aggregate
    class FlexMods:
        """What `softmax.flex_scores` needs of one tile besides the captured tensors."""

        SCORE_MOD: gl.constexpr
        MASK_MOD: gl.constexpr
        HAS_SCORE: gl.constexpr
        HAS_MASK: gl.constexpr
        EVEN_K: gl.constexpr  # seqlen_k a multiple of BLOCK_N: full blocks need no key bound
        b: gl.tensor  # the tile's batch index and q head, as the mods see them
        h: gl.tensor
        scale: gl.tensor  # the softmax scale (score_mod gets q·k·scale)
        skip_mask: gl.tensor  # the tile lists no partial block: its first block is full

    @aggregate
    class FlexWalk:
        """A query block's key blocks: n_part partial BlockMask blocks listed at part, then
        n_full full ones at full; each is SUB kernel blocks."""

        part: gl.tensor
        n_part: gl.tensor
        full: gl.tensor
        n_full: gl.tensor
        SUB: gl.constexpr

    @gluon.jit
    def _walk_block(walk, i):
        """The kernel key block (BLOCK_N keys) at step i of the walk."""
        j = i // walk.SUB
        if j < walk.n_part:
            kb = gl.load(walk.part + j)
        else:
            kb = gl.load(walk.full + (j - walk.n_part))
        return kb * walk.SUB + i % walk.SUB

    @gluon.jit
    def _flex_load(bufs, call, cfg, walk, q_row, q_head, kv_row, kv_head):
        _load_q(bufs, call, cfg, q_row, q_head, 0, 0)
        for i in range((walk.n_part + walk.n_full) * walk.SUB):
            _load_kv(bufs, call, cfg, i, kv_row + _walk_block(walk, i) * cfg.BLOCK_N, kv_head)

    @gluon.jit
    def _flex_consumer(bufs, call, cfg, tile, walk, mods, WG: gl.constexpr):
        """Warpgroup WG's 64 rows: the walk's blocks at ring positions 0, 1, ... (Q buffer
        WG, parity 0), then the epilogue."""
        rows = tile.m0 + WG * 64 + gl.arange(0, 64, layout=make_row_layout(cfg.BLOCK_N))
        q, q_hi, s_tok = _tile_begin(bufs, cfg, 0, WG, 0, WG)
        n_masked = walk.n_part * walk.SUB
        total = n_masked + walk.n_full * walk.SUB
        # The first block is always masked: a full one skips mask_mod through skip_mask.
        acc, p_op, m_i, l_i = _first_block(s_tok, q, bufs, call, cfg, tile, rows, 0,
                                           _walk_block(walk, 0), 0, True, mods)
        for i in range(1, n_masked):
            acc, p_op, m_i, l_i = _step(i, _walk_block(walk, i), q, q_hi, bufs, call, cfg,
                                        tile, acc, p_op, m_i, l_i, rows, 0, True, 0, WG, mods)
        for i in range(gl.maximum(n_masked, 1), total):
            acc, p_op, m_i, l_i = _step(i, _walk_block(walk, i), q, q_hi, bufs, call, cfg,
                                        tile, acc, p_op, m_i, l_i, rows, 0, False, 0, WG, mods)
        o_tok, slot = _last_pv(bufs, cfg, acc, p_op, total - 1, 0, WG)
        acc = _tile_finish(o_tok, p_op, bufs.v_empty, slot, False)
        tile_store(acc, m_i, l_i, rows, bufs, call, cfg, tile, WG)

    @gluon.jit
    def _store_empty(out_ptr, lse_ptr, q_start, m0, seqlen_q, HEAD_DIM_V: gl.constexpr,
                     BLOCK_N: gl.constexpr):
        """O = 0 and lse = -inf for the 128 rows of a query block that lists no key block."""
        o_layout: gl.constexpr = make_o_layout(HEAD_DIM_V)
        row_layout: gl.constexpr = make_row_layout(BLOCK_N)
        zeros = gl.zeros([64, HEAD_DIM_V], gl.float32, o_layout).to(out_ptr.dtype.element_ty)
        for half in gl.static_range(2):
            rows = m0 + half * 64 + gl.arange(0, 64, layout=row_layout)
            store_rows(out_ptr, zeros, rows, q_start, seqlen_q, 0, 1, HEAD_DIM_V, o_layout)
            gl.store(lse_ptr + q_start + rows, gl.full([64], -float("inf"), gl.float32,
                                                       row_layout), mask=rows < seqlen_q)

    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "n_heads", "group", "num_m_blocks",
                                  "q_row_b", "q_row_h", "q_head_c", "kv_row_b", "kv_row_h",
                                  "kv_head_c"])
    def flex_fwd_kernel(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, num_ptr, idx_ptr,
                        captured, seqlen_q, seqlen_k, n_heads, group, num_m_blocks, scale,
                        qk_scale, q_row_b, q_row_h, q_head_c, kv_row_b, kv_row_h, kv_head_c,
                        num_sb, num_sh, num_sk, num_sq, idx_sb, idx_sh, idx_sk, idx_sq,
                        HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EMU_EVERY: gl.constexpr,
                        RESCALE_THRESHOLD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr, SUB: gl.constexpr, SCORE_MOD: gl.constexpr,
                        MASK_MOD: gl.constexpr, HAS_SCORE: gl.constexpr,
                        HAS_MASK: gl.constexpr, EVEN_K: gl.constexpr):
        """q, k, v as 2-D (rows, heads · dim) descriptors: row b·row_b + h·row_h + m, head
        column h·head_c (BHSD: row_h = seqlen, head_c = 0; BSHD: row_h = 0, head_c = 1).
        out (batch, heads, seqlen_q, dv) and lse (batch, heads, seqlen_q) contiguous. num
        (B, H, kind, q block) and idx (B, H, kind, q block, k block): the BlockMask's block
        lists, kind 0 partial, 1 full (`portable.flex.block_lists`)."""
        # Query blocks of one (batch, head) side by side (their K/V shared in L2), the last
        # (under causal-like masks the longest) first.
        pid = gl.program_id(0)
        m_blk = num_m_blocks - 1 - pid % num_m_blocks
        bh = pid // num_m_blocks
        h = bh % n_heads
        b = bh // n_heads
        m0 = m_blk * 128
        # out and lse rows of this (batch, head): the epilogue's "sequence" of one head
        q_start = bh * seqlen_q
        at = b * num_sb + h * num_sh + m_blk * num_sq
        n_part = gl.load(num_ptr + at)
        n_full = gl.load(num_ptr + at + num_sk)
        if n_part + n_full == 0:
            _store_empty(out_ptr, lse_ptr, q_start, m0, seqlen_q, HEAD_DIM_V, BLOCK_N)
        else:
            lists = idx_ptr + b * idx_sb + h * idx_sh + m_blk * idx_sq
            walk = FlexWalk(lists, n_part, lists + idx_sk, n_full, SUB)
            bufs = allocate_smem(q_desc, k_desc, v_desc, o_desc, HEAD_DIM, HEAD_DIM_V,
                                 BLOCK_N, STAGES, 2, 1, 0, False)
            init_tile_barriers(bufs, STAGES, 0)
            cfg = FwdConsts(HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, True, False, False, False,
                            False, False, False, EMU_EVERY, RESCALE_THRESHOLD, False, 0, 2, 1,
                            False, False)
            # n_heads 1 and head 0 for the epilogue: out and lse rows are q_start + row
            one = gl.to_tensor(1)
            none = gl.to_tensor(-1)
            call = FwdCall(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, num_ptr, num_ptr,
                           num_ptr, lse_ptr, seqlen_q, seqlen_k, seqlen_q, one, one,
                           num_m_blocks, group, qk_scale, scale, none, none, one, one,
                           num_ptr, num_ptr, num_ptr, one)  # (no fp8 descales)
            tile = QTile(q_start, m0, seqlen_q, seqlen_k, gl.to_tensor(0))
            mods = FlexMods(SCORE_MOD, MASK_MOD, HAS_SCORE, HAS_MASK, EVEN_K, b, h, scale,
                            n_part == 0)
            kv_head = h // group
            gl.warp_specialize([
                (_flex_consumer, (bufs, call, cfg, tile, walk, (mods, captured), 0)),
                (_flex_consumer, (bufs, call, cfg, tile, walk, (mods, captured), 1)),
                (_flex_load, (bufs, call, cfg, walk, b * q_row_b + h * q_row_h + m0,
                              h * q_head_c, b * kv_row_b + kv_head * kv_row_h,
                              kv_head * kv_head_c)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
