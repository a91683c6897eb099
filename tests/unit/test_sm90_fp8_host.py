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


def _emulated_kernel(q8, k8, v8, descales, causal):
    """The fp8 kernel's numerics in torch: fp32 scores of the e4m3 values with the descales
    in the scale, 128-key blocks with a running max, P = 2^8 exp2(s - m) rounded to fp16 and
    then e4m3 for P·V, the row sum of the unrounded P, v_descale on O; lse from the max and
    the sum. (The fp8 wgmma's reduced accumulator precision is not modelled.)"""
    qd, kd, vd = descales
    batch, sq, hq, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    g = hq // hkv
    out = torch.empty(batch, sq, hq, d)
    lse = torch.empty(batch, hq, sq)
    log2e = 1.4426950408889634
    for b in range(batch):
        for h in range(hq):
            kh = h // g
            scale = d ** -0.5 * log2e * qd[b, kh].item() * kd[b, kh].item()
            s_all = (q8[b, :, h].float() @ k8[b, :, kh].float().T) * scale
            if causal:
                rows = torch.arange(sq)[:, None] + sk - sq
                s_all = s_all.masked_fill(torch.arange(sk)[None] > rows, float("-inf"))
            m = torch.full((sq,), float("-inf"))
            acc = torch.zeros(sq, d)
            l_sum = torch.zeros(sq)
            for lo in range(0, sk, 128):
                s = s_all[:, lo:lo + 128]
                m_new = torch.maximum(m, s.amax(1))
                m_sub = torch.where(m_new == float("-inf"), 0.0, m_new)
                alpha = torch.exp2(m - m_sub)
                p = torch.exp2(s - (m_sub - 8)[:, None])
                p8 = p.half().to(torch.float8_e4m3fn).float()
                acc = acc * alpha[:, None] + p8 @ v8[b, lo:lo + 128, kh].float()
                l_sum = l_sum * alpha + p.sum(1)
                m = m_new
            out[b, :, h] = acc / l_sum[:, None] * vd[b, kh]
            lse[b, h] = (m + torch.log2(l_sum) - 8) / log2e
    return out.to(torch.bfloat16), lse


@pytest.mark.parametrize("causal", [False, True])
def test_emulated_numerics_within_the_gpu_tests_bound(causal):
    """The GPU tests' e4m3-P bound (fp8_cases.p_e4m3_bound) holds for the kernel's
    arithmetic emulated on the CPU: the bound is not too tight for what the kernel does."""
    from fp8_cases import assert_p_e4m3_close, expected, fp8_inputs, p_e4m3_bound

    torch.manual_seed(0)
    _, (q8, k8, v8), ds = fp8_inputs(2, 200, 300, 4, 2, 128, 128, outliers=True)
    q8, k8, v8, ds = q8.cpu(), k8.cpu(), v8.cpu(), [s.cpu() for s in ds]
    out, lse = _emulated_kernel(q8, k8, v8, ds, causal)
    assert_p_e4m3_close(out, lse, expected(q8, k8, v8, ds, causal=causal),
                        p_e4m3_bound(q8, k8, v8, ds, causal=causal))
