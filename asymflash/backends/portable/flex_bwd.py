"""Portable FlexAttention backward: dQ, and dK/dV, with the mods and d score_mod / d score
inlined (the derivative tree of core/flex_ir.derivative, emitted like the mods).

P = exp(score_mod(s) - lse) is recomputed from the forward's lse. dQ: one program per
(query tile, q head) walks the kv blocks its query block lists, as the forward. dK/dV: one
program per (key tile, kv head) walks, for each q head of its GQA group, the query blocks
that list its kv block (the BlockMask transposed). Every output element is written by one
program: no atomics, deterministic. Gradients of captured tensors (a learned bias table, ALiBi
slopes) are scattered by the dQ kernel, which sees each score once: dS with respect to the
score_mod's output times d score_mod / d (the value read), added with fp32 atomics at the
position read (flex_emit.emit_grad_source). The atomics make those gradients, and only those,
vary in the last bits from run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.flex import memo_by_identity
from ...runtime.launch import launch_fitting
from . import Config, head_blocks
from .common import dot, load_rows, store_rows
from .flex import block_lists, mod_functions, tiles
from .flex_emit import captured_args, jit_grad_function, tuple_ints

# (BLOCK_M, BLOCK_N, warps, stages) per head-dim class, from a sweep of sm_90a builds of the
# compile test's mods (tests/compile/test_flex_compile.py), fewest local-memory instructions:
# dQ d=64 64x32/4 warps: 0 (128x64/8: 8); d=128 128x32/8: 6 (64x64/8: 233). dK/dV (BLOCK_N
# keys accumulate dK and dV) d=64 32x64/4: 29 (128x64/8: 56); d=128 32x64/8: 230 (128x32/8:
# 405); wrapping negative indices into captured tensors (as torch does) added some: dQ d=128
# 31, dK/dV d=64 73. The d=128 dQ tiles are single-buffered (stages 1): built as the launcher
# specialises aligned tensors, double-buffered K and V took 262144 bytes of shared memory
# (266240 with a captured gradient), more than Hopper's 232448, and the H100 refused the
# launch; single-buffered 86016 (77824), with no local-memory instruction. Not yet timed.
_DQ_TILES = {64: Config(64, 32, 4, 2), 128: Config(128, 32, 8, 1), 256: Config(32, 32, 8, 2)}
_DKDV_TILES = {64: Config(32, 64, 4, 2), 128: Config(32, 64, 8, 2), 256: Config(32, 32, 8, 2)}
# dQ scattering a captured tensor's gradient (the compile test's bias table[h, q - kv + c]):
# the position and slope tiles cost registers; same sweep, d=64 32x32/4 warps: 18 local
# instructions (64x32/4: 54, 64x32/8: 21); d=128 128x16/8: 75 (128x32/8: 147, 64x32/8: 287).
_DQ_GRAD_TILES = {64: Config(32, 32, 4, 2), 128: Config(128, 16, 8, 1),
                  256: Config(32, 32, 8, 2)}


@triton.jit
def _no_grads(ds, score, b, h, q_idx, kv_idx, inb, C, G):
    pass


@triton.jit
def _tile_ds(q, k, v, do, lse2, delta, rows, cols, b, h, seqlen_q, seqlen_k, scale, C, G,
             SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, DMOD: tl.constexpr,
             GRAD_MOD: tl.constexpr, HAS_SCORE: tl.constexpr, APPLY_MASK: tl.constexpr,
             SCATTER: tl.constexpr):
    """P and dS (with respect to the raw scaled score) of one tile; with SCATTER, also the
    captured tensors' gradients of the tile into G."""
    raw = dot(q, tl.trans(k), None) * scale
    q_idx = rows[:, None]
    kv_idx = cols[None, :]
    ok = (q_idx < seqlen_q) & (kv_idx < seqlen_k)
    s = raw
    if HAS_SCORE:
        s = SCORE_MOD(raw, b, h, q_idx, kv_idx, ok, C)
    if APPLY_MASK:
        ok = ok & MASK_MOD(b, h, q_idx, kv_idx, ok, C)
    p = tl.where(ok, tl.exp2(s * 1.4426950408889634 - lse2[:, None]), 0.0)
    dp = dot(do, tl.trans(v), None)
    ds = p * (dp - delta[:, None])
    if SCATTER:  # ds is still d loss / d score_mod's output here, as the chain rule wants
        GRAD_MOD(ds, raw, b, h, q_idx, kv_idx, p > 0, C, G)
    if HAS_SCORE:  # masked or -inf scores may have inf/nan slopes: they carry no gradient
        ds = tl.where(p > 0, ds * DMOD(raw, b, h, q_idx, kv_idx, ok, C), 0.0)
    return p, ds


