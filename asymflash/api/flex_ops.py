"""The flex path as torch.library custom ops: what torch.compile puts in its graph.

A flex call is a traced problem (core/flex.py's FlexProblem) whose only tensors are the
block layout and the tensors the mods capture. `encode` turns everything else (the mods'
expression trees, block sizes, scale, GQA group) into one string, so a call becomes
`asymflash::flex_fwd(q, k, v, kinds, captured, spec, need_grad)`: opaque to the compiler,
with a fake implementation for shapes and an autograd rule calling `asymflash::flex_bwd`.
The string is a compile-time constant of the graph: a mod that changes gives another
string, hence a recompile, never a kernel built for the old mod. Eager calls keep the
autograd.Function of api/flex.py (no op-layer cost); both run the same backends.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor

from ..core import flex_ir
from ..core.flex import PARTIAL, BlockLayout, FlexProblem, memo_by_identity
from ..runtime import dispatch


def encode(problem: FlexProblem) -> str:
    """The non-tensor part of a problem as a string (its tensors travel beside it: the
    layout's kinds, then the score_mod's captured tensors, then the mask_mod's)."""
    score, mask = problem.score, problem.mask
    n_score = len(score.captured) if score is not None else 0
    roots = flex_ir.dumps(score.root if score is not None else None,
                          mask.root if mask is not None else None)
    layout = problem.layout
    blocks = (layout.block_q, layout.block_k)
    if layout.kinds is None or layout.kinds.shape[2:] == (1, 1):
        blocks = (0, 0)  # one block over everything, whatever the lengths: see _ONE_BLOCK
    return repr((roots, n_score, *blocks, float.hex(problem.scale), problem.group,
                 problem.deterministic))


# The block size of a one-block layout: above any sequence length (the backends treat such
# a layout as one block, and core.flex.BlockLayout.element_kinds divides int32 positions
# by it). Not writing the lengths into the spec keeps it, and the compiled graph, valid for
# every length: no recompile when the sequence length changes.
_ONE_BLOCK = 1 << 30


def captured_list(problem: FlexProblem) -> list:
    score, mask = problem.captured_values()
    return [*score, *mask]


@functools.lru_cache(maxsize=256)
def _decode(spec: str):
    import ast

    roots, n_score, block_q, block_k, scale, group, deterministic = ast.literal_eval(spec)
    score, mask = flex_ir.loads(roots)
    return (score, mask, n_score, block_q or _ONE_BLOCK, block_k or _ONE_BLOCK,
            float.fromhex(scale), group, deterministic)


def _problem(spec: str, kinds: Tensor, need: tuple, *captured) -> FlexProblem:
    """The FlexProblem of an op call. need marks the captured tensors whose gradient the
    backward computes: the backends read it from requires_grad, which tensors inside an op
    do not carry."""
    # A one-block layout on the host (no BlockMask) is made afresh by every compiled call:
    # key it by value, so that the cache below hits.
    if kinds.numel() == 1 and kinds.device.type == "cpu":
        kinds = int(kinds.reshape(()))
    return _cached_problem(spec, kinds, need, *captured)


@memo_by_identity(64)
def _cached_problem(spec: str, kinds, need: tuple, *captured) -> FlexProblem:
    """_problem, cached per spec, layout and tensor identities, so that a repeated call
    reuses what the backends cache per problem (emitted kernels, block lists)."""
    score, mask, n_score, block_q, block_k, scale, group, deterministic = _decode(spec)
    if isinstance(kinds, int):
        kinds = torch.full((1, 1, 1, 1), kinds, dtype=torch.uint8)
    captured = tuple(t.detach().requires_grad_(n) for t, n in zip(captured, need))
    layout = BlockLayout(kinds, block_q, block_k, None, bool((kinds == PARTIAL).any()))
    return FlexProblem(
        None if score is None else flex_ir.Mod("score", score, captured[:n_score]),
        None if mask is None else flex_ir.Mod("mask", mask, captured[n_score:]),
        layout, scale, group, deterministic)


def _no_grads(captured) -> tuple:
    return (False,) * len(captured)


@torch.library.custom_op("asymflash::flex_fwd", mutates_args=())
def flex_fwd(query: Tensor, key: Tensor, value: Tensor, kinds: Tensor,
             captured: list[Tensor], spec: str, need_grad: bool) -> tuple[Tensor, Tensor]:
    problem = _problem(spec, kinds, _no_grads(captured), *captured)
    backend = dispatch.pick_flex(query, key, value, problem, "forward", need_grad=need_grad)
    out, lse = backend.flex_forward(query, key, value, problem)
    return out.contiguous(), lse.contiguous()  # the layouts the fake promises


@flex_fwd.register_fake
def _flex_fwd_fake(query, key, value, kinds, captured, spec, need_grad):
    rows = tuple(query.shape[:3])
    return (query.new_empty(*rows, value.shape[-1]),
            query.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("asymflash::flex_bwd", mutates_args=())
def flex_bwd(dout: Tensor, dlse: Optional[Tensor], query: Tensor, key: Tensor, value: Tensor,
             out: Tensor, lse: Tensor, kinds: Tensor, captured: list[Tensor], spec: str,
             need: list[bool]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, one gradient per captured tensor: empty where need is False)."""
    problem = _problem(spec, kinds, tuple(need), *captured)
    backend = dispatch.pick_flex(query, key, value, problem, "backward")
    n_score = len(problem.captured_values()[0])
    tensors = [None if t is None else t.detach()
               for t in (dout, dlse, query, key, value, out, lse)]
    with _autograd_inside_op() if any(need) else contextlib.nullcontext():
        dq, dk, dv, dcap = backend.flex_backward(*tensors, problem, list(need[:n_score]))
    dcap = [*dcap, *([None] * (len(captured) - n_score))]
    # contiguous whatever the backend and the inputs' strides: the layouts the fake promises
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            [g.contiguous() if g is not None and n else t.new_empty(0)
             for g, n, t in zip(dcap, need, captured)])


def _autograd_inside_op():
    """Autograd back on inside an op's implementation, which runs below it: the tiled torch
    backward takes the captured tensors' gradients with torch.autograd.grad through the
    mod's tree. The op's own inputs are detached first, so nothing leaks out."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           exclude)


@flex_bwd.register_fake
def _flex_bwd_fake(dout, dlse, query, key, value, out, lse, kinds, captured, spec, need):
    return (query.new_empty(query.shape), key.new_empty(key.shape),
            value.new_empty(value.shape),
            [t.new_empty(t.shape) if n else t.new_empty(0) for t, n in zip(captured, need)])


def _setup_context(ctx, inputs, output):
    query, key, value, kinds, captured, spec, _ = inputs
    n_score = _decode(spec)[2]
    ctx.save_for_backward(query, key, value, output[0], output[1], kinds, *captured)
    ctx.spec = spec
    # the mask's captured tensors (after the score_mod's) carry no gradient
    ctx.need = [t.requires_grad and i < n_score for i, t in enumerate(captured)]
    # use_backend lives in a context variable; autograd may run the backward elsewhere
    ctx.forced_backend = dispatch.forced_backend()


def _backward(ctx, dout, dlse):
    query, key, value, out, lse, kinds, *captured = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    forced = ctx.forced_backend
    with dispatch.use_backend(forced) if forced else contextlib.nullcontext():
        dq, dk, dv, dcap = torch.ops.asymflash.flex_bwd(
            dout.contiguous(), dlse, query, key, value, out, lse, kinds, captured, ctx.spec,
            ctx.need)
    return (dq, dk, dv, None, [g if n else None for g, n in zip(dcap, ctx.need)], None,
            None)


torch.library.register_autograd("asymflash::flex_fwd", _backward,
                                setup_context=_setup_context)


def run_op(query, key, value, spec, kinds, captured):
    """(out, lse) through the custom op: the path torch.compile traces."""
    need_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *captured))
    return torch.ops.asymflash.flex_fwd(query, key, value, kinds, list(captured), spec,
                                        need_grad)
