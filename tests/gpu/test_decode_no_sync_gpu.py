"""Decode on CUDA never waits for the GPU, and a wrong index still fails (marker `gpu`).

torch.cuda.set_sync_debug_mode("error") makes every synchronising torch call raise: the
default flash_attn_with_kvcache call (cache_seqlens a tensor, values checked) must pass
under it, first call and planned repeats, contiguous and paged. A wrong value fails a
device-side assert, which loses the CUDA context: that half runs in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from asymflash import flash_attn_with_kvcache
from asymflash.reference import attention_ref

pytestmark = pytest.mark.gpu


def _decode_inputs(paged):
    torch.manual_seed(0)
    b, hq, hkv, d, cap = 8, 32, 8, 128, 4096
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, cap, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    lens = torch.randint(1, cap, (b,), dtype=torch.int32, device="cuda")
    if not paged:
        return q, k, v, lens, None, k, v
    page = 64
    perm = torch.randperm(b * cap // page, device="cuda")
    table = perm.view(b, cap // page).to(torch.int32)
    kp = torch.empty(b * cap // page, page, hkv, d, dtype=k.dtype, device="cuda")
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(-1, page, hkv, d)
    vp[perm] = v.reshape(-1, page, hkv, d)
    return q, kp, vp, lens, table, k, v


@pytest.mark.parametrize("paged", [False, True])
def test_default_decode_does_not_synchronise(paged):
    q, kc, vc, lens, table, k, v = _decode_inputs(paged)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table)  # compile
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table,
                                         causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    for b, n in enumerate(lens.tolist()):
        want, _ = attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        assert (out[b:b + 1].float() - want).abs().max() < 2e-2


def _kernels_per_call(call, calls=3):
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower()]
    return len(kernels) / calls, sorted(set(kernels))


def test_paged_decode_launches_no_more_than_contiguous():
    """A launch is host time, and a decode step is host-bound at small batch: the page
    table's checks run as one kernel (backends/portable/cache_checks.py), so a planned paged
    call launches no more kernels than the contiguous one (the H100 models suite,
    2026-12-05: paged steps issued 170-198 us of Python against 70-79, with ~13 check ops)."""
    counts = {}
    for paged in (False, True):
        q, kc, vc, lens, table, _, _ = _decode_inputs(paged)
        counts[paged] = _kernels_per_call(lambda: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, page_table=table, causal=True))
    assert counts[True][0] <= counts[False][0], counts


WRONG_VALUES = {
    "length past the cache": "lens = torch.tensor([5, 129], dtype=torch.int32, device='cuda')",
    "page index past the pool": (  # (a page the sequence reads: past its length, unread)
        "lens = torch.tensor([5, 100], dtype=torch.int32, device='cuda'); "
        "table = torch.tensor([[0, 1], [2, 999]], dtype=torch.int32, device='cuda'); "
        "kc = kc.view(4, 64, 4, 64)"),
    "negative page index": (
        "lens = torch.tensor([5, 60], dtype=torch.int32, device='cuda'); "
        "table = torch.tensor([[0, 1], [-3, 2]], dtype=torch.int32, device='cuda'); "
        "kc = kc.view(4, 64, 4, 64)"),
    "left padding past the length": (
        "lens = torch.tensor([5, 60], dtype=torch.int32, device='cuda'); "
        "pad = torch.tensor([0, 61], dtype=torch.int32, device='cuda')"),
}


@pytest.mark.parametrize("wrong", list(WRONG_VALUES))
def test_wrong_index_value_fails_a_device_assert(wrong):
    code = textwrap.dedent("""
        import torch
        from asymflash import flash_attn_with_kvcache
        q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16, device="cuda")
        kc = torch.randn(2, 128, 4, 64, dtype=torch.bfloat16, device="cuda")
        table = pad = None
        {wrong}
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table,
                                cache_leftpad=pad)
        torch.cuda.synchronize()
        print("NO ERROR")
    """).format(wrong=WRONG_VALUES[wrong])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "NO ERROR" not in done.stdout, done.stdout
    assert "assert" in done.stderr.lower(), done.stderr[-2000:]