@triton.jit
def _row_stats(LSE, DELTA, bh, rows, seqlen_q):
    """lse in log2 units (+inf for rows with nothing to attend to or past the end, so
    P = 0 there) and delta of the query rows."""
    offs = bh.to(tl.int64) * seqlen_q + rows
    lse = tl.load(LSE + offs, mask=rows < seqlen_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + offs, mask=rows < seqlen_q, other=0.0)
    return lse2, delta


@triton.jit
def flex_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, NUM, IDX, C, G,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_nb, stride_nh, stride_nk, stride_nq, stride_ib, stride_ih, stride_ik, stride_iq,
    nheads, group, seqlen_q, seqlen_k, scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, DMOD: tl.constexpr,
    GRAD_MOD: tl.constexpr, HAS_GRAD: tl.constexpr,
    HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
):
    """NUM (B, H, 2, nQB) / IDX (B, H, 2, nQB, nKB): partial (0) and full (1) kv lists.
    G: (ptr, strides) of each fp32 captured-gradient buffer (GRAD_MOD scatters into it)."""
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    qb = m0 // BQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q = load_rows(Q + b64 * stride_qb + h * stride_qh, 0, rows, seqlen_q, stride_qm, offs_d, D)
    do = load_rows(DO + b64 * stride_dob + h * stride_doh, 0, rows, seqlen_q, stride_dom,
                   offs_dv, DV)
    lse2, delta = _row_stats(LSE, DELTA, bh, rows, seqlen_q)
    K_bh = K + b64 * stride_kb + (h // group) * stride_kh
    V_bh = V + b64 * stride_vb + (h // group) * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for kind in tl.static_range(2):
        n = tl.load(NUM + b * stride_nb + h * stride_nh + kind * stride_nk + qb * stride_nq)
        lst = IDX + b * stride_ib + h * stride_ih + kind * stride_ik + qb * stride_iq
        for i in range(n):
            kb = tl.load(lst + i)
            for n0 in tl.static_range(0, BK, BLOCK_N):
                cols = kb * BK + n0 + tl.arange(0, BLOCK_N)
                k = load_rows(K_bh, 0, cols, seqlen_k, stride_kn, offs_d, D)
                v = load_rows(V_bh, 0, cols, seqlen_k, stride_vn, offs_dv, DV)
                _, ds = _tile_ds(q, k, v, do, lse2, delta, rows, cols, b, h, seqlen_q,
                                 seqlen_k, scale, C, G, SCORE_MOD, MASK_MOD, DMOD, GRAD_MOD,
                                 HAS_SCORE, HAS_MASK and kind == 0, HAS_GRAD)
                dq = dot(ds.to(k.dtype), k, dq)
    store_rows(DQ + bh.to(tl.int64) * seqlen_q * D, 0, rows, seqlen_q, D, offs_d, D,
               (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def flex_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT, NUM, IDX, C,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_nb, stride_nh, stride_nk, stride_nq, stride_ib, stride_ih, stride_ik, stride_iq,
    nheads, nheads_kv, group, seqlen_q, seqlen_k, scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, DMOD: tl.constexpr,
    HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
):
    """NUM (B, H, 2, nKB) / IDX (B, H, 2, nKB, nQB): partial and full q lists per kv block."""
    bhk = tl.program_id(1)
    b = bhk // nheads_kv
    hk = bhk % nheads_kv
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    kb = n0 // BK
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    k = load_rows(K + b64 * stride_kb + hk * stride_kh, 0, cols, seqlen_k, stride_kn, offs_d, D)
    v = load_rows(V + b64 * stride_vb + hk * stride_vh, 0, cols, seqlen_k, stride_vn, offs_dv,
                  DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for g in range(group):
        h = hk * group + g
        bh = b * nheads + h
        Q_bh = Q + b64 * stride_qb + h * stride_qh
        DO_bh = DO + b64 * stride_dob + h * stride_doh
        for kind in tl.static_range(2):
            n = tl.load(NUM + b * stride_nb + h * stride_nh + kind * stride_nk + kb * stride_nq)
            lst = IDX + b * stride_ib + h * stride_ih + kind * stride_ik + kb * stride_iq
            for i in range(n):
                qb = tl.load(lst + i)
                for m0 in tl.static_range(0, BQ, BLOCK_M):
                    rows = qb * BQ + m0 + tl.arange(0, BLOCK_M)
                    q = load_rows(Q_bh, 0, rows, seqlen_q, stride_qm, offs_d, D)
                    do = load_rows(DO_bh, 0, rows, seqlen_q, stride_dom, offs_dv, DV)
                    lse2, delta = _row_stats(LSE, DELTA, bh, rows, seqlen_q)
                    p, ds = _tile_ds(q, k, v, do, lse2, delta, rows, cols, b, h, seqlen_q,
                                     seqlen_k, scale, C, C, SCORE_MOD, MASK_MOD, DMOD,
                                     _no_grads, HAS_SCORE, HAS_MASK and kind == 0, False)
                    dv = dot(tl.trans(p.to(do.dtype)), do, dv)
                    dk = dot(tl.trans(ds.to(q.dtype)), q, dk)
    base = bhk.to(tl.int64) * seqlen_k
    store_rows(DK + base * D, 0, cols, seqlen_k, D, offs_d, D,
               (dk * scale).to(DK.dtype.element_ty))
    store_rows(DV_OUT + base * DV, 0, cols, seqlen_k, DV, offs_dv, DV,
               dv.to(DV_OUT.dtype.element_ty))


def flex_backward(dout, dlse, q, k, v, out, lse, problem, captured_need_grad):
    batch, heads, seqlen_q, d = q.shape
    heads_kv, seqlen_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    if dout.stride(-1) != 1:  # the kernels read rows with unit stride (out.sum()'s
        dout = dout.contiguous()  # gradient is an expanded tensor, all strides 0)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:  # a gradient into lse adds p * dlse to dS: the same as lowering delta
        delta = delta - dlse.float()
    lse = lse.contiguous()
    delta = delta.contiguous()
    score, mask = problem.score, problem.mask
    captured = problem.captured_values()[0] + problem.captured_values()[1]
    score_fn, mask_fn, dmod_fn = mod_functions(score, mask, True)
    fns = dict(SCORE_MOD=score_fn, MASK_MOD=mask_fn, DMOD=dmod_fn,
               HAS_SCORE=score is not None, HAS_MASK=mask is not None)
    block_d, block_dv = head_blocks(d, dv)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    cap = captured_args(captured)

    def plan(table):
        """The tile meta-parameters and the mask's block size for one kernel."""
        bm, bn, warps, stages, bq, bk = tiles(q, v, problem, table)
        meta = dict(D=d, DV=dv, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=bm,
                    BLOCK_N=bn, BQ=bq, BK=bk, num_warps=warps, num_stages=stages, **fns)
        return meta, (bq, bk)

    where = (str(q.device), seqlen_q, seqlen_k)
    slots = grad_slots(captured_need_grad)
    meta, blocks = plan(_DQ_GRAD_TILES if slots else _DQ_TILES)
    num, idx = block_lists(problem.layout, *where, *blocks, batch, heads, False)
    dq = torch.empty(batch, heads, seqlen_q, d, dtype=q.dtype, device=q.device)
    buffers = [torch.zeros(captured[i].shape, dtype=torch.float32, device=q.device)
               for i in slots]
    grads = [(g, tuple_ints(g.stride())) for g in buffers]
    launch_fitting(
        flex_bwd_dq_kernel, (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * heads),
        (q, k, v, dout, lse, delta, dq, num, idx, cap, (*(x for g in grads for x in g), 0),
         *strides, *num.stride(), *idx.stride()[:4], heads, problem.group, seqlen_q,
         seqlen_k, problem.scale),
        dict(GRAD_MOD=grad_function(score, slots) if slots else _no_grads,
             HAS_GRAD=bool(slots), **meta))
    meta, blocks = plan(_DKDV_TILES)
    num, idx = block_lists(problem.layout, *where, *blocks, batch, heads, True)
    dk = torch.empty(batch, heads_kv, seqlen_k, d, dtype=k.dtype, device=q.device)
    dvt = torch.empty(batch, heads_kv, seqlen_k, dv, dtype=v.dtype, device=q.device)
    launch_fitting(
        flex_bwd_dkdv_kernel, (triton.cdiv(seqlen_k, meta["BLOCK_N"]), batch * heads_kv),
        (q, k, v, dout, lse, delta, dk, dvt, num, idx, cap, *strides, *num.stride(),
         *idx.stride()[:4], heads, heads_kv, problem.group, seqlen_q, seqlen_k,
         problem.scale), meta)
    dcap = [None] * len(problem.captured_values()[0])
    for i, g in zip(slots, buffers):
        dcap[i] = g.to(captured[i].dtype)
    return dq, dk, dvt, dcap


def grad_slots(captured_need_grad) -> tuple:
    """The score_mod's captured slots whose gradients are wanted."""
    return tuple(i for i, need in enumerate(captured_need_grad or ()) if need)


@memo_by_identity(128)
def grad_function(score, slots: tuple):
    """The emitted scatter of the gradients of captured slots `slots` (flex_emit);
    NotImplementedError names what has no derivative or no triton form."""
    return jit_grad_function(score.root, slots)
