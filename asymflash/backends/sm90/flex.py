"""FlexAttention on Hopper, for the flex dispatcher (`runtime.dispatch.pick_flex`): the
forward on the warp-specialised forward kernel (`fwd/flex_kernel.py`), the backward on the
backward's synchronous body (`bwd/flex_parts.py`, d <= 128). `unsupported_flex` /
`unsupported_flex_backward` say why a call cannot run here (the dispatcher then takes the
portable kernels, which compute the same semantics), `flex_forward` / `flex_backward` run it.

q, k, v arrive as torch's flex takes them, (batch, heads, seqlen, dim). The kernel reads
them in place through 2-D TMA descriptors where each head's rows are evenly spaced: a
contiguous (batch, heads, seqlen, dim) tensor, or the transposed view of a contiguous
(batch, seqlen, heads, dim) one (flash-attn's layout); any other layout is copied first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from .common import GLUON_ERROR, hopper_input_reason, tma_rows
from .fwd.config import _DEFAULT_CONFIGS, check_config
from .fwd.host import _consumer_regs, _launch_options

NAME = "sm90"
HEAD_DIMS = (64, 128, 256)
BWD_HEAD_DIMS = (64, 128)  # the backward's synchronous body
BLOCK_Q = 128  # a CTA's query rows: the BlockMask's query blocks must be this tall
LOG2E = 1.4426950408889634

if GLUON_ERROR is None:
    from .fwd.flex_kernel import flex_fwd_kernel


@functools.lru_cache(maxsize=None)
def flex_config(d: int, gathers: bool = False):
    """The forward's default tile for head dim d, on the one-tile grid. gathers: a mod
    reads a captured tensor at an index that varies along both rows and keys (a bias table
    indexed by q - kv): each score then holds a loaded value and its address, and 128-key
    blocks spill (the key loop kept hundreds of local-memory instructions at d=64 and 128,
    sm_90a): 64-key blocks."""
    cfg = replace(_DEFAULT_CONFIGS[d], persistent=False, q_buffers=1, lpt=False)
    if gathers and cfg.block_n > 64:
        cfg = replace(cfg, block_n=64, stages=max(cfg.stages, 3))
    check_config(cfg, d)
    return cfg


def gathers_2d(score, mask) -> bool:
    """Whether a mod reads a captured tensor at an index varying along both query rows and
    keys (`flex_config`)."""
    from ...core.flex_ir import loads_of, uses

    def varies(load, names) -> bool:
        return any(uses(i, name) for i in load.index for name in names)

    for mod in (score, mask):
        if mod is None:
            continue
        for load in loads_of(mod.root, range(len(mod.captured))):
            if varies(load, ("q_idx", "score")) and varies(load, ("kv_idx", "score")):
                return True
    return False


def unsupported_flex(q, k, v, problem, need_grad: bool) -> str | None:
    return _reason(q, k, v, problem, HEAD_DIMS, "flex forward", problem_reason)


def unsupported_flex_backward(q, k, v, problem) -> str | None:
    return _reason(q, k, v, problem, BWD_HEAD_DIMS, "flex backward", backward_problem_reason)


def _reason(q, k, v, problem, head_dims, direction: str, problem_check) -> str | None:
    """Why a flex call cannot run on the sm90 kernel of `direction`, or None: the Hopper
    checks, empty sequences, `problem_check` (mods, BlockMask), captured tensors' devices
    and int32 TMA row coordinates."""
    why = hopper_input_reason(q, k, v, None, head_dims, direction)
    if why is not None:
        return why
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "an empty sequence"
    why = problem_check(problem, q.shape[-1])
    if why is not None:
        return why
    for t in (*problem.captured_values()[0], *problem.captured_values()[1]):
        if t.device != q.device:
            return f"a captured tensor is on {t.device}, q on {q.device}"
    if max(q.numel() // q.shape[-1], k.numel() // k.shape[-1]) >= 2**31 - 2 * BLOCK_Q:
        return "rows exceed int32 TMA coordinates"
    return None


def problem_reason(problem, d: int) -> str | None:
    """Why the kernel cannot take this call's mods and BlockMask at head dim d, or None."""
    gathers = gathers_2d(problem.score, problem.mask)
    if gathers and d == 256:
        return ("a mod gathering a captured tensor along rows and keys at head dim 256 (the "
                "sm90 flex forward's key loop spills there)")
    layout = problem.layout
    block_n = flex_config(d, gathers).block_n
    if layout.kinds.shape[2:] != (1, 1):
        bq, bk = layout.block_q, layout.block_k
        if bq != BLOCK_Q or bk % block_n:
            return (f"BlockMask block size {(bq, bk)} (the sm90 flex forward takes "
                    f"({BLOCK_Q}, a multiple of {block_n}))")
    return None


