"""The backward's launch plans: which body a call runs (`_kind`), its constexprs, grid,
dQ reduce box and the switches derived from the shape (persistent grid, first stores, dK/dV
TMA stores). Shapes and switches only, no tensors: `host.py` launches what a plan says."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from asymflash.core.params import cdiv

from .. import common
from ..common import GLUON_ERROR
from . import entry
from .config import BwdConfig, _splits_warpgroups, head_chunk, select_config

if GLUON_ERROR is None:
    from triton.experimental.gluon import language as gl

# bwd_wide takes a q·k head dim of 192 as two pieces (`common.PIECE_HI`): q, k and dK are
# read and written as 64-column boxes (`piece_cols`).
PIECE_HI = common.PIECE_HI
piece_cols = common.piece_cols

# The forward's widths (`common.forward_widths`): both directions build 192/128 in pieces.
backward_widths = common.forward_widths


def _kind(head_dim: int, split: bool) -> int:
    if split:
        return entry.KIND_WS
    return entry.KIND_WIDE if head_dim in (192, 256) else entry.KIND_SYNC


def _launch_options(split: bool, cfg: BwdConfig) -> dict:
    # bwd_ws: 4 warps per compute warpgroup (the default partition is one), the load warp
    # padded to a warpgroup; maxnreg is the pool the partitions' setmaxnreg draw from
    # (168 * 384 = 64512 <= 64K registers).
    # kernel.py's bodies: two warpgroups (their MMA layouts assume exactly 8 warps).
    # With CUDA 13's ptxas (triton 3.9 on), options that keep its spills down.
    return ({"num_warps": 4, "maxnreg": 168} if split else {"num_warps": 8}) | \
        common.ptxas13_register_options(split)




def _constexprs(head_dim, head_dim_v, cfg: BwdConfig, *, uniform, has_seqused, has_left,
                has_right, softcap, deterministic=False, max_key_blocks=1, resident_ctas=1,
                kv_tma_store=False, split=False, heads_first_grid=0, first_stores=False):
    # Masks without a window stagger the walk: key block j starts at step
    # j·(steps // key blocks) instead of 0 (sched.walk_start), so the CTAs of a sequence do
    # not all reduce into the same dQ rows at once, and deterministic turns follow that
    # schedule instead of queueing every CTA behind the one before it. A staggered
    # deterministic walk makes key block j wait for j + 1 at some query blocks, so every key
    # block of a sequence must be resident at once (one CTA per SM): otherwise ascending
    # turns, where a CTA only waits for CTAs launched before it.
    stagger = (not has_left and not has_right
               and (not deterministic or max_key_blocks <= resident_ctas))
    # Every constexpr of the entry, each body's own switches and neutral values for the
    # others: a defaulted parameter left out would send every launch down Triton's own
    # launch path (DirectLaunch keeps binaries of full calls only).
    consts = {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim_v, "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "UNIFORM": uniform,
              "HAS_SEQUSED": has_seqused, "HAS_LEFT": has_left, "HAS_RIGHT": has_right,
              "SOFTCAP": softcap, "DV_OVERLAP": cfg.dv_overlap,
              "DP_EARLY": cfg.dp_early, "DETERMINISTIC": deterministic,
              "STAGGER": stagger, "RELEASE_AT": cfg.turn_release,
              "KV_TMA_STORE": kv_tma_store, "HEADS_FIRST": heads_first_grid,
              "DK_LATE": False, "STATS_LATE": cfg.stats_late, "DQ_IN_OPS": False,
              "HI_LATE": False, "FIRST_STORES": False, "LATE_WG": 0, "RING": 0,
              "DK_AFTER_DQ": False, "DQ_WARP": False, "MASK_MODE": 0, "PERSISTENT": False,
              "KV_BUFS": 1, "KIND": _kind(head_dim, split)}
    if head_dim not in (192, 256):  # bwd_wide splits dK/dQ by columns: its schedule has no
        consts["DK_LATE"] = cfg.dk_late  # such choice
    else:
        # the dO buffer holds a 32 KB half of dQ only at dv = 256 (192/128 runs dv = 128)
        consts["DQ_IN_OPS"] = cfg.dq_in_operands and head_dim_v == head_dim
        # Deterministic mode: a turn released in its own step (RELEASE_AT 0) must see both
        # halves land there; released in the next step (1, 2, 3), after the late high half's
        # issue, it waits for that reduce too (wait_group 0 covers every reduce issued).
        consts["HI_LATE"] = cfg.dq_hi_late and consts["DQ_IN_OPS"] and not (
            deterministic and consts["RELEASE_AT"] == 0)
    if split:
        consts["LATE_WG"] = 0  # the warpgroup that computes dQ one step late (ws_roles)
        consts["RING"] = cfg.ring_slots
        consts["DK_AFTER_DQ"] = cfg.ws_dk_after_dq
        consts["DQ_WARP"] = cfg.ws_dq_warp and not deterministic
        step_cols = head_dim == 64 if cfg.step_cols is None else cfg.step_cols
        consts["MASK_MODE"] = int(step_cols) | (2 if cfg.mask_scores else 0)
        consts["PERSISTENT"] = persists(cfg, uniform and not has_seqused, softcap)
        consts["KV_BUFS"] = cfg.ws_kv_buffers if consts["PERSISTENT"] else 1
    if head_dim == 192:  # dK in pieces: stored row by row (`attn_bwd_wide`)
        consts["KV_TMA_STORE"] = False
    if split or head_dim in (192, 256):  # bwd_ws, bwd_wide (kernel.py's kernel for d <= 128
        # always adds)
        consts["FIRST_STORES"] = first_stores and deterministic
    return consts


# Rows of dQ_acc's buffer past its own that a persistent bwd_ws gets zeroed by the preprocess:
# its tile counter in the first word (scripts may ask for more: clock stamps after it).
PERSISTENT_ROWS = 1


def persists(cfg: BwdConfig, dense: bool, softcap: bool = False) -> bool:
    """Whether bwd_ws runs as a persistent grid (BwdConfig.ws_persistent): dense lengths
    only (every CTA's tile holds keys), not with softcap (not tested on the GPU). In
    deterministic mode too (the turns then follow the tile order: `bwd_ws._ws_tiles`)."""
    return cfg.ws_persistent and dense and not softcap


def first_stores(cfg: BwdConfig, deterministic: bool, dense: bool, seqlen_q: int,
                 seqlen_k: int, window_right: int, fragments: bool) -> bool:
    """Deterministic mode on bwd_ws and bwd_wide: may each query block's first dQ turn store
    instead of adding it, so that the preprocess need not zero dQ_acc (half its traffic:
    model dim 2048, 16k tokens: 134 MB of fp32 writes beside 134 MB of reads)?

    Only where every query row sees a key, so that every query block has a turn 0 (no block
    is left unwritten): dense lengths, seqlen_k >= 1, and no right bound or one that keeps
    the first row's keys (seqlen_k - seqlen_q + right >= 0; a left bound never empties a
    row here). And only where a stored box holds no other sequence's rows: fragment-order
    tiles never do (dq_fragments.py), row-major ones where the blocks tile each sequence."""
    if not (deterministic and dense and seqlen_q >= 1 and seqlen_k >= 1):
        return False
    if window_right >= 0 and seqlen_k - seqlen_q + window_right < 0:
        return False
    # What it saves is fixed per token (the zeroing's 134 MB at model dim 2048); what it
    # costs grows with the keys each query block meets: the unwanted store or add per tile
    # (aimed past the buffer) still takes the TMA unit ~3 % of the kernel. So only while a
    # query block meets at most FIRST_STORES_MAX_KEYS keys (causal: half of seqlen_k on
    # average; see docs/tuning.md).
    keys = seqlen_k // 2 if window_right >= 0 else seqlen_k
    if keys > FIRST_STORES_MAX_KEYS:
        return False
    return fragments or seqlen_q % cfg.block_m == 0


FIRST_STORES_MAX_KEYS = 1024


def kv_tma_store(uniform: bool, max_seqlen_k: int, batch: int, block_n: int) -> bool:
    """Whether dK and dV can leave by TMA stores of whole key blocks (through shared memory,
    instead of masked per-thread stores): no block may hold keys of two sequences (dense
    lengths, a multiple of block_n), except the tensor's last, whose rows past the end the TMA
    unit clips."""
    return uniform and (max_seqlen_k % block_n == 0 or batch == 1)


def _dq_tile(head_dim: int, cfg: BwdConfig, split: bool) -> tuple[int, int]:
    """(rows, columns) of dQ one reduce adds: the whole row block, or half of its columns at
    d=256 (bwd_wide); in bwd_ws each warpgroup's half, of the columns (64-row steps) or the
    rows."""
    if head_dim == 192:  # three 64-column boxes (the 128-wide piece takes two)
        return cfg.block_m, piece_cols(head_dim)
    if split:
        return (64, head_dim // 2) if cfg.block_m == 64 else (cfg.block_m // 2, head_dim)
    return cfg.block_m, head_dim // 2 if head_dim == 256 else head_dim


def _dq_block(head_dim: int, cfg: BwdConfig, split: bool = False) -> tuple[int, int]:
    """The dQ reduce box: `_dq_tile`, or that tile in fragment order as 32-column rows
    (`BwdConfig.dq_fragment`)."""
    rows, cols = _dq_tile(head_dim, cfg, split)
    return (rows * cols // 32, 32) if _fragments(cfg, split, head_dim) else (rows, cols)


def _fragments(cfg: BwdConfig, split: bool, head_dim: int) -> bool:
    """Whether dQ leaves in fragment order (`dq_fragments.py`): TMA reduces of bwd_ws's
    tiles, of kernel.py's 128-row ones (two warpgroups of 64 rows; d=64), or of bwd_wide's
    128-column halves (the warpgroups' 64 columns each; d=256)."""
    return cfg.dq_fragment and (split or cfg.block_m == 128 or head_dim == 256)


def _dq_box_and_layout(head_dim: int, cfg: BwdConfig, split: bool) -> tuple[tuple, object]:
    """(box, shared layout) of the dQ reduce; unswizzled in fragment order (the kernel tells
    the two apart by the swizzle)."""
    block = _dq_block(head_dim, cfg, split)
    return block, _dq_layout(block, 0 if _fragments(cfg, split, head_dim) else cfg.dq_swizzle)


def _key_rows(cfg: BwdConfig, split: bool) -> int:
    """Rows of the dK/dV TMA-store box: the key block, or one warpgroup's half (bwd_ws)."""
    return cfg.block_n // 2 if split else cfg.block_n


@functools.lru_cache(maxsize=None)
def _dq_layout(block: tuple, swizzle: int = 128):
    """Shared layout of the fp32 dQ staging tile (`BwdConfig.dq_swizzle`); cached (building
    one cost ~30 us of host time per backward call)."""
    if swizzle == 128:
        return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)


