"""What each spawned rank runs for test_ring.py: the full problem made on every rank from one
seed, the ring over this rank's shard, and its shard of the single-process results."""

import datetime
import os

import torch
import torch.distributed as dist

from asymflash import attention_ref, flash_attn_func, flash_attn_varlen_func
from asymflash.distributed import (
    ring_attention,
    ring_attention_varlen,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)

TIMEOUT = datetime.timedelta(seconds=60)


def init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # W ranks share the CI machine's two cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)


def shard(x, world, rank, layout):
    return zigzag_shard(x, world, rank) if layout == "zigzag" else x.chunk(world, 1)[rank]


def problem(world, layout, hq, hkv, seed, batch=2, d=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    chunk = 7 if layout == "zigzag" else 9  # odd chunks: 2W * 7 or W * 9 tokens
    n = chunk * (2 * world if layout == "zigzag" else world)
    q = torch.randn(batch, n, hq, d, generator=g)
    k = torch.randn(batch, n, hkv, d, generator=g)
    v = torch.randn(batch, n, hkv, dv, generator=g)
    dout = torch.randn(batch, n, hq, dv, generator=g)
    return q, k, v, dout


def single_process(q, k, v, dout, dlse, causal, softcap, sink=None, window=(-1, -1)):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_())
    out, lse = flash_attn_func(*leaves[:3], causal=causal, softcap=softcap, return_lse=True,
                               learnable_sink=None if sink is None else leaves[3],
                               window_size=window)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    ref_out, _ = attention_ref(q, k, v, causal=causal, softcap=softcap, learnable_sink=sink,
                               window_size=window)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)  # the baseline itself
    return out.detach(), lse, grads


def ring(q, k, v, dout, causal, softcap, layout, deterministic=False, dlse=None, sink=None,
         window=(-1, -1)):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_())
    out, lse = ring_attention(*leaves[:3], causal=causal, softcap=softcap, layout=layout,
                              deterministic=deterministic, return_lse=True,
                              learnable_sink=None if sink is None else leaves[3],
                              window_size=window)
    if dlse is None:
        out.backward(dout)
    else:  # a loss through lse too (e.g. a z-loss)
        torch.autograd.backward((out, lse), (dout, dlse))
    return out.detach(), lse, [t.grad for t in leaves]


