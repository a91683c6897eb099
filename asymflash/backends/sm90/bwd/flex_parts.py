"""FlexAttention's backward on `kernel.py`'s synchronous body (d <= 128): what differs from a
dense call is which query blocks a key block's CTA visits (the BlockMask's transposed lists
instead of a range, `flex_step`) and how Pᵀ and the chain-rule factor are formed (the mods
instead of the mask bounds, `flex_probabilities`). The body takes them through its `flex`
argument, (FlexBwd, the captured tensors' (ptr, sizes, strides) tuple), or None."""

from __future__ import annotations

from ..common import GLUON_ERROR

if GLUON_ERROR is None:
    from ..common import aggregate, gl, gluon

    @aggregate
    class FlexBwd:
        """A flex call's lists and mods, as the backward's CTA sees them. num (B, H, kind,
        kv block) and idx (B, H, kind, kv block, q block): per q head and key block, the
        query blocks listed partial (kind 0, mask_mod applies) then full (kind 1)
        (`portable.flex.block_lists`, transposed); each listed block is SUB steps of
        BLOCK_M rows (BQ = SUB · BLOCK_M rows a block)."""

        num: gl.tensor
        idx: gl.tensor
        num_sb: gl.tensor
        num_sh: gl.tensor
        num_sk: gl.tensor
        num_sn: gl.tensor
        idx_sb: gl.tensor
        idx_sh: gl.tensor
        idx_sk: gl.tensor
        idx_sn: gl.tensor
        scale: gl.tensor  # the softmax scale (score_mod gets q·k·scale)
        BK: gl.constexpr  # keys of a BlockMask block (a multiple of the CTA's BLOCK_N)
        SUB: gl.constexpr
        SCORE_MOD: gl.constexpr
        MASK_MOD: gl.constexpr
        DMOD: gl.constexpr  # d score_mod / d score
        HAS_SCORE: gl.constexpr
        HAS_MASK: gl.constexpr

    @gluon.jit
    def _counts(fl, base, h):
        """(partial, full) blocks listed for q head h at `base` (the CTA's batch and key
        block)."""
        at = base + h * fl.num_sh
        return gl.load(fl.num + at), gl.load(fl.num + at + fl.num_sk)

    @gluon.jit
    def _base(fl, batch, n0):
        return batch * fl.num_sb + (n0 // fl.BK) * fl.num_sn

    @gluon.jit
    def flex_steps(fl, batch, n0, h_first, group):
        """The CTA's steps: every listed query block of every q head of the group, SUB
        steps each."""
        base = _base(fl, batch, n0)
        total = 0
        for g in range(group):
            n_part, n_full = _counts(fl, base, h_first + g)
            total += (n_part + n_full) * fl.SUB
        return total

    @gluon.jit
    def flex_step(fl, batch, n0, h_first, group, it, BLOCK_M: gl.constexpr):
        """Step `it` of the CTA's walk: (q head, first query row, whether its block is a
        partial one). Heads in order, each head's partial blocks then its full ones; a step
        past the last (the prefetch after it) gives a harmless (last head, row 0)."""
        base = _base(fl, batch, n0)
        h = h_first
        rem = it
        n_part, n_full = _counts(fl, base, h)
        count = (n_part + n_full) * fl.SUB
        while (rem >= count) & (h < h_first + group - 1):
            rem -= count
            h += 1
            n_part, n_full = _counts(fl, base, h)
            count = (n_part + n_full) * fl.SUB
        j = rem // fl.SUB
        masked = j < n_part
        at = gl.where(masked, j, fl.idx_sk + j - n_part)
        row = batch * fl.idx_sb + h * fl.idx_sh + (n0 // fl.BK) * fl.idx_sn
        qb = gl.load(fl.idx + row + at, mask=rem < count, other=0)
        return h, qb * (fl.SUB * BLOCK_M) + (rem % fl.SUB) * BLOCK_M, masked

    @gluon.jit
    def flex_probabilities(s, lse2, flex, batch, h, m0, n0, masked, kloc, cols, seqlen_q,
                           seqlen_k):
        """(Pᵀ, Pᵀ for dSᵀ) of one step from the raw Sᵀ = K·Qᵀ [keys, rows]: score_mod of
        the scaled scores, mask_mod where the block is a partial one, the sequence bounds,
        P from the rows' log2 lse; the second carries d score_mod / d score (0 where P is:
        masked or -inf scores may have inf or nan slopes)."""
        fl, captured = flex
        kv_idx = gl.expand_dims(n0 + kloc, 1)
        q_idx = gl.expand_dims(m0 + cols, 0)
        inb = (kv_idx < seqlen_k) & (q_idx < seqlen_q)
        raw = s * fl.scale
        score = raw
        if fl.HAS_SCORE:
            score = fl.SCORE_MOD(raw, batch, h, q_idx, kv_idx, inb, captured)
        ok = inb
        if fl.HAS_MASK:
            if masked:
                ok = ok & fl.MASK_MOD(batch, h, q_idx, kv_idx, inb, captured)
        p = gl.where(ok, gl.exp2(score * 1.4426950408889634 - gl.expand_dims(lse2, 0)), 0.0)
        p_ds = p
        if fl.HAS_SCORE:
            p_ds = gl.where(p > 0.0, p * fl.DMOD(raw, batch, h, q_idx, kv_idx, inb, captured),
                            0.0)
        return p, p_ds
