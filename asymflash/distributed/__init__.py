"""Context parallelism over torch.distributed: one sequence split over the ranks of a group.

    ring_attention(q, k, v, group, causal=..., ...)   attention of the local queries over the
                                                      keys of every rank (forward, backward)
    zigzag_shard / zigzag_unshard                     the causal load-balanced layout

The transport is torch.distributed's point-to-point (NCCL on GPUs, gloo on CPUs); each
block's attention runs through asymflash's dispatch (`flash_attn_func`, `attention_backward`),
so every backend serves it.
"""

from .api import ring_attention
from .sharding import zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]
