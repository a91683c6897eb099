"""asymflash.flex_attention: torch's FlexAttention programming model on asymflash.

Takes the very functions users write for torch.nn.attention.flex_attention (score_mod,
mask_mod through torch's BlockMask), traces them once into an expression tree
(core/flex_trace.py) and runs them on the first backend that can (runtime/dispatch.py,
pick_flex). Semantics: core/flex.py; the plain-math definition: reference.flex_attention_ref.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..core import flex_trace
from ..core.flex import FULL, PARTIAL, BlockLayout, FlexProblem, block_layout, memo_by_identity
from ..runtime.dispatch import pick_flex

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None,
                   block_mask=None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options=None):
    """FlexAttention with torch's signature, on (batch, heads, seqlen, dim) tensors.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); fp16, bf16 or fp32.
    score_mod(score, b, h, q_idx, kv_idx) -> score and the BlockMask's mask_mod(b, h, q_idx,
    kv_idx) -> bool are written in plain torch ops and may index tensors they capture
    (document ids, bias tables, slopes); captured tensors that require grad get gradients.
    block_mask is torch's BlockMask (torch.nn.attention.flex_attention.create_block_mask):
    empty blocks are skipped, full blocks skip mask_mod. scale defaults to 1/sqrt(E);
    enable_gqa allows Hq a multiple of Hkv. Returns out (B, Hq, L, Ev) in query's dtype, and
    with return_lse also lse fp32 (B, Hq, L) in natural log. A row with nothing to attend
    to gets out = 0, lse = -inf. kernel_options is accepted for compatibility and ignored.

    Raises TypeError/ValueError for bad input, flex_trace.ModTraceError (a TypeError) for a
    mod that uses an op outside the supported set, naming the op.

    Under torch.compile the attention is the custom op asymflash::flex_fwd (api/flex_ops.py);
    a score_mod or BlockMask is traced eagerly at one graph break before it
    (api/flex_compiled.py).
    """
    if torch.compiler.is_compiling():
        from .flex_compiled import compiled_flex

        out, lse = compiled_flex(query, key, value, score_mod, block_mask, scale, enable_gqa)
    else:
        problem = prepare(query, key, value, score_mod, block_mask, scale, enable_gqa)
        out, lse = run(query, key, value, problem)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- checks

def _fail(exc, what: str):
    raise exc(f"asymflash.flex_attention: {what}")


def check_inputs(query, key, value, enable_gqa: bool):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            _fail(TypeError, f"{name} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dim() != 4:
            _fail(ValueError, f"{name} has shape {tuple(t.shape)}; expected 4 dims "
                              "(batch, heads, seqlen, dim)")
        if t.dtype not in _DTYPES:
            _fail(TypeError, f"{name} has dtype {t.dtype}; allowed: {_DTYPES}")
        if t.device != query.device:
            _fail(ValueError, f"{name} is on {t.device}, query on {query.device}: use one "
                              "device")
        if t.dtype != query.dtype:
            _fail(TypeError, f"{name} has dtype {t.dtype}, query {query.dtype}: use one dtype")
    if key.shape[-1] != query.shape[-1]:
        _fail(ValueError, f"key has head dim {key.shape[-1]}, query {query.shape[-1]}; they "
                          "must be equal")
    if key.shape[:3] != value.shape[:3]:
        _fail(ValueError, f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree "
                          "in batch, heads and seqlen")
    if key.shape[0] != query.shape[0]:
        _fail(ValueError, f"key has batch {key.shape[0]}, query {query.shape[0]}; they must "
                          "be equal")
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv or (hq != hkv and not enable_gqa):
        _fail(ValueError, f"query has {hq} heads and key/value {hkv}: equal counts, or "
                          "enable_gqa=True with query heads a multiple of key/value heads")


def check_block_mask(block_mask, query, key):
    if block_mask is None:
        return
    needed = ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "mask_mod")
    if not all(hasattr(block_mask, a) for a in needed):
        _fail(TypeError, f"block_mask is a {type(block_mask).__name__}; expected torch's "
                         "BlockMask (torch.nn.attention.flex_attention.create_block_mask)")
    seq = tuple(getattr(block_mask, "seq_lengths", (query.shape[2], key.shape[2])))
    if seq != (query.shape[2], key.shape[2]):
        _fail(ValueError, f"block_mask was made for (q_len, kv_len) = {seq}, the inputs have "
                          f"{(query.shape[2], key.shape[2])}: create it for these lengths")
    num = block_mask.kv_num_blocks
    if num.device != query.device:
        _fail(ValueError, f"block_mask is on {num.device}, query on {query.device}")
    if num.shape[0] not in (1, query.shape[0]) or num.shape[1] not in (1, query.shape[1]):
        _fail(ValueError, f"block_mask has (batch, heads) = {tuple(num.shape[:2])}; expected "
                          f"1 or {query.shape[0]} and 1 or {query.shape[1]}")


# ---------------------------------------------------------------- preparation

def _is_noop_mask(fn) -> bool:
    from torch.nn.attention import flex_attention as torch_flex

    return fn is None or fn is getattr(torch_flex, "noop_mask", None)


def prepare(query, key, value, score_mod, block_mask, scale, enable_gqa,
            extra_score=None, extra_mask=None) -> FlexProblem:
    """Check everything, trace the mods, and describe the call for the backends.

    extra_score / extra_mask are built-in mods (flex_ir.Mod, e.g. flash_attn_func's softcap,
    ALiBi, causal and window masks) applied before the user's score_mod and together with
    the user's mask."""
    check_inputs(query, key, value, enable_gqa)
    check_block_mask(block_mask, query, key)
    if score_mod is not None and not callable(score_mod):
        _fail(TypeError, f"score_mod is a {type(score_mod).__name__}; expected a callable "
                         "score_mod(score, b, h, q_idx, kv_idx)")
    scale = _checked_scale(scale, query)
    layout = block_layout(block_mask, query.shape[2], key.shape[2])
    mask = None
    if block_mask is not None and not _is_noop_mask(block_mask.mask_mod) \
            and layout.has_partial:
        mask = flex_trace.traced(block_mask.mask_mod, "mask", query.device)
    if extra_mask is not None:
        mask = extra_mask if mask is None else _and_masks(extra_mask, mask)
        layout = _all_partial(layout)
    score = (flex_trace.traced(score_mod, "score", query.device) if score_mod is not None
             else None)
    if extra_score is not None:
        score = extra_score if score is None else _compose_scores(score, extra_score)
    for mod in (score, mask):
        for t in (mod.captured if mod is not None else ()):
            if t.device != query.device:
                _fail(ValueError, f"a tensor the mods capture (shape {tuple(t.shape)}) is on "
                                  f"{t.device}, query on {query.device}: move it to one device")
    return FlexProblem(score, mask, layout, float(scale), query.shape[1] // key.shape[1])


def _checked_scale(scale, query) -> float:
    if scale is None:
        return 1.0 / math.sqrt(query.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale):
        _fail(TypeError, f"scale is {scale!r}; expected a finite float or None")
    return float(scale)


@memo_by_identity(64)
def _and_masks(first, second):
    from ..core.flex_ir import and_masks

    return and_masks(first, second)


@memo_by_identity(64)
def _compose_scores(outer, inner):
    from ..core.flex_ir import compose_scores

    return compose_scores(outer, inner)


@memo_by_identity(64)
def _all_partial(layout):
    """A built-in mask applies everywhere: full blocks become partial."""
    kinds = layout.kinds.clone()
    kinds[kinds == FULL] = PARTIAL
    return BlockLayout(kinds, layout.block_q, layout.block_k, None)


# ---------------------------------------------------------------- autograd

class _FlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, problem, backend, *captured):
        out, lse = backend.flex_forward(query, key, value, problem)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.problem = problem
        ctx.need = [t.requires_grad for t in captured]
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        query, key, value, out, lse = ctx.saved_tensors
        problem = ctx.problem
        backend = pick_flex(query, key, value, problem, "backward")
        n_score = len(problem.captured_values()[0])
        dq, dk, dv, dcap = backend.flex_backward(
            torch.zeros_like(out) if dout is None else dout, dlse, query, key, value, out,
            lse, problem, ctx.need[:n_score])
        # the mask's captured tensors (after the score_mod's) carry no gradient
        return (dq, dk, dv, None, None, *dcap, *([None] * (len(ctx.need) - n_score)))