@dataclass(frozen=True)
class LaunchPlan:
    """What a backward launch needs that depends on shapes and switches only (as the
    forward's `fwd.LaunchPlan`): built once per distinct call by `launch_plan`."""

    cfg: BwdConfig
    grid: tuple
    num_m_blocks: int
    constexprs: dict  # and num_warps
    dq_block: tuple
    dq_layout: object
    split: bool  # bwd_ws's kernel

    @property
    def dq_fragment(self) -> bool:
        return _fragments(self.cfg, self.split, self.constexprs["HEAD_DIM"])

    @property
    def persistent(self) -> bool:
        """Whether bwd_ws runs as a persistent grid (its tile counter rides with dQ_acc)."""
        return self.split and self.constexprs.get("PERSISTENT", False)


@functools.lru_cache(maxsize=4096)
def launch_plan(width: int, width_v: int, max_seqlen_q: int, max_seqlen_k: int,
                uniform: bool, has_seqused: bool, window_left: int, window_right: int,
                softcap: bool, deterministic: bool, batch: int, hkv: int, sms: int,
                cfg: BwdConfig | None, hq: int = 0) -> LaunchPlan:
    """Config, grid and constexprs of one backward call (cfg: an override, or None; hq:
    query heads, 0 for hkv)."""
    cfg = select_config(width, cfg, softcap, deterministic,
                        window_left >= 0 or window_right >= 0, max_seqlen_q, window_left >= 0)
    key_blocks = cdiv(max(max_seqlen_k, 1), cfg.block_n)
    split = _splits_warpgroups(width, cfg, softcap)
    dense = uniform and not has_seqused
    chunk = head_chunk(cfg, window_right >= 0 and window_left < 0, dense, deterministic,
                       split and persists(cfg, dense, softcap), hq or hkv, hkv, batch,
                       max_seqlen_q, max_seqlen_k, window_right, width, width_v, sms)
    # the kernels' HEADS_FIRST (sched.key_block): 0 one head after another, 1 all heads
    # first, c >= 2 chunks of c kv heads
    first = 1 if chunk == hkv else chunk
    grid = ((chunk, hkv // chunk * key_blocks, batch) if chunk
            else (key_blocks, hkv, batch))
    consts = _constexprs(width, width_v, cfg, split=split, uniform=uniform,
                         has_seqused=has_seqused,
                         has_left=window_left >= 0, has_right=window_right >= 0,
                         softcap=softcap, deterministic=deterministic,
                         max_key_blocks=key_blocks, resident_ctas=sms,
                         heads_first_grid=first,
                         kv_tma_store=kv_tma_store(uniform, max_seqlen_k, batch, cfg.block_n),
                         first_stores=first_stores(cfg, deterministic, dense, max_seqlen_q,
                                                   max_seqlen_k, window_right,
                                                   _fragments(cfg, split, width)))
    consts.update(_launch_options(split, cfg))
    if split and consts["PERSISTENT"]:  # one CTA per SM, walking the grid's tiles
        grid = (max(1, min(grid[0] * grid[1] * grid[2], sms)),)
    dq_block, dq_layout = _dq_box_and_layout(width, cfg, split)
    return LaunchPlan(cfg, grid, cdiv(max(max_seqlen_q, 1), cfg.block_m), consts, dq_block,
                      dq_layout, split)
