"""Device-side mask bounds: which key blocks a query tile visits (forward) and which query
rows a key block sees (backward), with the blocks that need no mask. The Gluon twin of
`asymflash/core/masks.py` (host); tests/test_sm90_bounds.py ties the two."""

from __future__ import annotations

from .common import GLUON_ERROR

if GLUON_ERROR is None:
    from .common import gl, gluon

    @gluon.jit
    def key_blocks(m0, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """Key blocks of the query tile at row m0: visited [n_lo, n_hi), unmasked [n_a, n_b)."""
        shift = seqlen_k - seqlen_q
        row_last = gl.minimum(m0 + BLOCK_M - 1, seqlen_q - 1)
        # At least one block, so that rows without keys still produce out = 0, lse = -inf
        # through the masked peeled block.
        n_hi = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        n_lo = 0
        if HAS_RIGHT:
            n_hi = gl.minimum(n_hi, (gl.maximum(row_last + shift + window_right + 1, 0)
                                     + BLOCK_N - 1) // BLOCK_N)
        if HAS_LEFT:
            n_lo = gl.maximum(m0 + shift - window_left, 0) // BLOCK_N
        n_hi = gl.maximum(n_hi, n_lo + 1)
        # Blocks [n_a, n_b) are allowed for every row of the tile: no mask there.
        n_a = n_lo + 1
        if HAS_LEFT:
            n_a = gl.maximum(n_a, (gl.maximum(row_last + shift - window_left, 0)
                                   + BLOCK_N - 1) // BLOCK_N)
        n_a = gl.minimum(n_a, n_hi)
        n_b = seqlen_k // BLOCK_N
        if HAS_RIGHT:
            n_b = gl.minimum(n_b, gl.maximum(m0 + shift + window_right + 1, 0) // BLOCK_N)
        n_b = gl.minimum(gl.maximum(n_b, n_a), n_hi)
        return n_lo, n_a, n_b, n_hi

    @gluon.jit
    def query_range(n0, seqlen_q, shift, window_left, window_right, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
        """(m_lo, blocks): query rows [m_lo, m_lo + blocks·BLOCK_M) hold every row that can
        see a key of [n0, n0 + BLOCK_N) (core.masks.query_range), m_lo a block start."""
        m_lo = 0
        m_hi = seqlen_q
        if HAS_RIGHT:
            m_lo = (gl.maximum(n0 - shift - window_right, 0) // BLOCK_M) * BLOCK_M
        if HAS_LEFT:
            m_hi = gl.minimum(n0 + BLOCK_N - shift + window_left, seqlen_q)
        return m_lo, (gl.maximum(m_hi - m_lo, 0) + BLOCK_M - 1) // BLOCK_M

    @gluon.jit
    def mask_edges(n0, seqlen_k, shift, window_left, window_right, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """(keys_oob, m_full_lo, m_full_hi) of key block n0, for step_needs_mask: the block
        runs past the keys; the first query block start that sees every key of the block
        (right edge) and the last (left edge)."""
        keys_oob = n0 + BLOCK_N > seqlen_k
        m_full_lo = n0 + BLOCK_N - 1 - shift - window_right
        m_full_hi = n0 - shift + window_left - BLOCK_M + 1
        return keys_oob, m_full_lo, m_full_hi

    @gluon.jit
    def key_block_walk(n0, seqlen_q, seqlen_k, group, window_left, window_right,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                       HAS_RIGHT: gl.constexpr):
        """What a backward CTA derives from its key block [n0, n0 + BLOCK_N): (shift, m_lo,
        group_blocks, n_steps, keys_oob, m_full_lo, m_full_hi): the query blocks that see it
        (`query_range`), its steps over them for each q head of the GQA group, and the mask
        edges (`mask_edges`)."""
        shift = seqlen_k - seqlen_q
        m_lo, group_blocks = query_range(n0, seqlen_q, shift, window_left, window_right,
                                         BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        n_steps = group_blocks * group
        keys_oob, m_full_lo, m_full_hi = mask_edges(n0, seqlen_k, shift, window_left,
                                                    window_right, BLOCK_M, BLOCK_N)
        return shift, m_lo, group_blocks, n_steps, keys_oob, m_full_lo, m_full_hi

    @gluon.jit
    def step_needs_mask(m0, keys_oob, m_full_lo, m_full_hi, HAS_LEFT: gl.constexpr,
                        HAS_RIGHT: gl.constexpr):
        """False when every (row, key) pair of the block is allowed: all keys exist, the first
        row sees the last key (right edge), the last row the first key (left edge). Rows past
        seqlen_q are harmless (P = 0 through lse = +inf)."""
        need = keys_oob
        if HAS_RIGHT:
            need = need | (m0 < m_full_lo)
        if HAS_LEFT:
            need = need | (m0 > m_full_hi)
        return need

    @gluon.jit
    def allowed(kloc, cols, n_valid, m0, diag_right, diag_left, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr, STEP_COLS: gl.constexpr = False):
        """[keys, rows] mask of a Pᵀ tile. In block-local indices (key - n0, row - m0) every
        edge is one scalar: fewer live registers than absolute row/key tiles.

        STEP_COLS (bwd_ws at d=64): the column indices plus a zero the compiler cannot see
        through (asm of m0), so they are formed inside the masked step from one base
        register instead of living through the loop in ~32 registers per thread, which
        ptxas spilled around every masked step (sm_90a, step-loop local-memory instructions,
        causal: d=64 100 -> 27, d=128 36 -> 17). Faster at d=64 only (see docs/tuning.md);
        bwd/kernel.py's kernel spilled more with it."""
        if STEP_COLS:
            zero = gl.inline_asm_elementwise("sub.s32 $0, $1, $1;", "=r,r", [m0],
                                             dtype=gl.int32, is_pure=True, pack=1)
            cols = cols + zero
        c2 = gl.expand_dims(cols, 0)
        ok = gl.expand_dims(kloc < n_valid, 1)
        if HAS_RIGHT:
            ok = ok & (gl.expand_dims(kloc - (m0 + diag_right), 1) <= c2)
        if HAS_LEFT:
            ok = ok & (gl.expand_dims(kloc - (m0 + diag_left), 1) >= c2)
        return ok
