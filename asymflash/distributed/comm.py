"""The ring's transport: torch.distributed point-to-point (NCCL on GPUs, gloo on CPUs).

Each shift sends tensors to the next rank of the group and receives the same shapes from
the previous one, as one batch_isend_irecv: NCCL groups the pair into one launch on its own
stream, so the transfer runs while the caller computes on the current block, and the wait
comes only when the next block is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Tags keep the forward/backward K/V shift and the backward's dK/dV shift apart on
# transports that match messages by tag (gloo); NCCL matches by issue order, the same on
# every rank since every rank runs the same schedule.
TAG_KV = 11
TAG_DKV = 12


class Transfer:
    """Buffers being received; `wait()` returns them once they have arrived."""

    def __init__(self, works, buffers, sent):
        # `sent` holds the tensors being sent (contiguous copies among them) until the
        # transfer is waited on, so none is freed and reused while the transport reads it
        self._works, self._buffers, self._sent = works, buffers, sent

    def wait(self):
        for w in self._works:
            w.wait()
        self._works, self._sent = [], ()
        return self._buffers


class Ring:
    """Ranks of `group` in a ring: rank r sends to r + 1 and receives from r - 1."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def shift(self, tensors, tag: int) -> Transfer:
        """Start sending `tensors` (unchanged until the transfer is waited on) to the next
        rank and receiving their like from the previous one."""
        ops, buffers, sent = [], [], []
        for t in tensors:
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group, tag))
            buffers.append(buf)
            sent.append(t)
        return Transfer(dist.batch_isend_irecv(ops), buffers, sent)