def check_case(rank, world, causal, layout, hq, hkv, softcap=0.0, seed=0, sink=False,
               window=(-1, -1)):
    q, k, v, dout = problem(world, layout, hq, hkv, seed)
    g = torch.Generator().manual_seed(seed)
    dlse = torch.randn(q.shape[0], hq, q.shape[1], generator=g)
    sink = torch.randn(hq, generator=g) if sink else None
    full_out, full_lse, full_grads = single_process(q, k, v, dout, dlse, causal, softcap, sink,
                                                    window)
    local = [shard(t, world, rank, layout) for t in (q, k, v, dout)]
    dlse_local = shard(dlse.transpose(1, 2), world, rank, layout).transpose(1, 2)
    out, lse, grads = ring(*local, causal, softcap, layout, dlse=dlse_local, sink=sink,
                           window=window)
    what = f"rank {rank}/{world} causal={causal} window={window} {layout} heads {hq}/{hkv}"
    torch.testing.assert_close(out, shard(full_out, world, rank, layout), atol=1e-5,
                               rtol=1e-5, msg=lambda m: f"{what}: out: {m}")
    want_lse = shard(full_lse.transpose(1, 2), world, rank, layout).transpose(1, 2)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{what}: lse: {m}")
    for name, g, full in zip("qkv", grads, full_grads):
        torch.testing.assert_close(g, shard(full, world, rank, layout), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{what}: d{n}: {m}")
    if sink is not None:  # each rank's share, summed over the group
        dsink = grads[3].clone()
        dist.all_reduce(dsink)
        torch.testing.assert_close(dsink, full_grads[3], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{what}: dsink: {m}")
    if layout == "zigzag":  # the helpers round-trip through a collective
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.contiguous())
        torch.testing.assert_close(zigzag_unshard(gathered), full_out, atol=1e-5, rtol=1e-5)


def check_deterministic(rank, world, window=(-1, -1)):
    q, k, v, dout = problem(world, "zigzag", 4, 2, seed=5)
    local = [zigzag_shard(t, world, rank) for t in (q, k, v, dout)]
    first = ring(*local, True, 0.0, "zigzag", deterministic=True, window=window)
    again = ring(*local, True, 0.0, "zigzag", deterministic=True, window=window)
    assert torch.equal(first[0], again[0])
    for a, b in zip(first[2], again[2]):
        assert torch.equal(a, b), f"rank {rank}: deterministic gradients differ"


def shard_varlen(x, cu, world, rank, layout, dim=0):
    if layout == "zigzag":
        return zigzag_shard_varlen(x, cu, world, rank, dim)[0]
    cu = cu.tolist()
    return torch.cat([x.narrow(dim, a, z - a).chunk(world, dim)[rank]
                      for a, z in zip(cu, cu[1:])], dim)


def check_varlen(rank, world, causal, layout, hq, hkv, seed, sink=False, window=(-1, -1),
                 chunks=(3, 1, 5)):
    g = torch.Generator().manual_seed(seed)
    unit = 2 * world if layout == "zigzag" else world
    lens = [unit * c for c in chunks]  # local shards of that many chunk pairs / slices
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = cu[-1].item()
    q = torch.randn(total, hq, 16, generator=g)
    k, v = torch.randn(total, hkv, 16, generator=g), torch.randn(total, hkv, 8, generator=g)
    dout = torch.randn(total, hq, 8, generator=g)
    sink = torch.randn(hq, generator=g) if sink else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_())
    full_out, full_lse = flash_attn_varlen_func(
        *leaves[:3], cu, cu, max(lens), max(lens), causal=causal, return_lse=True,
        learnable_sink=None if sink is None else leaves[3], window_size=window)
    full_grads = torch.autograd.grad(full_out, leaves, dout)
    for b in range(len(lens)):  # the single-process baseline, sequence by sequence
        a, z = cu[b].item(), cu[b + 1].item()
        ref, _ = attention_ref(q[None, a:z], k[None, a:z], v[None, a:z], causal=causal,
                               learnable_sink=sink, window_size=window)
        torch.testing.assert_close(full_out[a:z], ref[0], atol=1e-5, rtol=1e-5)
    local = [shard_varlen(t, cu, world, rank, layout) for t in (q, k, v, dout)]
    local_cu = torch.div(cu, world, rounding_mode="floor")
    leaves = [t.clone().requires_grad_() for t in local[:3]]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_())
    out, lse = ring_attention_varlen(*leaves[:3], local_cu, max(lens) // world, causal=causal,
                                     layout=layout, return_lse=True, window_size=window,
                                     learnable_sink=None if sink is None else leaves[3])
    out.backward(local[3])
    if sink is not None:
        dsink = leaves[3].grad.clone()
        dist.all_reduce(dsink)
        torch.testing.assert_close(dsink, full_grads[3], atol=1e-4, rtol=1e-4)
    what = f"varlen rank {rank}/{world} causal={causal} window={window} {layout}"
    torch.testing.assert_close(out, shard_varlen(full_out.detach(), cu, world, rank, layout),
                               atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: out: {m}")
    torch.testing.assert_close(lse, shard_varlen(full_lse, cu, world, rank, layout, 1),
                               atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: lse: {m}")
    for name, t, full in zip("qkv", leaves, full_grads):
        torch.testing.assert_close(t.grad, shard_varlen(full, cu, world, rank, layout),
                                   atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{what}: d{n}: {m}")
    if layout == "zigzag":
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.detach().contiguous())
        torch.testing.assert_close(zigzag_unshard_varlen(gathered, cu), full_out.detach(),
                                   atol=1e-5, rtol=1e-5)


def check_bf16(rank, world):
    """The FlashAttention tolerance rule: the ring's error against the fp32 reference is at
    most twice the single-process bf16 error, plus a small atol."""
    q, k, v, dout = (t.bfloat16() for t in problem(world, "zigzag", 4, 2, seed=7))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_ref(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    base_out, _, base_grads = single_process_bf16(q, k, v, dout)
    local = [zigzag_shard(t, world, rank) for t in (q, k, v, dout)]
    out, _, grads = ring(*local, True, 0.0, "zigzag")
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    pairs = [("out", out, base_out, ref_out.detach())] + [
        (f"d{n}", g, b, r) for n, g, b, r in zip("qkv", grads, base_grads, ref_grads)]
    for name, got, base, ref in pairs:
        ref_local = zigzag_shard(ref, world, rank)
        err = (got.float() - ref_local).abs().max().item()
        base_err = (zigzag_shard(base, world, rank).float() - ref_local).abs().max().item()
        assert err <= 2 * base_err + 1e-3, f"rank {rank}: bf16 {name}: {err} vs {base_err}"


def single_process_bf16(q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=True, return_lse=True)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout)


def check_refusals(rank, world):
    """Every rank refuses the same way before any transfer: nothing is left hanging."""
    import pytest

    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="window_size"):
        ring_attention(q, q, q, window_size=(-2, 0), causal=True)
    with pytest.raises(ValueError, match="two equal chunks"):
        ring_attention(q[:, :5], q[:, :5], q[:, :5], window_size=(3, 3))
    with pytest.raises(ValueError, match="windowed ring attention"):
        ring_attention(q, q[:, :4], q[:, :4], window_size=(3, 3))
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="two equal chunks"):
        ring_attention(q[:, :5], q[:, :5], q[:, :5], causal=True)
    with pytest.raises(ValueError, match="same tokens"):
        ring_attention(q, q[:, :4], q[:, :4], causal=True)
    with pytest.raises(TypeError, match="dtype"):
        ring_attention(q.double(), q.double(), q.double())
    dist.barrier()


