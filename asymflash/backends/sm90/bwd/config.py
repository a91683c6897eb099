"""The sm90 backward's configuration: what one compiled kernel is (`BwdConfig`), the defaults
per head dim, and the per-call choices where the H200 measured a gain (`select_config`,
`_splits_warpgroups`; the measurements: docs/tuning.md). Pure Python, no Gluon: the kernels
are in `kernel.py` and `kernel_ws.py` (entered through `entry.py`), their launch in `host.py`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from asymflash.core.schedule import dispatch_imbalance, key_block_steps


@dataclass(frozen=True)
class BwdConfig:
    """Tile shape and scheduling switches of one compiled backward kernel."""

    block_m: int = 64  # query rows per step (the N of the Sᵀ/dPᵀ MMAs, the M of dQ)
    block_n: int = 128  # keys per CTA: two warpgroups of 64 (d <= 128), or shared (d = 256)
    # Keep dV = Pᵀ·dO in flight while dSᵀ is formed (more registers). A tie in bwd_ws's
    # default mode, a small gain in deterministic mode (on there, `select_config`).
    dv_overlap: bool = True
    dp_early: bool = True  # issue dPᵀ = V·dOᵀ with Sᵀ, overlapping the exponentials (more regs)
    # Deterministic mode, when a CTA passes a dQ turn on (its TMA reduce must have landed):
    # 0 in the step that issued it (waiting for the reduce there), 1 at the next step's main
    # barrier, 2 at the next step's reduce point (the reduce has had a whole step to land, but
    # the turn is held that much longer). 1 is fastest at d=128, and at d=256 with its dQ
    # halves staged in the operand buffers (dq_in_operands); see docs/tuning.md.
    # 3 (bwd_wide, d=256 only): 1's step, but after that barrier and by warp 0 alone
    # (`release_dq_turn_after_tma`'s FROM_WARP): the fence a release implies (a MEMBAR) then
    # waits under the dV and dPᵀ MMAs instead of holding every warp at the barrier.
    turn_release: int = 1
    # Issue dK += dSᵀ·Q after dQ = dS·K (not before it) and retire it only at the end of the
    # step: the tensor cores run dK while dQ is staged and reduced (scripts/bwd-timeline.py
    # showed them idle there). It moves the gap rather than filling it: dK no longer covers
    # forming dSᵀ. On at d=128; d=64 spilled with it and was slower (see docs/tuning.md).
    dk_late: bool = False
    # Load and stage the next step's lse/delta while the dQ MMA runs, instead of between the
    # Sᵀ issue and its wait. There, the shared-memory store of one stats buffer followed by
    # the read of the other made Triton's barrier pass put a CTA-wide bar.sync right after the
    # Sᵀ wait (the slot index is a runtime value: it cannot prove the two disjoint), and that
    # barrier waited for the stores, i.e. for the loads' latency. Faster at d <= 128; at d=256
    # and in deterministic causal mode slower (see docs/tuning.md).
    stats_late: bool = True
    # The warp-specialised kernel (`kernel_ws.py`): a load warp, and the two warpgroups out of
    # phase, meeting only through mbarriers (dQ by column halves, one reduce each). On at
    # d=128; at d=64 with `ws_dq_warp` (`select_config`). Not for softcap
    # (`_splits_warpgroups`: it keeps kernel.py's kernel). In deterministic mode a dQ warp of
    # its own waits for the turns and adds both warpgroups' tiles, so the turns' round trips
    # leave the compute warpgroups' path (kernel.py's kernel has no registers for such a
    # warp): deterministic mode then costs a few percent instead of tens (docs/tuning.md).
    split_warpgroups: bool = False
    ring_slots: int = 2  # bwd_ws: steps of Q/dO (and their statistics) its load warp keeps
    # Swizzle (bytes) of the fp32 dQ staging tile. With 128 (Triton's default for its 256-byte
    # rows) each warp's 64-bit stores from the wgmma accumulator take 4 shared-memory
    # wavefronts instead of 2 (ncu source counters: 9 % of all the kernel's wavefronts at
    # d=128): a half-warp writes rows 0-3 of a 32-byte column pair, and XOR-ing the 16-byte
    # chunk with the row maps the pair's chunks onto each other. With 32 the four rows land in
    # distinct banks; the TMA reduce then moves the tile as 8-column boxes (32-byte rows),
    # which costs more than the conflicts where the reduce is on the path. 32 at d=64 only
    # (see docs/tuning.md).
    dq_swizzle: int = 128
    # Each warpgroup stores its dQ tile in the wgmma accumulator's own order (128-bit stores,
    # 512 contiguous bytes per warp: no bank conflicts) and reduces it as one box into a
    # buffer of such tiles, which a portable kernel puts back in row order (`dq_fragments.py`,
    # after FA4's sm90 backward). Replaces dq_swizzle there. kernel.py's kernel takes it with
    # 128-row steps (d=64: both warpgroups' tiles, one box), bwd_wide each 128-column half.
    # On in the defaults of d=128 and d=256 and in d=64's bwd_ws builds (`select_config`;
    # see docs/tuning.md).
    dq_fragment: bool = False
    # bwd_ws: issue dK += dSᵀ·Q right after dQ = dS·K and wait for dQ alone, so dK runs while
    # dQ is staged and reduced (FA4's order), instead of issuing dK first, which made the wait
    # for dQ a wait for both (ncu: ~9 % of a compute warp's samples on that wait). dK then
    # waits for the other warpgroup's dSᵀ half too. On; off in deterministic mode, where it
    # was slower (`select_config`).
    ws_dk_after_dq: bool = False
    # The grid as (kv heads, key blocks, sequences) instead of (key blocks, kv heads,
    # sequences), with a causal mask (`sched.key_block`): the hardware then hands out key
    # block 0 (the most query blocks) of every head of a sequence first, which balances the
    # SMs' work (the host's replay of the hand-out: `dispatch_imbalance`). All heads at once
    # over long sequences lose L2 sharing. None: per call (`heads_first`: where all heads'
    # Q and dO fit HEADS_FIRST_L2_BYTES; where they do not, in chunks of heads: heads_chunk).
    heads_first: bool | None = None
    # Heads first in chunks of this many kv heads (a divisor of the call's; the grid is
    # (chunk's heads, chunks x key blocks, sequences): chunk by chunk, key block 0 of each of
    # its heads first). Where all heads' Q and dO overflow L2, one head after another ends
    # each head with its shortest blocks; chunks keep the balance and the L2 sharing. None:
    # per call (`head_chunk`); plain grids only (a persistent grid takes tiles in the order
    # of one head after another, or of all heads first).
    heads_chunk: int | None = None
    # bwd_ws without deterministic mode: the compute warpgroups hand their staged dQ tiles to
    # the dQ warp, which issues both reduces (deterministic mode's hand-over, without the
    # turns), instead of each issuing its own. On for d=64 unmasked, and causal from 2k rows
    # (1k as a persistent grid); off at d=128 (`select_config`; see docs/tuning.md).
    ws_dq_warp: bool = False
    # bwd_ws's masked steps (parts.probabilities' MASK_MODE). step_cols: the Pᵀ tile's
    # column indices formed inside the masked step (`bounds.allowed`'s STEP_COLS; None: at
    # d=64, where it measured faster; at d=128 it moved spills onto every step). mask_scores:
    # without softcap, Sᵀ masked to -inf before the exponentials instead of Pᵀ after them
    # (sm_90a: no local memory left around d=128's masked steps). On for masked d=64 calls
    # (`select_config`; unmasked ones mask only a ragged last key block, and their build
    # spilled more with it); at d=128 within the spread, so off.
    step_cols: bool | None = None
    mask_scores: bool = False
    # bwd_ws as a persistent grid, one CTA per SM taking the plain grid's tiles in its order
    # from a counter, the next tile's K/V and first Q/dO loading while the current one
    # finishes dQ and stores dK/dV (`host.persists`). A plain CTA's fixed cost is 1.9-3.4
    # steps (the K/V wait, the epilogue, the gap to the next CTA: scripts/bwd-ws-ctas.py).
    # On for unmasked calls without softcap at d=128, at d=64 up to 1k rows, and for causal
    # calls below 2k rows, the next tile taken once the current one's loads are out.
    # Deterministic mode (turns in the order tiles are taken: ascending, causal top-first,
    # no stagger, `kernel_ws._ws_tiles`): for d=64 causal below 2k rows (taken at a tile's
    # start, a tile could wait a whole tile for the CTA holding its predecessor). See
    # docs/tuning.md.
    ws_persistent: bool = False
    # K/V buffers of a persistent bwd_ws: with two, the load warp issues the next tile's K/V
    # as soon as it has taken the tile (its buffer's previous tile long done), instead of
    # once this tile's last MMAs have read K/V (that load, 4000-6000 cycles in flight, was
    # every tile boundary's critical path), and dK/dV stage in the tile's own K/V buffer.
    # Shared memory allows it only with 64-row steps at d=64 (182 KB). On for d=64 causal
    # calls below 1k rows (`select_config`).
    ws_kv_buffers: int = 1
    # bwd_wide (d = 256): no dQ staging tile; each step stages its dQ halves for their TMA
    # reduces in its own dO buffer and Q slot (32 KB each, free once dV/dPᵀ and dK have
    # retired), and the 32 KB go to a second dO buffer, so the next dO loads at barrier 1,
    # half a step earlier, and the high half no longer waits for the TMA unit to read the low
    # one out of the shared tile.
    dq_in_operands: bool = False
    # With dq_in_operands: the high dQ half's reduce is issued in the next step, once its
    # first MMAs are out, from the Q slot it was staged in (deterministic mode: where the
    # turn is released in the next step, turn_release 1-3, after that issue). Issued right after
    # the low half's, its UTMAREDG waited in the MIO queue for the TMA unit to read the low
    # half out, and the loop's back branch behind it (Nsight Compute: 15 % of the kernel's
    # warp samples on those three instructions at d=256).
    dq_hi_late: bool = False


# FA3's Hopper shapes (BM=64, BN=128, two MMA warpgroups) to start from. d=128 (ptxas,
# sm_90a) runs at the 255-register limit: it retires dV before forming dSᵀ (dv_overlap=False:
# 252 registers unmasked, 2-14 spill instructions on the masked path only, vs 254 and 10-22
# with the overlap); 128 query rows per step would need 256 accumulator registers. d=64 takes
# 128 query rows per step (half the steps, so half the per-step barriers, waits and dQ
# reduces; 255 registers), faster (see docs/tuning.md).
_DEFAULT_CONFIGS = {
    64: BwdConfig(block_m=128, block_n=128, dq_swizzle=32),
    128: BwdConfig(block_m=64, block_n=128, dv_overlap=False, dk_late=True,
                   split_warpgroups=True, dq_fragment=True, ws_dk_after_dq=True),
    # d_qk = 192, d_v <= 128 (DeepSeek-V3's 128 + 64 rope / 128): the head dim in a 128- and
    # a 64-wide piece (Gluon's tensors are powers of two), so no MMA runs on zero columns
    # (the 256/128 build did 1024 units of MMA work a step for 832); dQ leaves row-major as
    # 64-column boxes (`plan._dq_tile`). bwd_ws's 128-key tile (each warpgroup 64 keys, as
    # at d=128) halves the Q/dO loads and dQ reduces per key of bwd_wide's 64-key one, whose
    # MMAs the warpgroups split down to 32 columns; dK and dV then hold 160 of a partition's
    # 240 registers, so dPᵀ is issued after the probabilities (dp_early off). Deterministic
    # and softcap calls keep bwd_wide's 64-key tile (`select_config`; no dq_in_operands:
    # the dQ halves have no room in dv = 128's 16 KB dO buffer).
    192: BwdConfig(block_m=64, block_n=128, dv_overlap=False, dp_early=False,
                   split_warpgroups=True),
    256: BwdConfig(block_m=64, block_n=64, dv_overlap=False,  # FA3's hdim-256 tile
                   stats_late=False, dq_fragment=True, dq_in_operands=True,
                   dq_hi_late=True),
}


# Q and dO bytes of all (q) heads of one sequence that heads-first order may keep in flight
# (BwdConfig.heads_first).
HEADS_FIRST_L2_BYTES = 24 << 20


# A chunked grid order (BwdConfig.heads_chunk) is taken where it lowers the replayed
# imbalance of one head after another by more than this.
CHUNK_GAIN = 0.01


def heads_first(cfg: BwdConfig, masked: bool, uniform: bool, deterministic: bool, hq: int,
                max_seqlen_q: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether a call's grid runs all heads first (BwdConfig.heads_first): causal or
    right-window masks on dense lengths, not deterministic."""
    if not (masked and uniform) or deterministic:
        return False
    if cfg.heads_first is not None:
        return cfg.heads_first
    return hq * max_seqlen_q * (head_dim + head_dim_v) * 2 <= HEADS_FIRST_L2_BYTES