def run(query, key, value, problem: FlexProblem):
    """(out, lse) of a prepared call, differentiable in q, k, v and captured tensors."""
    captured = problem.captured_values()
    flat = (*captured[0], *captured[1])
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *captured[0]))
    backend = pick_flex(query, key, value, problem, "forward", need_grad=grad)
    if not grad:
        return backend.flex_forward(query, key, value, problem)
    return _FlexFunction.apply(query, key, value, problem, backend, *flat)


# ---------------------------------------------------------------- flash_attn_func's mods

@memo_by_identity(64)
def builtin_score(softcap: float, alibi_slopes, seqlen_q: int, seqlen_k: int):
    """flash_attn_func's softcap, then its ALiBi bias, as a score mod (or None).

    ALiBi as flash-attn defines it: -slope * |i + seqlen_k - seqlen_q - j| added to the
    scaled (and soft-capped) score of query i and key j, slopes (nheads,) or (batch, nheads).
    flash-attn's causal kernel adds slope * j instead, which differs from this by a constant
    per row: the same output, but an lse shifted by slope * (i + seqlen_k - seqlen_q)."""
    from ..core.flex_ir import Mod

    rank = 0 if alibi_slopes is None else alibi_slopes.dim()
    root = _builtin_score_root(softcap, rank, seqlen_q, seqlen_k)
    captured = () if alibi_slopes is None else (alibi_slopes,)
    return None if root is None else Mod("score", root, captured)


