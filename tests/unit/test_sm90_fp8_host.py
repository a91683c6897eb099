"""The sm90 fp8 forward's host side on the CPU: the transposed V and its key order agree
with the kernel's e4m3 P operand, and the dense fp8 call is routed to the kernel only
where it runs (the kernel itself: tests/compile, tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from asymflash.api import fp8
from asymflash.backends.sm90.fwd import host
from asymflash.core.fp8 import quantize


def _kernel_key_order(p: torch.Tensor) -> torch.Tensor:
    """What `epilogue.p_operand_fp8` does to P's columns (the same reshape and permute)."""
    rows, n = p.shape
    return p.reshape(rows, n // 32, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(rows, n)


def test_key_order_is_the_kernels():
    order = host.fp8_key_order(128)
    assert sorted(order.tolist()) == list(range(128))
    cols = torch.arange(128.0).expand(4, 128)
    assert torch.equal(_kernel_key_order(cols)[0].long(), order)
    # A column 16h + 4t + 2a + b holds S column 8(2h + a) + 2t + b
    for h in range(2):
        for t in range(4):
            for a in range(2):
                for b in range(2):
                    assert order[16 * h + 4 * t + 2 * a + b] == 8 * (2 * h + a) + 2 * t + b


@pytest.mark.parametrize("seqlen", [1, 32, 100, 256])
def test_transposed_v_gives_p_v(seqlen):
    """P (quantised and reordered as the kernel does) times the Vᵀ tiles the kernel loads
    equals P·V, for every sequence, kv head and key block."""
    torch.manual_seed(0)
    batch, hkv, dv, block_n = 3, 2, 64, 64
    v8, _ = quantize(torch.randn(batch, seqlen, hkv, dv), hkv)
    vt, cols = host.transpose_v_fp8(v8.reshape(batch * seqlen, hkv, dv), batch)
    assert cols % 32 == 0 and cols >= seqlen and vt.shape == (hkv * dv, batch * cols)
    assert vt.dtype == torch.float8_e4m3fn and vt.is_contiguous()
    n_blocks = -(-seqlen // block_n)
    for b in range(batch):
        for h in range(hkv):
            p = torch.rand(8, n_blocks * block_n, dtype=torch.float64)
            p[:, seqlen:] = 0  # masked keys
            want = p[:, :seqlen] @ v8[b, :, h].double()
            got = torch.zeros(8, dv, dtype=torch.float64)
            for n in range(n_blocks):  # the kernel's blocks: Vᵀ columns b·cols + n·BLOCK_N
                lo = b * cols + n * block_n
                # (TMA zero-fills past the tensor's end)
                tile = torch.zeros(dv, block_n, dtype=torch.float64)
                part = vt[h * dv:(h + 1) * dv, lo:lo + block_n].double()
                tile[:, :part.shape[1]] = part
                blk = _kernel_key_order(p[:, n * block_n:(n + 1) * block_n])
                got += blk @ tile.T  # (keys past the sequence: P = 0)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dense_fp8_on_cpu_keeps_the_host_cast():
    q8, _ = quantize(torch.randn(1, 16, 2, 128), 2)
    assert fp8.kernel_reason(q8, q8, q8) is not None
    assert host.fp8_unsupported(q8[0], q8[0], q8[0], None, None) is not None


def test_fp8_plan_is_built_for_e4m3():
    plan = host.launch_plan(128, 128, 4096, 4096, True, False, -1, 0, False, False, 2, 16,
                            4, 132, None, host.NO_TRICKS, True)
    assert plan.constexprs["FP8"] is True and plan.constexprs["RESCALE_THRESHOLD"] == 0.0
    plain = host.launch_plan(128, 128, 4096, 4096, True, False, -1, 0, False, False, 2, 16,
                             4, 132, None, host.NO_TRICKS)
    assert plain.constexprs["FP8"] is False
