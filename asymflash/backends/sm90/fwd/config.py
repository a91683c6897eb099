"""The sm90 forward's configuration: what one compiled kernel is (`FwdConfig`), the tuning
table per head dim, and the per-call choices made from a call's shape where the H200
measured a gain (`default_for_call`, `use_persistent`, `use_three_warpgroups`,
`SHORT_MASKED`, `persistent_launch`; the measurements: docs/tuning.md). Pure Python, no
Gluon: the kernel is in `kernel.py`, its launch in `host.py`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from asymflash.core.params import AttnParams
from asymflash.core.schedule import balanced_chunk, tile_costs


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape, pipeline depth and FA4 switches of one compiled kernel."""

    block_n: int = 128  # keys per block
    stages: int = 2  # depth of each of the K and V rings
    consumer_regs: int = 240  # setmaxnreg for each consumer warpgroup
    loader_regs: int = 24  # setmaxnreg for the TMA warp (padded to a warpgroup)
    # 0: every exp2 on MUFU; k in (2, 4, 8): 1 in k on the FMA pipe. Off: slower wherever
    # measured on Hopper, whose key loop is bound by the latency of each warpgroup's
    # S -> max -> exp -> P·V chain, not by MUFU's throughput (see docs/tuning.md).
    exp2_emu_every: int = 0
    # 0: rescale O every block; t > 0: FA4's conditional rescale (the max used for P moves
    # only when a row's max grows by more than t, log2 units; O is multiplied only in warps
    # where a row moved, `_rescale_if_moved`). On at d=256, where O's multiply is 130 of the
    # key loop's 416 instructions (see docs/tuning.md).
    rescale_threshold: float = 0.0
    lpt: bool = False  # longest-first tile order (causal/local: later query tiles work more)
    # Persistent grid (one CTA per SM looping over tiles, next tile's loads overlapping this
    # tile's epilogue). None: chosen per call from the shape (`use_persistent`).
    persistent: bool | None = None
    # Persistent grid with longest-first order, host side only: a chunk of (sequence, head)
    # pairs worked on together spans at least this many waves of the grid (a static schedule
    # needs many tiles per CTA per chunk to even out the work); 0: chunks sized by L2 alone
    # (always so without LPT: every tile then does the same work). Smaller chunks keep more
    # K/V in L2 once `balanced_chunks` evens out the work (see docs/tuning.md).
    chunk_waves: int = 3
    # With LPT, grow the chunk from there until the static schedule's busiest CTA has at
    # most `BALANCE_TOLERANCE` times the mean work (`balanced_chunk`). Off: the smallest chunk.
    balanced_chunks: bool = True
    # FA3's ping-pong: the consumer warpgroups take turns issuing their wgmmas (one mbarrier
    # each, passed round robin), so one's softmax overlaps another's matrix work. Neutral
    # with two warpgroups: off there. A gain with three (consumer_wgs=3, as FA4 runs d=64):
    # on wherever d=64 takes three (`_three_warpgroups`; see docs/tuning.md).
    pingpong: bool = False
    # Consumer warpgroups per CTA, 64 query rows each: 2 (128-row tiles) or 3 (FA3's 192-row
    # tile for d=64: a third instruction stream per SM sub-partition to hide MUFU and wgmma
    # latencies; needs the persistent grid, registers drop to 160 per consumer thread).
    consumer_wgs: int = 2
    # Q buffers per consumer warpgroup on the persistent grid: with 2 the loader brings the
    # next tile's Q (and so its K/V) while this tile still runs, instead of after its last
    # S = Q·Kᵀ; costs 16 / 32 KB more shared memory at d = 64 / 128 (none left at d = 256).
    q_buffers: int = 1
    # With a right bound (causal, windows) and 64-key blocks (d=256), a warpgroup whose 64
    # rows end a whole key block before its tile's last row stops there and releases the
    # tile's remaining blocks unread (`_warpgroup_end`), instead of computing blocks masked
    # out for all its rows: under a causal mask one in 2 (i + 1) blocks of the i-th 128-row
    # tile. A gain for short masked calls only (see docs/tuning.md).
    # On for short masked calls only (`default_for_call`, `SHORT_MASKED`).
    tail_skip: bool = False


# Tuning table (the H200 measurements behind each entry: docs/tuning.md).
#   d=64:  BN=128, 4 stages (148 KB smem).
#   d=128: BN=128, 2 stages (160 KB; 3 do not fit).
#   d=256: BN=64 keeps S at 32 registers next to a 128-register O; 2 stages + Q = 192 KB;
#          the conditional rescale (threshold 8) on, a loss at d=64 and d=128.
#   A second Q buffer per warpgroup on the persistent grid (d <= 128): a gain.
#   d=192 (q·k; V <= 128 wide, DeepSeek-V3's MLA prefill), not yet timed on the GPU: Q and K
#          as a 128- and a 64-wide piece (`FwdConsts.PIECES`). With V at 128, S and O take
#          the registers of the d=128 build (64 + 64 fp32 per thread at 128-key blocks), so
#          its tile: BN=128, 2 stages. Shared memory: Q 48 KB + K 96 KB + V 64 KB = 208 KB,
#          no room for two 16 KB O tiles: O is staged in Q's 128-wide piece on the plain
#          grid, in one turn-shared 16 KB tile on the persistent one (224 KB;
#          `epilogue.o_staging`), so one Q buffer per warpgroup. 64-key blocks would leave
#          S half the wgmma N and twice the steps.
_DEFAULT_CONFIGS = {
    64: FwdConfig(block_n=128, stages=4, q_buffers=2),
    128: FwdConfig(block_n=128, stages=2, q_buffers=2),
    192: FwdConfig(block_n=128, stages=2),
    256: FwdConfig(block_n=64, stages=2, rescale_threshold=8.0),
}

