"""Tile costs and the host's replays of the kernels' static schedules (plain Python).

The persistent forward walks its tiles in a fixed longest-first order (`sm90/sched.py`); the
backward's CTAs are handed to SMs in grid order. Where a heuristic depends on how balanced
that makes the SMs' work, it replays the schedule here on the host, once per shape (the
callers cache): the forward picks the L2 chunk of (sequence, head) pairs, the backward
whether to group kv heads. tests/compile/test_sm90_compile.py ties the replay to the
kernel's order.
"""

from __future__ import annotations

import functools
import heapq

# ---- forward: the persistent grid's static longest-first schedule ------------------------

# How much more work than the mean the busiest CTA of a static longest-first schedule may get
# (`balanced_chunk`), and the work of a tile besides its key blocks, in key blocks (Q load,
# first block's wait, epilogue: a guess; the choice barely moves with it).
BALANCE_TOLERANCE = 1.025
TILE_OVERHEAD_BLOCKS = 1.5


def tile_costs(seqlen_q: int, seqlen_k: int, window_right: int, block_m: int,
               block_n: int) -> tuple[float, ...]:
    """Work of each query tile of a sequence, in key blocks (the device's `key_blocks` n_hi
    without a left window: the persistent grid takes none)."""
    costs = []
    for m0 in range(0, seqlen_q, block_m):
        n_hi = -(-seqlen_k // block_n)
        if window_right >= 0:
            last = min(m0 + block_m - 1, seqlen_q - 1) + seqlen_k - seqlen_q + window_right
            n_hi = min(n_hi, -(-max(last + 1, 0) // block_n))
        costs.append(max(n_hi, 1) + TILE_OVERHEAD_BLOCKS)
    return tuple(costs)


def schedule_imbalance(costs: tuple[float, ...], n_hb: int, grid: int, hb_chunk: int) -> float:
    """Busiest CTA's work over the mean in the persistent grid's static schedule: the
    kernel's `_tile_of` (chunks of hb_chunk pairs, query blocks outer, longest first) and
    `_wave_tile` (tile w·grid + p to CTA p, CTA order reversed on odd waves)."""
    import torch  # CPU only, once per shape (launch_plan is cached)

    num_m_blocks = len(costs)
    tiles = num_m_blocks * n_hb
    t = torch.arange(tiles)
    per_chunk = hb_chunk * num_m_blocks
    chunk = t // per_chunk
    width = torch.clamp(n_hb - chunk * hb_chunk, max=hb_chunk)
    m_blk = num_m_blocks - 1 - (t - chunk * per_chunk) // width
    work = torch.tensor(costs, dtype=torch.float64)[m_blk]
    waves = -(-tiles // grid)
    per_cta = torch.zeros(waves * grid, dtype=torch.float64)
    per_cta[:tiles] = work
    per_cta = per_cta.view(waves, grid)
    per_cta[1::2] = per_cta[1::2].flip(1)
    return float(per_cta.sum(0).max() / (work.sum() / grid))


@functools.lru_cache(maxsize=256)
def balanced_chunk(costs: tuple[float, ...], n_hb: int, grid: int, smallest: int) -> int:
    """The smallest chunk from `smallest` (L2: smaller is better) whose static schedule is
    balanced within BALANCE_TOLERANCE, else the most balanced (24 candidates at most).
    The imbalance jumps with the chunk (d=64 causal 16k, three warpgroups, 86 tiles per
    head, 32 heads: 1.127 at 13 pairs, 1.022 at 10), and the time with it."""
    best = (float("inf"), smallest)
    # (at most 24 candidates: each is a pass over every tile)
    for hb in range(smallest, min(n_hb, smallest + 23) + 1):
        imbalance = schedule_imbalance(costs, n_hb, grid, hb)
        if imbalance <= BALANCE_TOLERANCE:
            return hb
        best = min(best, (imbalance, hb))
    return best[1]


# ---- backward: CTAs handed out in grid order -------------------------------------------

def key_block_steps(block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                    window_right: int, group: int) -> tuple[int, ...]:
    """Steps (query blocks of the GQA group's heads) of each key block of a dense call
    with a right mask edge (causal: window_right 0): key block j sees the rows from
    j·block_n - (seqlen_k - seqlen_q) - window_right on."""
    shift = seqlen_k - seqlen_q
    n_blocks = -(-seqlen_k // block_n)
    first_rows = (max(0, j * block_n - shift - window_right) for j in range(n_blocks))
    return tuple(-(-max(0, seqlen_q - r) // block_m) * group for r in first_rows)


# A CTA's cost beyond its steps, in steps (the warp-specialised backward: K/V wait,
# epilogue, the gap to the next CTA, 1.9-3.4 steps: `BwdConfig.ws_persistent`).
CTA_FIXED_STEPS = 2.0


@functools.lru_cache(maxsize=256)
def dispatch_imbalance(steps: tuple[int, ...], hkv: int, batch: int, chunk: int,
                       slots: int) -> float:
    """Busiest slot's work over the mean when the hardware hands the grid's CTAs out in
    order, each to the first slot (resident CTA) that frees up: sequences, then chunks of
    `chunk` kv heads, then key blocks, then the chunk's heads (chunk 1: one head after
    another)."""
    costs = [s + CTA_FIXED_STEPS for s in steps]
    free = [0.0] * slots  # a heap of the slots' finish times
    total = 0.0
    for _ in range(batch * (hkv // chunk)):
        for cost in costs:
            for _ in range(chunk):
                heapq.heapreplace(free, free[0] + cost)
                total += cost
    return max(free) / (total / slots)
