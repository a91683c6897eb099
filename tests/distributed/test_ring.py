"""Ring attention over gloo, world sizes 2 and 4 (spawned processes): forward, lse and
gradients equal the single-process asymflash result (itself checked against the reference)
for causal and not, sliding windows, zigzag and contiguous shards, GQA, softcap;
deterministic mode repeats bitwise; bad calls are refused before any transfer."""

import socket
import time

import pytest
import ring_cases
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this build",
                allow_module_level=True)

DEADLINE_S = 120  # a hang (a mismatched transfer) fails the test instead of the CI job


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *args):
    ctx = torch.multiprocessing.start_processes(fn, args=(world, _free_port(), *args),
                                                nprocs=world, join=False,
                                                start_method="spawn")
    end = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=max(1.0, end - time.monotonic())):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"ring attention with world {world} did not finish in {DEADLINE_S} s")


def test_ring_matches_single_process_world_2():
    _spawn(ring_cases.worker, 2, ring_cases.CASES + ring_cases.WINDOW_CASES,
           ring_cases.VARLEN_CASES + ring_cases.VARLEN_WINDOW_CASES, True)


def test_ring_matches_single_process_world_4():
    # the schedules that differ with more ranks (causal skips, zigzag halves, varlen); CI's
    # two cores run four ranks slowly, so the dtype and softcap cases stay at world 2
    _spawn(ring_cases.worker, 4, ring_cases.CASES[:3] + ring_cases.WINDOW_CASES[:4],
           ring_cases.VARLEN_CASES[:1] + ring_cases.VARLEN_WINDOW_CASES, False)


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from asymflash.distributed import ring_attention

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


def test_zigzag_shards_round_trip():
    from asymflash.distributed import zigzag_shard, zigzag_unshard

    x = torch.arange(2 * 3 * 24).view(2, 3, 24).transpose(1, 2)  # tokens on dim 1
    shards = [zigzag_shard(x, 3, r) for r in range(3)]
    assert shards[0][0, :, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert shards[2][0, :, 0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="multiple of 2 \\* world = 6"):
        zigzag_shard(x[:, :23], 3, 0)
    with pytest.raises(ValueError, match="rank 3 of world 3"):
        zigzag_shard(x, 3, 3)


def test_one_rank_group_is_plain_attention():
    """A group of one: the ring is one causal block, in this process (no spawn)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from asymflash import flash_attn_func
    from asymflash.distributed import ring_attention

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(2, 13, h, 8, requires_grad=True) for h in (4, 2, 2))
        sink = torch.randn(4, requires_grad=True)
        dout = torch.randn(2, 13, 4, 8)
        out, lse = ring_attention(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
        want_out, want_lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink,
                                             return_lse=True)
        want = torch.autograd.grad(want_out, (q, k, v, sink), dout)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        # a window over an odd-length shard: one rank's zigzag shard is the sequence itself
        out = ring_attention(q, k, v, window_size=(3, 2))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want_out = flash_attn_func(q, k, v, window_size=(3, 2))
        want = torch.autograd.grad(want_out, (q, k, v), dout)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    finally:
        dist.destroy_process_group()