def row_form(t: torch.Tensor):
    """(rows view (rows, heads, dim), rows per batch, rows per head, head column step) of a
    (batch, heads, seqlen, dim) tensor read in place, or None where it must be copied."""
    batch, heads, seqlen, dim = t.shape
    if t.data_ptr() % 16 or t.stride(-1) != 1:
        return None
    sb, sh, ss, _ = t.stride()
    if (sh == seqlen * dim or heads == 1) and (ss == dim or seqlen == 1) and \
            (sb == heads * seqlen * dim or batch == 1):  # contiguous BHSD
        return t.reshape(batch * heads * seqlen, 1, dim), heads * seqlen, seqlen, 0
    if (ss == heads * dim or seqlen == 1) and (sh == dim or heads == 1) and \
            (sb == seqlen * heads * dim or batch == 1):  # BSHD storage, seen as BHSD
        return t.transpose(1, 2).reshape(batch * seqlen, heads, dim), seqlen, 0, 1
    return None


def _rows(t: torch.Tensor):
    form = row_form(t)
    return form if form is not None else row_form(t.contiguous())


def flex_forward(q, k, v, problem):
    """(out (batch, heads, seqlen_q, dv) in q.dtype, lse (batch, heads, seqlen_q) fp32)."""
    from ..portable.flex import block_lists, mod_functions
    from ..portable.flex_emit import captured_args

    batch, heads, seqlen_q, d = q.shape
    seqlen_k, dv = k.shape[2], v.shape[-1]
    cfg = flex_config(d, gathers_2d(problem.score, problem.mask))
    layout = problem.layout
    bk = cfg.block_n if layout.kinds.shape[2:] == (1, 1) else layout.block_k
    num, idx = block_lists(layout, str(q.device), seqlen_q, seqlen_k, BLOCK_Q, bk, batch,
                           heads, False)
    score, mask = problem.score, problem.mask
    score_fn, mask_fn, _ = mod_functions(score, mask, False)
    captured = problem.captured_values()[0] + problem.captured_values()[1]

    q_rows, q_row_b, q_row_h, q_head_c = _rows(q)
    k_rows, kv_row_b, kv_row_h, kv_head_c = _rows(k)
    v_form = row_form(v)
    if v_form is None or v_form[1:] != (kv_row_b, kv_row_h, kv_head_c):
        # k's form for v too (one set of row steps for both)
        v_form = row_form(v.transpose(1, 2).contiguous().transpose(1, 2)
                          if kv_head_c else v.contiguous())
    v_rows = v_form[0]
    out = torch.empty(batch, heads, seqlen_q, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    q_desc = tma_rows(q_rows, (64, d))
    k_desc = tma_rows(k_rows, (cfg.block_n, d))
    v_desc = tma_rows(v_rows, (cfg.block_n, dv))
    # a 32-column stand-in: O leaves by masked per-thread stores (`epilogue.tile_store`)
    o_desc = tma_rows(out.view(-1, 1, dv), (64, 32))
    num_m_blocks = math.ceil(seqlen_q / BLOCK_Q)
    has_score = score is not None
    qk_scale = LOG2E if has_score else problem.scale * LOG2E
    consts = dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        EMU_EVERY=cfg.exp2_emu_every, RESCALE_THRESHOLD=float(cfg.rescale_threshold),
        CONSUMER_REGS=_consumer_regs(cfg), LOADER_REGS=cfg.loader_regs, SUB=bk // cfg.block_n,
        SCORE_MOD=score_fn, MASK_MOD=mask_fn, HAS_SCORE=has_score,
        HAS_MASK=mask is not None, EVEN_K=seqlen_k % cfg.block_n == 0,
        **_launch_options(cfg))
    grid = (num_m_blocks * heads * batch,)
    flex_fwd_kernel[grid](
        q_desc, k_desc, v_desc, o_desc, out, lse, num, idx, captured_args(captured),
        seqlen_q, seqlen_k, heads, problem.group, num_m_blocks, problem.scale, qk_scale,
        q_row_b, q_row_h, q_head_c, kv_row_b, kv_row_h, kv_head_c,
        *num.stride(), *idx.stride()[:4], **consts)
    return out, lse


