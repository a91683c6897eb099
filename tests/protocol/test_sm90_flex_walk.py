"""The sm90 flex forward's key-block walk (`fwd/flex_kernel._walk_block`), run on integers
(no GPU): the loader and both consumer warpgroups call it with the same step numbers, so
it alone decides which key blocks a tile sees and in which order. Against the BlockMask's
lists as `portable.flex.block_lists` builds them: every partial block, then every full
one, each as SUB kernel blocks in order, nothing else."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_code import _Gl, python_body

from asymflash.backends.portable.flex import block_lists
from asymflash.backends.sm90 import common
from asymflash.core.flex import EMPTY, FULL, PARTIAL, BlockLayout

if common.GLUON_ERROR is not None:
    pytest.skip("triton's Gluon (the kernels' source) is not importable here",
                allow_module_level=True)

from asymflash.backends.sm90.fwd import flex_kernel  # noqa: E402


class Pointer:
    """A device pointer into a flat int list: `+` moves it, `gl.load` reads it."""

    def __init__(self, data, at=0):
        self.data, self.at = data, at

    def __add__(self, n):
        return Pointer(self.data, self.at + int(n))

    def read(self):
        assert 0 <= self.at < len(self.data), f"read at {self.at} of {len(self.data)}"
        return self.data[self.at]


class _GlLoads(_Gl):
    load = staticmethod(lambda p: p.read())


def walk_block(walk, i):
    fn = python_body(flex_kernel._walk_block)
    env = dict(fn.__globals__, gl=_GlLoads)
    return types.FunctionType(fn.__code__, env)(walk, i)


@pytest.mark.parametrize("sub", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_walk_visits_partial_then_full_blocks_of_each_query_block(seed, sub):
    g = torch.Generator().manual_seed(seed)
    n_q, n_k = 5, 7
    kinds = torch.randint(0, 3, (1, 2, n_q, n_k), generator=g).to(torch.uint8)
    kinds[0, 0, 1] = EMPTY  # a query block without key blocks
    layout = BlockLayout(kinds, 128, 128 * sub, None)
    num, idx = block_lists(layout, "cpu", n_q * 128, n_k * 128 * sub, 128, 128 * sub, 1, 2,
                           False)
    flat = idx.flatten().tolist()
    for h in range(2):
        for qb in range(n_q):
            n_part, n_full = int(num[0, h, 0, qb]), int(num[0, h, 1, qb])
            lists = Pointer(flat, h * idx.stride(1) + qb * idx.stride(3))
            walk = types.SimpleNamespace(part=lists, n_part=n_part,
                                         full=lists + idx.stride(2), n_full=n_full, SUB=sub)
            steps = [walk_block(walk, i) for i in range((n_part + n_full) * sub)]
            row = kinds[0, h, qb]
            want = [kb * sub + s for kind in (PARTIAL, FULL)
                    for kb in torch.nonzero(row == kind).flatten().tolist()
                    for s in range(sub)]
            assert steps == want, (h, qb, steps, want)