CASES = [
    dict(causal=False, layout="zigzag", hq=4, hkv=4),
    dict(causal=True, layout="zigzag", hq=4, hkv=2, sink=True),
    dict(causal=True, layout="contiguous", hq=6, hkv=2),
    dict(causal=False, layout="contiguous", hq=2, hkv=1, softcap=3.0),
]


# Sliding windows: smaller and larger than a chunk (7 tokens zigzag, 9 contiguous), causal,
# symmetric, asymmetric, one side unbounded.
WINDOW_CASES = [
    dict(causal=True, layout="zigzag", hq=4, hkv=2, window=(5, 0), sink=True),
    dict(causal=False, layout="contiguous", hq=6, hkv=2, window=(40, 0)),
    dict(causal=False, layout="zigzag", hq=2, hkv=1, window=(8, 8)),
    dict(causal=False, layout="contiguous", hq=4, hkv=2, window=(3, 11), softcap=3.0),
    dict(causal=False, layout="zigzag", hq=2, hkv=2, window=(-1, 3)),
    dict(causal=True, layout="contiguous", hq=2, hkv=2, window=(12, 6)),  # right ignored
]


VARLEN_CASES = [
    dict(causal=True, layout="zigzag", hq=4, hkv=2, sink=True),
    dict(causal=False, layout="zigzag", hq=2, hkv=2),
    dict(causal=True, layout="contiguous", hq=2, hkv=1),
]


# local lengths 1, 17, 113 (contiguous) or chunks of those (zigzag)
VARLEN_WINDOW_CASES = [
    dict(causal=True, layout="zigzag", hq=4, hkv=2, window=(9, 0), chunks=(1, 17, 113)),
    dict(causal=False, layout="contiguous", hq=2, hkv=1, window=(12, 5),
         chunks=(1, 17, 113)),
]


def worker(rank, world, port, cases, varlen_cases, bf16):
    init(rank, world, port)
    try:
        for i, case in enumerate(cases):
            check_case(rank, world, seed=i, **case)
        for i, case in enumerate(varlen_cases):
            check_varlen(rank, world, seed=100 + i, **case)
        check_deterministic(rank, world)
        check_deterministic(rank, world, window=(6, 0))
        if bf16:
            check_bf16(rank, world)
        check_refusals(rank, world)
    finally:
        dist.destroy_process_group()
