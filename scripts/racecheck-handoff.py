"""A minimal, correct mbarrier hand-off, as the sm90 kernels use it, for compute-sanitizer.

Why: racecheck reports shared-memory hazards in the persistent kernels where the loader warp
writes a tile's coordinates into a shared slot and the consumer warpgroups read them after
an mbarrier wait (`sm90/sched.py`, `publish_tile` / `read_tile`). The PTX memory model orders
those accesses: the writer's stores, a barrier among the writing warp's threads, then an
mbarrier arrive (release, CTA scope); the reader's mbarrier wait (acquire) completes only
after that arrive. This kernel is that pattern and nothing else, in a two-slot ring over
many rounds, with a result that is wrong if the hand-off ever is. If racecheck reports
hazards here too, its reports on the kernels are about the mbarrier hand-off racecheck does
not model, not about a race; a racecheck that reports nothing here would make the kernels'
reports real findings.

    compute-sanitizer --tool racecheck python scripts/racecheck-handoff.py
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROUNDS = 64
SLOTS = gl.constexpr(2)


@gluon.constexpr_function
def _layout(num_warps):
    return gl.BlockedLayout([4], [32], [num_warps], [0])


@gluon.jit
def _producer(slots, full, empty, ROUNDS: gl.constexpr):
    """One warp: round i writes (i, 2i, 3i, 4i) into slot i % 2 once the consumers freed it."""
    idx = gl.arange(0, 4, layout=_layout(gl.num_warps()))
    for i in range(ROUNDS):
        s = i % SLOTS
        mbarrier.wait(empty.index(s), ((i // SLOTS) & 1) ^ 1)
        slots.index(s).store((idx + 1) * i)
        gl.thread_barrier()  # every thread's store before the one arriving thread's release
        mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _consumer(slots, full, empty, out_ptr, ROUNDS: gl.constexpr):
    """One warpgroup: sums what each round handed over, then frees the slot."""
    layout: gl.constexpr = _layout(gl.num_warps())
    idx = gl.arange(0, 4, layout=layout)
    acc = gl.zeros([4], gl.int32, layout)
    for i in range(ROUNDS):
        s = i % SLOTS
        mbarrier.wait(full.index(s), (i // SLOTS) & 1)
        acc += slots.index(s).load(layout)
        mbarrier.arrive(empty.index(s), count=1)
    gl.store(out_ptr + gl.program_id(0) * 4 + idx, acc)


@gluon.jit
def handoff_kernel(out_ptr, ROUNDS: gl.constexpr):
    slots = gl.allocate_shared_memory(gl.int32, [SLOTS, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_consumer, (slots, full, empty, out_ptr, ROUNDS)),
                        (_producer, (slots, full, empty, ROUNDS))], [1], [24])


def main() -> int:
    ctas = 4
    out = torch.zeros(ctas, 4, dtype=torch.int32, device="cuda")
    handoff_kernel[(ctas,)](out, ROUNDS, num_warps=4)
    want = torch.arange(1, 5, dtype=torch.int32) * (ROUNDS * (ROUNDS - 1) // 2)
    ok = torch.equal(out.cpu(), want.expand(ctas, 4))
    print(f"handoff: {'ok' if ok else 'WRONG'} (sums {out[0].tolist()}, want {want.tolist()})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
