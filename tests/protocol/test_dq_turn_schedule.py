"""A model of the sm90 backward's staggered walk and deterministic dQ turns (no GPU).

The kernels (bwd_parts.walk_start / wait_dq_turn, Gluon) cannot run on a CPU; this mirrors
their integer arithmetic in Python and checks the properties the design relies on: every
query block's turns are a permutation of the key blocks, the turn order is the order of the
ideal schedule's visits (so no CTA waits when all run at the same pace, even with each turn
released one step late), and an event simulation with random step times never deadlocks.
The GPU tests (test_sm90_bwd_gpu.py, deterministic cases) check the kernels themselves.
"""

from __future__ import annotations

import random

import pytest


def walk(n_blk, n_seq, n_steps):
    """Step indices key block n_blk visits, in order (walk_start + next_step)."""
    stride = n_steps // n_seq
    return [(stride * n_blk + t) % n_steps for t in range(n_steps)]


def turn(e, n_blk, n_seq, n_steps):
    """wait_dq_turn for masks without a window."""
    stride = n_steps // n_seq
    if stride == 0:
        return n_blk
    first = min(e // stride, n_seq - 1)
    return (first - n_blk + n_seq) % n_seq


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