def compile_for_target(d: int = 128, score=None, mask=None, captured_sig=(), even_k=True,
                       sub: int = 1, dtype=torch.bfloat16, arch: int = 90, cfg=None):
    """Compile the flex forward without a GPU (CI check): score / mask traced mods
    (flex_trace.trace) or None, captured_sig their captured tensors' signature entries
    ((ptr type, sizes, strides) per tensor, score_mod's first). Returns triton's
    CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..portable.flex import mod_functions
    from .common import SIG_DTYPES, smem_layout

    cfg = cfg or flex_config(d, gathers_2d(score, mask))
    ty = SIG_DTYPES[dtype]

    def desc(rows, cols):
        return f"tensordesc<{ty}[{rows}, {cols}],{smem_layout((rows, cols), dtype)!r}>"

    score_fn, mask_fn, _ = mod_functions(score, mask, False)
    signature = {
        "q_desc": desc(64, d), "k_desc": desc(cfg.block_n, d), "v_desc": desc(cfg.block_n, d),
        "o_desc": desc(64, 32), "out_ptr": f"*{ty}", "lse_ptr": "*fp32", "num_ptr": "*i32",
        "idx_ptr": "*i32", "captured": (*captured_sig, "i32")}
    for name in ("seqlen_q", "seqlen_k", "n_heads", "group", "num_m_blocks"):
        signature[name] = "i32"
    signature["scale"] = signature["qk_scale"] = "fp32"
    for name in ("q_row_b", "q_row_h", "q_head_c", "kv_row_b", "kv_row_h", "kv_head_c",
                 "num_sb", "num_sh", "num_sk", "num_sq", "idx_sb", "idx_sh", "idx_sk",
                 "idx_sq"):
        signature[name] = "i32"
    constexprs = dict(
        HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        EMU_EVERY=cfg.exp2_emu_every, RESCALE_THRESHOLD=float(cfg.rescale_threshold),
        CONSUMER_REGS=_consumer_regs(cfg), LOADER_REGS=cfg.loader_regs, SUB=sub,
        SCORE_MOD=score_fn, MASK_MOD=mask_fn, HAS_SCORE=score is not None,
        HAS_MASK=mask is not None, EVEN_K=even_k)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(flex_fwd_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=_launch_options(cfg))


@functools.lru_cache(maxsize=None)
def flex_bwd_config(d: int):
    """The backward's tile for a flex call: the synchronous body's (no warp
    specialisation), 64 query rows a step (d=64's default 128 leaves no registers for the
    mods), dQ row-major."""
    from .bwd.config import _DEFAULT_CONFIGS as BWD_CONFIGS

    return replace(BWD_CONFIGS[d], split_warpgroups=False, dq_fragment=False, block_m=64)


def backward_problem_reason(problem, d: int) -> str | None:
    """Why the flex backward cannot take this call's mods, captured tensors and BlockMask
    at head dim d, or None."""
    if any(t.requires_grad for t in problem.captured_values()[0]):
        return "gradients of captured tensors (the portable backward adds them)"
    if problem.deterministic or torch.are_deterministic_algorithms_enabled():
        return "deterministic gradients (dQ partials meet in TMA reduce-adds, in any order)"
    layout = problem.layout
    if layout.kinds.shape[2:] != (1, 1):
        bq, bk = layout.block_q, layout.block_k
        block_n = flex_bwd_config(d).block_n
        if bq % 64 or bk % block_n:
            return (f"BlockMask block size {(bq, bk)} (the sm90 flex backward takes multiples "
                    f"of (64, {block_n}))")
    return None


def _bshd_rows(t: torch.Tensor) -> torch.Tensor:
    """(batch · seqlen, heads, dim) rows of a (batch, heads, seqlen, dim) tensor: a view of
    BSHD storage (how a projection's output usually arrives), else a copy."""
    batch, heads, seqlen, dim = t.shape
    return t.transpose(1, 2).reshape(batch * seqlen, heads, dim)


def flex_backward(dout, dlse, q, k, v, out, lse, problem, captured_need_grad):
    """(dq, dk, dv, captured gradients: None each) of a flex call; dq, dk, dv as
    (batch, heads, seqlen, dim) views of BSHD storage."""
    from ...core.params import AttnParams, MaskSpec, SeqInfo
    from ...runtime.launch import sm_count
    from ..portable.flex import block_lists, mod_functions
    from ..portable.flex_emit import captured_args
    from .bwd import host as bwd

    batch, heads, seqlen_q, d = q.shape
    hkv, seqlen_k = k.shape[1], k.shape[2]
    cfg = flex_bwd_config(d)
    layout = problem.layout
    recut = layout.kinds.shape[2:] == (1, 1)
    bq, bk = (128, cfg.block_n) if recut else (layout.block_q, layout.block_k)
    num, idx = block_lists(layout, str(q.device), seqlen_q, seqlen_k, bq, bk, batch, heads,
                           True)
    score, mask = problem.score, problem.mask
    score_fn, mask_fn, dmod_fn = mod_functions(score, mask, True)
    captured = problem.captured_values()[0] + problem.captured_values()[1]
    seq = SeqInfo.dense(batch, seqlen_q, seqlen_k, q.device)
    params = AttnParams(softmax_scale=problem.scale, mask=MaskSpec())
    plan = bwd.launch_plan(d, d, seqlen_q, seqlen_k, True, False, -1, -1, False, False,
                           batch, hkv, sm_count(q.device), cfg, heads)
    assert not plan.split and not plan.dq_fragment, plan
    rows = [bwd.common.tma_ready(_bshd_rows(t)) for t in (q, k, v)]
    lse_rows = lse.transpose(0, 1).reshape(heads, batch * seqlen_q)
    dlse_rows = None if dlse is None else dlse.transpose(0, 1).reshape(heads, -1)
    c = plan.constexprs
    consts = {name: c[name] for name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "DV_OVERLAP",
                                         "DP_EARLY", "KV_TMA_STORE", "DK_LATE", "STATS_LATE")}
    consts.update({name: value for name, value in c.items() if name.islower()})  # launch
    consts.update(BK=bk, SUB=bq // cfg.block_m, SCORE_MOD=score_fn, MASK_MOD=mask_fn,
                  DMOD=dmod_fn, HAS_SCORE=score is not None, HAS_MASK=mask is not None)
    extra = (num, idx, captured_args(captured), *num.stride(), *idx.stride()[:4])
    dq, dk, dv, _ = bwd._run(plan, d, d, False, _bshd_rows(dout), *rows, _bshd_rows(out),
                             lse_rows, dlse_rows, seq, params, None, flex=(extra, consts))

    def as_bhsd(t, seqlen):
        return t.view(batch, seqlen, t.shape[1], d).transpose(1, 2)

    return (as_bhsd(dq, seqlen_q), as_bhsd(dk, seqlen_k), as_bhsd(dv, seqlen_k),
            [None] * len(captured_need_grad))


