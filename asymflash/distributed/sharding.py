"""Zigzag sharding: causal load balancing for ring attention.

With causal attention, the i-th slice of a sequence attends to i earlier slices: cut in W
contiguous shards, the last rank would do W times the work of the first. Zigzag cuts the
sequence in 2W chunks and gives rank r chunks r and 2W - 1 - r: every rank holds one early
and one late chunk, and every ring step costs every rank the same (half a block pair).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def _check(x, world, rank, dim):
    if not isinstance(x, Tensor):
        raise TypeError(f"asymflash: zigzag_shard: x is a {type(x).__name__}; expected a "
                        "torch.Tensor")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"asymflash: zigzag_shard: rank {rank} of world {world}; need "
                         "0 <= rank < world")
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"asymflash: zigzag_shard: x has {n} tokens on dim {dim}; zigzag "
                         f"needs a multiple of 2 * world = {2 * world} (pad the sequence)")


def zigzag_shard(x: Tensor, world: int, rank: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s zigzag shard of the full sequence `x` (tokens on `dim`, default 1 as in
    (batch, seqlen, nheads, d)): chunks rank and 2 * world - 1 - rank of 2 * world, in order."""
    _check(x, world, rank, dim)
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's zigzag shard, listed in rank order (e.g. from
    torch.distributed.all_gather): the inverse of zigzag_shard."""
    world = len(shards)
    if world == 0:
        raise ValueError("asymflash: zigzag_unshard: no shards given")
    halves = [s.chunk(2, dim) for s in shards]
    if any(len(h) != 2 or h[0].shape != h[1].shape for h in halves):
        raise ValueError("asymflash: zigzag_unshard: each shard must hold two equal chunks "
                         f"on dim {dim} (got lengths {[s.shape[dim] for s in shards]})")
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _sequences(cu_seqlens, world):
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    lens = [z - a for a, z in zip(cu, cu[1:])]
    bad = [n for n in lens if n % (2 * world)]
    if bad:
        raise ValueError(f"asymflash: zigzag varlen: sequence lengths {bad[:4]} are not "
                         f"multiples of 2 * world = {2 * world} (pad each sequence)")
    return cu


def zigzag_shard_varlen(x: Tensor, cu_seqlens, world: int, rank: int, dim: int = 0):
    """Rank `rank`'s zigzag shard of packed sequences (tokens on `dim`, default 0 as in
    (total, nheads, d)): each sequence's own zigzag shard, in sequence order. Every length
    must be a multiple of 2 * world. Returns (shard, local cu_seqlens (int32, cu_seqlens //
    world, on x's device), local max_seqlen)."""
    cu = _sequences(cu_seqlens, world)
    parts = [zigzag_shard(x.narrow(dim, a, z - a), world, rank, dim)
             for a, z in zip(cu, cu[1:])]
    local = torch.tensor([c // world for c in cu], dtype=torch.int32, device=x.device)
    max_local = max((z - a for a, z in zip(cu, cu[1:])), default=0) // world
    out = torch.cat(parts, dim) if parts else x.narrow(dim, 0, 0)
    return out, local, max_local


def zigzag_unshard_varlen(shards: Sequence[Tensor], cu_seqlens, dim: int = 0) -> Tensor:
    """The packed sequences from every rank's zigzag_shard_varlen shard, in rank order;
    cu_seqlens are the full sequences' offsets."""
    world = len(shards)
    if world == 0:
        raise ValueError("asymflash: zigzag_unshard_varlen: no shards given")
    cu = _sequences(cu_seqlens, world)
    seqs = []
    for a, z in zip(cu, cu[1:]):
        n = (z - a) // world
        seqs.append(zigzag_unshard([s.narrow(dim, a // world, n) for s in shards], dim))
    return torch.cat(seqs, dim) if seqs else shards[0]
