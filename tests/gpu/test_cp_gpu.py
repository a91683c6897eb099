"""Context parallelism's building blocks on one GPU at realistic sizes (marker `gpu`):
partials over key blocks, merged with flash_attn_combine, and the backward of each block
against the merged out and lse (attention_backward), on every CUDA backend, against the
reference over all keys with the FlashAttention tolerance rule. The multi-GPU ring itself
is scripts/cp-bench.py's run (torchrun, NCCL)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, forced, reference_pair

from asymflash import attention_backward, flash_attn_combine, flash_attn_func
from asymflash.runtime.dispatch import backend_names

pytestmark = pytest.mark.gpu
BACKENDS = backend_names("cuda") if torch.cuda.is_available() else []

# (batch, block, blocks, nheads_q, nheads_kv, d, causal, dtype): the queries are the last
# block of blocks * block keys, as on the last rank of a contiguous ring
CASES = [
    (1, 2048, 4, 16, 4, 128, True, torch.bfloat16),
    (2, 1024, 3, 8, 8, 64, False, torch.float16),
    (1, 1536, 3, 8, 2, 256, True, torch.bfloat16),
]


def check_blocks(backend, case, device):
    batch, block, blocks, hq, hkv, d, causal, dtype = case
    n = block * blocks
    q = torch.randn(batch, block, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, n, hkv, d, device=device, dtype=dtype)
    v = torch.randn(batch, n, hkv, d, device=device, dtype=dtype)
    dout = torch.randn(batch, block, hq, d, device=device, dtype=dtype)
    spans = [(i * block, (i + 1) * block) for i in range(blocks)]
    with forced(backend):
        parts = [flash_attn_func(q, k[:, a:z], v[:, a:z], causal=causal and a == n - block,
                                 return_lse=True) for a, z in spans]
        out, lse = flash_attn_combine(torch.stack([p[0] for p in parts]),
                                      torch.stack([p[1] for p in parts]).transpose(-1, -2))
        lse = lse.transpose(1, 2)  # FA3's (batch, seqlen, nheads) -> asymflash's layout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
        dks, dvs = [], []
        for a, z in spans:
            g = attention_backward(dout, q, k[:, a:z], v[:, a:z], out, lse,
                                   causal=causal and a == n - block)
            dq += g[0]
            dks.append(g[1])
            dvs.append(g[2])
    ref32, ref_low = reference_pair(q, k, v, dout, causal=causal)
    assert out.dtype == dtype
    assert_fa_close("out", out, ref32[0], ref_low[0], atol=1e-3)
    assert_lse_close(lse, ref32[1])
    grads = (dq.to(dtype), torch.cat(dks, 1), torch.cat(dvs, 1))
    for name, g, r32, rlow in zip(("dq", "dk", "dv"), grads, ref32[2:], ref_low[2:]):
        assert_fa_close(name, g, r32, rlow, atol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:7]))
def test_combine_and_block_backward(backend, case):
    check_blocks(backend, case, "cuda")