def head_chunk(cfg: BwdConfig, masked: bool, uniform: bool, deterministic: bool,
               persistent: bool, hq: int, hkv: int, batch: int, max_seqlen_q: int,
               max_seqlen_k: int, window_right: int, head_dim: int, head_dim_v: int,
               slots: int) -> int:
    """The grid's head order: 0, one head after another (key blocks first); hkv, all heads
    first (`heads_first`); 2 <= c < hkv, heads first in chunks of c kv heads
    (BwdConfig.heads_chunk; plain grids only)."""
    if not (masked and uniform) or deterministic or cfg.heads_first is False:
        return 0
    chunk = cfg.heads_chunk
    if chunk is not None:  # an explicit chunk wins (1: one head after another)
        if chunk < 1 or hkv % chunk or (1 < chunk < hkv and persistent):
            raise ValueError(f"BwdConfig.heads_chunk {chunk}: needs a divisor of the {hkv} kv "
                             "heads and, below all of them, the plain grid (ws_persistent off)")
        return hkv if chunk == hkv else 0 if chunk == 1 else chunk
    if heads_first(cfg, masked, uniform, deterministic, hq, max_seqlen_q, head_dim,
                   head_dim_v):
        return hkv
    if persistent:
        return 0
    per_head = hq // hkv * max_seqlen_q * (head_dim + head_dim_v) * 2
    fits = [c for c in range(2, hkv) if hkv % c == 0 and c * per_head <= HEADS_FIRST_L2_BYTES]
    if not fits:
        return 0
    steps = key_block_steps(cfg.block_m, cfg.block_n, max_seqlen_q, max_seqlen_k,
                            window_right, hq // hkv)
    flat = dispatch_imbalance(steps, hkv, batch, 1, slots)
    chunked = dispatch_imbalance(steps, hkv, batch, fits[-1], slots)
    return fits[-1] if flat - chunked > CHUNK_GAIN else 0


def _splits_warpgroups(head_dim: int, cfg: BwdConfig, softcap: bool) -> bool:
    """Whether a call runs `bwd_ws`'s kernel (BwdConfig.split_warpgroups). Not with softcap:
    its chain-rule tile does not fit a partition's 240 registers (sm_90a: 40 local-memory
    instructions in every step)."""
    return (cfg.split_warpgroups
            and (head_dim, cfg.block_m) in ((128, 64), (64, 64), (64, 128), (192, 64))
            and not softcap)


def _ptxas13() -> bool:
    """Whether Triton assembles sm_90a with CUDA 13's ptxas (`common.sm90_ptxas_major`)."""
    from .. import common

    return common.GLUON_ERROR is None and common.sm90_ptxas_major() >= 13


def select_config(head_dim: int, override: BwdConfig | None = None,
                  softcap: bool = False, deterministic: bool = False,
                  masked: bool = False, max_seqlen_q: int | None = None,
                  window: bool = False) -> BwdConfig:
    """Heuristic config; `override` wins when given. masked: a causal mask or a sliding
    window; window: the mask has a left edge (a sliding window); max_seqlen_q: the call's
    longest query sequence (None: a long one, as the compile checks build)."""
    if override is not None:
        cfg = override
    else:
        cfg = _DEFAULT_CONFIGS[head_dim]
        if deterministic:
            # see BwdConfig.stats_late and BwdConfig.ws_dk_after_dq
            cfg = replace(cfg, stats_late=False, ws_dk_after_dq=False)
            if head_dim == 128 and not softcap:
                # bwd_ws's deterministic kernel keeps dV in flight (BwdConfig.dv_overlap)
                cfg = replace(cfg, dv_overlap=True)
            if head_dim == 256:
                # BwdConfig.turn_release has the numbers; the late high dQ half (dq_hi_late,
                # the non-deterministic default) is released with the turn in the next step,
                # from warp 0 (turn_release 3): faster than without it, and than 1. Not at
                # d=192: its 64-column fp32 boxes are two 128-byte boxes, issued from warps
                # 0 and 1, so warp 0 alone cannot see them land.
                cfg = replace(cfg, turn_release=3)
            if head_dim == 64 and not softcap:
                # bwd_ws's kernel with 128-row steps, its dQ warp taking the turns and the
                # reduces off the compute warpgroups (which spill: sm_90a 37 local-memory
                # instructions, 162 causal), row-major dQ tiles swizzled by 128 as at d=128;
                # 64-row steps spill nothing and were slower. Faster than kernel.py's
                # deterministic mode (see docs/tuning.md).
                cfg = replace(cfg, split_warpgroups=True, dq_swizzle=128)
                if masked and not window and max_seqlen_q is not None and max_seqlen_q < 1024:
                    # short causal calls as the default mode runs them (below), turns in
                    # tile order
                    cfg = replace(cfg, block_m=64, ring_slots=3, dq_fragment=True,
                                  ws_persistent=True, ws_kv_buffers=2)
        elif head_dim == 64 and not softcap and max_seqlen_q is not None and (
                (masked and not window and max_seqlen_q < 1024)
                or (not masked and max_seqlen_q <= 256)):
            # Short calls (causal below 1k rows, unmasked up to 256): bwd_ws with 64-row
            # steps (for causal calls a finer diagonal; for all twice the
            # steps over a tile's fixed cost; no spills in its step loops), three ring slots,
            # fragment-order dQ tiles, as a persistent grid (the fastest of the variants
            # tried; see docs/tuning.md). From 1k rows the 128-row build (above).
            # With two K/V buffers (BwdConfig.ws_kv_buffers; 256 / 512 / 1k / 2k rows, two
            # columns each): 108 / 187 / 278-279 / 353-357 -> 117 / 194-195 / 278-279 /
            # 348-350. Unmasked calls up to 256 rows too: 128 / 256 / 384 rows 116-117 /
            # 203 / 269 (the 128-row build, below) -> 123 / 213 / 265 (512: 317 -> 297-300).
            cfg = replace(cfg, split_warpgroups=True, block_m=64, ring_slots=3,
                          dq_fragment=True, ws_persistent=True, ws_kv_buffers=2)
        elif head_dim == 64 and not softcap and (not masked or (
                not window and (max_seqlen_q is None or max_seqlen_q >= 1024))):
            # bwd_ws's kernel as deterministic d=64 runs it (above), its dQ warp issuing the
            # reduces, dQ tiles in fragment order (BwdConfig.ws_dq_warp has the numbers):
            # unmasked +6 % at 1k rows, +8-22 % from 2k, a tie at 512; causal from 2k rows
            # +4-9 % (a tie at 1k, -7 % at 512), and from 1k as a persistent grid (below).
            # Sliding windows were not timed: they stay.
            cfg = replace(cfg, split_warpgroups=True, ws_dq_warp=True, dq_fragment=True,
                          dq_swizzle=128)
        if head_dim == 128 and not deterministic and _ptxas13():
            # dK after dQ keeps dK's accumulator in flight beside dQ's; CUDA 13's ptxas
            # (triton 3.9) spills that far more than CUDA 12.9's (sm_90a local-memory
            # instructions, with common.ptxas13_register_options: 84 -> 34 unmasked
            # persistent, 144 -> 51 causal; with it on, triton 3.8 31 unmasked, 3.6 41 / 40).
            # With CUDA 12's it was a tie unmasked and 5 % causal (BwdConfig.ws_dk_after_dq;
            # not timed with CUDA 13's).
            cfg = replace(cfg, ws_dk_after_dq=False)
        short = max_seqlen_q is not None and max_seqlen_q <= 1024
        if not (deterministic or masked or softcap) and (head_dim == 128 or (
                head_dim == 64 and short)):
            cfg = replace(cfg, ws_persistent=True)  # BwdConfig.ws_persistent has the numbers
        elif (head_dim in (64, 128) and masked and not window and not (deterministic or softcap)
              and max_seqlen_q is not None and max_seqlen_q < 2048):
            cfg = replace(cfg, ws_persistent=True)  # causal below 2k rows (ditto)
        elif (head_dim in (64, 128) and masked and not window and deterministic
              and not softcap and max_seqlen_q is not None and max_seqlen_q < 2048):
            # deterministic causal below 2k rows (BwdConfig.ws_persistent)
            cfg = replace(cfg, ws_persistent=True)
        if head_dim == 64 and masked and not softcap:
            cfg = replace(cfg, mask_scores=True)  # BwdConfig.mask_scores has the numbers
        if head_dim == 192 and (deterministic or softcap):
            # bwd_ws has no dQ pieces for its dQ warp, nor registers for softcap's tile
            # (`_splits_warpgroups`): bwd_wide's 64-key tile
            cfg = replace(cfg, split_warpgroups=False, block_n=64, stats_late=False)
        if softcap:
            # The softcap chain-rule tile takes the registers dPᵀ's early issue needs (d=128:
            # 2 spill instructions in the unmasked loop otherwise; d=64 with 128-row steps:
            # ~200).
            cfg = replace(cfg, dp_early=False)
    # The MMA layouts hard-wire two warpgroups; d <= 128 and bwd_ws at d = 192 give each
    # warpgroup 64 keys, bwd_wide (d = 192, d = 256) has them share 64 keys. 64 query rows
    # per step, or 128 at d = 64 (registers allow it).
    wide = head_dim == 256 or (head_dim == 192 and not _splits_warpgroups(head_dim, cfg,
                                                                           softcap))
    block_n = 64 if wide else 128
    block_ms = (64, 128) if head_dim == 64 else (64,)
    if cfg.ws_kv_buffers not in (1, 2) or (cfg.ws_kv_buffers == 2 and (
            head_dim != 64 or cfg.block_m != 64)):
        raise ValueError(f"unsupported sm90 backward config {cfg} at head dim {head_dim}: "
                         "ws_kv_buffers is 1, or 2 at head dim 64 with 64-row steps")
    if cfg.turn_release not in (0, 1, 2, 3) or (cfg.turn_release == 3 and head_dim != 256):
        raise ValueError(f"unsupported sm90 backward config {cfg} at head dim {head_dim}: "
                         "turn_release is 0, 1 or 2, or 3 at head dim 256")
    if head_dim == 192 and (cfg.dq_fragment or cfg.dq_in_operands):
        raise ValueError(f"unsupported sm90 backward config {cfg} at head dim 192: dQ "
                         "leaves row-major (no dq_fragment, no dq_in_operands)")
    if cfg.block_n != block_n or cfg.block_m not in block_ms or cfg.ring_slots < 2:
        raise ValueError(f"unsupported sm90 backward config {cfg} at head dim {head_dim}: "
                         f"needs block_n {block_n}, block_m in {block_ms}, ring_slots >= 2")
    return cfg
