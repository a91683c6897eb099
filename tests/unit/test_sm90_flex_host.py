"""The sm90 flex forward's host side on the CPU: how it reads (batch, heads, seqlen, dim)
tensors as TMA rows, which mods take 64-key blocks, what it refuses, and that the
dispatcher pairs it with the portable backward."""

from __future__ import annotations

import pytest
import torch

from asymflash.backends.sm90 import flex
from asymflash.core import flex_trace
from asymflash.core.flex import FULL, BlockLayout, FlexProblem

TABLE = torch.randn(4, 300)
KEEP = torch.rand(8, 8) < 0.5


@pytest.mark.parametrize("form", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", [(2, 3, 17, 64), (1, 1, 113, 128), (3, 2, 1, 64)])
def test_row_form_addresses_every_element(form, shape):
    """Row b·row_b + h·row_h + s, column block h·head_c of the rows view holds t[b, h, s]."""
    batch, heads, seqlen, dim = shape
    if form == "bhsd":
        t = torch.randn(batch, heads, seqlen, dim)
    else:
        t = torch.randn(batch, seqlen, heads, dim).transpose(1, 2)
    rows, row_b, row_h, head_c = flex.row_form(t)
    assert rows.data_ptr() == t.data_ptr(), "read in place, not copied"
    flat = rows.reshape(rows.shape[0], -1)
    for b in range(batch):
        for h in range(heads):
            r = b * row_b + h * row_h + torch.arange(seqlen)
            cols = h * head_c * dim + torch.arange(dim)
            assert torch.equal(flat[r][:, cols], t[b, h])


def test_row_form_copies_other_layouts():
    t = torch.randn(2, 17, 3, 64).permute(0, 2, 3, 1).contiguous().permute(0, 1, 3, 2)
    assert flex.row_form(t) is None  # (batch, heads, dim, seqlen) storage
    rows, *_ = flex._rows(t)
    assert rows.data_ptr() != t.data_ptr()
    assert torch.equal(rows.reshape(2, 3, 17, 64), t)


def _mod(fn, kind):
    return flex_trace.trace(fn, kind) if fn is not None else None


@pytest.mark.parametrize("score,mask,expected", [
    (None, None, False),
    (lambda s, b, h, q, kv: s - 0.1 * (q - kv).abs(), None, False),  # no captured tensor
    (lambda s, b, h, q, kv: s + TABLE[h, q - kv + 150], None, True),  # one index, both axes
    (None, lambda b, h, q, kv: KEEP[q // 128, kv // 128], True),  # two indices, one each
    (lambda s, b, h, q, kv: s + TABLE[h, q % 300], None, False),  # rows only
    (lambda s, b, h, q, kv: s + TABLE[h, (s * 10).long().clamp(0, 299)], None, True),
])
def test_gathers_2d(score, mask, expected):
    assert flex.gathers_2d(_mod(score, "score"), _mod(mask, "mask")) is expected


def _problem(score=None, mask=None, block=(128, 128), kinds_shape=(1, 1, 4, 4)):
    kinds = torch.full(kinds_shape, FULL, dtype=torch.uint8)
    layout = BlockLayout(kinds, *block, None)
    return FlexProblem(_mod(score, "score"), _mod(mask, "mask"), layout, 0.1, 1)


def test_problem_reason():
    bias = lambda s, b, h, q, kv: s + TABLE[h, q - kv + 150]  # noqa: E731
    assert flex.problem_reason(_problem(), 128) is None
    assert flex.problem_reason(_problem(bias), 128) is None  # 64-key blocks
    assert "head dim 256" in flex.problem_reason(_problem(bias), 256)
    assert "block size (64, 128)" in flex.problem_reason(_problem(block=(64, 128)), 128)
    assert flex.problem_reason(_problem(block=(128, 256)), 128) is None  # 2 blocks per entry
    assert "block size (128, 96)" in flex.problem_reason(_problem(block=(128, 96)), 64)
    # one block for the whole call (no BlockMask): any size, re-cut to the kernel's tiles
    assert flex.problem_reason(_problem(block=(1000, 777), kinds_shape=(1, 1, 1, 1)),
                               128) is None


def test_gathering_mods_take_64_key_blocks():
    assert flex.flex_config(128).block_n == 128
    assert flex.flex_config(128, True).block_n == 64
    assert flex.flex_config(64, True).block_n == 64
    assert flex.flex_config(256).block_n == 64


def test_refused_without_hopper():
    """On a machine without an sm_90 GPU the sm90 flex kernels name why (the dispatcher then
    takes the portable ones)."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    for why in (flex.unsupported_flex(q, q, q, _problem(), False),
                flex.unsupported_flex_backward(q, q, q, _problem())):
        assert why is not None and ("sm90" in why or "Hopper" in why or "gluon" in why.lower())


def test_backward_problem_reason():
    bias = torch.randn(4, 300, requires_grad=True)
    learned = lambda s, b, h, q, kv: s + bias[h, q % 300]  # noqa: E731
    assert flex.backward_problem_reason(_problem(), 128) is None
    assert "captured" in flex.backward_problem_reason(_problem(learned), 128)
    with torch.no_grad():
        frozen = _problem(lambda s, b, h, q, kv: s + TABLE[h, q % 300])
    assert flex.backward_problem_reason(frozen, 128) is None
    det = FlexProblem(None, None, _problem().layout, 0.1, 1, deterministic=True)
    assert "deterministic" in flex.backward_problem_reason(det, 128)
    assert flex.backward_problem_reason(_problem(block=(64, 128)), 64) is None
    assert "block size (96, 128)" in flex.backward_problem_reason(_problem(block=(96, 128)),
                                                                  128)
    assert "block size (128, 64)" in flex.backward_problem_reason(_problem(block=(128, 64)),
                                                                  128)


def test_flex_backward_keeps_list_strides_runtime():
    """Triton makes an int argument of value 1 a constexpr unless told not to; the flex
    backward puts the BlockMask lists' strides into FlexBwd's tensor fields, which refuse
    one (the first GPU run: every call with a stride of 1 failed to compile)."""
    entry = pytest.importorskip("asymflash.backends.sm90.bwd.entry")
    if not hasattr(entry, "attn_bwd_flex_kernel"):
        pytest.skip("triton's Gluon (the kernels' source) is not importable here")
    strides = [f"{t}_s{a}" for t in ("num", "idx") for a in "bhkn"]
    assert set(strides) <= set(entry.attn_bwd_flex_kernel.do_not_specialize)

