"""A model of the sm90 backward's staggered walk and deterministic dQ turns (no GPU).

The kernels cannot run on a CPU, but their scheduling arithmetic can: `walk` and `turn`
below call the kernels' own functions (sched.walk_start / next_step, bwd parts.dq_turn) on
plain integers (`kernel_code.on_ints`). The tests check the properties the design relies
on: every query block's turns are a permutation of the key blocks, the turn order is the
order of the ideal schedule's visits (so no CTA waits when all run at the same pace, even
with each turn released one step late), and an event simulation with random step times
never deadlocks. The GPU tests (test_sm90_bwd_gpu.py, deterministic cases) check the
kernels themselves.
"""

from __future__ import annotations

import random

import pytest
from kernel_code import on_ints

from asymflash.backends.sm90 import sched
from asymflash.backends.sm90.bwd import parts

# A walk over n_steps steps of one key block: `group` q heads of n_steps // group query
# blocks each; query blocks of one row (BLOCK_M = 1) from row 0, so a step's index is
# e = h * blocks + m0.


def walk(n_blk, n_seq, n_steps, group=1):
    """Step indices key block n_blk visits, in order (walk_start, then next_step)."""
    blocks = n_steps // group
    h, m0, _ = on_ints(sched.walk_start, n_blk, n_seq, n_steps, blocks, 0, 0, True, 1)
    steps = []
    for _ in range(n_steps):
        steps.append(h * blocks + m0)
        h, m0 = on_ints(sched.next_step, h, m0, 0, blocks, 0, group, 1)
    return steps


def turn(e, n_blk, n_seq, n_steps, group=1):
    """Key block n_blk's turn at step e's query block (dq_turn, masks without a window)."""
    blocks = n_steps // group
    stride = on_ints(sched.walk_start, n_blk, n_seq, n_steps, blocks, 0, 0, True, 1)[2]
    _, t = on_ints(parts.dq_turn, 0, 0, group, e // blocks, blocks, e % blocks, n_blk, n_seq,
                   0, -1, -1, 0, 0, blocks, stride, 1, 1, False, False, True)
    return t


SHAPES = [(1, 1), (4, 8), (3, 20), (6, 6), (5, 17), (16, 32), (7, 113), (9, 8), (4, 3)]


@pytest.mark.parametrize("n_seq,n_steps", SHAPES)
def test_turns_are_a_permutation_and_follow_the_ideal_schedule(n_seq, n_steps):
    walks = [walk(j, n_seq, n_steps) for j in range(n_seq)]
    for e in range(n_steps):
        turns = [turn(e, j, n_seq, n_steps) for j in range(n_seq)]
        assert sorted(turns) == list(range(n_seq))
        if n_steps >= n_seq:  # staggered: visits in turn order, at least one step apart
            visit = {turns[j]: walks[j].index(e) for j in range(n_seq)}
            for r in range(1, n_seq):
                assert visit[r] >= visit[r - 1] + 1, (e, visit)


@pytest.mark.parametrize("n_seq,n_steps", [s for s in SHAPES if s[1] % 2 == 0])
def test_a_gqa_group_walks_its_heads_like_one_long_query_range(n_seq, n_steps):
    """Two q heads of half the query blocks each: the same steps and turns as one head."""
    for j in range(n_seq):
        assert walk(j, n_seq, n_steps, 2) == walk(j, n_seq, n_steps)
    for e in range(n_steps):
        assert [turn(e, j, n_seq, n_steps, 2) for j in range(n_seq)] == \
            [turn(e, j, n_seq, n_steps) for j in range(n_seq)]


@pytest.mark.parametrize("n_seq,n_steps", SHAPES)
@pytest.mark.parametrize("defer", [False, True])
def test_random_step_times_never_deadlock_and_keep_the_order(n_seq, n_steps, defer):
    rng = random.Random(n_seq * 1000 + n_steps)
    walks = [walk(j, n_seq, n_steps) for j in range(n_seq)]
    counter = [0] * n_steps
    order = [[] for _ in range(n_steps)]
    pos = [0] * n_seq  # next step of each CTA
    held = [None] * n_seq  # deferred release: the turn a CTA still holds
    clock = [rng.random() for _ in range(n_seq)]
    while any(p < n_steps for p in pos):
        # The CTA with the earliest clock that can proceed does its next reduce point.
        ready = sorted((clock[j], j) for j in range(n_seq) if pos[j] < n_steps)
        for _, j in ready:
            if defer and held[j] is not None:  # release before waiting
                counter[held[j]] += 1
                held[j] = None
            e = walks[j][pos[j]]
            if counter[e] == turn(e, j, n_seq, n_steps):
                order[e].append(j)
                if defer:
                    held[j] = e
                else:
                    counter[e] += 1
                pos[j] += 1
                clock[j] += 0.5 + rng.random()
                if pos[j] == n_steps and held[j] is not None:
                    counter[held[j]] += 1
                    held[j] = None
                break
        else:
            raise AssertionError(f"deadlock: positions {pos}, counters {counter}")
    for e in range(n_steps):
        assert order[e] == sorted(range(n_seq), key=lambda j: turn(e, j, n_seq, n_steps))