# Softcap calls take these fields. d=192: tanh's registers beside S of 128-key blocks spill
# (sm_90a: 4 local-memory instructions around the key loops; 10 inside them with a window,
# sink and varlen too); 64-key blocks (S at 32 registers per thread), 3 stages, spill none.
SOFTCAP_FIELDS = {192: {"block_n": 64, "stages": 3}}


def select_config(head_dim: int, head_dim_v: int, params: AttnParams,
                  override: FwdConfig | None = None) -> FwdConfig:
    """Heuristic config; `override` wins when given."""
    if override is not None:
        return override
    return _default_config(head_dim, params.mask.is_local, params.softcap > 0)


@functools.lru_cache(maxsize=None)
def _default_config(head_dim: int, local: bool, softcap: bool = False) -> FwdConfig:
    cfg = replace(_DEFAULT_CONFIGS[head_dim], lpt=local)
    if softcap and head_dim in SOFTCAP_FIELDS:
        cfg = replace(cfg, **SOFTCAP_FIELDS[head_dim])
    return cfg


@functools.lru_cache(maxsize=None)
def _three_warpgroups(cfg: FwdConfig) -> FwdConfig:
    # Taking turns (FwdConfig.pingpong), with one Q buffer each: the turns count from its
    # barrier's parity (`check_config`); the turns gain more than a second Q buffer did.
    return replace(cfg, consumer_wgs=3, persistent=True, q_buffers=1, pingpong=True)


@functools.lru_cache(maxsize=None)
def _with_persistent(cfg: FwdConfig, persistent: bool) -> FwdConfig:
    return replace(cfg, persistent=persistent)


# K/V bytes one wave of a persistent grid should keep hot in L2 (H200: 50 MB L2; Q and O
# stream through it too).
L2_KV_BUDGET = 24 << 20


def use_persistent(head_dim: int, lpt: bool, max_seqlen_q: int, uniform: bool,
                   plain: bool) -> bool:
    """Default of FwdConfig.persistent for one call: only where the H200 measured a gain.

    Measured per head dim, mask and length (see docs/tuning.md). Not measured, so on the
    plain grid: varlen / seqused_k, softcap, sink, sliding windows (those persistent builds
    also keep a few values in local memory around the tile loop). d=192 (not yet timed)
    takes d=256's rules: the 256/128 build it replaces ran them.
    """
    if not (uniform and plain):
        return False
    if lpt:
        return not (head_dim == 128 and max_seqlen_q >= 16384)
    if head_dim == 64:
        return True
    if head_dim in (192, 256):
        return max_seqlen_q >= 16384
    return head_dim == 128 and max_seqlen_q <= 1024


def use_three_warpgroups(head_dim: int, masked: bool, max_seqlen_q: int, uniform: bool,
                         plain: bool) -> bool:
    """Default of FwdConfig.consumer_wgs: 3 (192-row tiles) only where the H200 measured a gain.

    d=64 on the persistent grid, taking turns, with balanced chunks: a gain non-causal from
    2k rows and causal from 8k rows, a loss below (a 192-row tile wastes more of the
    diagonal); see docs/tuning.md.
    """
    if head_dim != 64 or not (uniform and plain):
        return False
    return max_seqlen_q >= (8192 if masked else 2048)


# Short masked calls (dense, no softcap, sink or left window) up to this many query rows
# take these fields (FwdConfig.tail_skip has the measurements): a warpgroup stops at its own
# last key block, and d=128 takes 64-key blocks so that it can. d=192 (not yet timed) as
# d=256, whose 256/128 build it replaces (up to 1k rows), on 64-key blocks with d=128's 3
# stages (168 KB with Q).
SHORT_MASKED = {64: (512, {"block_n": 64, "tail_skip": True}),
                128: (512, {"block_n": 64, "stages": 3, "tail_skip": True}),
                192: (1024, {"block_n": 64, "stages": 3, "tail_skip": True}),
                256: (1024, {"tail_skip": True})}


