"""flex_attention and flash_attn_func's mods under torch.compile: api/flex.py calls in here
only while Dynamo traces, so that `import asymflash` does not import Dynamo (the decorators
below need it; ~1 s of a process's start).

Dynamo cannot trace make_fx (how mods become expression trees), nor the data-dependent
host work of a BlockMask's layout. A call whose mods are all built in (no callable:
flash_attn_func's causal/window/softcap/ALiBi, flex_attention without mods) builds its
spec from Python constants at trace time and stays in one graph. A call with a user
callable (or built-in mods on dynamic lengths of different sizes) is lowered (traced,
encoded) eagerly by a function Dynamo does not enter: one graph break, after which the
custom op and the captured tensors are in the next graph.
"""

from __future__ import annotations

import torch

from ..core.flex import FULL, PARTIAL, BlockLayout, FlexProblem
from .flex import (
    _builtin_score_root,
    _checked_scale,
    _mods_problem,
    builtin_mask,
    check_inputs,
    prepare,
)
from .flex_ops import captured_list, encode, run_op


@torch._dynamo.disable(reason="asymflash traces score_mod / mask_mod / BlockMask with make_fx "
                              "outside the graph; the attention itself is the custom op "
                              "asymflash::flex_fwd in the next graph")
def _lower(build, *args):
    """(spec, layout kinds, captured tensors) of the problem build(*args) makes, eagerly."""
    problem = build(*args)
    return encode(problem), problem.layout.kinds, captured_list(problem)


def compiled_flex(query, key, value, score_mod, block_mask, scale, enable_gqa):
    if score_mod is None and block_mask is None:
        check_inputs(query, key, value, enable_gqa)
        group = query.shape[1] // key.shape[1]
        spec = _builtin_spec(_checked_scale(scale, query), group, 0.0, 0, 0, -1, -1)
        return run_op(query, key, value, spec, _one_block(False), [])
    return run_op(query, key, value, *_lower(prepare, query, key, value, score_mod,
                                             block_mask, scale, enable_gqa))


def _compiled_builtin(query, key, value, softmax_scale, window, softcap, alibi_slopes,
                      deterministic):
    check_inputs(query, key, value, True)
    group = query.shape[1] // key.shape[1]
    spec = _builtin_spec(_checked_scale(softmax_scale, query), group, float(softcap),
                         0 if alibi_slopes is None else alibi_slopes.dim(),
                         _static_offset(query, key), window.window_left,
                         window.window_right, bool(deterministic))
    masked = window.window_left >= 0 or window.window_right >= 0
    captured = [] if alibi_slopes is None else [alibi_slopes]
    return run_op(query, key, value, spec, _one_block(masked), captured)


def _static_offset(query, key):
    """seqlen_k - seqlen_q as a Python int, or None where Dynamo has it as a symbol (lengths
    made dynamic, and not known equal): the built-in mods' one dependence on the lengths."""
    offset = key.shape[2] - query.shape[2]
    if offset == 0:  # self-attention: a constant even when the lengths are dynamic
        return 0
    return None if isinstance(offset, torch.SymInt) else offset


def _one_block(masked: bool):
    """The layout of a call without a BlockMask: one block, partial when a built-in mask
    applies (as _all_partial makes it in the eager path)."""
    return torch.full((1, 1, 1, 1), PARTIAL if masked else FULL, dtype=torch.uint8)


@torch._dynamo.assume_constant_result
def _builtin_spec(scale: float, group: int, softcap: float, alibi_rank: int, offset: int,
                  window_left: int, window_right: int, deterministic: bool = False) -> str:
    """The spec of a call whose mods are all built in, from Python values only (Dynamo
    runs this at trace time and keeps the string as a constant). The mods depend on the
    lengths only through offset = seqlen_k - seqlen_q (the bottom-right alignment)."""
    from ..core.flex_ir import Mod
    from ..core.params import MaskSpec

    score = _builtin_score_root(softcap, alibi_rank, 0, offset)
    mask = builtin_mask(MaskSpec(window_left, window_right), 0, offset)
    layout = BlockLayout(None, 0, 0, None, mask is not None)  # one block (see encode)
    slots = (None,) if alibi_rank else ()  # encode reads only how many slots there are
    return encode(FlexProblem(None if score is None else Mod("score", score, slots), mask,
                              layout, scale, group, deterministic))


def compiled_mods(query, key, value, softmax_scale, window, softcap, score_mod, mask_mod,
                  alibi_slopes, deterministic):
    """flash_attn_func's mods while Dynamo traces: built-in mods on static lengths in one
    graph, anything else lowered eagerly at one graph break."""
    if score_mod is None and mask_mod is None and _static_offset(query, key) is not None:
        return _compiled_builtin(query, key, value, softmax_scale, window, softcap,
                                 alibi_slopes, deterministic)
    return run_op(query, key, value, *_lower(
        _mods_problem, query, key, value, softmax_scale, window, softcap, score_mod,
        mask_mod, alibi_slopes, deterministic))
