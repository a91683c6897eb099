"""The forward's softmax, run inside each consumer warpgroup: scores (mask, softcap), the
online softmax in exp2 units, FA4's exp2 on the FMA pipe (`emu_asm`, the polynomial of
`core/exp2.py`) and the conditional rescale of O."""

from __future__ import annotations

from ....core.exp2 import FLOOR_MAGIC, POLY_COEFFS, X_MIN, ptx_f32
from ..common import GLUON_ERROR

# The polynomial exp2's PTX literals, from core/exp2.py (the model of the sequence in
# `emu_asm`): c3, c2, c1, c0, the clamp and the floor constant. A global of plain strings,
# so Triton's cache key sees them.
_EMU_LITERALS = tuple(ptx_f32(c) for c in (*POLY_COEFFS[::-1], X_MIN, FLOOR_MAGIC))

if GLUON_ERROR is None:
    from ..common import gl, gluon, tanh
    from .epilogue import make_s_layout

    @gluon.constexpr_function
    def emu_asm(every):
        """PTX for `every` packed elements: the first every-1 on MUFU, the last on FMA.

        The cubic of `core/exp2.py` (coefficients, pins, error bound, and the CPU model that
        evaluates this very sequence bit for bit). floor(x) comes from adding 1.5 * 2^23
        rounding down: the sum's ulp is 1, so it is floor(x) + 1.5 * 2^23 exactly, floor(x)
        in its low mantissa bits; shifted left by 23 those bits are floor(x) << 23, what the
        exponent field needs (the constant's own bits shift out). A cvt to an integer (F2I)
        or a round to an integral float (FRND) would do the same on the quarter-rate unit
        MUFU.EX2 runs on, so each emulated element would cost two of those slots, not one.
        """
        every = int(every)
        c3, c2, c1, c0, x_min, magic = _EMU_LITERALS
        lines = ["{", ".reg .f32 ef, ej, et, ep;", ".reg .b32 ei, eb;"]
        for i in range(every - 1):
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${every + i};")
        x, y = f"${2 * every - 1}", f"${every - 1}"
        lines += [
            # Clamp so that 2^floor(x) stays a normal number; -inf becomes exactly 0 below.
            f"max.ftz.f32 ef, {x}, {x_min};",
            f"add.rm.ftz.f32 et, ef, {magic};",
            f"sub.ftz.f32 ej, et, {magic};",
            "sub.ftz.f32 ef, ef, ej;",
            f"fma.rn.ftz.f32 ep, ef, {c3}, {c2};",
            f"fma.rn.ftz.f32 ep, ep, ef, {c1};",
            f"fma.rn.ftz.f32 ep, ep, ef, {c0};",
            "mov.b32 ei, et;",
            "shl.b32 ei, ei, 23;",
            "mov.b32 eb, ep;",
            "add.s32 eb, eb, ei;",
            f"mov.b32 {y}, eb;",
            "}",
        ]
        return "\n".join(lines)

    @gluon.constexpr_function
    def emu_constraints(every):
        return ",".join(["=r"] * every + ["r"] * every)

    @gluon.jit
    def exp2(x, EMU_EVERY: gl.constexpr):
        """2^x; with EMU_EVERY=k one element in k is computed on the FMA pipe."""
        if EMU_EVERY == 0:
            return gl.exp2(x)
        else:
            return gl.inline_asm_elementwise(emu_asm(EMU_EVERY), emu_constraints(EMU_EVERY),
                                             [x], dtype=gl.float32, is_pure=True,
                                             pack=EMU_EVERY)

    @gluon.constexpr_function
    def rescale_asm(pack):
        """PTX for `pack` elements of O, each multiplied in place by its row's alpha, unless the
        warp's flag (the same in every element: operand 3 pack is the first) is 0. The branch
        is warp-uniform, so the skipped multiplies are not issued at all."""
        pack = int(pack)
        lines = ["{", ".reg .pred %rs_q;", f"setp.eq.u32 %rs_q, ${3 * pack}, 0;",
                 "@%rs_q bra.uni RS_SKIP_${:uid};"]
        lines += [f"mul.f32 ${i}, ${i}, ${2 * pack + i};" for i in range(pack)]
        lines += ["RS_SKIP_${:uid}:", "}"]
        return "\n".join(lines)

    @gluon.constexpr_function
    def rescale_constraints(pack):
        # Each output tied to its own input element: O is updated in place, with no second
        # copy live (a second copy spilled at d=64 with three warpgroups).
        pack = int(pack)
        return ",".join(["=r"] * pack + [str(i) for i in range(pack)] + ["r"] * (2 * pack))

    @gluon.jit
    def rescale_if_moved(acc, alpha_o):
        """FA4's conditional rescale (`FwdConfig.rescale_threshold`), decided per warp: O is
        multiplied by alpha only in warps where some row moved its max (alpha < 1); alpha is
        exactly 1 in the other rows. A warp vote decides it: the reduction over the
        warpgroup the first version used went through shared memory and a barrier every key
        block, and lost. alpha_o holds a thread's two rows."""
        moved = gl.inline_asm_elementwise(
            "{ .reg .pred %mv_p, %mv_q; setp.lt.f32 %mv_p, $2, 0f3F800000;"
            " setp.lt.or.f32 %mv_p, $3, 0f3F800000, %mv_p;"
            " vote.sync.any.pred %mv_q, %mv_p, 0xffffffff;"
            " selp.u32 $0, 1, 0, %mv_q; selp.u32 $1, 1, 0, %mv_q; }",
            "=r,=r,r,r", [alpha_o], dtype=gl.int32, is_pure=True, pack=2)
        alpha_b, moved_b = gl.broadcast(gl.expand_dims(alpha_o, 1), gl.expand_dims(moved, 1))
        # 32 elements per asm block: a thread holds 32, 64 or 128 of O (dv = 64 / 128 / 256)
        PACK: gl.constexpr = 32
        return gl.inline_asm_elementwise(rescale_asm(PACK), rescale_constraints(PACK),
                                         [acc, alpha_b, moved_b], dtype=gl.float32,
                                         is_pure=True, pack=PACK)

    @gluon.jit
    def scores(s, n, rows, shift, seqlen_k, call, cfg, MASKED: gl.constexpr):
        """Raw Q·Kᵀ block -> logits before the (log2-folded) scale, masked keys at -inf
        (key block n; rows: the query rows, shift = seqlen_k - seqlen_q of their sequence;
        call, cfg: the kernel's runtime arguments and switches, `kernel.py`)."""
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        HAS_LEFT: gl.constexpr = cfg.HAS_LEFT
        HAS_RIGHT: gl.constexpr = cfg.HAS_RIGHT
        s_layout: gl.constexpr = make_s_layout(BLOCK_N, cfg.FP8)
        window_left = call.window_left
        window_right = call.window_right
        if cfg.SOFTCAP:
            s = tanh(s * call.softcap_pre)
        if MASKED:
            cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            c2 = gl.expand_dims(cols, 0)
            r2 = gl.expand_dims(rows, 1)
            ok = c2 < seqlen_k
            if HAS_RIGHT:
                ok = ok & (c2 <= r2 + shift + window_right)
            if HAS_LEFT:
                ok = ok & (c2 >= r2 + shift - window_left)
            s = gl.where(ok, s, -float("inf"))
        return s

    @gluon.jit
    def block_scores(s, n, rows, shift, call, cfg, tile, MASKED: gl.constexpr, mods=None):
        """`scores` of key block n, or a flex call's (`flex_scores`) where mods is given."""
        if mods is None:
            out = scores(s, n, rows, shift, tile.seqlen_k, call, cfg, MASKED)
        else:
            out = flex_scores(s, n, rows, tile, cfg, mods, MASKED)
        return out

    @gluon.jit
    def flex_scores(s, n, rows, tile, cfg, mods, MASKED: gl.constexpr):
        """A flex call's logits of key block n (`fwd/flex.py`): score_mod of the scaled
        scores (natural units out: the call's qk_scale is then log2(e) alone), and where the
        block is a partial one of the BlockMask (MASKED) mask_mod and the sequence bounds,
        or for a full block the key bound alone where the last block is ragged. Disallowed
        scores become -inf. mods = (FlexMods, the captured tensors' (ptr, sizes, strides)
        tuple)."""
        fl, captured = mods
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        s_layout: gl.constexpr = make_s_layout(BLOCK_N)
        cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        q_idx = gl.expand_dims(rows, 1)
        kv_idx = gl.expand_dims(cols, 0)
        inb = (q_idx < tile.seqlen_q) & (kv_idx < tile.seqlen_k)
        if fl.HAS_SCORE:
            s = fl.SCORE_MOD(s * fl.scale, fl.b, fl.h, q_idx, kv_idx, inb, captured)
        if MASKED:
            ok = inb
            if fl.HAS_MASK:
                # skip_mask: the peeled first block is a full one (no partial blocks listed)
                ok = ok & (fl.MASK_MOD(fl.b, fl.h, q_idx, kv_idx, inb, captured)
                           | fl.skip_mask)
            s = gl.where(ok, s, -float("inf"))
        elif not fl.EVEN_K:
            s = gl.where(inb, s, -float("inf"))
        return s

    @gluon.jit
    def online_softmax(s, m_i, l_i, qk_scale, EMU_EVERY: gl.constexpr,
                        RESCALE_THRESHOLD: gl.constexpr, P_SHIFT: gl.constexpr = 0.0):
        """One block of the online softmax in log2 units.

        Returns P (fp32, unnormalised), the new running max/sum and the factor O must be
        multiplied by. m_i is in scaled log2 units; -inf while a row has seen no key.
        P_SHIFT > 0 (fp8, `epilogue.P_SHIFT`): P and the row sum carry a factor 2^P_SHIFT,
        taken off the max that each row subtracts (one add per row, none per element).
        """
        m_blk = gl.max(s, 1) * qk_scale
        m_cand = gl.maximum(m_i, m_blk)
        if RESCALE_THRESHOLD > 0:
            # Stale max: P may reach 2^threshold, harmless in fp32 and in bf16/fp16 P.
            m_new = gl.where(m_cand > m_i + RESCALE_THRESHOLD, m_cand, m_i)
        else:
            m_new = m_cand
        # Rows without any allowed key so far keep m = -inf; subtract 0 there instead of
        # -inf so that exp2(-inf - -inf) never produces NaN (p and alpha come out 0 / 1).
        m_sub = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_sub)
        # s * qk_scale - m folds into one FFMA per element before the exponential.
        if P_SHIFT != 0:
            p = exp2(s * qk_scale - gl.expand_dims(m_sub - P_SHIFT, 1), EMU_EVERY)
        else:
            p = exp2(s * qk_scale - gl.expand_dims(m_sub, 1), EMU_EVERY)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha
