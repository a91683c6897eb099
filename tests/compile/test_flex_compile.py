"""The portable flex kernels, with mods (and the backward's d score_mod / d score) emitted
from their expression trees and passed as constexpr functions, build for sm_90a with no GPU.
The interpreter cannot check this part: constexpr function arguments, the tuple of captured
tensors and the emitted code's types under the compiler."""

from __future__ import annotations

import pytest
from sass_report import sass_report, within_budget

# Shared by the build scripts below (each runs in a worker interpreter): the signature of a
# flex kernel (tuple arguments "C", "G" typed as given, `scale` fp32) and its sm_90a compile.
_SIGNATURE = r"""
from kernel_signature import kernel_signature


def signature(fn, cons, tuples, pointers):
    return kernel_signature(fn, cons, pointers, ("scale",), tuples)


def compile_sm90(fn, sig, cons, tiles):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, sig, cons), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
"""

_BUILD = _SIGNATURE + r"""
import sys
import torch
import triton
from asymflash.backends.portable.flex import _TILES, flex_fwd_kernel
from asymflash.backends.portable.flex_bwd import (_DKDV_TILES, _DQ_GRAD_TILES, _DQ_TILES,
                                                 _no_grads, flex_bwd_dkdv_kernel,
                                                 flex_bwd_dq_kernel)
from asymflash.backends.portable.flex_emit import jit_function, jit_grad_function
from asymflash.core import flex_trace
from asymflash.core.flex_ir import derivative, shift_slots

name, d = sys.argv[1], int(sys.argv[2])
# dq_grad: the dQ kernel scattering the bias table's gradient (fp32 atomics)
fn = {"fwd": flex_fwd_kernel, "dq": flex_bwd_dq_kernel, "dq_grad": flex_bwd_dq_kernel,
      "dkdv": flex_bwd_dkdv_kernel}[name]
grad = name == "dq_grad"
table = torch.randn(4, 300)
doc = torch.zeros(300, dtype=torch.int64)
score = flex_trace.trace(
    lambda s, b, h, q, kv: 20 * torch.tanh(s / 20) + table[h, q - kv + 150], "score")
mask = flex_trace.trace(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), "mask")
c = {"fwd": _TILES, "dq": _DQ_TILES, "dq_grad": _DQ_GRAD_TILES, "dkdv": _DKDV_TILES}[name][d]
cons = dict(SCORE_MOD=jit_function(score.root), MASK_MOD=jit_function(shift_slots(mask.root, 1)),
            DMOD=jit_function(derivative(score.root)), HAS_SCORE=True, HAS_MASK=True, D=d,
            GRAD_MOD=jit_grad_function(score.root, (0,)) if grad else _no_grads,
            HAS_GRAD=grad,
            DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BQ=128, BK=128)
cons = {k: v for k, v in cons.items() if k in fn.arg_names}
pointers = {"LSE": "*fp32", "DELTA": "*fp32", "PNUM": "*i32", "PIDX": "*i32", "FNUM": "*i32",
            "FIDX": "*i32", "NUM": "*i32", "IDX": "*i32"}
# C: (table, its sizes, its strides, doc, sizes, strides, the closing 0); G: (the table's
# fp32 gradient, its strides, the closing 0)
tuples = {"C": ("*fp32", ("i32", "i32"), ("i32", "i32"), "*i64", ("i32",), ("i32",), "i32"),
          "G": ("*fp32", ("i32", "i32"), "i32") if grad else ("i32",)}
kernel = compile_sm90(fn, signature(fn, cons, tuples, pointers), cons, c)
"""


@pytest.mark.parametrize("d", [64, 128])
def test_flex_forward_builds_for_sm90_with_few_spills(d):
    """0 local-memory instructions at d=64, 2 at d=128 (the wrap of negative indices into
    the bias table costs a tile of integers; 0 without it)."""
    report = sass_report(_BUILD, "fwd", str(d))
    assert report["mma"] > 0, "no tensor-core instructions"
    budget = {64: 0, 128: 7}[d]
    within_budget(report, report["local"], budget)


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("d", [64, 128])
def test_flex_backward_builds_for_sm90(d, kernel):
    """The backward kernels with the derivative tree inlined. dK/dV still spills on every
    tile tried (flex_bwd.py's table): the bound records today's counts so a change shows."""
    report = sass_report(_BUILD, kernel, str(d))
    assert report["mma"] > 0, "no tensor-core instructions"
    budget = {("dq", 64): 0, ("dq", 128): 47, ("dkdv", 64): 95, ("dkdv", 128): 255}[kernel, d]
    within_budget(report, report["local"], budget)


@pytest.mark.parametrize("d", [64, 128])
def test_flex_dq_with_captured_gradient_scatter_builds_for_sm90(d):
    """The dQ kernel that also scatters the bias table's gradient (one fp32 atomic add per
    score element, at table[h, q - kv + 150]): it builds, its atomics are relaxed
    reductions into global memory (RED, not ATOM with its ordering), and the spill counts
    of its tiles (flex_bwd._DQ_GRAD_TILES: 18 at d=64, 75 at d=128) do not grow."""
    report = sass_report(_BUILD, "dq_grad", str(d))
    assert report["mma"] > 0, "no tensor-core instructions"
    assert report["red"] > 0, "no fp32 global reductions (RED.ADD.F32)"
    budget = {64: 23, 128: 95}[d]
    within_budget(report, report["local"], budget)


_BUILD_REDUCED = _SIGNATURE + r"""
import sys
import torch
import triton
from asymflash.backends.portable.flex import _keep_all
from asymflash.backends.portable.flex_bwd import _DQ_GRAD_TILES, flex_bwd_dq_kernel as fn
from asymflash.backends.portable.flex_emit import jit_function, jit_grad_function
from asymflash.core import flex_trace
from asymflash.core.flex_ir import derivative

d = int(sys.argv[1])
row, col = torch.randn(300), torch.randn(2, 300)
temp = torch.ones((), dtype=torch.bfloat16)  # 0-dim: empty size and stride tuples
score = flex_trace.trace(lambda s, b, h, q, kv: s * (temp + row[q]) - torch.exp(col[b, kv]),
                         "score")
c = _DQ_GRAD_TILES[d]
cons = dict(SCORE_MOD=jit_function(score.root), MASK_MOD=_keep_all,
            DMOD=jit_function(derivative(score.root)),
            GRAD_MOD=jit_grad_function(score.root, (0, 1, 2)), HAS_GRAD=True, HAS_SCORE=True,
            HAS_MASK=False, D=d, DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BQ=128, BK=128)
ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
ints = lambda t: ("i32",) * t.dim()
caps = [x for t in score.captured for x in (ptr[t.dtype], ints(t), ints(t))]
grads = [x for t in score.captured for x in ("*fp32", ints(t))]
pointers = {"LSE": "*fp32", "DELTA": "*fp32", "NUM": "*i32", "IDX": "*i32"}
tuples = {"C": (*caps, "i32"), "G": (*grads, "i32")}
kernel = compile_sm90(fn, signature(fn, cons, tuples, pointers), cons, c)
"""


def test_flex_dq_scatter_of_row_column_and_scalar_reads_builds_for_sm90():
    """Reads whose position varies along the rows only, the keys only, or not at all (a
    0-dim bf16 tensor, with empty size/stride tuples): the emitted scatter sums the tile
    over the other axes first, so it issues few reductions (24 RED instructions at d=64
    for the three tensors, 32x32 tiles) and barely spills (2 local instructions)."""
    report = sass_report(_BUILD_REDUCED, "64")
    assert report["mma"] > 0, "no tensor-core instructions"
    assert 0 < report["red"] < 64, f"{report['red']} fp32 global reductions"
    within_budget(report, report["local"], 7)


# The C tuple typed as Triton's launcher types it, from real captured tensors: an element
# equal to 1 becomes a constant there (the compile tests above type every element i32).
_BUILD_SPECIALISED = _SIGNATURE + r"""
import sys, torch, triton
from triton.backends.compiler import BaseBackend
from triton._C.libtriton import native_specialize_impl
from asymflash.backends.portable.flex import _TILES, _keep_all, flex_fwd_kernel as fn
from asymflash.backends.portable.flex_emit import captured_args, jit_function
from asymflash.core import flex_trace
table = torch.randn(128, 128) > 0  # strides (128, 1): a tuple element of 1 without the bias
mask = flex_trace.trace(lambda b, h, q, kv: table[q // 16, kv // 16], "mask")
d = 128
c = _TILES[d]
cons = dict(SCORE_MOD=_keep_all, MASK_MOD=jit_function(mask.root), HAS_SCORE=False,
            HAS_MASK=True, D=d, DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BQ=128, BK=128)
cons = {k: v for k, v in cons.items() if k in fn.arg_names}
pointers = {"LSE": "*fp32", "PNUM": "*i32", "PIDX": "*i32", "FNUM": "*i32", "FIDX": "*i32"}
ci = fn.arg_names.index("C")
# the C tuple's types and constants as Triton's launcher specialises the real values
# (ints equal to 1 become constants, whatever do_not_specialize says)
types, keys = native_specialize_impl(BaseBackend, captured_args(mask.captured), False, True, True)
def walk(t, k, path):
    if isinstance(t, tuple):
        for i, (a, b) in enumerate(zip(t, k)):
            walk(a, b, path + (i,))
    elif t == "constexpr":
        cons[path] = k
walk(types, keys, (ci,))
kernel = compile_sm90(fn, signature(fn, cons, {"C": types}, pointers), cons, c)
"""


def test_flex_forward_builds_as_the_launcher_specialises_its_tuple():
    """A mask reading a table of strides (128, 1), the C tuple specialised from the real
    values: it builds (without flex_emit.TUPLE_BIAS the stride of 1 became a constant that
    reached the emitted mod as None: the first GPU run failed every such call)."""
    report = sass_report(_BUILD_SPECIALISED)
    assert report["mma"] > 0, "no tensor-core instructions"
