"""Context parallelism over torch.distributed: one sequence split over the ranks of a group.

    ring_attention(q, k, v, group, causal=..., ...)   attention of the local queries over the
                                                      keys of every rank (forward, backward)
    ring_attention_varlen(q, k, v, cu_seqlens, ...)   the same over packed sequences
    zigzag_shard / zigzag_unshard (and _varlen)       the causal load-balanced layout

The transport is torch.distributed's point-to-point (NCCL on GPUs, gloo on CPUs); each
block's attention runs through asymflash's dispatch (`flash_attn_func`, `attention_backward`),
so every backend serves it.
"""

from .api import ring_attention, ring_attention_varlen
from .sharding import zigzag_shard, zigzag_shard_varlen, zigzag_unshard, zigzag_unshard_varlen

__all__ = ["ring_attention", "ring_attention_varlen", "zigzag_shard", "zigzag_unshard",
           "zigzag_shard_varlen", "zigzag_unshard_varlen"]