def _builtin_score_root(softcap: float, alibi_rank: int, seqlen_q: int, seqlen_k: int):
    """builtin_score's tree (None: the identity); alibi_rank 0 means no ALiBi, else the
    slopes' rank (1: per head, 2: per batch and head), read from captured slot 0."""
    from ..core.flex_ir import Const, Input, Load, Op

    f32, i32 = torch.float32, torch.int32
    root = Input("score", f32)
    if softcap > 0:
        root = Op("mul", (Const(float(softcap), f32),
                          Op("tanh", (Op("div", (root, Const(float(softcap), f32)), f32),), f32)),
                  f32)
    if alibi_rank:
        index = (Input("h", i32),) if alibi_rank == 1 else (Input("b", i32), Input("h", i32))
        slope = Load(0, index, f32)
        pos = Op("add", (Input("q_idx", i32), Const(seqlen_k - seqlen_q, torch.int64)), i32)
        dist = Op("abs", (Op("sub", (pos, Input("kv_idx", i32)), i32),), i32)
        root = Op("sub", (root, Op("mul", (slope, dist), f32)), f32)
    return None if root == Input("score", f32) else root


@memo_by_identity(64)
def builtin_mask(window, seqlen_q: int, seqlen_k: int):
    """The causal / local window (core.masks' bottom-right rule) as a mask mod, or None."""
    from ..core.flex_ir import Const, Input, Mod, Op

    i32, b = torch.int32, torch.bool
    pos = Op("add", (Input("q_idx", i32), Const(seqlen_k - seqlen_q, torch.int64)), i32)
    kv = Input("kv_idx", i32)
    terms = []
    if window.window_right >= 0:
        terms.append(Op("le", (kv, Op("add", (pos, Const(window.window_right, torch.int64)),
                                      i32)), b))
    if window.window_left >= 0:
        terms.append(Op("ge", (kv, Op("sub", (pos, Const(window.window_left, torch.int64)),
                                      i32)), b))
    if not terms:
        return None
    root = terms[0] if len(terms) == 1 else Op("and", tuple(terms), b)
    return Mod("mask", root, ())


def _check_slopes(alibi_slopes, q):
    batch, nheads = q.shape[0], q.shape[2]
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(f"asymflash: alibi_slopes is a {type(alibi_slopes).__name__}; "
                        "expected a float32 tensor (nheads,) or (batch, nheads)")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"asymflash: alibi_slopes has shape {tuple(alibi_slopes.shape)}; "
                         f"expected ({nheads},) or ({batch}, {nheads})")
    if alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device:
        raise TypeError(f"asymflash: alibi_slopes is {alibi_slopes.dtype} on "
                        f"{alibi_slopes.device}; expected float32 on {q.device}")


def flash_attn_with_mods(q, k, v, softmax_scale, causal, window_size, softcap,
                         learnable_sink, return_lse, score_mod, mask_mod, alibi_slopes,
                         deterministic=False):
    """flash_attn_func with score_mod / mask_mod / alibi_slopes: BSHD in and out, through
    the flex machinery (mods see the query head h; masks combine with causal/window)."""
    from ..core.masks import normalize_window

    _check_mods_call(q, k, v, softmax_scale, window_size, softcap, learnable_sink, mask_mod,
                     alibi_slopes)
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))
    window = normalize_window(causal, window_size)
    if not torch.compiler.is_compiling():
        problem = _mods_problem(query, key, value, softmax_scale, window, softcap, score_mod,
                                mask_mod, alibi_slopes, deterministic)
        out, lse = run(query, key, value, problem)
    else:
        from .flex_compiled import compiled_mods

        out, lse = compiled_mods(query, key, value, softmax_scale, window, softcap, score_mod,
                                 mask_mod, alibi_slopes, deterministic)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _check_mods_call(q, k, v, softmax_scale, window_size, softcap, learnable_sink, mask_mod,
                     alibi_slopes):
    from . import validation as check

    if learnable_sink is not None:
        raise NotImplementedError("asymflash: learnable_sink together with score_mod, "
                                  "mask_mod or alibi_slopes is not implemented")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"asymflash: mask_mod is a {type(mask_mod).__name__}; expected a "
                        "callable mask_mod(b, h, q_idx, kv_idx)")
    check.check_tensors(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    check.check_scalars(softmax_scale, window_size, softcap)
    if alibi_slopes is not None:
        _check_slopes(alibi_slopes, q)


def _mods_problem(query, key, value, softmax_scale, window, softcap, score_mod, mask_mod,
                  alibi_slopes, deterministic) -> FlexProblem:
    """flash_attn_func's call (BHSD views) as a FlexProblem: its built-in mods, then the
    user's, with the user's mask_mod and the causal/window mask combined. deterministic
    keeps the atomics of captured-tensor gradients out (core.flex.FlexProblem)."""
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    extra_mask = builtin_mask(window, seqlen_q, seqlen_k)
    if mask_mod is not None:
        from ..core.flex_ir import and_masks

        user = flex_trace.traced(mask_mod, "mask", query.device)
        extra_mask = user if extra_mask is None else and_masks(extra_mask, user)
    problem = prepare(query, key, value, score_mod, None, softmax_scale, True,
                      builtin_score(softcap, alibi_slopes, seqlen_q, seqlen_k), extra_mask)
    return dataclasses.replace(problem, deterministic=True) if deterministic else problem