def compile_backward_for_target(d: int = 128, score=None, mask=None, captured_sig=(),
                                sub: int = 2, dtype=torch.bfloat16, arch: int = 90):
    """Compile the flex backward (`bwd/entry.attn_bwd_flex_kernel`) without a GPU (CI
    check); arguments as `compile_for_target`'s."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..portable.flex import mod_functions
    from .bwd import entry
    from .bwd import host as bwd

    cfg = flex_bwd_config(d)
    signature = bwd.kernel_signature(d, d, cfg, False, dtype)
    signature.update({"num_ptr": "*i32", "idx_ptr": "*i32",
                      "captured": (*captured_sig, "i32")})
    for name in ("num_sb", "num_sh", "num_sk", "num_sn", "idx_sb", "idx_sh", "idx_sk",
                 "idx_sn"):
        signature[name] = "i32"
    score_fn, mask_fn, dmod_fn = mod_functions(score, mask, True)
    c = bwd._constexprs(d, d, cfg, uniform=True, has_seqused=False, has_left=False,
                        has_right=False, softcap=False, kv_tma_store=True)
    constexprs = {name: c[name] for name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "DV_OVERLAP",
                                             "DP_EARLY", "KV_TMA_STORE", "DK_LATE",
                                             "STATS_LATE")}
    constexprs.update(BK=cfg.block_n, SUB=sub, SCORE_MOD=score_fn, MASK_MOD=mask_fn,
                      DMOD=dmod_fn, HAS_SCORE=score is not None, HAS_MASK=mask is not None)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(entry.attn_bwd_flex_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=bwd._launch_options(False, cfg))
