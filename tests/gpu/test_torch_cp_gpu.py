"""torch's own context parallelism runs on asymflash once SDPA is registered (marker `gpu`).

`torch.distributed.tensor.experimental.context_parallel` replaces F.scaled_dot_product_attention
inside its context by a ring that calls the aten flash op (and its backward) per block with
that block's lse; `torch_sdpa.register()` puts asymflash behind those ops. On one GPU the
ring has one rank, which still takes that route: the test counts asymflash's calls and checks
out and gradients against the fp32 reference. The multi-GPU timing is scripts/cp-bench.py's
`torch-cp-asymflash` row."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_fa_close, reference_pair

from asymflash.integrations import torch_sdpa

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or not dist.is_available():
    pytest.skip("needs CUDA and torch.distributed", allow_module_level=True)

cp = pytest.importorskip("torch.distributed.tensor.experimental")
DEV = "cuda"


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    if owned:
        dist.destroy_process_group()


def _unshard(mesh, tensors):
    """The full-sequence view of context-parallel shards (dim 2), where torch offers it."""
    try:
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    except ImportError:
        return tensors  # one rank: its shard is the sequence (load balancing is the identity)
    return context_parallel_unshard(mesh, tensors, [2] * len(tensors))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_context_parallel_runs_on_asymflash(mesh, registered, causal, d, monkeypatch):
    if not causal:
        # torch balances the load of causal masks only (it refuses is_causal=False with its
        # load balancing on); on one rank either way the shard is the whole sequence
        options = getattr(pytest.importorskip(
            "torch.distributed.tensor.experimental._attention"), "_cp_options", None)
        if options is None or not hasattr(options, "enable_load_balance"):
            pytest.skip("this torch has no switch for context parallel's load balancing")
        monkeypatch.setattr(options, "enable_load_balance", False)
    b, h, n = 2, 8, 1536
    g = torch.Generator(device=DEV).manual_seed(d + causal)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g, device=DEV, dtype=torch.bfloat16)
                     for _ in range(4))
    # the reference takes asymflash's (batch, seqlen, heads, dim) layout
    ref32, ref_low = reference_pair(*(t.transpose(1, 2) for t in (q, k, v)),
                                    dout.transpose(1, 2), causal=causal)
    bufs = [t.clone() for t in (q, k, v, dout)]
    with cp.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4):
        qs, ks, vs, douts = bufs
        leaves = [t.detach().requires_grad_() for t in (qs, ks, vs)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        grads = torch.autograd.grad(out, leaves, douts)
        got = _unshard(mesh, [out.detach(), *grads])
    assert torch_sdpa.stats["asymflash_forward"] >= 1
    assert torch_sdpa.stats["asymflash_backward"] >= 1
    assert torch_sdpa.stats["torch_forward"] == torch_sdpa.stats["torch_backward"] == 0
    wanted = (ref32[0], *ref32[2:]), (ref_low[0], *ref_low[2:])
    for name, x, r32, rlow in zip(("out", "dq", "dk", "dv"), got, *wanted):
        assert_fa_close(name, x.transpose(1, 2), r32, rlow, 1e-3 if name == "out" else 2e-3)
