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

Head dim 192 (d_v <= 128, DeepSeek-V3's MLA prefill; `FwdConsts.PIECES`): Gluon's tensors
are powers of two, so each Q buffer and K slot is a 128-wide and a 64-wide piece, filled by
three 64-column TMA boxes (`common.load_pieces`), and S = Q_lo·K_loᵀ + Q_hi·K_hiᵀ is two
wgmmas into one accumulator: no MMA on the zero columns a 256-wide build would carry.

Masks are bottom-right aligned (see `core/params.py`). The key-block range of a CTA is split
into a peeled first block (always masked, which also covers empty rows and empty key
sequences), a masked prefix (sliding-window left edge), an unmasked middle and a masked
suffix (causal diagonal / right window / ragged end), so the common blocks pay no mask.

FA4 tricks, chosen per call through `FwdConfig` (the defaults: `config.py`) or, for every
call, by the switches ASYMFLASH_SM90_EXP2_EMU=k and ASYMFLASH_SM90_RESCALE=t (`fa4_tricks`):
* `exp2_emu_every = k`: every k-th exponential runs as a cubic polynomial on the FMA pipe
  instead of MUFU (2^x = 2^floor(x) · p(frac(x)), the integer part added to the exponent
  bits). Off: slower on the H200 wherever measured (`FwdConfig.exp2_emu_every`).
* `rescale_threshold = t > 0`: the running max used for P only moves when a row's max grows
  by more than t (log2 units), and O is rescaled only in warps where some row moved. Exact:
  the final normalisation uses the same stale max for O and for the row sum. On at d=256.

FP8 (`host.forward_fp8`): e4m3 Q and K tiles, V given transposed (fp8 wgmma reads both
operands K-major), P rounded to e4m3 in registers as the A operand of P·V
(`epilogue.p_operand_fp8`: the keys of each 32-key group renumbered so that no value leaves
its thread; the host's Vᵀ holds them in that order), the descales folded into the softmax
scale and O's normalisation.

Lengths, head counts, window sizes and scales are runtime arguments; a kernel is compiled
once per (dtype, head dims, config, feature switches).
"""

from __future__ import annotations

from ....core.exp2 import FLOOR_MAGIC, POLY_COEFFS, X_MIN, ptx_f32
from ..common import GLUON_ERROR

# The polynomial exp2's PTX literals, from core/exp2.py (the model of the sequence in
# `emu_asm`): c3, c2, c1, c0, the clamp and the floor constant. A global of plain strings,
# so Triton's cache key sees them.
_EMU_LITERALS = tuple(ptx_f32(c) for c in (*POLY_COEFFS[::-1], X_MIN, FLOOR_MAGIC))

if GLUON_ERROR is None:
    from ..bounds import key_blocks
    from ..common import (
        PIECE,
        copy_rows,
        fence_async_shared,
        gl,
        gluon,
        load_pieces,
        mbarrier,
        sequence,
        tile_layout,
        tma,
        tma_load,
        to_16bit,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from ..sched import (
        packed_tile,
        persistent_tile,
        publish_tile,
        read_tile,
        tile_of,
        wave_tile,
    )
    from .epilogue import (
        P_SHIFT_FP8,
        make_o_layout,
        make_p_layout,
        make_row_layout,
        make_s_layout,
        o_staging,
        o_turn_index,
        p_operand,
        q_bar_count,
        stacked,
        tile_store,
    )
    from .softmax import (
        block_scores,
        online_softmax,
        rescale_if_moved,
    )
    from .state import FwdCall, FwdConsts, FwdSmem, QTile, descale_index, with_qk_scale

    @gluon.jit
    def _load_q(bufs, call, cfg, q_row, q_head, q_slot0, q_phase):
        """Q of one tile (NUM_WG x 64 rows from q_row) into Q buffers q_slot0, q_slot0 + 1, ...

        On the persistent grid a Q buffer is refilled only after its warpgroup released the
        tile it last held (q_empty, parity q_phase ^ 1: the first wait passes at once).
        """
        for wg in gl.static_range(cfg.NUM_WG):
            if cfg.PERSISTENT:
                mbarrier.wait(bufs.q_empty.index(q_slot0 + wg), q_phase ^ 1)
            if cfg.PIECES:  # three 64-column boxes (`load_pieces`)
                load_pieces(call.q_desc, bufs.q.index(q_slot0 + wg),
                            bufs.q_hi.index(q_slot0 + wg), bufs.q_bar.index(q_slot0 + wg),
                            q_row + wg * 64, q_head, 64, cfg.HEAD_DIM, True)
            else:
                mbarrier.expect(bufs.q_bar.index(q_slot0 + wg), call.q_desc.block_type.nbytes)
                copy_rows(call.q_desc, q_row + wg * 64, q_head, cfg.HEAD_DIM,
                          bufs.q_bar.index(q_slot0 + wg), bufs.q.index(q_slot0 + wg), True)

    @gluon.jit
    def _load_kv(bufs, call, cfg, pos, row, kv_head):
        """The key block at rows [row, row + BLOCK_N) of kv_head into ring position pos."""
        slot = pos % cfg.STAGES
        # Fresh mbarriers count as having completed the phase before phase 0, so the first
        # pass through the ring does not wait.
        phase = ((pos // cfg.STAGES) & 1) ^ 1
        mbarrier.wait(bufs.k_empty.index(slot), phase)
        if cfg.PIECES:
            load_pieces(call.k_desc, bufs.k.index(slot), bufs.k_hi.index(slot),
                        bufs.k_ready.index(slot), row, kv_head, cfg.BLOCK_N, cfg.HEAD_DIM,
                        True)
        else:
            mbarrier.expect(bufs.k_ready.index(slot), call.k_desc.block_type.nbytes)
            copy_rows(call.k_desc, row, kv_head, cfg.HEAD_DIM, bufs.k_ready.index(slot),
                      bufs.k.index(slot), True)
        mbarrier.wait(bufs.v_empty.index(slot), phase)
        mbarrier.expect(bufs.v_ready.index(slot), call.v_desc.block_type.nbytes)
        if cfg.FP8:
            # Vᵀ (kv_heads · dv rows, batch · v_cols key columns; `host.transpose_v_fp8`):
            # dense sequences, so row = sequence · seqlen_k + the block's first key
            seq = row // call.seqlen_k
            tma_load(call.v_desc, [kv_head * cfg.HEAD_DIM_V,
                                   seq * call.v_cols + row - seq * call.seqlen_k],
                     bufs.v_ready.index(slot), bufs.v.index(slot))
        else:
            copy_rows(call.v_desc, row, kv_head, cfg.HEAD_DIM_V, bufs.v_ready.index(slot),
                      bufs.v.index(slot), True)

    @gluon.jit
    def _load_tile(bufs, call, cfg, q_row, q_head, kv_row, kv_head, n_lo, n_hi, it0, q_slot0,
                   q_phase):
        """Q of one tile (`_load_q`), then its key blocks [n_lo, n_hi) at ring positions
        it0, ..."""
        _load_q(bufs, call, cfg, q_row, q_head, q_slot0, q_phase)
        for i in range(n_hi - n_lo):
            _load_kv(bufs, call, cfg, it0 + i, kv_row + (n_lo + i) * cfg.BLOCK_N, kv_head)

    @gluon.constexpr_function
    def p_shift(fp8):
        return P_SHIFT_FP8 if fp8 else 0.0

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
    def _step(i, n, q, q_hi, bufs, call, cfg, tile, acc, p_op, m_i, l_i, rows, shift,
              MASKED: gl.constexpr, q_phase, WG: gl.constexpr, mods=None):
        """Ring position i holds key block n; P_{i-1} (p_op) still has to meet V_{i-1}.
        With PINGPONG the wgmmas are issued in this warpgroup's turn (`_take_turn`).
        q_hi: Q's 64-wide piece at head dim 192 (cfg.PIECES), else q. mods: a flex call's
        score_mod and mask_mod (`block_scores`), or None."""
        STAGES: gl.constexpr = cfg.STAGES
        PINGPONG: gl.constexpr = cfg.PINGPONG
        s_layout: gl.constexpr = make_s_layout(cfg.BLOCK_N, cfg.FP8)
        o_layout: gl.constexpr = make_o_layout(cfg.HEAD_DIM_V, cfg.FP8)
        p_layout: gl.constexpr = make_p_layout(cfg.HEAD_DIM_V)
        slot = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(bufs.k_ready.index(slot), (i // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(bufs.v_ready.index(prev), ((i - 1) // STAGES) & 1)
            _take_turn(bufs.q_bar, q_phase + i, WG, PINGPONG)
        s_zero = gl.zeros([64, cfg.BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q, bufs.k.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if cfg.PIECES:  # the 64-wide pieces' K-steps into the same S (issued in order)
            s_tok = warpgroup_mma(q_hi, bufs.k_hi.index(slot).permute((1, 0)), s_tok,
                                  is_async=True)
        if not PINGPONG:
            mbarrier.wait(bufs.v_ready.index(prev), ((i - 1) // STAGES) & 1)
        if cfg.FP8:
            o_tok = warpgroup_mma(p_op.to(gl.float8e4nv), bufs.v.index(prev).permute((1, 0)),
                                  acc, is_async=True)
        else:
            o_tok = warpgroup_mma(p_op, bufs.v.index(prev), acc, is_async=True)
        if PINGPONG:
            _pass_turn(bufs.q_bar, WG, PINGPONG)
        # wgmma groups retire in order: with one group left in flight (P·V), S_i is complete.
        s = warpgroup_mma_wait(1, deps=[s_tok])
        mbarrier.arrive(bufs.k_empty.index(slot))
        s = block_scores(s, n, rows, shift, call, cfg, tile, MASKED, mods)
        p, m_i, l_i, alpha = online_softmax(s, m_i, l_i, call.qk_scale, cfg.EMU_EVERY,
                                            cfg.RESCALE_THRESHOLD, p_shift(cfg.FP8))
        # p_op is a register operand of the P·V in flight: keep it alive until that group retires.
        if cfg.FP8:  # (`_tile_finish`)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(bufs.v_empty.index(prev))
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        if cfg.RESCALE_THRESHOLD > 0:
            # P packed first: the skip's branch ends the block, so the packs can still
            # interleave with the exponentials
            p_op = gl.convert_layout(to_16bit(p, q.dtype), p_layout)
            acc = rescale_if_moved(acc, alpha_o)
        else:
            acc = acc * gl.expand_dims(alpha_o, 1)
            p_op = p_operand(p, q.dtype, cfg.HEAD_DIM_V, cfg.FP8)
        return acc, p_op, m_i, l_i

    @gluon.jit
    def _consumer_loop(lo, hi, base, q, q_hi, bufs, call, cfg, tile, acc, p_op, m_i, l_i,
                       rows, shift, MASKED: gl.constexpr, q_phase, WG: gl.constexpr):
        # Ring position of key block n: n + base (base = ring position of n_lo minus n_lo).
        for n in range(lo, hi):
            acc, p_op, m_i, l_i = _step(n + base, n, q, q_hi, bufs, call, cfg, tile, acc, p_op,
                                        m_i, l_i, rows, shift, MASKED, q_phase, WG)
        return acc, p_op, m_i, l_i

    @gluon.jit
    def _tile_begin(bufs, cfg, it0, q_slot, q_phase, WG: gl.constexpr):
        """Wait for the tile's Q (buffer q_slot, parity q_phase) and its first key block (ring
        position it0), then issue S_0 = Q·K_0ᵀ without waiting: (Q, Q's 64-wide piece at
        head dim 192 or Q again, S_0 in flight)."""
        s_layout: gl.constexpr = make_s_layout(cfg.BLOCK_N, cfg.FP8)
        mbarrier.wait(bufs.q_bar.index(q_slot), q_phase)
        q = bufs.q.index(q_slot)
        if cfg.PIECES:
            q_hi = bufs.q_hi.index(q_slot)
        else:
            q_hi = q
        slot0 = it0 % cfg.STAGES
        mbarrier.wait(bufs.k_ready.index(slot0), (it0 // cfg.STAGES) & 1)
        if cfg.PINGPONG:
            _take_turn(bufs.q_bar, q_phase + it0, WG, cfg.PINGPONG)
        s_tok = warpgroup_mma(q, bufs.k.index(slot0).permute((1, 0)),
                              gl.zeros([64, cfg.BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        if cfg.PIECES:
            s_tok = warpgroup_mma(q_hi, bufs.k_hi.index(slot0).permute((1, 0)), s_tok,
                                  is_async=True)
        if cfg.PINGPONG:
            _pass_turn(bufs.q_bar, WG, cfg.PINGPONG)
        return q, q_hi, s_tok

    @gluon.jit
    def _tile_run(q, q_hi, s_tok, bufs, call, cfg, tile, rows, shift, n_lo, n_a, n_b, n_end,
                  it0, q_slot, q_phase, WG: gl.constexpr):
        """From S_0 (the only wgmma group in flight) to the issue of the last P·V, over key
        blocks [n_lo, n_end) (n_end: this warpgroup's last block, `_warpgroup_end`): returns
        (O in flight, its P operand, row max, row sum, the last V slot)."""
        # Peeled first block: no P·V to overlap with yet, and always masked.
        acc, p_op, m_i, l_i = _first_block(s_tok, q, bufs, call, cfg, tile, rows, shift, n_lo,
                                           it0, True)
        base = it0 - n_lo
        n_a = gl.minimum(n_a, n_end)
        n_b = gl.minimum(n_b, n_end)
        acc, p_op, m_i, l_i = _consumer_loop(n_lo + 1, n_a, base, q, q_hi, bufs, call, cfg,
                                             tile, acc, p_op, m_i, l_i, rows, shift, True,
                                             q_phase, WG)
        acc, p_op, m_i, l_i = _consumer_loop(n_a, n_b, base, q, q_hi, bufs, call, cfg, tile,
                                             acc, p_op, m_i, l_i, rows, shift, False, q_phase,
                                             WG)
        acc, p_op, m_i, l_i = _consumer_loop(n_b, n_end, base, q, q_hi, bufs, call, cfg, tile,
                                             acc, p_op, m_i, l_i, rows, shift, True, q_phase,
                                             WG)

        if cfg.PERSISTENT:
            # Every S wgmma of this tile has retired (each step ends with a full wait).
            mbarrier.arrive(bufs.q_empty.index(q_slot), count=1)

        o_tok, slot = _last_pv(bufs, cfg, acc, p_op, n_end - 1 + base, q_phase, WG)
        return o_tok, p_op, m_i, l_i, slot

    @gluon.jit
    def _first_block(s_tok, q, bufs, call, cfg, tile, rows, shift, n, it0, MASKED: gl.constexpr,
                     mods=None):
        """The peeled first key block n at ring position it0 (S_0 in flight, no P·V to
        overlap with yet): returns (O = 0, P_0 as P·V's operand, row max, row sum)."""
        row_layout: gl.constexpr = make_row_layout(cfg.BLOCK_N, cfg.FP8)
        m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
        l_i = gl.zeros([64], gl.float32, row_layout)
        acc = gl.zeros([64, cfg.HEAD_DIM_V], gl.float32,
                       make_o_layout(cfg.HEAD_DIM_V, cfg.FP8))
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(bufs.k_empty.index(it0 % cfg.STAGES))
        s = block_scores(s, n, rows, shift, call, cfg, tile, MASKED, mods)
        p, m_i, l_i, _alpha = online_softmax(s, m_i, l_i, call.qk_scale, cfg.EMU_EVERY,
                                             cfg.RESCALE_THRESHOLD, p_shift(cfg.FP8))
        p_op = p_operand(p, q.dtype, cfg.HEAD_DIM_V, cfg.FP8)
        return acc, p_op, m_i, l_i

    @gluon.jit
    def _last_pv(bufs, cfg, acc, p_op, last, q_phase, WG: gl.constexpr):
        """Issue the tile's last P·V (ring position last) and leave it in flight: returns
        (its token, its V slot)."""
        slot = last % cfg.STAGES
        mbarrier.wait(bufs.v_ready.index(slot), (last // cfg.STAGES) & 1)
        if cfg.PINGPONG:
            _take_turn(bufs.q_bar, q_phase + last + 1, WG, cfg.PINGPONG)
        if cfg.FP8:
            o_tok = warpgroup_mma(p_op.to(gl.float8e4nv), bufs.v.index(slot).permute((1, 0)),
                                  acc, is_async=True)
        else:
            o_tok = warpgroup_mma(p_op, bufs.v.index(slot), acc, is_async=True)
        if cfg.PINGPONG:
            _pass_turn(bufs.q_bar, WG, cfg.PINGPONG)
        return o_tok, slot

    @gluon.jit
    def _tile_finish(o_tok, p_op, v_empty, slot, FP8: gl.constexpr):
        """Wait for the last P·V and free its V slot; returns O.

        fp8 (`_tile_finish`): the P·V's e4m3 A registers are made at its issue from the
        fp16 P (`epilogue.p_operand_fp8`) and the wait's lowering takes no 8-bit values, so
        no P is a dependency of the wait; ptxas itself keeps a wgmma's A registers until
        its wait_group, or serialises the wgmmas (tests/compile checks it does not)."""
        if FP8:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_empty.index(slot))
        return acc

    @gluon.jit
    def _warpgroup_end(tile, window_right, n_lo, n_hi, cfg, WG: gl.constexpr):
        """End of warpgroup WG's key blocks within its tile's [n_lo, n_hi). With TAIL_SKIP (a
        right bound and 64-key blocks), a warpgroup whose 64 rows end a whole block before
        the tile's last row stops there: under a causal mask, a 128-row tile's first
        warpgroup would otherwise multiply, exponentiate and add one block that is masked out
        for every one of its rows (d=256: one in 2 (i + 1) blocks of the i-th tile)."""
        n_end = n_hi
        if cfg.TAIL_SKIP:
            row_last = gl.minimum(tile.m0 + WG * 64 + 63, tile.seqlen_q - 1)
            allowed = gl.maximum(row_last + tile.seqlen_k - tile.seqlen_q + window_right + 1,
                                 0)
            n_end = gl.maximum(gl.minimum(n_hi, (allowed + cfg.BLOCK_N - 1) // cfg.BLOCK_N),
                               n_lo + 1)
        return n_end

    @gluon.jit
    def _release_blocks(bufs, lo, hi, base, STAGES: gl.constexpr):
        """Release key blocks [lo, hi) (ring positions lo + base, ...) without reading them:
        each slot is waited for first, so the arrival counts toward this use of the slot and
        not the one before. Called once the warpgroup's own last V slot is released (a slot
        held while waiting for a later fill of the ring could stall the loader for good)."""
        for n in range(lo, hi):
            pos = n + base
            slot = pos % STAGES
            phase = (pos // STAGES) & 1
            mbarrier.wait(bufs.k_ready.index(slot), phase)
            mbarrier.arrive(bufs.k_empty.index(slot))
            mbarrier.wait(bufs.v_ready.index(slot), phase)
            mbarrier.arrive(bufs.v_empty.index(slot))

    @gluon.jit
    def _consumer_tile(bufs, call, cfg, tile, n_lo, n_a, n_b, n_hi, it0, q_slot, q_phase,
                       WG: gl.constexpr):
        """One 64-row query tile of warpgroup WG: key blocks [n_lo, n_hi) sit at K/V ring
        positions it0, it0 + 1, ...; its Q arrives in Q buffer q_slot, on q_bar[q_slot] with
        parity q_phase (q_slot = WG, but for the persistent grid's second Q buffers). On the
        persistent grid q_empty[q_slot] is arrived on as soon as the last S = Q·Kᵀ has
        retired, so the loader can bring a later tile's Q during the last P·V and the store.
        Ping-pong (one Q buffer per warpgroup only) counts its turns from q_phase.
        """
        row_layout: gl.constexpr = make_row_layout(cfg.BLOCK_N, cfg.FP8)
        rows = tile.m0 + WG * 64 + gl.arange(0, 64, layout=row_layout)
        if cfg.FP8:
            # q·k of the dequantised tensors is qd·kd·(q·k) of the e4m3 ones: both descales
            # of the tile's (sequence, kv head) go into the softmax scale
            at = descale_index(call, tile)
            call = with_qk_scale(call, call.qk_scale * gl.load(call.q_descale_ptr + at)
                                 * gl.load(call.k_descale_ptr + at))
        q, q_hi, s_tok = _tile_begin(bufs, cfg, it0, q_slot, q_phase, WG)
        n_end = _warpgroup_end(tile, call.window_right, n_lo, n_hi, cfg, WG)
        o_tok, p_op, m_i, l_i, slot = _tile_run(q, q_hi, s_tok, bufs, call, cfg, tile, rows,
                                                tile.seqlen_k - tile.seqlen_q, n_lo, n_a, n_b,
                                                n_end, it0, q_slot, q_phase, WG)
        acc = _tile_finish(o_tok, p_op, bufs.v_empty, slot, cfg.FP8)
        tile_store(acc, m_i, l_i, rows, bufs, call, cfg, tile, WG)
        if cfg.TAIL_SKIP:  # the blocks past this warpgroup's end, released once its O is out
            _release_blocks(bufs, n_end, n_hi, it0 - n_lo, cfg.STAGES)

    @gluon.jit
    def _load_role_persistent(bufs, call, cfg):
        it = 0  # K/V ring position of the next tile's first key block
        tc = 0  # tiles done by this CTA: tile tc's Q goes to buffer set tc % Q_BUFS
        nprog = gl.num_programs(0)
        for wave in range(0, (call.num_tiles + nprog - 1) // nprog):
            live, m0, head, q_start, k_start, sq, sk = persistent_tile(
                wave, call.num_tiles, call.n_heads, call.n_batch, call.num_m_blocks,
                call.hb_chunk, call.seqlen_q, call.seqlen_k, call.cu_q_ptr, call.cu_k_ptr,
                call.used_k_ptr, cfg.LPT, cfg.UNIFORM, cfg.HAS_SEQUSED, cfg.BLOCK_M)
            if live:
                n_lo, n_a, n_b, n_hi = key_blocks(m0, sq, sk, call.window_left,
                                                   call.window_right, cfg.HAS_LEFT,
                                                   cfg.HAS_RIGHT, cfg.BLOCK_N, cfg.BLOCK_M)
                kv_head = head // call.group
                if cfg.UNIFORM:
                    publish_tile(bufs.sched, bufs.q_empty, tc, m0, head, q_start, cfg.NUM_WG,
                                 cfg.Q_BUFS)
                _load_tile(bufs, call, cfg, q_start + m0, head, k_start, kv_head, n_lo, n_hi,
                           it, (tc % cfg.Q_BUFS) * cfg.NUM_WG, (tc // cfg.Q_BUFS) & 1)
                it += n_hi - n_lo
                tc += 1

    @gluon.jit
    def _consumer_role_persistent(bufs, call, cfg, WG: gl.constexpr):
        it = 0
        tc = 0
        nprog = gl.num_programs(0)
        for wave in range(0, (call.num_tiles + nprog - 1) // nprog):
            if cfg.UNIFORM:  # the tile's coordinates come from the loader (`publish_tile`)
                live = wave_tile(wave, gl.program_id(0), nprog) < call.num_tiles
            else:
                live, m0, head, q_start, k_start, sq, sk = persistent_tile(
                    wave, call.num_tiles, call.n_heads, call.n_batch, call.num_m_blocks,
                    call.hb_chunk, call.seqlen_q, call.seqlen_k, call.cu_q_ptr, call.cu_k_ptr,
                    call.used_k_ptr, cfg.LPT, cfg.UNIFORM, cfg.HAS_SEQUSED, cfg.BLOCK_M)
            if live:
                q_slot = (tc % cfg.Q_BUFS) * cfg.NUM_WG + WG
                q_phase = (tc // cfg.Q_BUFS) & 1
                if cfg.UNIFORM:
                    mbarrier.wait(bufs.q_bar.index(q_slot), q_phase)
                    m0, head, q_start = read_tile(bufs.sched, tc)
                    sq = call.seqlen_q
                    sk = call.seqlen_k
                n_lo, n_a, n_b, n_hi = key_blocks(m0, sq, sk, call.window_left,
                                                   call.window_right, cfg.HAS_LEFT,
                                                   cfg.HAS_RIGHT, cfg.BLOCK_N, cfg.BLOCK_M)
                _consumer_tile(bufs, call, cfg, QTile(q_start, m0, sq, sk, head), n_lo, n_a,
                               n_b, n_hi, it, q_slot, q_phase, WG)
                it += n_hi - n_lo
                tc += 1
        tma.store_wait(0)  # the last tile's O store reads o_smem

    @gluon.jit
    def allocate_smem(q_desc, k_desc, v_desc, o_desc, HEAD_DIM: gl.constexpr,
                      HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr, PINGPONG: gl.constexpr,
                      PERSISTENT: gl.constexpr, FP8: gl.constexpr = False):
        """The CTA's shared memory and mbarriers (not yet initialised) as a FwdSmem (FP8:
        the e4m3 build's, V transposed)."""
        # HEAD_DIM 192 (PIECES): q_smem and k_smem hold columns 0-127, q_hi and k_hi
        # 128-191 (Gluon's tensors are powers of two; q and k arrive as 64-column boxes).
        PIECES: gl.constexpr = HEAD_DIM == 128 + PIECE
        QK_LO: gl.constexpr = HEAD_DIM - PIECE if PIECES else HEAD_DIM
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * NUM_WG, 64, QK_LO],
                                           tile_layout(q_desc.layout))
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, QK_LO],
                                           tile_layout(k_desc.layout))
        # fp8: Vᵀ tiles (dv x keys): fp8 wgmma reads B K-major (keys contiguous), so P·V
        # takes them transposed
        if FP8:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DIM_V, BLOCK_N],
                                               v_desc.layout)
        else:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM_V],
                                               tile_layout(v_desc.layout))
        if PIECES:
            q_hi = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * NUM_WG, 64, PIECE],
                                             tile_layout(q_desc.layout))
            k_hi = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, PIECE],
                                             tile_layout(k_desc.layout))
        else:  # stand-ins (FwdSmem has one type per field), never read
            q_hi = q_smem
            k_hi = k_smem
        # O staging for the TMA-store epilogue, one tile per consumer warpgroup (a 32-column
        # stand-in, optimised away, when the host left it off: `output_box_width`).
        O_STAGING: gl.constexpr = o_staging(o_desc.block_shape, HEAD_DIM, HEAD_DIM_V, PERSISTENT,
                                            FP8)
        if O_STAGING == 1:
            o_smem = q_smem
        elif O_STAGING == 2:
            o_smem = gl.allocate_shared_memory(o_desc.dtype, stacked(1, o_desc.block_shape),
                                               tile_layout(o_desc.layout))
        else:
            o_smem = gl.allocate_shared_memory(o_desc.dtype,
                                               stacked(NUM_WG, o_desc.block_shape),
                                               tile_layout(o_desc.layout))
        # Q barriers of the consumer warpgroups, then (ping-pong only) their turn barriers,
        # then (O_STAGING 2) the staging tile's turn barrier.
        q_bar = gl.allocate_shared_memory(
            gl.int64, [q_bar_count(NUM_WG, PINGPONG, O_STAGING, Q_BUFS), 1],
            mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1],
                                            mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The persistent loader's tile coordinates for the consumers (`publish_tile`).
        sched = gl.allocate_shared_memory(gl.int32, [2, 4],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bufs = FwdSmem(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                       v_empty, sched, o_smem, q_hi, k_hi)
        return bufs

    @gluon.jit
    def _init_persistent_barriers(bufs, o_desc, HEAD_DIM: gl.constexpr,
                                  HEAD_DIM_V: gl.constexpr, STAGES: gl.constexpr,
                                  NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr,
                                  PINGPONG: gl.constexpr, FP8: gl.constexpr):
        """The mbarriers of a persistent CTA (`allocate_smem`'s order)."""
        O_STAGING: gl.constexpr = o_staging(o_desc.block_shape, HEAD_DIM, HEAD_DIM_V, True, FP8)
        for wg in gl.static_range(o_turn_index(PINGPONG, NUM_WG, Q_BUFS)):
            mbarrier.init(bufs.q_bar.index(wg), count=1)
        if O_STAGING == 2:
            mbarrier.init(bufs.q_bar.index(o_turn_index(PINGPONG, NUM_WG, Q_BUFS)), count=1)
        for wg in gl.static_range(Q_BUFS * NUM_WG):
            mbarrier.init(bufs.q_empty.index(wg), count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(bufs.k_ready.index(st), count=1)
            mbarrier.init(bufs.v_ready.index(st), count=1)
            mbarrier.init(bufs.k_empty.index(st), count=NUM_WG)
            mbarrier.init(bufs.v_empty.index(st), count=NUM_WG)
        fence_async_shared()

    @gluon.jit
    def init_tile_barriers(bufs, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """The mbarriers of a one-tile CTA (two consumer warpgroups)."""
        for wg in gl.static_range(4 if PINGPONG else 2):
            mbarrier.init(bufs.q_bar.index(wg), count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(bufs.k_ready.index(st), count=1)
            mbarrier.init(bufs.v_ready.index(st), count=1)
            # Both consumer warpgroups must release a slot before it is refilled.
            mbarrier.init(bufs.k_empty.index(st), count=2)
            mbarrier.init(bufs.v_empty.index(st), count=2)
        fence_async_shared()

    # Lengths, counts and windows stay runtime values: one compile serves every shape
    # (Triton would specialise on the value 1 and on divisibility by 16 otherwise).
    # The fp8 arguments come last, so the 16-bit builds keep their parameter offsets.
    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "n_heads", "n_batch",
                                  "num_m_blocks", "group", "window_left", "window_right",
                                  "num_tiles", "hb_chunk", "v_cols"])
    def attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                         used_k_ptr, sink_ptr, seqlen_q, seqlen_k, total_q, n_heads, n_batch,
                         num_m_blocks, group, qk_scale, softcap_pre, window_left, window_right,
                         num_tiles, hb_chunk, q_descale_ptr, k_descale_ptr, v_descale_ptr,
                         v_cols,
                         HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, UNIFORM: gl.constexpr,
                         HAS_SEQUSED: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINK: gl.constexpr,
                         LPT: gl.constexpr, EMU_EVERY: gl.constexpr,
                         RESCALE_THRESHOLD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         LOADER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
                         PINGPONG: gl.constexpr, NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr,
                         TAIL_SKIP: gl.constexpr, FP8: gl.constexpr):
        # PINGPONG: how many consumer warpgroups take turns issuing their wgmmas (NUM_WG, or 0
        # for none). NUM_WG = 3 only with PERSISTENT; Q_BUFS = 2 (a second Q buffer
        # per warpgroup: the loader brings the next tile's Q a whole tile ahead) only with
        # PERSISTENT, without PINGPONG and at d <= 128, so never with O_STAGING 2 (both
        # checked on the host).
        bufs = allocate_smem(q_desc, k_desc, v_desc, o_desc, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                             STAGES, NUM_WG, Q_BUFS, PINGPONG, PERSISTENT, FP8)
        cfg = FwdConsts(HEAD_DIM, HEAD_DIM_V, BLOCK_N, STAGES, UNIFORM, HAS_SEQUSED, HAS_LEFT,
                        HAS_RIGHT, SOFTCAP, HAS_SINK, LPT, EMU_EVERY, RESCALE_THRESHOLD,
                        PERSISTENT, PINGPONG, NUM_WG, Q_BUFS, TAIL_SKIP, FP8)
        if PERSISTENT:
            # grid = min(#SMs, #tiles); every role walks tiles pid, pid + grid, ... and keeps
            # its own ring position, so the loader runs ahead into the next tile (its Q once
            # the consumers released the current one, its K/V as ring slots free up).
            _init_persistent_barriers(bufs, o_desc, HEAD_DIM, HEAD_DIM_V, STAGES, NUM_WG, Q_BUFS,
                                      PINGPONG, FP8)
            call = FwdCall(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                           used_k_ptr, sink_ptr, seqlen_q, seqlen_k, total_q, n_heads, n_batch,
                           num_m_blocks, group, qk_scale, softcap_pre, window_left,
                           window_right, num_tiles, hb_chunk, q_descale_ptr, k_descale_ptr,
                           v_descale_ptr, v_cols)
            if NUM_WG == 3:
                gl.warp_specialize([
                    (_consumer_role_persistent, (bufs, call, cfg, 0)),
                    (_consumer_role_persistent, (bufs, call, cfg, 1)),
                    (_consumer_role_persistent, (bufs, call, cfg, 2)),
                    (_load_role_persistent, (bufs, call, cfg)),
                ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
            else:
                gl.warp_specialize([
                    (_consumer_role_persistent, (bufs, call, cfg, 0)),
                    (_consumer_role_persistent, (bufs, call, cfg, 1)),
                    (_load_role_persistent, (bufs, call, cfg)),
                ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            if UNIFORM or LPT:
                m_blk, head, batch = tile_of(gl.program_id(0), n_heads, n_batch, num_m_blocks,
                                              hb_chunk, LPT, False)
            else:  # packed sequences: no tiles past their ends (`host.packed_grid`)
                m_blk, head, batch = packed_tile(gl.program_id(0), n_heads, n_batch, cu_q_ptr,
                                                 128)
            q_start, k_start, seqlen_q, seqlen_k = sequence(batch, seqlen_q, seqlen_k,
                                                             cu_q_ptr, cu_k_ptr, used_k_ptr,
                                                             UNIFORM, HAS_SEQUSED)
            m0 = m_blk * 128
            if m0 < seqlen_q:
                n_lo, n_a, n_b, n_hi = key_blocks(m0, seqlen_q, seqlen_k, window_left,
                                                   window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                                                   128)
                init_tile_barriers(bufs, STAGES, PINGPONG)

                kv_head = head // group
                # One sequence per CTA: its own lengths stand in for the longest ones.
                call = FwdCall(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_q_ptr,
                               cu_k_ptr, used_k_ptr, sink_ptr, seqlen_q, seqlen_k, total_q,
                               n_heads, n_batch, num_m_blocks, group, qk_scale, softcap_pre,
                               window_left, window_right, num_tiles, hb_chunk, q_descale_ptr,
                               k_descale_ptr, v_descale_ptr, v_cols)
                tile = QTile(q_start, m0, seqlen_q, seqlen_k, head)
                # One tile: ring position 0, Q buffer WG, parity 0 (constants here). The
                # workers get the values computed here (loaded lengths, key blocks) through
                # shared memory, in the order of their role's arguments: that order shapes
                # the generated code, so n_lo stays ahead of n_a, n_b, n_hi.
                gl.warp_specialize([
                    (_consumer_tile, (bufs, call, cfg, tile, n_lo, n_a, n_b, n_hi, 0, 0, 0, 0)),
                    (_consumer_tile, (bufs, call, cfg, tile, n_lo, n_a, n_b, n_hi, 0, 1, 0, 1)),
                    (_load_tile, (bufs, call, cfg, q_start + m0, head, k_start, kv_head, n_lo,
                                  n_hi, 0, 0, 0)),
                ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
