"""Portable FlexAttention forward: the mods inlined, the BlockMask's lists visited.

One program = BLOCK_M queries of one (batch, q head). It walks the kv blocks its query block
lists: partial blocks apply mask_mod, full blocks skip it, unlisted blocks are never loaded.
The score_mod and mask_mod are triton functions emitted from their expression trees
(flex_emit.py) and passed as constexpr arguments, so each mod compiles into the kernel.
The backward is flex_bwd.py, gradients of captured tensors included; calls with
deterministic=True that need those take the tiled torch backend's (runtime/dispatch.pick_flex).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.flex import FULL, PARTIAL, memo_by_identity
from ...core.flex_ir import shift_slots
from ...runtime.dispatch import interpreting
from ...runtime.launch import launch_fitting
from . import Config, head_blocks, unsupported_input
from .common import dot, finish_rows, load_rows, online_softmax_step, store_rows
from .flex_emit import captured_args, jit_function

NAME = "portable"
_INTERPRETER_TILE = 16  # the interpreter's cost grows with tile area

# (BLOCK_M, BLOCK_N, warps, stages) per head-dim class: the first that built for sm_90a with
# no local memory in a sweep of the compile test's mods (tests/compile/test_flex_compile.py;
# d=64: the dense forward's 128x64/4 warps/3 stages spilled 434 instructions, 128x64 with 8
# warps none; d=128: 2 since the negative-index wrap of captured reads). Not yet timed on a
# GPU.
_TILES = {64: Config(128, 64, 8, 2), 128: Config(128, 32, 8, 2), 256: Config(32, 32, 8, 2)}


@triton.jit
def _identity_mod(score, b, h, q_idx, kv_idx, inb, C):
    return score


@triton.jit
def _keep_all(b, h, q_idx, kv_idx, inb, C):
    return inb


@triton.jit
def _visit_block(acc, m_i, l_i, q, K_bh, V_bh, kb, rows, b, h, seqlen_q, seqlen_k,
                 stride_kn, stride_vn, offs_d, offs_dv, scale, C,
                 SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE: tl.constexpr,
                 APPLY_MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold the kv block kb (BK keys, BLOCK_N at a time) into (acc, row max, row sum)."""
    for n0 in tl.static_range(0, BK, BLOCK_N):
        cols = kb * BK + n0 + tl.arange(0, BLOCK_N)
        k = load_rows(K_bh, 0, cols, seqlen_k, stride_kn, offs_d, D)
        s = dot(q, tl.trans(k), None) * scale
        q_idx = rows[:, None]
        kv_idx = cols[None, :]
        ok = (q_idx < seqlen_q) & (kv_idx < seqlen_k)
        if HAS_SCORE:
            s = SCORE_MOD(s, b, h, q_idx, kv_idx, ok, C)
        if APPLY_MASK:
            ok = ok & MASK_MOD(b, h, q_idx, kv_idx, ok, C)
        # log2 units from here: the softmax runs on exp2 (common.py)
        s = tl.where(ok, s * 1.4426950408889634, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v = load_rows(V_bh, 0, cols, seqlen_k, stride_vn, offs_dv, DV)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def flex_fwd_kernel(
    Q, K, V, Out, LSE, PNUM, PIDX, FNUM, FIDX, C,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    stride_pnb, stride_pnh, stride_pnq, stride_pib, stride_pih, stride_piq,
    stride_fnb, stride_fnh, stride_fnq, stride_fib, stride_fih, stride_fiq,
    nheads, group, seqlen_q, seqlen_k, scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    qb = m0 // BQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(Q + b.to(tl.int64) * stride_qb + h * stride_qh, 0, rows, seqlen_q,
                  stride_qm, offs_d, D)
    hk = h // group
    K_bh = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    V_bh = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    n_part = tl.load(PNUM + b * stride_pnb + h * stride_pnh + qb * stride_pnq)
    part = PIDX + b * stride_pib + h * stride_pih + qb * stride_piq
    for i in range(n_part):
        kb = tl.load(part + i)
        acc, m_i, l_i = _visit_block(acc, m_i, l_i, q, K_bh, V_bh, kb, rows, b, h, seqlen_q,
                                     seqlen_k, stride_kn, stride_vn, offs_d, offs_dv, scale,
                                     C, SCORE_MOD, MASK_MOD, HAS_SCORE, HAS_MASK, D, DV, BK,
                                     BLOCK_N)
    n_full = tl.load(FNUM + b * stride_fnb + h * stride_fnh + qb * stride_fnq)
    full = FIDX + b * stride_fib + h * stride_fih + qb * stride_fiq
    for i in range(n_full):
        kb = tl.load(full + i)
        acc, m_i, l_i = _visit_block(acc, m_i, l_i, q, K_bh, V_bh, kb, rows, b, h, seqlen_q,
                                     seqlen_k, stride_kn, stride_vn, offs_d, offs_dv, scale,
                                     C, SCORE_MOD, MASK_MOD, HAS_SCORE, False, D, DV, BK,
                                     BLOCK_N)
    out, lse = finish_rows(acc, m_i, l_i, LSE, 0, False)
    o_base = Out + b.to(tl.int64) * stride_ob + h * stride_oh
    store_rows(o_base, 0, rows, seqlen_q, stride_om, offs_dv, DV, out.to(Out.dtype.element_ty))
    tl.store(LSE + bh.to(tl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)


# ---------------------------------------------------------------- host

def tiles(q, v, problem, table=None):
    """(BLOCK_M, BLOCK_N, warps, stages, BQ, BK): the kernel tile divides the mask's block
    (a mask with a single block is re-cut to the tile)."""
    layout = problem.layout
    d, dv = q.shape[-1], v.shape[-1]
    if interpreting():
        bm = bn = _INTERPRETER_TILE
        warps, stages = 4, 1
    else:
        width = max(d, dv)
        c = (table or _TILES)[64 if width <= 64 else 128 if width <= 128 else 256]
        bm, bn, warps, stages = c.block_m, c.block_n, c.num_warps, c.num_stages
    if layout.kinds.shape[2:] == (1, 1):
        return bm, bn, warps, stages, bm, bn
    bq, bk = layout.block_q, layout.block_k
    while bm > 16 and bq % bm:
        bm //= 2
    while bn > 16 and bk % bn:
        bn //= 2
    return bm, bn, warps, stages, bq, bk


def unsupported_flex(q, k, v, problem, need_grad: bool):
    why = unsupported_input(q)
    if why is not None:
        return why
    d, dv = q.shape[-1], v.shape[-1]
    if d > 256 or dv > 256:
        return f"head dims {d}/{dv} (up to 256)"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "q, k and v need a unit stride in the head dim"
    layout = problem.layout
    if layout.kinds.shape[2:] != (1, 1):
        bq, bk = layout.block_q, layout.block_k
        if bq % 16 or bk % 16:
            return f"BlockMask block size {(bq, bk)} (needs multiples of 16)"
    for t in (*problem.captured_values()[0], *problem.captured_values()[1]):
        if t.device != q.device:
            return f"a captured tensor is on {t.device}, q on {q.device}"
    return None


def _lists(kinds, value, batch, heads):
    """(num, indices) of the blocks of one kind, listed in kv order, broadcast to (B, H)."""
    hit = kinds == value
    num = hit.sum(-1, dtype=torch.int32)
    order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    n_q = kinds.shape[2]
    return (num.expand(batch, heads, n_q),
            order.expand(batch, heads, n_q, kinds.shape[3]))


@memo_by_identity(128)
def mod_functions(score, mask, derivative_too: bool):
    """The triton functions of a call's mods: (score_mod, mask_mod, d score_mod / d score);
    the mask's captured slots follow the score_mod's (one C tuple for both)."""
    from ...core.flex_ir import derivative

    n_score = len(score.captured) if score is not None else 0
    score_fn = jit_function(score.root) if score is not None else _identity_mod
    mask_fn = (jit_function(shift_slots(mask.root, n_score)) if mask is not None
               else _keep_all)
    dmod_fn = (jit_function(derivative(score.root)) if derivative_too and score is not None
               else _identity_mod)
    return score_fn, mask_fn, dmod_fn


@memo_by_identity(128)
def block_lists(layout, device: str, seqlen_q, seqlen_k, bq, bk, batch, heads,
                transpose: bool):
    """NUM (B, H, 2, n) and IDX (B, H, 2, n, m): the partial (0) and full (1) block lists
    per query block (per kv block if transpose), on the device. A single-block layout is
    re-cut to (bq, bk) tiles, all of its kind. Cached per layout: a repeated call does no
    tensor work here."""
    kinds = layout.kinds.to(device)
    if kinds.shape[2:] == (1, 1):
        kinds = kinds.expand(-1, -1, triton.cdiv(seqlen_q, bq), triton.cdiv(seqlen_k, bk))
    if transpose:
        kinds = kinds.transpose(2, 3)
    pnum, pidx = _lists(kinds, PARTIAL, batch, heads)
    fnum, fidx = _lists(kinds, FULL, batch, heads)
    return torch.stack((pnum, fnum), 2), torch.stack((pidx, fidx), 2)


def unsupported_flex_backward(q, k, v, problem):
    why = unsupported_flex(q, k, v, problem, True)
    if why is not None:
        return why
    slots = tuple(i for i, t in enumerate(problem.captured_values()[0]) if t.requires_grad)
    if not slots:
        return None
    if problem.deterministic or torch.are_deterministic_algorithms_enabled():
        return ("deterministic gradients of captured tensors (this backend adds them with "
                "atomics)")
    from .flex_bwd import grad_function

    try:
        grad_function(problem.score, slots)
    except NotImplementedError as e:
        return f"gradients of captured tensors: {e}"
    return None


def flex_backward(dout, dlse, q, k, v, out, lse, problem, captured_need_grad):
    from .flex_bwd import flex_backward as run  # flex_bwd imports this module's helpers

    return run(dout, dlse, q, k, v, out, lse, problem, captured_need_grad)


def flex_forward(q, k, v, problem):
    batch, heads, seqlen_q, d = q.shape
    seqlen_k, dv = k.shape[2], v.shape[-1]
    bm, bn, warps, stages, bq, bk = tiles(q, v, problem)
    num, idx = block_lists(problem.layout, str(q.device), seqlen_q, seqlen_k, bq, bk, batch,
                           heads, False)
    pnum, fnum = num[:, :, 0], num[:, :, 1]
    pidx, fidx = idx[:, :, 0], idx[:, :, 1]
    score, mask = problem.score, problem.mask
    captured = problem.captured_values()[0] + problem.captured_values()[1]
    score_fn, mask_fn, _ = mod_functions(score, mask, False)
    out = torch.empty(batch, heads, seqlen_q, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    block_d, block_dv = head_blocks(d, dv)
    grid = (triton.cdiv(seqlen_q, bm), batch * heads)
    args = (q, k, v, out, lse, pnum, pidx, fnum, fidx, captured_args(captured),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            *pnum.stride(), *pidx.stride()[:3], *fnum.stride(), *fidx.stride()[:3],
            heads, problem.group, seqlen_q, seqlen_k, problem.scale)
    launch_fitting(flex_fwd_kernel, grid, args, dict(
        SCORE_MOD=score_fn, MASK_MOD=mask_fn, HAS_SCORE=score is not None,
        HAS_MASK=mask is not None, D=d, DV=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=bm, BLOCK_N=bn, BQ=bq, BK=bk, num_warps=warps, num_stages=stages))
    return out, lse
