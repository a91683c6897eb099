"""The sm90 backward's one launch entry: `attn_bwd_kernel` takes the launch's arguments,
packs them into two aggregates, `BwdCall` (the runtime values) and `BwdConsts` (the
compile-time switches), and runs the body the host chose (KIND): one of `kernel.py`'s
synchronous bodies (d <= 128, d = 256) or `kernel_ws.py`'s warp-specialised one.
The bodies read the launch through the aggregates, so the signature lives here only
(`host.py` builds the one argument list and constexpr dict)."""

from __future__ import annotations

from ..common import GLUON_ERROR

# KIND: which body a build runs (`host._kind`).
KIND_SYNC, KIND_WIDE, KIND_WS = 0, 1, 2

if GLUON_ERROR is None:
    from ..common import aggregate, gl, gluon, tma
    from .flex_parts import FlexBwd
    from .kernel import attn_bwd_sync, attn_bwd_wide
    from .kernel_ws import attn_bwd_ws

    _WIDE, _WS = gl.constexpr(KIND_WIDE), gl.constexpr(KIND_WS)

    @aggregate
    class BwdCall:
        """The runtime arguments of one launch, in the launch's order (the constructor takes
        the fields in order: `common.aggregate`)."""

        q_desc: tma.tensor_descriptor  # [rows, d] (or [rows, heads, d]: common.tma_heads)
        k_desc: tma.tensor_descriptor
        v_desc: tma.tensor_descriptor
        do_desc: tma.tensor_descriptor
        dq_desc: tma.tensor_descriptor  # fp32 dQ_acc: row-major or fragment-order tiles
        dk_desc: tma.tensor_descriptor
        dv_desc: tma.tensor_descriptor
        lse_ptr: gl.tensor
        delta_ptr: gl.tensor
        dk_ptr: gl.tensor  # dK, dV by pointer where TMA stores would cross sequences
        dv_ptr: gl.tensor
        cu_q_ptr: gl.tensor
        cu_k_ptr: gl.tensor
        used_k_ptr: gl.tensor  # seqused_k, or cu_seqlens_k when there is none
        sem_ptr: gl.tensor  # dQ turns (deterministic), a persistent grid's tile counter
        seqlen_q: gl.tensor  # the longest sequence's (varlen) or every sequence's length
        seqlen_k: gl.tensor
        total_q: gl.tensor
        n_heads: gl.tensor
        n_kv_heads: gl.tensor
        group: gl.tensor  # q heads per kv head
        num_m_blocks: gl.tensor
        qk_scale: gl.tensor  # softmax scale · log2(e) (softcap: common.exp2_scales)
        softmax_scale: gl.tensor
        softcap_pre: gl.tensor
        window_left: gl.tensor
        window_right: gl.tensor

    @aggregate
    class BwdConsts:
        """The compile-time switches of one build (`host._constexprs`; a body reads the
        ones it has, the others hold neutral values)."""

        HEAD_DIM: gl.constexpr
        HEAD_DIM_V: gl.constexpr
        BLOCK_M: gl.constexpr  # query rows of a step
        BLOCK_N: gl.constexpr  # keys of a CTA
        UNIFORM: gl.constexpr  # every sequence of the call has the same lengths
        HAS_SEQUSED: gl.constexpr
        HAS_LEFT: gl.constexpr
        HAS_RIGHT: gl.constexpr
        SOFTCAP: gl.constexpr
        DV_OVERLAP: gl.constexpr  # dV = Pᵀ·dO in flight while dSᵀ is formed
        DP_EARLY: gl.constexpr
        DETERMINISTIC: gl.constexpr
        STAGGER: gl.constexpr  # sched.walk_start
        RELEASE_AT: gl.constexpr  # BwdConfig.turn_release
        KV_TMA_STORE: gl.constexpr
        HEADS_FIRST: gl.constexpr  # sched.key_block's grid order
        DK_LATE: gl.constexpr  # kernel.py's schedule, like STATS_LATE and RELEASE_AT
        STATS_LATE: gl.constexpr
        DQ_IN_OPS: gl.constexpr  # attn_bwd_wide: BwdConfig.dq_in_operands
        HI_LATE: gl.constexpr  # attn_bwd_wide: BwdConfig.dq_hi_late
        FIRST_STORES: gl.constexpr  # host.first_stores
        LATE_WG: gl.constexpr  # kernel_ws.py on: its roles' switches (host._constexprs)
        RING: gl.constexpr
        DK_AFTER_DQ: gl.constexpr
        DQ_WARP: gl.constexpr
        MASK_MODE: gl.constexpr
        PERSISTENT: gl.constexpr
        KV_BUFS: gl.constexpr

    # Lengths, head counts and windows stay runtime values: Triton would otherwise compile a
    # variant per value 1 (and per divisibility by 16), and with seqlen_q = group = 1 folded
    # to constants the step loop collapses into a form triton 3.6's LLVM lowering crashes on
    # (tests/compile/test_sm90_bwd_compile.py).
    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_kv_heads",
                                  "group", "window_left", "window_right", "num_m_blocks"])
    def attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                        delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr, sem_ptr,
                        seqlen_q, seqlen_k, total_q, n_heads, n_kv_heads, group, num_m_blocks,
                        qk_scale, softmax_scale, softcap_pre, window_left, window_right,
                        HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, UNIFORM: gl.constexpr,
                        HAS_SEQUSED: gl.constexpr, HAS_LEFT: gl.constexpr,
                        HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                        DV_OVERLAP: gl.constexpr, DP_EARLY: gl.constexpr,
                        DETERMINISTIC: gl.constexpr, STAGGER: gl.constexpr,
                        RELEASE_AT: gl.constexpr, KV_TMA_STORE: gl.constexpr,
                        HEADS_FIRST: gl.constexpr, DK_LATE: gl.constexpr,
                        STATS_LATE: gl.constexpr, DQ_IN_OPS: gl.constexpr,
                        HI_LATE: gl.constexpr, FIRST_STORES: gl.constexpr,
                        LATE_WG: gl.constexpr, RING: gl.constexpr, DK_AFTER_DQ: gl.constexpr,
                        DQ_WARP: gl.constexpr, MASK_MODE: gl.constexpr,
                        PERSISTENT: gl.constexpr, KV_BUFS: gl.constexpr, KIND: gl.constexpr):
        call = BwdCall(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                       delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr, sem_ptr,
                       seqlen_q, seqlen_k, total_q, n_heads, n_kv_heads, group, num_m_blocks,
                       qk_scale, softmax_scale, softcap_pre, window_left, window_right)
        cfg = BwdConsts(HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, UNIFORM, HAS_SEQUSED, HAS_LEFT,
                        HAS_RIGHT, SOFTCAP, DV_OVERLAP, DP_EARLY, DETERMINISTIC, STAGGER,
                        RELEASE_AT, KV_TMA_STORE, HEADS_FIRST, DK_LATE, STATS_LATE, DQ_IN_OPS,
                        HI_LATE, FIRST_STORES, LATE_WG, RING, DK_AFTER_DQ, DQ_WARP, MASK_MODE,
                        PERSISTENT, KV_BUFS)
        if KIND == _WS:
            attn_bwd_ws(call, cfg)
        elif KIND == _WIDE:
            attn_bwd_wide(call, cfg)
        else:
            attn_bwd_sync(call, cfg)

    # FlexAttention's backward (`sm90/flex.py`): `attn_bwd_kernel`'s runtime arguments, then
    # the BlockMask's transposed lists, the captured tensors and the mods; the synchronous
    # body with its d <= 128 switches (KIND_SYNC builds, not deterministic, no stagger).
    # The lists' strides stay runtime values too: Triton would make a stride of 1 a constexpr,
    # which FlexBwd's tensor fields refuse.
    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_kv_heads",
                                  "group", "window_left", "window_right", "num_m_blocks",
                                  "num_sb", "num_sh", "num_sk", "num_sn", "idx_sb", "idx_sh",
                                  "idx_sk", "idx_sn"])
    def attn_bwd_flex_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc,
                             lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
                             used_k_ptr, sem_ptr, seqlen_q, seqlen_k, total_q, n_heads,
                             n_kv_heads, group, num_m_blocks, qk_scale, softmax_scale,
                             softcap_pre, window_left, window_right, num_ptr, idx_ptr,
                             captured, num_sb, num_sh, num_sk, num_sn, idx_sb, idx_sh, idx_sk,
                             idx_sn, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, DV_OVERLAP: gl.constexpr,
                             DP_EARLY: gl.constexpr, KV_TMA_STORE: gl.constexpr,
                             DK_LATE: gl.constexpr, STATS_LATE: gl.constexpr,
                             BK: gl.constexpr, SUB: gl.constexpr, SCORE_MOD: gl.constexpr,
                             MASK_MOD: gl.constexpr, DMOD: gl.constexpr,
                             HAS_SCORE: gl.constexpr, HAS_MASK: gl.constexpr):
        call = BwdCall(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse_ptr,
                       delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr, sem_ptr,
                       seqlen_q, seqlen_k, total_q, n_heads, n_kv_heads, group, num_m_blocks,
                       qk_scale, softmax_scale, softcap_pre, window_left, window_right)
        # dense lengths, no mask bounds (the mods mask), the plain grid in key-block order
        cfg = BwdConsts(HEAD_DIM, HEAD_DIM, BLOCK_M, BLOCK_N, True, False, False, False, False,
                        DV_OVERLAP, DP_EARLY, False, False, 1, KV_TMA_STORE, 0, DK_LATE,
                        STATS_LATE, False, False, False, 0, 0, False, False, 0, False, 1)
        flex = FlexBwd(num_ptr, idx_ptr, num_sb, num_sh, num_sk, num_sn, idx_sb, idx_sh,
                       idx_sk, idx_sn, softmax_scale, BK, SUB, SCORE_MOD, MASK_MOD, DMOD,
                       HAS_SCORE, HAS_MASK)
        attn_bwd_sync(call, cfg, (flex, captured))
