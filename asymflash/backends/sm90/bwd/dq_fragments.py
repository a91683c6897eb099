"""dQ partial sums in the wgmma accumulator's own order (`BwdConfig.dq_fragment`).

The backward's compute warpgroups each hold a 64 x C fp32 tile of dQ = dS·K in registers
(the wgmma accumulator layout) and add it to global memory through shared memory and a TMA
reduce. Stored into a row-major 128-byte-swizzled tile, every 64-bit store of a warp takes
4 shared-memory wavefronts instead of 2 (ncu source counters, d=128 16k: 9 % of the
kernel's wavefronts), and the fence and barrier after the stores wait for them.

Here the tile is stored in *fragment order* instead: offset bit k of the shared tile holds
the (row, column) step `fragment_bases(C)[k]`, chosen so that thread t's registers 4i..4i+3
sit at offsets 512·i + 4·t + 0..3. Each warp then writes 512 contiguous bytes per 128-bit
store (conflict-free), and the tile is reduced as one unswizzled [64·C/32, 32] TMA box into
a global buffer of whole tiles in the same order. `dq_from_fragments` (a portable kernel)
puts the rows back in place, casting to the input dtype, where the row-major path had a
`.to()`: it reads each tile in memory order (128-bit loads of whole 128-byte rows) and lets
Triton permute the values into rows through shared memory. (Its first version gathered
element by element: 32-bit loads, half of each row used, and 137 spilled values at d=256;
with a tile per 16k tokens the conversion costs the same at every sequence length, so it
weighed most on short ones.)

Tile numbering: the 64-row query block r of sequence b (rows q_start + 64·r ...) is global
block `q_start // 64 + 2b + r`. Sequences never share a block, so no tile holds two
sequences' rows, even where a 128-row step reduces two blocks at once past a sequence's end
(a sequence of 128k + t rows, 0 < t < 64, reaches 2k + 2 blocks; the next one starts
(q_start % 64 + len) // 64 + 2 >= 2k + 2 blocks later); there are at most total_q // 64 +
2·batch + 2 blocks.

The kernel sees the buffer as a (rows, heads, 32) fp32 tensor (`tiles_view`): with P column
parts per block (2 at d=128 in bwd_ws, else 1) and T = 64·C/32 rows per tile, block g's part
p is rows (P·g + p)·T ... (P·g + p + 1)·T, head h columns 32h ... 32h + 31, so the reduce
coordinates need no head count. It is allocated as (64·blocks, heads, width), the shape the
backward preprocess zeroes in the launch that computes delta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from ....core.params import cdiv
from ....runtime.launch import DirectLaunch

ROWS = 64  # rows of one warpgroup's dQ tile (a wgmma M)


@constexpr_function  # also called inside Gluon kernels (parts.fragment_layout)
def fragment_bases(cols: int, rows: int = 64) -> list[list[int]]:
    """(row, column) step of each offset bit of a rows x cols fragment-order tile (rows 64:
    one warpgroup's accumulator; 128: two warpgroups stacked, each one such 64-row tile).

    The accumulator layout (NVMMA v3, warps of 16 rows): lane 4a + q holds rows a and a + 8
    and columns 8j + 2q, 8j + 2q + 1; register bit 0 steps a column, bit 1 eight rows, the
    higher bits 8, 16, ... columns; warp w adds 16·w rows. Offset bits: registers 0-1, then
    the lane (q, then a), then the warp within the warpgroup (a thread's four consecutive
    registers, then the threads in order), then the remaining register bits (one 128-bit
    store each), then the warpgroup."""
    bases = [[0, 1], [8, 0], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [16, 0], [32, 0]]
    c = 8
    cols = int(cols)
    while c < cols:
        bases.append([0, c])
        c *= 2
    if int(rows) == 128:
        bases.append([64, 0])
    return bases


def num_blocks(total_q: int, batch: int) -> int:
    """64-row blocks the fragment buffer holds (see the tile numbering above). Its TMA row
    coordinates (int32) reach 2·width rows per block: total_q up to ~2^29 at d=128, beyond
    what a q tensor of one head can occupy on a 141 GB GPU."""
    return total_q // ROWS + 2 * batch + 2


def fragment_buffer(total_q: int, batch: int, heads: int, width: int,
                    device: torch.device, extra_rows: int = 0) -> torch.Tensor:
    """The fp32 buffer of whole fragment-order tiles, uninitialised, as (64·blocks, heads,
    width): the shape the backward preprocess zeroes (`portable.row_delta(zero=)`). The kernel
    sees it through `tiles_view`. extra_rows: rows after the tiles', for the caller."""
    return torch.empty((num_blocks(total_q, batch) * ROWS + extra_rows, heads, width),
                       dtype=torch.float32, device=device)


def tiles_view(acc: torch.Tensor) -> torch.Tensor:
    """`fragment_buffer` as (rows, heads, 32): common.tma_rows makes it a [rows, heads·32]
    descriptor with a [64·C/32, 32] box (C the tile's columns)."""
    return acc.view(-1, acc.shape[1], 32)


@triton.jit
def _tile_rows(x, COLS: tl.constexpr):
    """A fragment-order tile read in memory order, x [2·COLS, 32] (offset = 32·row + lane),
    as its 64 x COLS rows: offset bit k holds `fragment_bases(COLS)[k]`, i.e. from the lowest
    bit column 0, row 3, columns 1-2, rows 0-2, rows 4-5, then columns 3 and up (tests check
    this against the bases themselves). Split into one dimension per bit (highest first) and
    permuted into row-major bit order; Triton moves the values between threads through
    shared memory."""
    x = tl.reshape(x, [COLS // 8, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    # dims: 0 col 3+, 1 row 5, 2 row 4, 3 row 2, 4 row 1, 5 row 0, 6 col 2, 7 col 1, 8 row 3,
    # 9 col 0
    x = tl.permute(x, [1, 2, 8, 3, 4, 5, 0, 6, 7, 9])
    return tl.reshape(x, [64, COLS])


@triton.jit
def _dq_from_fragments_kernel(acc_ptr, dq_ptr, cu_q_ptr, stride_row, stride_head, n_heads,
                              D: tl.constexpr, WIDTH: tl.constexpr, COLS: tl.constexpr):
    # One 64-row block of one head and sequence: each of its WIDTH / COLS tiles is read in
    # memory order (whole 128-byte rows: the loads coalesce) and stored as rows.
    block = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    seqlen = tl.load(cu_q_ptr + b + 1) - q_start
    if block * 64 < seqlen:
        g = (q_start // 64 + 2 * b + block).to(tl.int64)
        tile_rows = tl.arange(0, 2 * COLS)[:, None]
        lane = tl.arange(0, 32)[None, :]
        rows = block * 64 + tl.arange(0, 64)[:, None]
        cols = tl.arange(0, COLS)[None, :]
        for part in tl.static_range(WIDTH // COLS):
            acc_row = (g * (WIDTH // COLS) + part) * (2 * COLS) + tile_rows
            x = tl.load(acc_ptr + (acc_row * n_heads + h) * 32 + lane)
            val = _tile_rows(x, COLS)
            col = part * COLS + cols
            dst = dq_ptr + (q_start + rows).to(tl.int64) * stride_row + h * stride_head + col
            tl.store(dst, val.to(dq_ptr.dtype.element_ty), mask=(rows < seqlen) & (col < D))


_FROM_FRAGMENTS = DirectLaunch(_dq_from_fragments_kernel)  # host time: short calls are bound by it


def dq_from_fragments(acc: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                      total_q: int, heads: int, d: int, width: int, cols: int,
                      dtype: torch.dtype, site=None) -> torch.Tensor:
    """dQ (total_q, heads, d) in `dtype` from the fragment buffer (`fragment_buffer`, or its
    `tiles_view`; tiles `cols` wide). site: a `launch.LaunchSite` of a call plan's runner,
    or None."""
    batch = cu_seqlens_q.numel() - 1
    dq = torch.empty((total_q, heads, d), dtype=dtype, device=acc.device)
    grid = (cdiv(max(max_seqlen_q, 1), ROWS), heads, batch)
    args = (acc, dq, cu_seqlens_q, dq.stride(0), dq.stride(1), heads)
    kwargs = dict(D=d, WIDTH=width, COLS=cols)
    if site is None:
        _FROM_FRAGMENTS[grid](*args, **kwargs)
    else:
        site(_FROM_FRAGMENTS, grid, args, kwargs)
    return dq
