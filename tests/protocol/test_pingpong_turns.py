"""The forward's ping-pong turn protocol (sm90/fwd/kernel.py `_take_turn` / `_pass_turn`),
on a model of mbarrier phases: with 2 or 3 consumer warpgroups taking turns, any
interleaving the hardware could pick issues the wgmma groups strictly round robin, and
nobody deadlocks. The barrier each call waits on or arrives at, and the parity, come from
the kernel's own functions run on integers (`kernel_code.on_ints`).

mbarrier model: a barrier counts completed phases (each arrive completes one here: count 1);
`wait(parity)` passes while the current, incomplete phase's parity differs from `parity`,
i.e. once the phase of that parity has completed (a fresh barrier passes a wait on 1).
"""

from __future__ import annotations

import random

import pytest
from kernel_code import BarrierLog, Indices, on_ints

from asymflash.backends.sm90.fwd import kernel


def take_turn_parity(k: int, wg: int, turns: int) -> int:
    """The parity `_take_turn` waits for at warpgroup wg's k-th turn, on wg's own barrier."""
    log = BarrierLog()
    on_ints(kernel._take_turn, Indices, k, wg, turns, mbarrier=log)
    (what, bar, parity), = log.events
    assert what == "wait" and bar == turns + wg  # turn barriers follow the Q barriers
    return parity


def pass_turn_target(wg: int, turns: int) -> int:
    """The warpgroup whose turn barrier `_pass_turn` arrives on."""
    log = BarrierLog()
    on_ints(kernel._pass_turn, Indices, wg, turns, mbarrier=log)
    (what, bar), = log.events
    assert what == "arrive"
    return bar - turns


@pytest.mark.parametrize("turns", [2, 3])
@pytest.mark.parametrize("seed", range(20))
def test_turns_go_round_robin_under_any_schedule(turns, seed):
    rng = random.Random(seed)
    groups = 40  # turns each warpgroup takes
    phases = [0] * turns  # completed phases of each warpgroup's turn barrier
    taken = [0] * turns
    order = []
    while min(taken) < groups:
        ready = [w for w in range(turns) if taken[w] < groups
                 and phases[w] % 2 != take_turn_parity(taken[w], w, turns)]
        assert ready, f"deadlock after {order}"
        w = rng.choice(ready)  # any warpgroup whose wait passes may go now
        order.append(w)
        taken[w] += 1
        phases[pass_turn_target(w, turns)] += 1
    assert order == [i % turns for i in range(turns * groups)], order