def default_for_call(d: int, local: bool, masked: bool, max_seqlen_q: int, dense: bool,
                     plain: bool, packed: bool = False, softcap: bool = False) -> FwdConfig:
    """The default config of one call (`persistent` still open): head dim, mask and softcap
    (`SOFTCAP_FIELDS`) first, then the shape-dependent choices where the H200 measured a
    gain. packed: sequences of different lengths (cu_seqlens); plain: no softcap, sink or
    left window."""
    if packed:
        # Packed documents: neighbouring CTAs on one head, K/V hot in L2, beat the
        # longest-first order there (docs/tuning.md, scripts/varlen-probe.py)
        return _in_order(d, local, softcap)
    if use_three_warpgroups(d, masked, max_seqlen_q, dense, plain):
        return _three_warpgroups(_default_config(d, local))
    if masked and dense and plain and max_seqlen_q <= SHORT_MASKED.get(d, (0,))[0]:
        return _short_masked(d, local)
    return _default_config(d, local, softcap)


@functools.lru_cache(maxsize=None)
def _in_order(d: int, local: bool, softcap: bool) -> FwdConfig:
    return replace(_default_config(d, local, softcap), lpt=False)


@functools.lru_cache(maxsize=None)
def _short_masked(d: int, local: bool) -> FwdConfig:
    return replace(_default_config(d, local), **SHORT_MASKED[d][1])


def persistent_launch(cfg: FwdConfig, max_seqlen_q: int, max_seqlen_k: int, uniform: bool,
                      batch: int, num_tiles: int, hq: int, hkv: int, d: int, dv: int, sms: int,
                      plain: bool, window_right: int = -1) -> tuple[FwdConfig, int, int]:
    """(config with `persistent` decided, grid size, hb_chunk) of one call.

    hb_chunk: how many (sequence, head) pairs a persistent grid works on together, so that
    their K/V (shared by a GQA group) fit in `L2_KV_BUDGET` (and, with LPT, the chunk spans
    `chunk_waves` waves, grown until the schedule is balanced: `balanced_chunk`). uniform:
    dense sequences without seqused_k; plain: no softcap, sink or left window.
    """
    if cfg.persistent is None:
        cfg = _with_persistent(cfg, cfg.consumer_wgs == 3 or use_persistent(
            d, cfg.lpt, max_seqlen_q, uniform, plain))
    if not cfg.persistent:
        return cfg, num_tiles, 1
    grid = min(num_tiles, sms)
    num_m_blocks = num_tiles // (hq * batch)
    kv_bytes = max(max_seqlen_k, 1) * (d + dv) * 2 * hkv // hq
    waves = cfg.chunk_waves if cfg.lpt else 0
    hb_chunk = min(max(L2_KV_BUDGET // max(kv_bytes, 1),
                       -(-waves * grid // max(num_m_blocks, 1)), 1), hq * batch)
    if cfg.lpt and cfg.balanced_chunks and num_tiles > 0:
        costs = tile_costs(max_seqlen_q, max_seqlen_k, window_right, 64 * cfg.consumer_wgs,
                           cfg.block_n)
        hb_chunk = balanced_chunk(costs, hq * batch, grid, hb_chunk)
    return cfg, grid, hb_chunk


# Head dims of the fp8 build (`host.forward_fp8`). d=256 stages O in a tile of its own
# (`epilogue.o_staging`: a bf16 tile does not fit the e4m3 Q buffer; sm_90a compile: 164 KB
# of shared memory, no local memory).
FP8_HEAD_DIMS = (64, 128, 256)


def check_config(cfg: FwdConfig, head_dim: int, fp8: bool = False) -> None:
    """Refuse configs the kernel cannot build (before anything is launched); `persistent`
    decided (the plain grid ignores q_buffers). fp8: the e4m3 build."""
    if fp8 and head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"the fp8 forward is built for head dims {FP8_HEAD_DIMS}, "
                         f"got {head_dim}")
    if fp8 and cfg.rescale_threshold:
        raise ValueError("the fp8 forward needs FwdConfig.rescale_threshold=0 (P is scaled "
                         "to e4m3's range against the exact running max)")
    if cfg.q_buffers not in (1, 2):
        raise ValueError(f"FwdConfig.q_buffers must be 1 or 2, got {cfg.q_buffers}")
    # (d=256 with one K/V stage fits two Q buffers but was slower: see docs/tuning.md)
    if cfg.q_buffers == 2 and cfg.persistent and (cfg.pingpong or head_dim > 128):
        raise ValueError("FwdConfig.q_buffers=2 on the persistent grid needs head_dim <= 128 "
                         "and no ping-pong: set q_buffers=1")
    if cfg.consumer_wgs not in (2, 3):
        raise ValueError(f"FwdConfig.consumer_wgs must be 2 or 3, got {cfg.consumer_wgs}")
    if cfg.consumer_wgs == 3 and (cfg.persistent is False or head_dim != 64):
        raise ValueError("FwdConfig.consumer_wgs=3 needs head_dim 64 and the persistent grid")
    # d=192: 128-key blocks fill 208 KB with 2 stages (`_DEFAULT_CONFIGS`); a third does not
    # fit (the compile would fail only at launch)
    if head_dim == 192 and cfg.block_n * cfg.stages > 256:
        raise ValueError(f"FwdConfig block_n={cfg.block_n}, stages={cfg.stages} at head_dim "
                         "192: the K/V rings fit 256 keys (128 x 2, 64 x 4)")
