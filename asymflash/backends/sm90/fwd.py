"""Warp-specialised FlashAttention forward for Hopper (sm_90a), written in Gluon.

One CTA owns 128 query rows of one (sequence, head) and runs three roles
(`gl.warp_specialize`):

* load (1 warp): TMA-loads the two 64-row Q tiles once, then streams K and V blocks into
  separate `STAGES`-deep shared-memory rings. Each ring slot has a "ready" mbarrier (TMA
  transaction count) and an "empty" mbarrier that both consumers arrive on.
* two consumer warpgroups (the default partition and one 4-warp worker run the same code on
  their own 64-row Q tile): S = Q·Kᵀ with async wgmma, online softmax in exp2 units (log2(e)
  folded into the scale), P cast to 16 bit and kept in registers as the A operand of P·V.
  FA3's intra-warpgroup overlap: S_j is issued before P_{j-1}·V_{j-1}, and the softmax of
  S_j runs while that P·V is still in flight.

Persistent grid (`FwdConfig.persistent`; by default chosen per shape in `use_persistent`):
one CTA per SM walks tiles wave by wave (CTA order reversed on odd waves), the tile list
cut into chunks of (sequence, head) pairs whose K/V fit in L2, query blocks longest-first
within a chunk. Every role walks the same list and carries its K/V ring position and Q
barrier parity across tiles, so the loader fetches the next tile's Q (released by each
warpgroup after its last S = Q·Kᵀ) and first K/V blocks while the consumers finish the last
P·V, the normalisation and the store of the current one.

Masks are bottom-right aligned (see `core/params.py`). The key-block range of a CTA is split
into a peeled first block (always masked, which also covers empty rows and empty key
sequences), a masked prefix (sliding-window left edge), an unmasked middle and a masked
suffix (causal diagonal / right window / ragged end), so the common blocks pay no mask.

FA4 tricks, chosen per call through `FwdConfig` (the defaults: `fwd_config.py`) or, for every
call, by the switches ASYMFLASH_SM90_EXP2_EMU=k and ASYMFLASH_SM90_RESCALE=t (`fa4_tricks`):
* `exp2_emu_every = k`: every k-th exponential runs as a cubic polynomial on the FMA pipe
  instead of MUFU (2^x = 2^floor(x) · p(frac(x)), the integer part added to the exponent
  bits). Off: slower on the H200 wherever measured (`FwdConfig.exp2_emu_every`).
* `rescale_threshold = t > 0`: the running max used for P only moves when a row's max grows
  by more than t (log2 units), and O is rescaled only in warps where some row moved. Exact:
  the final normalisation uses the same stale max for O and for the row sum. On at d=256.

Lengths, head counts, window sizes and scales are runtime arguments; a kernel is compiled
once per (dtype, head dims, config, feature switches).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from asymflash.core.params import AttnParams, MaskSpec, SeqInfo, cdiv
from asymflash.runtime import dispatch

from ...runtime.launch import DirectLaunch, descriptor_token, sm_count
from .fwd_config import (  # noqa: F401 - re-exported: tests, scripts and bwd read them here
    _DEFAULT_CONFIGS,
    L2_KV_BUDGET,
    SHORT_MASKED,
    FwdConfig,
    _default_config,
    _three_warpgroups,
    _with_persistent,
    balanced_chunk,
    check_config,
    default_for_call,
    persistent_launch,
    schedule_imbalance,
    select_config,
    tile_costs,
    use_persistent,
    use_three_warpgroups,
)

try:  # Gluon is optional: a CPU-only or older triton must still import this module.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any import failure means: no fast path
    _GLUON_ERROR = f"triton.experimental.gluon (Hopper) not importable: {exc!r}"

# The Gluon API changes between releases; only the versions this kernel was verified on run it.
TESTED_TRITON_VERSIONS = ("3.6.0",)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # tensor shapes must be powers of two in Gluon 3.6
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_M_WG = 64  # query rows per consumer warpgroup (the wgmma M)
BLOCK_M = 2 * BLOCK_M_WG  # query rows per CTA


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a forward launch needs that depends on shapes and switches only, not on
    the tensors' data: built once per distinct call (`launch_plan`), so a repeated call
    pays for descriptors, two allocations and the launch alone (host time is what 512-row
    calls were bound by, H200 2026-11-29)."""

    cfg: FwdConfig
    grid: int
    hb_chunk: int
    num_m_blocks: int
    num_tiles: int
    constexprs: dict
    o_width: int  # output_box_width


# FA4's two forward tricks as process-wide switches (both off by default: on the H200 each
# lost, see fwd_config.py's tuning table), so that any call, and the benchmark, can run with them:
# ASYMFLASH_SM90_EXP2_EMU=k (2, 4 or 8) puts one exponential in k on the FMA pipe,
# ASYMFLASH_SM90_RESCALE=t (> 0, log2 units; FA4 uses 8) rescales O only when a row's max
# grew by more than t. They apply to the config a call would otherwise run; an explicit
# FwdConfig wins. Part of dispatch.SWITCHES, so call plans are keyed by them.
EXP2_EMU_SWITCH = "ASYMFLASH_SM90_EXP2_EMU"
RESCALE_SWITCH = "ASYMFLASH_SM90_RESCALE"
EXP2_EMU_CHOICES = (0, 2, 4, 8)


def fa4_tricks() -> tuple[int | None, float | None]:
    """(exp2_emu_every, rescale_threshold) forced by the switches, None where a switch is
    unset (the call's config keeps its own value; "0" turns a trick off); ValueError on a bad
    value."""
    emu = _switch_value(EXP2_EMU_SWITCH, int, lambda k: k in EXP2_EMU_CHOICES,
                        "0 (off), 2, 4 or 8 (one exponential in k on the FMA pipe)")
    thr = _switch_value(RESCALE_SWITCH, float, lambda t: 0.0 <= t < float("inf"),
                        "0 (off) or a positive threshold in log2 units (FA4 uses 8)")
    return emu, thr


def _switch_value(name: str, parse, valid, expected: str):
    """The value of switch `name` (None when unset or empty), ValueError when it does not
    parse or is not `valid`."""
    text = dispatch.switch(name)
    if not text:
        return None
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return value


NO_TRICKS = (None, None)  # what callers with an explicit FwdConfig pass to `launch_plan`


@functools.lru_cache(maxsize=4096)
def launch_plan(d: int, dv: int, max_seqlen_q: int, max_seqlen_k: int, uniform: bool,
                has_seqused: bool, window_left: int, window_right: int, softcap: bool,
                has_sink: bool, batch: int, hq: int, hkv: int, sms: int,
                cfg: FwdConfig | None, tricks: tuple = NO_TRICKS) -> LaunchPlan:
    """The config, grid and constexprs of one call (cfg: an override, or None; tricks:
    `fa4_tricks()`, applied to the config; callers with an override pass NO_TRICKS)."""
    plain = not softcap and not has_sink and window_left < 0
    local = window_left >= 0 or window_right >= 0
    dense = uniform and not has_seqused
    o_width = output_box_width(d, dv, uniform and max_seqlen_q % 64 == 0)
    if cfg is None:
        cfg = default_for_call(d, local, window_right >= 0, max_seqlen_q, dense, plain)
    if tricks[0] is not None:
        cfg = replace(cfg, exp2_emu_every=tricks[0])
    if tricks[1] is not None:
        cfg = replace(cfg, rescale_threshold=tricks[1])
    num_m_blocks = cdiv(max_seqlen_q, BLOCK_M_WG * max(cfg.consumer_wgs, 1))
    num_tiles = num_m_blocks * hq * batch
    cfg, grid, hb_chunk = persistent_launch(cfg, max_seqlen_q, max_seqlen_k, dense, batch,
                                            num_tiles, hq, hkv, d, dv, sms, plain, window_right)
    check_config(cfg, d)
    consts = _constexprs(d, dv, cfg, uniform=dense, has_seqused=has_seqused,
                         has_left=window_left >= 0, has_right=window_right >= 0,
                         softcap=softcap, has_sink=has_sink)
    consts.update(_launch_options(cfg))
    return LaunchPlan(cfg, grid, hb_chunk, num_m_blocks, num_tiles, consts, o_width)


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------

