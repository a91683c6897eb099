"""The sm90 flex kernels' walks over a BlockMask's lists, run on integers (no GPU), against
the lists as `portable.flex.block_lists` builds them. The forward (`fwd/flex_kernel.
_walk_block`): the loader and both consumer warpgroups call it with the same step numbers,
so it alone decides which key blocks a tile sees: every partial block, then every full
one, each as SUB kernel blocks in order. The backward (`bwd/flex_parts.flex_step`,
`flex_steps`): a key block's CTA visits, for each q head of its GQA group in order, the
query blocks listed partial (masked) then full, SUB steps of BLOCK_M rows each."""

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
    load = staticmethod(lambda p, mask=True, other=0: p.read() if mask else other)
    where = staticmethod(lambda c, a, b: a if c else b)


def walk_block(walk, i):
    return python_body(flex_kernel._walk_block, gl=_GlLoads)(walk, i)


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


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_backward_walk_visits_each_heads_listed_query_blocks(seed, group):
    from asymflash.backends.sm90.bwd import flex_parts

    g = torch.Generator().manual_seed(seed)
    batch, heads, n_q, n_k, sub, block_m = 2, 2 * group, 6, 5, 2, 64
    kinds = torch.randint(0, 3, (batch, heads, n_q, n_k), generator=g).to(torch.uint8)
    kinds[0, 0, :, 2] = EMPTY  # a key block no query block sees (for head 0)
    layout = BlockLayout(kinds, sub * block_m, 128, None)
    num, idx = block_lists(layout, "cpu", n_q * sub * block_m, n_k * 128, sub * block_m, 128,
                           batch, heads, True)
    fl = types.SimpleNamespace(
        num=Pointer(num.flatten().tolist()), idx=Pointer(idx.flatten().tolist()),
        num_sb=num.stride(0), num_sh=num.stride(1), num_sk=num.stride(2), num_sn=num.stride(3),
        idx_sb=idx.stride(0), idx_sh=idx.stride(1), idx_sk=idx.stride(2), idx_sn=idx.stride(3),
        BK=128, SUB=sub)
    steps_of = python_body(flex_parts.flex_steps, gl=_GlLoads)
    step = python_body(flex_parts.flex_step, gl=_GlLoads)
    for b in range(batch):
        for hk in range(heads // group):
            for kb in range(n_k):
                h_first = hk * group
                want = [(h, qb * sub * block_m + s * block_m, kind == PARTIAL)
                        for h in range(h_first, h_first + group)
                        for kind in (PARTIAL, FULL)
                        for qb in torch.nonzero(kinds[b, h, :, kb] == kind).flatten().tolist()
                        for s in range(sub)]
                n = steps_of(fl, b, kb * 128, h_first, group)
                got = [tuple(step(fl, b, kb * 128, h_first, group, it, block_m))
                       for it in range(n)]
                assert n == len(want) and got == want, (b, hk, kb, got, want)
                # the prefetch past the last step reads nothing outside the lists
                step(fl, b, kb * 128, h_first, group, n, block_m)