if _GLUON_ERROR is None:

    @gluon.constexpr_function
    def _emu_asm(every):
        """PTX for `every` packed elements: the first every-1 on MUFU, the last on FMA.

        Cubic for 2^f on [0, 1) with p(0)=1 and p(1)=2 pinned (continuous across integer
        steps); max relative error 1.03e-4, far below the bf16/fp16 rounding P receives
        before P·V. Coefficients of f, f^2, f^3: 0.6954244, 0.22630768, 0.07826797.

        floor(x) comes from adding 1.5 * 2^23 rounding down: the sum's ulp is 1, so it is
        floor(x) + 1.5 * 2^23 exactly, with floor(x) in its low mantissa bits; shifted left by
        23 those bits are floor(x) << 23, what the exponent field needs (the constant's own
        bits shift out). A cvt to an integer (F2I) and a round to an integral float (FRND)
        did the same, but both run on the same quarter-rate unit as MUFU.EX2 (16 per clock
        per SM on sm_90), so each emulated element cost two of those slots instead of one.
        The result is bit-identical (`core/exp2.py` models it).
        """
        every = int(every)
        lines = ["{", ".reg .f32 ef, ej, et, ep;", ".reg .b32 ei, eb;"]
        for i in range(every - 1):
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${every + i};")
        x, y = f"${2 * every - 1}", f"${every - 1}"
        lines += [
            # Clamp so that 2^floor(x) stays a normal number; -inf becomes exactly 0 below.
            f"max.ftz.f32 ef, {x}, 0fC2FE0000;",
            "add.rm.ftz.f32 et, ef, 0f4B400000;",
            "sub.ftz.f32 ej, et, 0f4B400000;",
            "sub.ftz.f32 ef, ef, ej;",
            "fma.rn.ftz.f32 ep, ef, 0f3DA04AF5, 0f3E67BD33;",
            "fma.rn.ftz.f32 ep, ep, ef, 0f3F320755;",
            "fma.rn.ftz.f32 ep, ep, ef, 0f3F800000;",
            "mov.b32 ei, et;",
            "shl.b32 ei, ei, 23;",
            "mov.b32 eb, ep;",
            "add.s32 eb, eb, ei;",
            f"mov.b32 {y}, eb;",
            "}",
        ]
        return "\n".join(lines)

    @gluon.constexpr_function
    def _emu_constraints(every):
        return ",".join(["=r"] * every + ["r"] * every)

    @gluon.jit
    def _exp2(x, EMU_EVERY: gl.constexpr):
        """2^x; with EMU_EVERY=k one element in k is computed on the FMA pipe."""
        if EMU_EVERY == 0:
            return gl.exp2(x)
        else:
            return gl.inline_asm_elementwise(_emu_asm(EMU_EVERY), _emu_constraints(EMU_EVERY),
                                             [x], dtype=gl.float32, is_pure=True,
                                             pack=EMU_EVERY)

    @gluon.constexpr_function
    def _rescale_asm(pack):
        """PTX for `pack` elements of O, each multiplied in place by its row's alpha, unless the
        warp's flag (the same in every element: operand 3 pack is the first) is 0. The branch
        is warp-uniform, so the skipped multiplies are not issued at all."""
        pack = int(pack)
        lines = ["{", ".reg .pred %rs_q;", f"setp.eq.u32 %rs_q, ${3 * pack}, 0;",
                 "@%rs_q bra.uni RS_SKIP_${:uid};"]
        lines += [f"mul.f32 ${i}, ${i}, ${2 * pack + i};" for i in range(pack)]
        lines += ["RS_SKIP_${:uid}:", "}"]
        return "\n".join(lines)

    @gluon.constexpr_function
    def _rescale_constraints(pack):
        # Each output tied to its own input element: O is updated in place, with no second
        # copy live (a second copy spilled at d=64 with three warpgroups).
        pack = int(pack)
        return ",".join(["=r"] * pack + [str(i) for i in range(pack)] + ["r"] * (2 * pack))

    @gluon.jit
    def _rescale_if_moved(acc, alpha_o):
        """FA4's conditional rescale (`FwdConfig.rescale_threshold`), decided per warp: O is
        multiplied by alpha only in warps where some row moved its max (alpha < 1); alpha is
        exactly 1 in the other rows. A warp vote decides it: the reduction over the
        warpgroup the first version used went through shared memory and a barrier every key
        block, and lost. alpha_o holds a thread's two rows."""
        moved = gl.inline_asm_elementwise(
            "{ .reg .pred %mv_p, %mv_q; setp.lt.f32 %mv_p, $2, 0f3F800000;"
            " setp.lt.or.f32 %mv_p, $3, 0f3F800000, %mv_p;"
            " vote.sync.any.pred %mv_q, %mv_p, 0xffffffff;"
            " selp.u32 $0, 1, 0, %mv_q; selp.u32 $1, 1, 0, %mv_q; }",
            "=r,=r,r,r", [alpha_o], dtype=gl.int32, is_pure=True, pack=2)
        alpha_b, moved_b = gl.broadcast(gl.expand_dims(alpha_o, 1), gl.expand_dims(moved, 1))
        # 32 elements per asm block: a thread holds 32, 64 or 128 of O (dv = 64 / 128 / 256)
        PACK: gl.constexpr = 32
        return gl.inline_asm_elementwise(_rescale_asm(PACK), _rescale_constraints(PACK),
                                         [acc, alpha_b, moved_b], dtype=gl.float32,
                                         is_pure=True, pack=PACK)

    @gluon.jit
    def _to_16bit(x, dtype: gl.constexpr):
        """x.to(dtype) for a 16-bit dtype, two neighbouring elements per cvt with the first in
        the low half. `x.to(dtype)` converts element by element and packs each pair high-first,
        so every register of P (and dSᵀ) needed a PRMT half swap before it could be a wgmma A
        operand: 32 of ~450 instructions per key block at d=64 (sm_90a SASS, 2026-11-30)."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _tanh(x):
        # tanh.approx has ~5e-4 relative error, i.e. 0.025 in a logit capped at 50: use the
        # exact-ish identity tanh(x) = 1 - 2 / (2^(2x·log2 e) + 1) (ex2 + rcp, MUFU twice).
        e = gl.exp2(x * (2.0 * 1.4426950408889634))
        return 1.0 - 2.0 / (e + 1.0)

    # ------------------------------------------------------------------------------------------
    # load role
    # ------------------------------------------------------------------------------------------
    @gluon.constexpr_function
    def _heads_axis(block_shape) -> bool:
        """A (rows, heads, dim) descriptor (`tma_heads`) rather than (rows, heads·dim)."""
        return len(block_shape) == 3

    @gluon.constexpr_function
    def _tile_layout(layout):
        """The 2-D shared layout of a descriptor's tile (the same bytes as its 3-D box)."""
        return gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2,
                                    layout.transposed, layout.fp4_padded)

    @gluon.jit
    def _copy_rows(desc, row, head, WIDTH: gl.constexpr, bar, dst, pred):
        """TMA-load one tile of head `head` from rows [row, row + box) into dst [box, WIDTH].

        A (rows, heads·dim) descriptor reads column head·WIDTH; a (rows, heads, dim) one reads
        (row, head, 0), and the TMA unit zero-fills the columns from dim up to WIDTH (head
        dims between the compiled widths, without padded copies of q, k, v).
        """
        if _heads_axis(desc.block_shape):
            tma.async_copy_global_to_shared(
                desc, [row, head, 0], bar, dst._reinterpret(desc.dtype, desc.block_shape,
                                                            desc.layout), pred=pred)
        else:
            tma.async_copy_global_to_shared(desc, [row, head * WIDTH], bar, dst, pred=pred)

    @gluon.jit
    def _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                   k_empty, v_ready, v_empty, q_row, q_head, kv_row, kv_head, n_lo, n_hi, it0,
                   q_slot0, q_phase, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WAIT_Q: gl.constexpr,
                   NUM_WG: gl.constexpr):
        """Q of one tile (NUM_WG x 64 rows) into Q buffers q_slot0, q_slot0 + 1, ..., then
        its key blocks [n_lo, n_hi) at ring positions it0, ...

        With WAIT_Q (persistent grid) a Q buffer is refilled only after its warpgroup released
        the tile it last held (q_empty, parity q_phase ^ 1: the first wait passes at once).
        """
        for wg in gl.static_range(NUM_WG):
            if WAIT_Q:
                mbarrier.wait(q_empty.index(q_slot0 + wg), q_phase ^ 1)
            mbarrier.expect(q_bar.index(q_slot0 + wg), q_desc.block_type.nbytes)
            _copy_rows(q_desc, q_row + wg * 64, q_head, HEAD_DIM, q_bar.index(q_slot0 + wg),
                       q_smem.index(q_slot0 + wg), True)
        for i in range(n_hi - n_lo):
            pos = it0 + i
            slot = pos % STAGES
            # Fresh mbarriers count as having completed the phase before phase 0, so the first
            # pass through the ring does not wait.
            phase = ((pos // STAGES) & 1) ^ 1
            row = kv_row + (n_lo + i) * BLOCK_N
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _copy_rows(k_desc, row, kv_head, HEAD_DIM, k_ready.index(slot), k_smem.index(slot),
                       True)
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _copy_rows(v_desc, row, kv_head, HEAD_DIM_V, v_ready.index(slot),
                       v_smem.index(slot), True)

    # ------------------------------------------------------------------------------------------
    # tile schedule: which (query block, head, sequence) a tile index is, and its key blocks
    # ------------------------------------------------------------------------------------------
    @gluon.jit
    def _tile_of(tile, n_heads, n_batch, num_m_blocks, hb_chunk, LPT: gl.constexpr,
                 CHUNKED: gl.constexpr):
        """(query block, head, sequence) of a tile index.

        CHUNKED (persistent grid): (sequence, head) pairs, heads of one sequence adjacent, are
        cut into chunks of hb_chunk pairs whose K/V fit in L2 together; a chunk's tiles are
        consecutive, query blocks outer (last block first with LPT: it sees the most keys under
        a causal mask), pairs inner. Otherwise the one-CTA-per-tile orders of the plain grid.
        """
        n_hb = n_heads * n_batch
        if CHUNKED:
            per_chunk = hb_chunk * num_m_blocks
            chunk = tile // per_chunk
            hb0 = chunk * hb_chunk
            width = gl.minimum(hb_chunk, n_hb - hb0)
            r = tile - chunk * per_chunk
            m_blk = r // width
            if LPT:
                m_blk = num_m_blocks - 1 - m_blk
            hb = hb0 + r % width
        elif LPT:
            # Later query tiles see more keys under a causal/local mask: start them first and
            # spread each wave over all heads and sequences.
            m_blk = num_m_blocks - 1 - tile // n_hb
            hb = tile % n_hb
        else:
            # Neighbouring CTAs share a head, so its K/V stays hot in L2.
            m_blk = tile % num_m_blocks
            hb = tile // num_m_blocks
        return m_blk, hb % n_heads, hb // n_heads

    @gluon.jit
    def _sequence(batch, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr,
                  UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr):
        """First packed query/key row and the query/key lengths of one sequence."""
        if UNIFORM:
            q_start = batch * seqlen_q
            k_start = batch * seqlen_k
        else:
            q_start = gl.load(cu_q_ptr + batch)
            seqlen_q = gl.load(cu_q_ptr + batch + 1) - q_start
            k_start = gl.load(cu_k_ptr + batch)
            seqlen_k = gl.load(cu_k_ptr + batch + 1) - k_start
        if HAS_SEQUSED:
            seqlen_k = gl.load(used_k_ptr + batch)
        return q_start, k_start, seqlen_q, seqlen_k

    @gluon.jit
    def _key_blocks(m0, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """Key blocks of the query tile at row m0: visited [n_lo, n_hi), unmasked [n_a, n_b)."""
        shift = seqlen_k - seqlen_q
        row_last = gl.minimum(m0 + BLOCK_M - 1, seqlen_q - 1)
        # At least one block, so that rows without keys still produce out = 0, lse = -inf
        # through the masked peeled block.
        n_hi = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        n_lo = 0
        if HAS_RIGHT:
            n_hi = gl.minimum(n_hi, (gl.maximum(row_last + shift + window_right + 1, 0)
                                     + BLOCK_N - 1) // BLOCK_N)
        if HAS_LEFT:
            n_lo = gl.maximum(m0 + shift - window_left, 0) // BLOCK_N
        n_hi = gl.maximum(n_hi, n_lo + 1)
        # Blocks [n_a, n_b) are allowed for every row of the tile: no mask there.
        n_a = n_lo + 1
        if HAS_LEFT:
            n_a = gl.maximum(n_a, (gl.maximum(row_last + shift - window_left, 0)
                                   + BLOCK_N - 1) // BLOCK_N)
        n_a = gl.minimum(n_a, n_hi)
        n_b = seqlen_k // BLOCK_N
        if HAS_RIGHT:
            n_b = gl.minimum(n_b, gl.maximum(m0 + shift + window_right + 1, 0) // BLOCK_N)
        n_b = gl.minimum(gl.maximum(n_b, n_a), n_hi)
        return n_lo, n_a, n_b, n_hi

    # ------------------------------------------------------------------------------------------
    # softmax role (runs inside each consumer warpgroup)
    # ------------------------------------------------------------------------------------------
    @gluon.jit
    def _scores(s, n, rows, shift, seqlen_k, window_left, window_right, softcap_pre,
                MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Raw Q·Kᵀ block -> logits before the (log2-folded) scale, masked keys at -inf."""
        if SOFTCAP:
            s = _tanh(s * softcap_pre)
        if MASKED:
            cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            c2 = gl.expand_dims(cols, 0)
            r2 = gl.expand_dims(rows, 1)
            ok = c2 < seqlen_k
            if HAS_RIGHT:
                ok = ok & (c2 <= r2 + shift + window_right)
            if HAS_LEFT:
                ok = ok & (c2 >= r2 + shift - window_left)
            s = gl.where(ok, s, -float("inf"))
        return s

    @gluon.jit
    def _online_softmax(s, m_i, l_i, qk_scale, EMU_EVERY: gl.constexpr,
                        RESCALE_THRESHOLD: gl.constexpr):
        """One block of the online softmax in log2 units.

        Returns P (fp32, unnormalised), the new running max/sum and the factor O must be
        multiplied by. m_i is in scaled log2 units; -inf while a row has seen no key.
        """
        m_blk = gl.max(s, 1) * qk_scale
        m_cand = gl.maximum(m_i, m_blk)
        if RESCALE_THRESHOLD > 0:
            # Stale max: P may reach 2^threshold, harmless in fp32 and in bf16/fp16 P.
            m_new = gl.where(m_cand > m_i + RESCALE_THRESHOLD, m_cand, m_i)
        else:
            m_new = m_cand
        # Rows without any allowed key so far keep m = -inf; subtract 0 there instead of
        # -inf so that exp2(-inf - -inf) never produces NaN (p and alpha come out 0 / 1).
        m_sub = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_sub)
        # s * qk_scale - m folds into one FFMA per element before the exponential.
        p = _exp2(s * qk_scale - gl.expand_dims(m_sub, 1), EMU_EVERY)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    # ------------------------------------------------------------------------------------------
    # mma role: one pipelined step of a consumer warpgroup
    # ------------------------------------------------------------------------------------------
    @gluon.jit
    def _take_turn(bars, k, WG: gl.constexpr, TURNS: gl.constexpr):
        """Ping-pong among TURNS (2 or 3) warpgroups, round robin: wait until warpgroup WG
        may issue its k-th group of wgmmas (k counts the groups this warpgroup issued in the
        CTA's life). bars[TURNS + w] (after the Q barriers) is w's turn barrier: the
        warpgroup before it arrives there after issuing its own k-th group. Warpgroup 0 goes
        first: its first wait is on parity 1 of a fresh barrier, which passes at once; the
        others' k-th turn is the k-th completed phase of theirs."""
        if WG == 0:
            mbarrier.wait(bars.index(TURNS + WG), (k + 1) & 1)
        else:
            mbarrier.wait(bars.index(TURNS + WG), k & 1)

    @gluon.jit
    def _pass_turn(bars, WG: gl.constexpr, TURNS: gl.constexpr):
        mbarrier.arrive(bars.index(TURNS + (WG + 1) % TURNS), count=1)

    @gluon.jit
    def _step(i, n, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc, p_op, m_i, l_i,
              rows, shift, seqlen_k, window_left, window_right, qk_scale, softcap_pre,
              MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              SOFTCAP: gl.constexpr, EMU_EVERY: gl.constexpr,
              RESCALE_THRESHOLD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
              bars, q_phase, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ring position i holds key block n; P_{i-1} (p_op) still has to meet V_{i-1}.
        With PINGPONG the two wgmmas are issued in this warpgroup's turn (`_take_turn`)."""
        slot = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
            _take_turn(bars, q_phase + i, WG, PINGPONG)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if not PINGPONG:
            mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            _pass_turn(bars, WG, PINGPONG)
        # wgmma groups retire in order: with one group left in flight, S_i is complete.
        s = warpgroup_mma_wait(1, deps=[s_tok])
        mbarrier.arrive(k_empty.index(slot))
        s = _scores(s, n, rows, shift, seqlen_k, window_left, window_right, softcap_pre, MASKED,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, BLOCK_N, s_layout)
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, EMU_EVERY, RESCALE_THRESHOLD)
        # p_op is a register operand of the P·V in flight: keep it alive until that group retires.
        acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_empty.index(prev))
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        if RESCALE_THRESHOLD > 0:
            # P packed first: the skip's branch ends the block, so the packs can still
            # interleave with the exponentials
            p_op = gl.convert_layout(_to_16bit(p, q.dtype), p_layout)
            acc = _rescale_if_moved(acc, alpha_o)
        else:
            acc = acc * gl.expand_dims(alpha_o, 1)
            p_op = gl.convert_layout(_to_16bit(p, q.dtype), p_layout)
        return acc, p_op, m_i, l_i

    @gluon.jit
    def _consumer_loop(lo, hi, base, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc,
                       p_op, m_i, l_i, rows, shift, seqlen_k, window_left, window_right, qk_scale,
                       softcap_pre, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
                       HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, EMU_EVERY: gl.constexpr,
                       RESCALE_THRESHOLD: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       p_layout: gl.constexpr, bars, q_phase, WG: gl.constexpr,
                       PINGPONG: gl.constexpr):
        # Ring position of key block n: n + base (base = ring position of n_lo minus n_lo).
        for n in range(lo, hi):
            acc, p_op, m_i, l_i = _step(
                n + base, n, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc, p_op,
                m_i, l_i, rows, shift, seqlen_k, window_left, window_right, qk_scale,
                softcap_pre, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY, RESCALE_THRESHOLD,
                BLOCK_N, STAGES, s_layout, o_layout, p_layout, bars, q_phase, WG, PINGPONG)
        return acc, p_op, m_i, l_i

    # ------------------------------------------------------------------------------------------
    # consumer warpgroup: peeled first block, three loops, last P·V, epilogue
    # ------------------------------------------------------------------------------------------
    # Layouts of a consumer warpgroup's 64-row tile: S (64 x BLOCK_N), O (64 x HEAD_DIM_V),
    # P as the register operand of P·V, and one value per row of S.
    @gluon.constexpr_function
    def _s_layout(block_n):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, int(block_n), 16])

    @gluon.constexpr_function
    def _o_layout(head_dim_v):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, int(head_dim_v), 16])

    @gluon.constexpr_function
    def _p_layout(head_dim_v):
        return gl.DotOperandLayout(operand_index=0, parent=_o_layout(head_dim_v), k_width=2)

    @gluon.constexpr_function
    def _row_layout(block_n):
        return gl.SliceLayout(1, _s_layout(block_n))

    @gluon.jit
    def _tile_begin(q_smem, k_smem, q_bar, k_ready, it0, q_slot, q_phase, WG: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait for the tile's Q (buffer q_slot, parity q_phase) and its first key block (ring
        position it0), then issue S_0 = Q·K_0ᵀ without waiting: (Q, S_0 in flight)."""
        s_layout: gl.constexpr = _s_layout(BLOCK_N)
        mbarrier.wait(q_bar.index(q_slot), q_phase)
        q = q_smem.index(q_slot)
        slot0 = it0 % STAGES
        mbarrier.wait(k_ready.index(slot0), (it0 // STAGES) & 1)
        if PINGPONG:
            _take_turn(q_bar, q_phase + it0, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(slot0).permute((1, 0)),
                              gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        if PINGPONG:
            _pass_turn(q_bar, WG, PINGPONG)
        return q, s_tok

    @gluon.jit
    def _tile_run(q, s_tok, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                  rows, shift, seqlen_k, n_lo, n_a, n_b, n_end, it0, q_slot, q_phase,
                  window_left, window_right, qk_scale, softcap_pre, WG: gl.constexpr,
                  HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                  EMU_EVERY: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
                  RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr):
        """From S_0 (the only wgmma group in flight) to the issue of the last P·V, over key
        blocks [n_lo, n_end) (n_end: this warpgroup's last block, `_warpgroup_end`): returns
        (O in flight, its P operand, row max, row sum, the last V slot)."""
        s_layout: gl.constexpr = _s_layout(BLOCK_N)
        o_layout: gl.constexpr = _o_layout(HEAD_DIM_V)
        p_layout: gl.constexpr = _p_layout(HEAD_DIM_V)
        row_layout: gl.constexpr = _row_layout(BLOCK_N)
        m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
        l_i = gl.zeros([64], gl.float32, row_layout)
        acc = gl.zeros([64, HEAD_DIM_V], gl.float32, o_layout)

        # Peeled first block: no P·V to overlap with yet, and always masked.
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(it0 % STAGES))
        s = _scores(s, n_lo, rows, shift, seqlen_k, window_left, window_right, softcap_pre, True,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, BLOCK_N, s_layout)
        p, m_i, l_i, _alpha = _online_softmax(s, m_i, l_i, qk_scale, EMU_EVERY, RESCALE_THRESHOLD)
        p_op = gl.convert_layout(_to_16bit(p, q.dtype), p_layout)

        base = it0 - n_lo
        n_a = gl.minimum(n_a, n_end)
        n_b = gl.minimum(n_b, n_end)
        acc, p_op, m_i, l_i = _consumer_loop(
            n_lo + 1, n_a, base, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
            acc, p_op, m_i, l_i, rows, shift, seqlen_k, window_left,
            window_right, qk_scale, softcap_pre, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY,
            RESCALE_THRESHOLD, BLOCK_N, STAGES, s_layout, o_layout, p_layout, q_bar, q_phase,
            WG, PINGPONG)
        acc, p_op, m_i, l_i = _consumer_loop(
            n_a, n_b, base, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
            acc, p_op, m_i, l_i, rows, shift, seqlen_k, window_left,
            window_right, qk_scale, softcap_pre, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY,
            RESCALE_THRESHOLD, BLOCK_N, STAGES, s_layout, o_layout, p_layout, q_bar, q_phase,
            WG, PINGPONG)
        acc, p_op, m_i, l_i = _consumer_loop(
            n_b, n_end, base, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
            acc, p_op, m_i, l_i, rows, shift, seqlen_k, window_left,
            window_right, qk_scale, softcap_pre, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY,
            RESCALE_THRESHOLD, BLOCK_N, STAGES, s_layout, o_layout, p_layout, q_bar, q_phase,
            WG, PINGPONG)

        if RELEASE_Q:
            # Every S wgmma of this tile has retired (each step ends with a full wait).
            mbarrier.arrive(q_empty.index(q_slot), count=1)

        # Last P·V, left in flight.
        last = n_end - 1 + base
        slot = last % STAGES
        mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
        if PINGPONG:
            _take_turn(q_bar, q_phase + last + 1, WG, PINGPONG)
        o_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
        if PINGPONG:
            _pass_turn(q_bar, WG, PINGPONG)
        return o_tok, p_op, m_i, l_i, slot

    @gluon.jit
    def _tile_finish(o_tok, p_op, v_empty, slot):
        """Wait for the last P·V and free its V slot; returns O."""
        acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_empty.index(slot))
        return acc

    @gluon.jit
    def _warpgroup_end(m0, seqlen_q, seqlen_k, window_right, n_lo, n_hi, WG: gl.constexpr,
                       BLOCK_N: gl.constexpr, SKIP: gl.constexpr):
        """End of warpgroup WG's key blocks within its tile's [n_lo, n_hi). With SKIP (a right
        bound and 64-key blocks), a warpgroup whose 64 rows end a whole block before the
        tile's last row stops there: under a causal mask, a 128-row tile's first warpgroup
        would otherwise multiply, exponentiate and add one block that is masked out for
        every one of its rows (d=256: one in 2 (i + 1) blocks of the i-th tile)."""
        n_end = n_hi
        if SKIP:
            row_last = gl.minimum(m0 + WG * 64 + 63, seqlen_q - 1)
            allowed = gl.maximum(row_last + seqlen_k - seqlen_q + window_right + 1, 0)
            n_end = gl.maximum(gl.minimum(n_hi, (allowed + BLOCK_N - 1) // BLOCK_N), n_lo + 1)
        return n_end

    @gluon.jit
    def _release_blocks(k_ready, k_empty, v_ready, v_empty, lo, hi, base,
                        STAGES: gl.constexpr):
        """Release key blocks [lo, hi) (ring positions lo + base, ...) without reading them:
        each slot is waited for first, so the arrival counts toward this use of the slot and
        not the one before. Called once the warpgroup's own last V slot is released (a slot
        held while waiting for a later fill of the ring could stall the loader for good)."""
        for n in range(lo, hi):
            pos = n + base
            slot = pos % STAGES
            phase = (pos // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            mbarrier.arrive(k_empty.index(slot))
            mbarrier.wait(v_ready.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot))

    @gluon.jit
    def _tile_store(acc, m_i, l_i, rows, out_ptr, o_desc, o_smem, lse_ptr, sink_ptr, q_bar,
                    q_start, m0, seqlen_q, total_q, head, n_heads, WG: gl.constexpr,
                    HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, HAS_SINK: gl.constexpr,
                    RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr):
        """Epilogue: normalise O, write lse and O of `rows` (m0 + 64·WG + 0 ... 63; rows at or
        past seqlen_q are not written). The sink is one more logit in the denominator with no
        value row."""
        o_layout: gl.constexpr = _o_layout(HEAD_DIM_V)
        row_layout: gl.constexpr = _row_layout(BLOCK_N)
        if HAS_SINK:
            sink = gl.load(sink_ptr + head) * 1.4426950408889634
            m_fin = gl.maximum(m_i, sink)
            m_sub = gl.where(m_fin == -float("inf"), 0.0, m_fin)
            o_scale = gl.exp2(m_i - m_sub)
            l_i = l_i * o_scale + gl.exp2(sink - m_sub)
            m_i = m_fin
        else:
            o_scale = gl.full([64], 1.0, gl.float32, row_layout)
        has_mass = l_i > 0.0
        inv_l = gl.where(has_mass, o_scale / gl.where(has_mass, l_i, 1.0), 0.0)
        lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                       -float("inf"))
        valid = rows < seqlen_q
        lse_off = head.to(gl.int64) * total_q + q_start + rows
        gl.store(lse_ptr + lse_off, lse, mask=valid)

        out = (acc * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1))
        out = out.to(out_ptr.dtype.element_ty)
        if _full_width(o_desc.block_shape, HEAD_DIM_V):
            # Every sequence's rows fill whole 64-row tiles (the host checked): O leaves
            # through shared memory and one TMA store. Issuing the masked per-thread stores
            # below took ~2300 of a ~16600-cycle tile at d=128, 512 rows
            # (scripts/fwd-timeline.py, H200). A warpgroup whose rows all lie past the
            # sequence (192-row tiles) stores nothing.
            # Wide rows on the persistent grid: one staging tile, the warpgroups take turns
            # (`_o_staging`); the turn barrier sits after the Q (and ping-pong) barriers.
            SHARED: gl.constexpr = _o_staging(o_desc.block_shape, HEAD_DIM_V, RELEASE_Q) == 2
            o_tile = o_smem.index(0 if SHARED else WG)
            if SHARED:
                # Warpgroup w's k-th turn follows 2k + w arrivals: parity 1 - w every time.
                # The turn barrier is q_bar's last (`_q_bar_count`), whatever the number of
                # Q buffers (a fixed index once fell on a second Q buffer's barrier).
                o_turn = q_bar.index(q_bar.shape[0] - 1)
                mbarrier.wait(o_turn, 1 - WG)
            if m0 + WG * 64 < seqlen_q:
                tma.store_wait(0)  # this warpgroup's previous store has read o_smem
                gl.thread_barrier()
                o_tile.store(out)
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(
                    o_desc, [q_start + m0 + WG * 64, head * HEAD_DIM_V], o_tile)
            if not RELEASE_Q:  # a one-tile CTA: the store must finish before it exits
                tma.store_wait(0)
            elif SHARED:  # the other warpgroup's turn once the store has read the tile
                tma.store_wait(0)
                gl.thread_barrier()
                mbarrier.arrive(o_turn, count=1)
        else:
            _store_rows(out_ptr, out, rows, q_start, seqlen_q, head, n_heads, HEAD_DIM_V,
                        o_layout)

    @gluon.jit
    def _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                       v_empty, out_ptr, o_desc, o_smem,
                       lse_ptr, sink_ptr, q_start, m0, seqlen_q, seqlen_k,
                       total_q, head, n_heads, n_lo, n_a, n_b, n_hi, it0, q_slot, q_phase,
                       window_left, window_right, qk_scale, softcap_pre, WG: gl.constexpr,
                       HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                       HAS_SINK: gl.constexpr, EMU_EVERY: gl.constexpr,
                       RESCALE_THRESHOLD: gl.constexpr, RELEASE_Q: gl.constexpr,
                       PINGPONG: gl.constexpr, TAIL_SKIP: gl.constexpr):
        """One 64-row query tile of warpgroup WG: key blocks [n_lo, n_hi) sit at K/V ring
        positions it0, it0 + 1, ...; its Q arrives in Q buffer q_slot, on q_bar[q_slot] with
        parity q_phase (q_slot = WG, but for the persistent grid's second Q buffers). With
        RELEASE_Q (persistent grid) q_empty[q_slot] is arrived on as soon as the last S = Q·Kᵀ
        has retired, so the loader can bring a later tile's Q during the last P·V and the store.
        Ping-pong (one Q buffer per warpgroup only) counts its turns from q_phase.
        """
        row_layout: gl.constexpr = _row_layout(BLOCK_N)
        rows = m0 + WG * 64 + gl.arange(0, 64, layout=row_layout)
        q, s_tok = _tile_begin(q_smem, k_smem, q_bar, k_ready, it0, q_slot, q_phase, WG,
                               BLOCK_N, STAGES, PINGPONG)
        n_end = _warpgroup_end(m0, seqlen_q, seqlen_k, window_right, n_lo, n_hi, WG, BLOCK_N,
                               TAIL_SKIP)
        o_tok, p_op, m_i, l_i, slot = _tile_run(
            q, s_tok, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
            rows, seqlen_k - seqlen_q, seqlen_k, n_lo, n_a, n_b, n_end, it0, q_slot, q_phase,
            window_left, window_right, qk_scale, softcap_pre, WG, HEAD_DIM_V, BLOCK_N, STAGES,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY, RESCALE_THRESHOLD, RELEASE_Q, PINGPONG)
        acc = _tile_finish(o_tok, p_op, v_empty, slot)
        _tile_store(acc, m_i, l_i, rows, out_ptr, o_desc, o_smem, lse_ptr, sink_ptr, q_bar,
                    q_start, m0, seqlen_q, total_q, head, n_heads, WG, HEAD_DIM_V, BLOCK_N,
                    HAS_SINK, RELEASE_Q, PINGPONG)
        if TAIL_SKIP:  # the blocks past this warpgroup's end, released once its O is out
            _release_blocks(k_ready, k_empty, v_ready, v_empty, n_end, n_hi, it0 - n_lo,
                            STAGES)

    @gluon.constexpr_function
    def _stacked(n, block_shape):
        return [n] + [int(x) for x in block_shape]

    @gluon.constexpr_function
    def _full_width(block_shape, width):
        """Whether the output descriptor's box spans a whole row of O (TMA-store epilogue);
        a narrower box only carries the layout of an unused buffer (see `forward`)."""
        return block_shape[1] == width

    @gluon.constexpr_function
    def _o_staging(block_shape, width, persistent):
        """Where the TMA-store epilogue stages O: 0, one tile per warpgroup of its own
        (dv <= 128, or no TMA store at all); wide rows (d = dv = 256: a tile each does not
        fit next to the 192 KB of Q and the K/V rings; the host gives such a box only where
        dv = d, `output_box_width`) 1: in the warpgroup's Q buffer on the plain grid, where
        Q is dead after the last S; 2: on the persistent grid, in one 32 KB tile the
        warpgroups take turns at (there the next tile's Q lands during the epilogue; staged
        in the Q buffer it had to wait for the store: d=256 causal 512 rows 216 -> 111
        TFLOP/s, H200 2026-11-29)."""
        if block_shape[1] != width or width <= 128:
            return 0
        return 2 if persistent else 1

    @gluon.constexpr_function
    def _o_turn_index(pingpong, num_wg, q_bufs):
        """Index in q_bar of the staging turn barrier (`_o_staging` 2: two warpgroups, one Q
        buffer each): after the Q barriers and the ping-pong turn barriers (`pingpong`: the
        number of warpgroups taking turns, 0 without)."""
        return num_wg * q_bufs + int(pingpong)

    @gluon.constexpr_function
    def _q_bar_count(num_wg, pingpong, o_staging, q_bufs):
        return _o_turn_index(pingpong, num_wg, q_bufs) + (1 if o_staging == 2 else 0)

    @gluon.jit
    def _store_rows(out_ptr, out, rows, q_start, seqlen_q, head, n_heads,
                    HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
        """O rows of a tile, rows at or past seqlen_q masked off (per-thread stores)."""
        o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        row_off = ((q_start + o_rows).to(gl.int64) * n_heads + head) * HEAD_DIM_V
        offs = gl.expand_dims(row_off, 1) + gl.expand_dims(o_cols, 0)
        gl.store(out_ptr + offs, out, mask=gl.expand_dims(o_rows < seqlen_q, 1))

    # ------------------------------------------------------------------------------------------
    # persistent grid: each role walks the same tile sequence, ring positions carried over
    # ------------------------------------------------------------------------------------------
    @gluon.jit
    def _wave_tile(wave, pid, nprog):
        """Tile of CTA pid in a wave of nprog consecutive tiles: CTA order reversed on odd
        waves, so that a CTA given a heavy tile (longest-first order) next gets a light one."""
        odd = wave & 1
        return wave * nprog + pid + odd * (nprog - 1 - 2 * pid)

    @gluon.jit
    def _persistent_tile(wave, num_tiles, n_heads, n_batch, num_m_blocks, hb_chunk, seqlen_q,
                         seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr, LPT: gl.constexpr,
                         UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                         BLOCK_M: gl.constexpr):
        """This CTA's tile in `wave`, as both roles see it: (live, first query row m0, q head,
        packed q/k start rows, q/k lengths); live is False past the last tile or sequence."""
        tile = _wave_tile(wave, gl.program_id(0), gl.num_programs(0))
        m_blk, head, batch = _tile_of(gl.minimum(tile, num_tiles - 1), n_heads, n_batch,
                                      num_m_blocks, hb_chunk, LPT, True)
        q_start, k_start, sq, sk = _sequence(batch, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr,
                                             used_k_ptr, UNIFORM, HAS_SEQUSED)
        m0 = m_blk * BLOCK_M
        return (tile < num_tiles) & (m0 < sq), m0, head, q_start, k_start, sq, sk

    @gluon.constexpr_function
    def _sched_layout(num_warps):
        return gl.BlockedLayout([4], [32], [num_warps], [0])

    @gluon.jit
    def _publish_tile(sched, q_empty, tc, m0, head, q_start, NUM_WG: gl.constexpr,
                      Q_BUFS: gl.constexpr):
        """Loader, uniform lengths: hand this tile's (m0, head, q_start) to the consumers in
        shared memory slot tc % 2, so they need not work out the schedule's integer divisions
        between two tiles (~600 cycles, d=128 512 rows, scripts/fwd-timeline.py). The slot was
        last read at the start of tile tc - 2, before its Q was released: wait until every
        warpgroup has released tile tc - Q_BUFS's Q (tc - 1 or tc - 2). The Q barriers'
        arrivals (after the stores, and a warp barrier) publish it."""
        slot0 = (tc % Q_BUFS) * NUM_WG
        for wg in gl.static_range(NUM_WG):
            mbarrier.wait(q_empty.index(slot0 + wg), ((tc // Q_BUFS) & 1) ^ 1)
        idx = gl.arange(0, 4, layout=_sched_layout(gl.num_warps()))
        sched.index(tc & 1).store(gl.where(idx == 0, m0, gl.where(idx == 1, head, q_start)))
        gl.thread_barrier()

    @gluon.jit
    def _read_tile(sched, tc):
        """Consumer side of `_publish_tile`, once the tile's Q barrier has completed."""
        layout: gl.constexpr = _sched_layout(gl.num_warps())
        idx = gl.arange(0, 4, layout=layout)
        v = sched.index(tc & 1).load(layout)
        return (gl.sum(gl.where(idx == 0, v, 0), 0), gl.sum(gl.where(idx == 1, v, 0), 0),
                gl.sum(gl.where(idx == 2, v, 0), 0))

    @gluon.jit
    def _load_role_persistent(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                              k_ready, k_empty, v_ready, v_empty, sched, cu_q_ptr, cu_k_ptr,
                              used_k_ptr,
                              seqlen_q, seqlen_k, n_heads, n_batch, num_m_blocks, num_tiles,
                              hb_chunk, group, window_left, window_right,
                              HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                              LPT: gl.constexpr, NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr):
        BLOCK_M: gl.constexpr = 64 * NUM_WG
        it = 0  # K/V ring position of the next tile's first key block
        tc = 0  # tiles done by this CTA: tile tc's Q goes to buffer set tc % Q_BUFS
        nprog = gl.num_programs(0)
        for wave in range(0, (num_tiles + nprog - 1) // nprog):
            live, m0, head, q_start, k_start, sq, sk = _persistent_tile(
                wave, num_tiles, n_heads, n_batch, num_m_blocks, hb_chunk, seqlen_q, seqlen_k,
                cu_q_ptr, cu_k_ptr, used_k_ptr, LPT, UNIFORM, HAS_SEQUSED, BLOCK_M)
            if live:
                n_lo, n_a, n_b, n_hi = _key_blocks(m0, sq, sk, window_left, window_right,
                                                   HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_M)
                kv_head = head // group
                if UNIFORM:
                    _publish_tile(sched, q_empty, tc, m0, head, q_start, NUM_WG, Q_BUFS)
                _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                           k_ready, k_empty, v_ready, v_empty, q_start + m0, head, k_start,
                           kv_head, n_lo, n_hi, it, (tc % Q_BUFS) * NUM_WG,
                           (tc // Q_BUFS) & 1, HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, True,
                           NUM_WG)
                it += n_hi - n_lo
                tc += 1

    @gluon.jit
    def _consumer_role_persistent(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                                  v_ready, v_empty, sched, out_ptr, o_desc, o_smem,
                                  lse_ptr, sink_ptr, cu_q_ptr,
                                  cu_k_ptr, used_k_ptr, seqlen_q, seqlen_k, total_q, n_heads,
                                  n_batch, num_m_blocks, num_tiles, hb_chunk, window_left,
                                  window_right, qk_scale, softcap_pre, WG: gl.constexpr,
                                  HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                                  STAGES: gl.constexpr, UNIFORM: gl.constexpr,
                                  HAS_SEQUSED: gl.constexpr, HAS_LEFT: gl.constexpr,
                                  HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                                  HAS_SINK: gl.constexpr, LPT: gl.constexpr,
                                  EMU_EVERY: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
                                  PINGPONG: gl.constexpr, NUM_WG: gl.constexpr,
                                  Q_BUFS: gl.constexpr, TAIL_SKIP: gl.constexpr):
        BLOCK_M: gl.constexpr = 64 * NUM_WG
        it = 0
        tc = 0
        nprog = gl.num_programs(0)
        for wave in range(0, (num_tiles + nprog - 1) // nprog):
            if UNIFORM:  # the tile's coordinates come from the loader (`_publish_tile`)
                live = _wave_tile(wave, gl.program_id(0), nprog) < num_tiles
            else:
                live, m0, head, q_start, k_start, sq, sk = _persistent_tile(
                    wave, num_tiles, n_heads, n_batch, num_m_blocks, hb_chunk, seqlen_q,
                    seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr, LPT, UNIFORM, HAS_SEQUSED, BLOCK_M)
            if live:
                q_slot = (tc % Q_BUFS) * NUM_WG + WG
                q_phase = (tc // Q_BUFS) & 1
                if UNIFORM:
                    mbarrier.wait(q_bar.index(q_slot), q_phase)
                    m0, head, q_start = _read_tile(sched, tc)
                    sq = seqlen_q
                    sk = seqlen_k
                n_lo, n_a, n_b, n_hi = _key_blocks(m0, sq, sk, window_left, window_right,
                                                   HAS_LEFT, HAS_RIGHT, BLOCK_N, BLOCK_M)
                _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                               v_empty, out_ptr, o_desc, o_smem,
                               lse_ptr, sink_ptr, q_start, m0, sq, sk, total_q,
                               head, n_heads, n_lo, n_a, n_b, n_hi, it, q_slot, q_phase,
                               window_left, window_right, qk_scale, softcap_pre, WG, HEAD_DIM_V,
                               BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_SINK,
                               EMU_EVERY, RESCALE_THRESHOLD, True, PINGPONG,
                               TAIL_SKIP)
                it += n_hi - n_lo
                tc += 1
        tma.store_wait(0)  # the last tile's O store reads o_smem

    # ------------------------------------------------------------------------------------------
    # kernel: tile schedule, block ranges, shared memory, role launch
    # ------------------------------------------------------------------------------------------
    # Lengths, counts and windows stay runtime values: one compile serves every shape
    # (Triton would specialise on the value 1 and on divisibility by 16 otherwise).
    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_batch",
                                  "num_m_blocks", "group", "window_left", "window_right",
                                  "num_tiles", "hb_chunk"])
    def _attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                         used_k_ptr, sink_ptr, seqlen_q, seqlen_k, total_q, n_heads, n_batch,
                         num_m_blocks, group, qk_scale, softcap_pre, window_left, window_right,
                         num_tiles, hb_chunk,
                         HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, UNIFORM: gl.constexpr,
                         HAS_SEQUSED: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINK: gl.constexpr,
                         LPT: gl.constexpr, EMU_EVERY: gl.constexpr,
                         RESCALE_THRESHOLD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         LOADER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
                         PINGPONG: gl.constexpr, NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr,
                         TAIL_SKIP: gl.constexpr):
        # PINGPONG: how many consumer warpgroups take turns issuing their wgmmas (NUM_WG, or 0
        # for none). NUM_WG = 3 only with PERSISTENT; Q_BUFS = 2 (a second Q buffer
        # per warpgroup: the loader brings the next tile's Q a whole tile ahead) only with
        # PERSISTENT, without PINGPONG and at d <= 128, so never with O_STAGING 2 (both
        # checked on the host).
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * NUM_WG, 64, HEAD_DIM],
                                           _tile_layout(q_desc.layout))
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM],
                                           _tile_layout(k_desc.layout))
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM_V],
                                           _tile_layout(v_desc.layout))
        # O staging for the TMA-store epilogue, one tile per consumer warpgroup (a 32-column
        # stand-in, optimised away, when the host left it off: `output_box_width`).
        O_STAGING: gl.constexpr = _o_staging(o_desc.block_shape, HEAD_DIM_V, PERSISTENT)
        if O_STAGING == 1:
            o_smem = q_smem
        elif O_STAGING == 2:
            o_smem = gl.allocate_shared_memory(o_desc.dtype, _stacked(1, o_desc.block_shape),
                                               _tile_layout(o_desc.layout))
        else:
            o_smem = gl.allocate_shared_memory(o_desc.dtype,
                                               _stacked(NUM_WG, o_desc.block_shape),
                                               _tile_layout(o_desc.layout))
        # Q barriers of the consumer warpgroups, then (ping-pong only) their turn barriers,
        # then (O_STAGING 2) the staging tile's turn barrier.
        q_bar = gl.allocate_shared_memory(
            gl.int64, [_q_bar_count(NUM_WG, PINGPONG, O_STAGING, Q_BUFS), 1],
            mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1],
                                            mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The persistent loader's tile coordinates for the consumers (`_publish_tile`).
        sched = gl.allocate_shared_memory(gl.int32, [2, 4],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if PERSISTENT:
            # grid = min(#SMs, #tiles); every role walks tiles pid, pid + grid, ... and keeps
            # its own ring position, so the loader runs ahead into the next tile (its Q once
            # the consumers released the current one, its K/V as ring slots free up).
            for wg in gl.static_range(_o_turn_index(PINGPONG, NUM_WG, Q_BUFS)):
                mbarrier.init(q_bar.index(wg), count=1)
            if O_STAGING == 2:
                mbarrier.init(q_bar.index(_o_turn_index(PINGPONG, NUM_WG, Q_BUFS)), count=1)
            for wg in gl.static_range(Q_BUFS * NUM_WG):
                mbarrier.init(q_empty.index(wg), count=1)
            for st in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(st), count=1)
                mbarrier.init(v_ready.index(st), count=1)
                mbarrier.init(k_empty.index(st), count=NUM_WG)
                mbarrier.init(v_empty.index(st), count=NUM_WG)
            fence_async_shared()
            if NUM_WG == 3:
                # Written out: the role list must be literal (see the plain grid below).
                gl.warp_specialize([
                    (_consumer_role_persistent, (
                        q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                        v_empty, sched, out_ptr, o_desc, o_smem,
                        lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr,
                        seqlen_q, seqlen_k, total_q, n_heads, n_batch, num_m_blocks, num_tiles,
                        hb_chunk, window_left, window_right, qk_scale, softcap_pre, 0,
                        HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT,
                        SOFTCAP, HAS_SINK, LPT, EMU_EVERY, RESCALE_THRESHOLD, PINGPONG, 3, Q_BUFS,
                        TAIL_SKIP)),
                    (_consumer_role_persistent, (
                        q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                        v_empty, sched, out_ptr, o_desc, o_smem,
                        lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr,
                        seqlen_q, seqlen_k, total_q, n_heads, n_batch, num_m_blocks, num_tiles,
                        hb_chunk, window_left, window_right, qk_scale, softcap_pre, 1,
                        HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT,
                        SOFTCAP, HAS_SINK, LPT, EMU_EVERY, RESCALE_THRESHOLD, PINGPONG, 3, Q_BUFS,
                        TAIL_SKIP)),
                    (_consumer_role_persistent, (
                        q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                        v_empty, sched, out_ptr, o_desc, o_smem,
                        lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr,
                        seqlen_q, seqlen_k, total_q, n_heads, n_batch, num_m_blocks, num_tiles,
                        hb_chunk, window_left, window_right, qk_scale, softcap_pre, 2,
                        HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT,
                        SOFTCAP, HAS_SINK, LPT, EMU_EVERY, RESCALE_THRESHOLD, PINGPONG, 3, Q_BUFS,
                        TAIL_SKIP)),
                    (_load_role_persistent, (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                        k_empty, v_ready, v_empty, sched, cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q,
                        seqlen_k, n_heads, n_batch, num_m_blocks, num_tiles, hb_chunk, group,
                        window_left, window_right, HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES,
                        UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT, LPT, 3, Q_BUFS)),
                ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
            else:
                gl.warp_specialize([
                    (_consumer_role_persistent, (
                        q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                        sched, out_ptr, o_desc, o_smem,
                        lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q,
                        seqlen_k, total_q, n_heads, n_batch, num_m_blocks, num_tiles, hb_chunk,
                        window_left, window_right, qk_scale, softcap_pre, 0, HEAD_DIM_V, BLOCK_N,
                        STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_SINK, LPT,
                        EMU_EVERY, RESCALE_THRESHOLD, PINGPONG, 2, Q_BUFS,
                        TAIL_SKIP)),
                    (_consumer_role_persistent, (
                        q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                        sched, out_ptr, o_desc, o_smem,
                        lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q,
                        seqlen_k, total_q, n_heads, n_batch, num_m_blocks, num_tiles, hb_chunk,
                        window_left, window_right, qk_scale, softcap_pre, 1, HEAD_DIM_V, BLOCK_N,
                        STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_SINK, LPT,
                        EMU_EVERY, RESCALE_THRESHOLD, PINGPONG, 2, Q_BUFS,
                        TAIL_SKIP)),
                    (_load_role_persistent, (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                        k_empty, v_ready, v_empty, sched, cu_q_ptr, cu_k_ptr, used_k_ptr, seqlen_q,
                        seqlen_k, n_heads, n_batch, num_m_blocks, num_tiles, hb_chunk, group,
                        window_left, window_right, HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM,
                        HAS_SEQUSED, HAS_LEFT, HAS_RIGHT, LPT, 2, Q_BUFS)),
                ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            m_blk, head, batch = _tile_of(gl.program_id(0), n_heads, n_batch, num_m_blocks,
                                          hb_chunk, LPT, False)
            q_start, k_start, seqlen_q, seqlen_k = _sequence(batch, seqlen_q, seqlen_k,
                                                             cu_q_ptr, cu_k_ptr, used_k_ptr,
                                                             UNIFORM, HAS_SEQUSED)
            m0 = m_blk * 128
            if m0 < seqlen_q:
                n_lo, n_a, n_b, n_hi = _key_blocks(m0, seqlen_q, seqlen_k, window_left,
                                                   window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                                                   128)
                for wg in gl.static_range(4 if PINGPONG else 2):
                    mbarrier.init(q_bar.index(wg), count=1)
                for st in gl.static_range(STAGES):
                    mbarrier.init(k_ready.index(st), count=1)
                    mbarrier.init(v_ready.index(st), count=1)
                    # Both consumer warpgroups must release a slot before it is refilled.
                    mbarrier.init(k_empty.index(st), count=2)
                    mbarrier.init(v_empty.index(st), count=2)
                fence_async_shared()

                kv_head = head // group
                # Argument tuples are written inline: a tuple assigned to a variable inside a
                # kernel turns its constexpr entries into runtime values.
                gl.warp_specialize([
                    (_consumer_tile, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                                      v_ready, v_empty, out_ptr, o_desc, o_smem,
                                      lse_ptr, sink_ptr, q_start, m0,
                                      seqlen_q, seqlen_k, total_q, head, n_heads, n_lo, n_a, n_b,
                                      n_hi, 0, 0, 0, window_left, window_right, qk_scale,
                                      softcap_pre, 0, HEAD_DIM_V, BLOCK_N, STAGES, HAS_LEFT,
                                      HAS_RIGHT, SOFTCAP, HAS_SINK, EMU_EVERY, RESCALE_THRESHOLD,
                                      False, PINGPONG, TAIL_SKIP)),
                    (_consumer_tile, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                                      v_ready, v_empty, out_ptr, o_desc, o_smem,
                                      lse_ptr, sink_ptr, q_start, m0,
                                      seqlen_q, seqlen_k, total_q, head, n_heads, n_lo, n_a, n_b,
                                      n_hi, 0, 1, 0, window_left, window_right, qk_scale,
                                      softcap_pre, 1, HEAD_DIM_V, BLOCK_N, STAGES, HAS_LEFT,
                                      HAS_RIGHT, SOFTCAP, HAS_SINK, EMU_EVERY, RESCALE_THRESHOLD,
                                      False, PINGPONG, TAIL_SKIP)),
                    (_load_tile, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                  k_ready, k_empty, v_ready, v_empty, q_start + m0, head,
                                  k_start, kv_head, n_lo, n_hi, 0, 0, 0, HEAD_DIM, HEAD_DIM_V,
                                  BLOCK_N, STAGES, False, 2)),
                ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SIG_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _smem_layout_cached(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _smem_layout(block, dtype):
    """The TMA/wgmma shared-memory layout of a tile; cached: building one costs ~30 us of
    host time, three per call (measured on the CI CPU), as much as a short kernel."""
    return _smem_layout_cached(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def _layout_and_token(block: tuple, dtype):
    """(shared layout, launch.descriptor_token) of a default descriptor: one cache lookup on
    a (tuple, dtype) key per descriptor (hashing the layout itself costs more)."""
    layout = _smem_layout_cached(block, dtype)
    return layout, descriptor_token(dtype, block, layout)


def exp2_scales(params: AttnParams) -> tuple[float, float]:
    """(qk_scale, softcap_pre) of the Gluon kernels: exp2 takes s·qk_scale, s = q·k, or with
    softcap s = tanh(q·k·softcap_pre) (so S = c·tanh(q·k·scale/c) in log2 units, and the
    backward's chain-rule factor is 1 - tanh²)."""
    if params.softcap > 0:
        return params.softcap * LOG2E, params.softmax_scale / params.softcap
    return params.softmax_scale * LOG2E, 1.0


# Strided q, k, v (views of a fused QKV projection, transposed (batch, heads, seqlen, dim)
# tensors): read in place through descriptors with their own strides; with the switch at 0
# (and where TMA cannot address them) the kernels read contiguous copies (`tma_ready`).
def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` where the kernels' descriptors can read it as it is, else a contiguous 16-byte
    aligned copy: a copy costs a read and a write of the tensor, the portable kernels that
    strided inputs took before cost far more on Hopper."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    if tma_layout_reason(t, "") is None:  # read in place: see docs/tuning.md
        return t
    return t.clone(memory_format=torch.contiguous_format)


def row_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """(row stride, head stride) of a (rows, heads, dim) tensor, in elements, as a TMA
    descriptor walks it; a dimension of size 1 takes its dense stride (torch leaves any
    value there)."""
    rows, heads, dim = t.shape
    head_stride = t.stride(1) if heads > 1 else dim
    return (t.stride(0) if rows > 1 else heads * head_stride), head_stride


def rows_dense(t: torch.Tensor) -> bool:
    """Whether the heads of a row lie side by side (head stride = dim), so the tensor reads
    as a (rows, heads·dim) matrix with its own row stride (`tma_rows`)."""
    return row_head_strides(t)[1] == t.shape[2]


def tma_layout_reason(t: torch.Tensor, name: str) -> str | None:
    """Why a (rows, heads, dim) tensor cannot be read in place by TMA, or None: the base and
    the row and head strides must be 16-byte multiples, the dim contiguous."""
    rows, heads, dim = t.shape
    size = t.element_size()
    row_stride, head_stride = row_head_strides(t)
    if dim > 1 and t.stride(2) != 1:
        return f"{name}'s head dim is not contiguous"
    if t.data_ptr() % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    if row_stride <= 0 or head_stride <= 0 or (row_stride * size) % 16 or \
            (head_stride * size) % 16:
        return (f"{name}'s strides ({row_stride}, {head_stride}) are not positive 16-byte "
                "multiples (TMA)")
    return None


def tma_rows(t: torch.Tensor, block, layout=None) -> "TensorDescriptor":
    """TMA descriptor of a packed (rows, heads, dim) tensor seen as (rows, heads * dim), so
    a head is a column offset and one descriptor serves all heads and sequences. The heads of
    a row must lie side by side (`rows_dense`); the rows may be strided (a fused QKV view).

    Built without TensorDescriptor's own checks (~10 us each, several per call): what they
    verify, a 16-byte aligned non-empty tensor with 16-byte aligned rows, is already
    guaranteed by `hopper_input_reason` (heads * dim is a multiple of 64 here).
    """
    desc = object.__new__(TensorDescriptor)
    cols = t.shape[1] * t.shape[2]
    row_stride = t.stride(0) if t.shape[0] > 1 else cols
    desc.base, desc.shape, desc.strides = t, [t.shape[0], cols], [row_stride, 1]
    desc.block_shape, desc.padding = list(block), "zero"
    if layout is None:  # the layout and its launch.specialization_key token, cached
        desc.layout, desc.asym_token = _layout_and_token(tuple(block), t.dtype)
    else:
        desc.layout = layout
        desc.asym_token = descriptor_token(t.dtype, tuple(block), layout)
    return desc


def tma_heads(t: torch.Tensor, rows: int, width: int) -> "TensorDescriptor":
    """TMA descriptor of a packed (rows, heads, dim) tensor as it is, with a box of `rows`
    rows of one head, `width` >= dim wide: the TMA unit fills the columns past dim with
    zeros, so head dims between the compiled widths need no zero-padded copy. Needs 16-byte
    row strides (dim a multiple of 8 at 16 bits). Any row and head strides TMA can address
    (`tma_layout_reason`): a transposed (batch, heads, seqlen, dim) tensor is read in place."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape = t, list(t.shape)
    desc.strides = [*row_head_strides(t), 1]
    desc.block_shape, desc.padding = [rows, 1, width], "zero"
    desc.layout, desc.asym_token = _layout_and_token((rows, 1, width), t.dtype)
    return desc


def output_box_width(d: int, dv: int, full_tiles: bool = True) -> int:
    """Columns of the output descriptor's box: the whole row (the kernel's TMA-store
    epilogue) where every sequence fills whole 64-row tiles (`full_tiles`: uniform lengths, a
    multiple of 64, so no tile holds rows of two sequences) and the staging tiles fit in
    shared memory: dv <= 128 (+16 / +32 KB next to 148-192 KB of rings), or dv = d (O is
    staged in the warpgroup's Q buffer, `_o_in_q`); else 32, never a whole row: a box the
    kernel only takes the layout of (masked per-thread stores)."""
    return dv if full_tiles and (dv <= 128 or dv == d) else 32


def _constexprs(head_dim, head_dim_v, cfg: FwdConfig, *, uniform, has_seqused, has_left,
                has_right, softcap, has_sink):
    return {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim_v, "BLOCK_N": cfg.block_n,
            "STAGES": cfg.stages, "UNIFORM": uniform, "HAS_SEQUSED": has_seqused,
            "HAS_LEFT": has_left, "HAS_RIGHT": has_right, "SOFTCAP": softcap,
            "HAS_SINK": has_sink, "LPT": cfg.lpt, "EMU_EVERY": cfg.exp2_emu_every,
            "RESCALE_THRESHOLD": float(cfg.rescale_threshold),
            "CONSUMER_REGS": _consumer_regs(cfg), "LOADER_REGS": cfg.loader_regs,
            "PERSISTENT": bool(cfg.persistent),
            "PINGPONG": cfg.consumer_wgs if cfg.pingpong else 0,
            "NUM_WG": cfg.consumer_wgs, "Q_BUFS": cfg.q_buffers if cfg.persistent else 1,
            # ping-pong counts its turns per key block: there every warpgroup visits them all
            "TAIL_SKIP": bool(cfg.tail_skip and has_right and cfg.block_n == 64
                              and not cfg.pingpong)}


def _consumer_regs(cfg: FwdConfig) -> int:
    # Three consumer warpgroups + the loader's: 512 threads share 64K registers.
    return cfg.consumer_regs if cfg.consumer_wgs == 2 else min(cfg.consumer_regs, 160)


def _launch_options(cfg: FwdConfig):
    # 4 warps per consumer warpgroup (the default partition is one of them); the loader is
    # padded to a warpgroup. maxnreg sets the register pool from which the default partition
    # gets what the workers leave: 168 * 384 threads = 64512 <= 64K registers (two consumer
    # warpgroups), 128 * 512 with three.
    return {"num_warps": 4, "maxnreg": 168 if cfg.consumer_wgs == 2 else 128}


def compile_for_target(head_dim=128, head_dim_v=None, dtype=torch.bfloat16,
                       cfg: FwdConfig | None = None, arch=90, heads_axis=False,
                       tma_store=True, **features):
    """Compile the kernel without a GPU (CI check); returns triton's CompiledKernel.
    heads_axis: with the (rows, heads, dim) descriptors of head dims between the widths;
    tma_store: the TMA-store epilogue (where `output_box_width` allows it)."""
    if _GLUON_ERROR is not None:
        raise RuntimeError(_GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    cfg = cfg or _DEFAULT_CONFIGS[head_dim]
    check_config(cfg, head_dim)
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
                 "softcap": False, "has_sink": False}
    feats.update(features)
    ty = _SIG_DTYPES[dtype]

    def desc(block):
        if heads_axis:
            block = [block[0], 1, block[1]]
        dims = ", ".join(map(str, block))
        return f"tensordesc<{ty}[{dims}],{_smem_layout(block, dtype)!r}>"

    o_width = output_box_width(head_dim, head_dim_v) if tma_store else 32
    signature = {
        "q_desc": desc([64, head_dim]), "k_desc": desc([cfg.block_n, head_dim]),
        "v_desc": desc([cfg.block_n, head_dim_v]),
        "o_desc": f"tensordesc<{ty}[64, {o_width}],{_smem_layout((64, o_width), dtype)!r}>",
        "out_ptr": f"*{ty}", "lse_ptr": "*fp32",
        "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "used_k_ptr": "*i32", "sink_ptr": "*fp32",
        "seqlen_q": "i32", "seqlen_k": "i32", "total_q": "i32", "n_heads": "i32", "n_batch": "i32",
        "num_m_blocks": "i32", "group": "i32", "qk_scale": "fp32", "softcap_pre": "fp32",
        "window_left": "i32", "window_right": "i32", "num_tiles": "i32", "hb_chunk": "i32"}
    constexprs = _constexprs(head_dim, head_dim_v, cfg, **feats)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(_attn_fwd_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=_launch_options(cfg))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def hopper_input_reason(q, k, v, sink, head_dims, direction: str) -> str | None:
    """What every sm90 Gluon kernel needs of its inputs (None = all there), or why not.

    direction ("forward" / "backward") only words the message; head_dims is what the
    kernel's tiles were built for.
    """
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if triton.__version__ not in TESTED_TRITON_VERSIONS:
        return (f"sm90 Gluon {direction} tested on triton {TESTED_TRITON_VERSIONS}, "
                f"found {triton.__version__}")
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"sm90 {direction} needs CUDA tensors"
    if _capability(q.device) != (9, 0):
        return f"sm90 {direction} needs an sm_90 (Hopper) GPU"
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"sm90 {direction} supports bf16/fp16 q, k, v of one dtype, "
                f"got {q.dtype}/{k.dtype}/{v.dtype}")
    d, dv = q.shape[-1], v.shape[-1]
    if head_dims is not None and (d not in head_dims or dv != d):
        return (f"sm90 {direction} supports head_dim == head_dim_v in {head_dims}, "
                f"got {d}/{dv}")
    # Any layout with a contiguous head dim: what TMA cannot read in place is copied first
    # (tma_ready).
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (q, k, v)):
        return f"sm90 {direction} needs q, k, v with a contiguous head dim"
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        return f"nheads_q {hq} is not a multiple of nheads_kv {hkv}"
    if q.shape[0] == 0 or k.shape[0] == 0:
        return "empty q or k"
    if sink is not None and (sink.dtype != torch.float32 or sink.numel() != hq):
        return "sink must be fp32 of shape (nheads_q,)"
    return None


def kernel_head_dim(d: int, dv: int) -> int | None:
    """Head dim of the compiled kernel that computes head dims (d, dv), or None.

    64, 128 and 256 (with dv == d) run as they are. Other widths from 72 to 256 (e.g. 96,
    192/128) run zero-padded to the next of 128/256 on both sides: the padded columns add 0 to
    q·k and produce output columns that are dropped. That wastes MMA work ((128 - 96) / 128 at
    d=96; 192/128 runs the 256/256 kernel) but beats the portable kernel by far on Hopper.
    Widths up to 64 other than 64 itself stay on the portable kernel."""
    if d == dv and d in SUPPORTED_HEAD_DIMS:
        return d
    width = max(d, dv)
    if width <= 64 or width > 256:
        return None
    return 128 if width <= 128 else 256


def forward_widths(d: int, dv: int) -> tuple[int, int] | None:
    """(head dim, head dim of V) of the forward kernel that computes (d, dv), or None.

    kernel_head_dim's width on both sides, except that a V of at most 128 next to a wider
    q·k (DeepSeek's 192/128) runs the 256/128 kernel: padding V to 256 would double the P·V
    work for nothing."""
    width = kernel_head_dim(d, dv)
    if width == 256 and dv <= 128 and d != dv:
        return 256, 128
    return None if width is None else (width, width)


def pad_head_dim(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


# Short query blocks of a GQA group share their K/V: with seqlen_q <= this, the group's q heads
# are packed into the query rows of one kv head (below).
PACK_GQA_MAX_SEQLEN_Q = 64


def packs_gqa(total_q: int, hq: int, hkv: int, seq: SeqInfo, params: AttnParams,
              sink) -> bool:
    """Whether `forward` runs the q heads of each kv head as extra query rows (FA3's
    pack_gqa): a 128-row tile then holds seqlen_q x group useful rows instead of seqlen_q,
    and each K/V tile is read once per kv head instead of once per q head.

    Exact only where every row of a sequence sees the same keys: no mask, or one query row
    (bottom-right aligned, it sees every key unless a left window cuts them), and no sink
    (a per-q-head logit). H200, GQA 32:4, d=128, 8k keys, batch 32 (2026-11-29, bench
    --seqlen-k): 76 -> 152 TFLOP/s at seqlen_q 16, 295 -> 521 at 64 (cuDNN 86 / 312).
    """
    if hq == hkv or sink is not None or seq.max_seqlen_q > PACK_GQA_MAX_SEQLEN_Q:
        return False
    if total_q * (hq // hkv) >= 2**31 - 3 * BLOCK_M:  # the packed rows' int32 TMA coordinates
        return False
    mask = params.mask
    return mask.window_left < 0 and (mask.window_right < 0 or seq.max_seqlen_q == 1)


def _forward_packed_gqa(q, k, v, seq: SeqInfo, params: AttnParams, cfg):
    """`forward` with q head hk·g + j of row i moved to row i·g + j of kv head hk."""
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    q_rows = q.view(total_q, hkv, g, d).transpose(1, 2).reshape(total_q * g, hkv, d)
    seq_rows = SeqInfo(seq.cu_seqlens_q * g, seq.cu_seqlens_k, seq.max_seqlen_q * g,
                       seq.max_seqlen_k, seq.seqused_k, seq.uniform)
    # Every row sees every key (packs_gqa), so no mask is needed: with more rows, the
    # bottom-right alignment of a causal mask would cut keys it does not cut now.
    out, lse = forward(q_rows, k, v, seq_rows, replace(params, mask=MaskSpec()), None, cfg)
    dv = out.shape[-1]
    out = out.view(total_q, g, hkv, dv).transpose(1, 2).reshape(total_q, hq, dv)
    lse = lse.view(hkv, total_q, g).transpose(1, 2).reshape(hq, total_q)
    return out, lse


def unsupported(q, k, v, seq: SeqInfo, params: AttnParams, sink) -> str | None:
    """None when this kernel computes the call exactly, else why not (for the dispatcher)."""
    d, dv = q.shape[-1], v.shape[-1]
    if kernel_head_dim(d, dv) is None:
        return (f"sm90 forward supports head dims 64/64, 128/128, 256/256 and (zero-padded) "
                f"any d, dv with 64 < max(d, dv) <= 256; got {d}/{dv}")
    why = hopper_input_reason(q, k, v, sink, None, "forward")
    if why is not None:
        return why
    if seq.max_seqlen_q == 0:
        return "no query rows"
    if max(q.shape[0], k.shape[0]) >= 2**31 - 3 * BLOCK_M:
        return "sequence rows exceed int32 TMA coordinates"
    return None


@functools.lru_cache(maxsize=None)
def _launcher() -> DirectLaunch:
    """The forward kernel, launched without Triton's per-call binding once compiled."""
    return DirectLaunch(_attn_fwd_kernel)


def forward(q, k, v, seq: SeqInfo, params: AttnParams, sink, cfg: FwdConfig | None = None):
    """out (total_q, Hq, Dv) in q.dtype and lse (Hq, total_q) fp32 (natural log)."""
    d, dv = q.shape[-1], v.shape[-1]
    dv_out = dv
    widths = forward_widths(d, dv)
    # Head dims between the compiled widths (see forward_widths) run the next widths' kernel:
    # read through (rows, heads, dim) descriptors that zero-fill the missing columns, or,
    # where TMA cannot address the rows (dim not a multiple of 8), from zero-padded copies.
    # softmax_scale already holds d's default.
    padded = (d, dv) != widths
    if padded and (d % 8 or dv % 8):
        out, lse = forward(pad_head_dim(q, widths[0]), pad_head_dim(k, widths[0]),
                           pad_head_dim(v, widths[1]), seq, params, sink, cfg)
        return out[..., :dv].contiguous(), lse
    total_q, hq, _ = q.shape
    total_k, hkv, _ = k.shape
    if packs_gqa(total_q, hq, hkv, seq, params, sink):
        return _forward_packed_gqa(q, k, v, seq, params, cfg)
    d, dv = widths
    plan = _launch_plan_of(d, dv, q, k, seq, params, sink, cfg)
    out, lse, _ = _launch(q, k, v, seq, params, sink, plan, padded)
    if dv_out != dv:
        return out[..., :dv_out].contiguous(), lse
    return out, lse


def _launch_plan_of(d, dv, q, k, seq: SeqInfo, params: AttnParams, sink, cfg) -> LaunchPlan:
    """launch_plan for kernel widths (d, dv) and this call."""
    return launch_plan(d, dv, seq.max_seqlen_q, seq.max_seqlen_k, bool(seq.uniform),
                       seq.seqused_k is not None, params.mask.window_left,
                       params.mask.window_right, params.softcap > 0, sink is not None,
                       seq.batch, q.shape[1], k.shape[1], sm_count(q.device), cfg,
                       NO_TRICKS if cfg is not None else fa4_tricks())


def _launch(q, k, v, seq: SeqInfo, params: AttnParams, sink, plan: LaunchPlan, padded: bool,
            bound=None):
    """(out, lse, kernel arguments) of one launch: allocate out and lse, build the
    descriptors, launch (through `bound`, a `launch.BoundLaunch`, where given and valid)."""
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    total_q, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    d, dv = plan.constexprs["HEAD_DIM"], plan.constexprs["HEAD_DIM_V"]
    # The kernel writes all `width` columns: padded dims get a wider output, cut by forward.
    out = torch.empty((total_q, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    # 2-D views (rows, heads*dim): a head is a column offset, so one descriptor serves all
    # heads and sequences; rows past a sequence end are masked (keys) or not stored (queries).
    # Padded head dims, and inputs whose heads do not lie side by side in a row, take
    # (rows, heads, dim) boxes instead.
    block_n = plan.cfg.block_n
    if padded or not (rows_dense(q) and rows_dense(k) and rows_dense(v)):
        q_desc = tma_heads(q, 64, d)
        k_desc = tma_heads(k, block_n, d)
        v_desc = tma_heads(v, block_n, dv)
    else:
        q_desc = tma_rows(q, (64, d))
        k_desc = tma_rows(k, (block_n, d))
        v_desc = tma_rows(v, (block_n, dv))
    o_desc = tma_rows(out, (64, plan.o_width))
    qk_scale, softcap_pre = exp2_scales(params)
    has_seqused = seq.seqused_k is not None
    args = (q_desc, k_desc, v_desc, o_desc, out, lse, seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.seqused_k if has_seqused else seq.cu_seqlens_q,
            sink if sink is not None else lse, seq.max_seqlen_q, seq.max_seqlen_k, total_q, hq,
            seq.batch, plan.num_m_blocks, hq // hkv, qk_scale, softcap_pre,
            params.mask.window_left, params.mask.window_right, plan.num_tiles, plan.hb_chunk)
    if bound is None or not bound((plan.grid,), args):
        _launcher()[(plan.grid, )](*args, **plan.constexprs)
    return out, lse, args


class ForwardRunner:
    """`forward` for one call signature with its decisions made once: the dispatcher's call
    plans (`asymflash.runtime.plans`) keep one per (shapes, strides, dtypes, device, params, sink
    class) and call it with that signature's tensors only. The first call launches through
    Triton's path and binds the compiled binary; later calls allocate, build descriptors and
    launch (`launch.BoundLaunch`)."""

    def __init__(self, q, k, v, seq: SeqInfo, params: AttnParams, sink):
        self.seq, self.params = seq, params
        self.plan = _launch_plan_of(q.shape[-1], v.shape[-1], q, k, seq, params, sink, None)
        self.bound = None

    def __call__(self, q, k, v, sink):
        bound = self.bound
        out, lse, args = _launch(q, k, v, self.seq, self.params, sink, self.plan, False, bound)
        if bound is None:  # None again where it cannot bind (a profiler's hook): retried
            self.bound = _launcher().bind(args, self.plan.constexprs)
        return out, lse


def forward_runner(q, k, v, seq: SeqInfo, params: AttnParams, sink):
    """A ForwardRunner for calls with this signature, or None where `forward` does more than
    one plain launch (padded head dims, packed GQA heads): those keep calling `forward`."""
    d, dv = q.shape[-1], v.shape[-1]
    if forward_widths(d, dv) != (d, dv):
        return None
    if packs_gqa(q.shape[0], q.shape[1], k.shape[1], seq, params, sink):
        return None
    return ForwardRunner(q, k, v, seq, params, sink)
