"""The sm90 forward's host side: launch plans (config, grid, constexprs), descriptors,
`forward` / `forward_runner` and the dispatch checks (`unsupported`). The kernel:
`kernel.py`; the config and its heuristics: `config.py`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from asymflash.core.params import AttnParams, MaskSpec, SeqInfo, cdiv
from asymflash.runtime import env

from ....runtime.launch import DirectLaunch, sm_count
from ..common import (  # noqa: F401 - tests and scripts read the descriptor helpers here
    GLUON_ERROR,
    LN2,
    LOG2E,
    SIG_DTYPES,
    SUPPORTED_HEAD_DIMS,
    exp2_scales,
    forward_widths,
    hopper_input_reason,
    kernel_head_dim,
    layout_and_token,
    pad_head_dim,
    piece_cols,
    row_head_strides,
    rows_dense,
    smem_layout,
    tma_heads,
    tma_layout_reason,
    tma_ready,
    tma_rows,
)
from .config import (  # noqa: F401 - re-exported: tests and scripts read them here
    _DEFAULT_CONFIGS,
    FP8_HEAD_DIMS,
    L2_KV_BUDGET,
    SHORT_MASKED,
    SOFTCAP_FIELDS,
    FwdConfig,
    check_config,
    default_for_call,
    persistent_launch,
    select_config,
    use_persistent,
    use_three_warpgroups,
)

if GLUON_ERROR is None:
    import triton

    from ..common import TensorDescriptor
    from .kernel import attn_fwd_kernel

BLOCK_M_WG = 64  # query rows per consumer warpgroup (the wgmma M)
BLOCK_M = 2 * BLOCK_M_WG  # query rows per CTA


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a forward launch needs that depends on shapes and switches only, not on
    the tensors' data: built once per distinct call (`launch_plan`), so a repeated call
    pays for descriptors, two allocations and the launch alone (host time bounds short
    calls)."""

    cfg: FwdConfig
    grid: int
    hb_chunk: int
    num_m_blocks: int
    num_tiles: int
    constexprs: dict
    o_width: int  # output_box_width


# FA4's two forward tricks as process-wide switches (the defaults: config.py's tuning
# table), so that any call, and the benchmark, can run with them:
# ASYMFLASH_SM90_EXP2_EMU=k (2, 4 or 8) puts one exponential in k on the FMA pipe,
# ASYMFLASH_SM90_RESCALE=t (> 0, log2 units; FA4 uses 8) rescales O only when a row's max
# grew by more than t. They apply to the config a call would otherwise run; an explicit
# FwdConfig wins. Per-call switches (runtime/env.py): call plans are keyed by them.
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
    text = env.get(name)
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
                cfg: FwdConfig | None, tricks: tuple = NO_TRICKS,
                fp8: bool = False) -> LaunchPlan:
    """The config, grid and constexprs of one call (cfg: an override, or None; tricks:
    `fa4_tricks()`, applied to the config; callers with an override pass NO_TRICKS; fp8:
    the e4m3 build, `forward_fp8`)."""
    plain = not softcap and not has_sink and window_left < 0
    local = window_left >= 0 or window_right >= 0
    dense = uniform and not has_seqused
    o_width = output_box_width(d, dv, uniform and max_seqlen_q % 64 == 0)
    if cfg is None:
        cfg = default_for_call(d, local, window_right >= 0, max_seqlen_q, dense, plain,
                               packed=not uniform, softcap=softcap)
        if fp8 and cfg.consumer_wgs == 3:
            # the fp8 build of three warpgroups keeps values in local memory inside its key
            # loops (tests/compile), and was never measured: two warpgroups
            cfg = default_for_call(d, local, window_right >= 0, 0, dense, plain,
                                   packed=not uniform, softcap=softcap)
    if tricks[0] is not None:
        cfg = replace(cfg, exp2_emu_every=tricks[0])
    if tricks[1] is not None:
        cfg = replace(cfg, rescale_threshold=tricks[1])
    if fp8 and cfg.rescale_threshold:  # fp8 scales P by 2^8 against the exact max
        cfg = replace(cfg, rescale_threshold=0.0)
    num_m_blocks = cdiv(max_seqlen_q, BLOCK_M_WG * max(cfg.consumer_wgs, 1))
    num_tiles = num_m_blocks * hq * batch
    cfg, grid, hb_chunk = persistent_launch(cfg, max_seqlen_q, max_seqlen_k, dense, batch,
                                            num_tiles, hq, hkv, d, dv, sms, plain, window_right)
    check_config(cfg, d, fp8)
    consts = _constexprs(d, dv, cfg, uniform=dense, has_seqused=has_seqused,
                         has_left=window_left >= 0, has_right=window_right >= 0,
                         softcap=softcap, has_sink=has_sink, fp8=fp8)
    consts.update(_launch_options(cfg))
    return LaunchPlan(cfg, grid, hb_chunk, num_m_blocks, num_tiles, consts, o_width)


def output_box_width(d: int, dv: int, full_tiles: bool = True) -> int:
    """Columns of the output descriptor's box: the whole row (the kernel's TMA-store
    epilogue) where every sequence fills whole 64-row tiles (`full_tiles`: uniform lengths, a
    multiple of 64, so no tile holds rows of two sequences) and the staging tiles fit in
    shared memory: dv <= 128 (+16 / +32 KB next to 148-192 KB of rings), or dv = d (O is
    staged in the warpgroup's Q buffer, `_o_in_q`); else 32, never a whole row: a box the
    kernel only takes the layout of (masked per-thread stores)."""
    return dv if full_tiles and (dv <= 128 or dv == d) else 32


def _constexprs(head_dim, head_dim_v, cfg: FwdConfig, *, uniform, has_seqused, has_left,
                has_right, softcap, has_sink, fp8=False):
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
                              and not cfg.pingpong),
            "FP8": bool(fp8)}


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
                       cfg: FwdConfig | dict | None = None, arch=90, heads_axis=False,
                       tma_store=True, **features):
    """Compile the kernel without a GPU (CI check); returns triton's CompiledKernel.
    cfg: a config, or a dict of overrides of the head dim's default one;
    heads_axis: with the (rows, heads, dim) descriptors of head dims between the widths;
    tma_store: the TMA-store epilogue (where `output_box_width` allows it);
    dtype=torch.float8_e4m3fn: the fp8 build (`forward_fp8`: e4m3 q, k and Vᵀ, bf16 out)."""
    if GLUON_ERROR is not None:
        raise RuntimeError(GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    fp8 = dtype == torch.float8_e4m3fn
    if cfg is None or isinstance(cfg, dict):
        base = _DEFAULT_CONFIGS[head_dim]
        if fp8:  # as `launch_plan`: P is scaled against the exact running max
            base = replace(base, rescale_threshold=0.0)
        cfg = replace(base, **(cfg or {}))
    check_config(cfg, head_dim, fp8)
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
                 "softcap": False, "has_sink": False, "fp8": fp8}
    feats.update(features)
    ty = SIG_DTYPES[dtype]
    out_dtype = torch.bfloat16 if fp8 else dtype
    oty = SIG_DTYPES[out_dtype]

    def desc(block):
        if heads_axis:
            block = [block[0], 1, block[1]]
        dims = ", ".join(map(str, block))
        return f"tensordesc<{ty}[{dims}],{smem_layout(block, dtype)!r}>"

    o_width = output_box_width(head_dim, head_dim_v) if tma_store else 32
    cols = piece_cols(head_dim)  # q and k boxes: the head, or at 192 its 64-column pieces
    signature = {
        "q_desc": desc([64, cols]), "k_desc": desc([cfg.block_n, cols]),
        # fp8: Vᵀ's (dv, keys) box, never through the heads axis (`transpose_v_fp8`)
        "v_desc": (f"tensordesc<{ty}[{head_dim_v}, {cfg.block_n}],"
                   f"{smem_layout((head_dim_v, cfg.block_n), dtype)!r}>" if fp8
                   else desc([cfg.block_n, head_dim_v])),
        "o_desc": (f"tensordesc<{oty}[64, {o_width}],"
                   f"{smem_layout((64, o_width), out_dtype)!r}>"),
        "out_ptr": f"*{oty}", "lse_ptr": "*fp32",
        "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "used_k_ptr": "*i32", "sink_ptr": "*fp32",
        "seqlen_q": "i32", "seqlen_k": "i32", "total_q": "i32", "n_heads": "i32", "n_batch": "i32",
        "num_m_blocks": "i32", "group": "i32", "qk_scale": "fp32", "softcap_pre": "fp32",
        "window_left": "i32", "window_right": "i32", "num_tiles": "i32", "hb_chunk": "i32",
        "q_descale_ptr": "*fp32", "k_descale_ptr": "*fp32", "v_descale_ptr": "*fp32",
        "v_cols": "i32"}
    constexprs = _constexprs(head_dim, head_dim_v, cfg, **feats)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(attn_fwd_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=_launch_options(cfg))


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
    (a per-q-head logit). A large gain for short GQA queries (see docs/tuning.md).
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
        return (f"sm90 forward supports head dims 64/64, 128/128, 192/128, 256/256 and "
                f"(zero-padded) any d, dv with 64 < max(d, dv) <= 256; got {d}/{dv}")
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
    return DirectLaunch(attn_fwd_kernel)


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
    q_desc, k_desc, v_desc = input_descriptors(q, k, v, d, dv, plan.cfg.block_n, padded)
    o_desc = tma_rows(out, (64, plan.o_width))
    qk_scale, softcap_pre = exp2_scales(params)
    has_seqused = seq.seqused_k is not None
    args = (q_desc, k_desc, v_desc, o_desc, out, lse, seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.seqused_k if has_seqused else seq.cu_seqlens_q,
            sink if sink is not None else lse, seq.max_seqlen_q, seq.max_seqlen_k, total_q, hq,
            seq.batch, plan.num_m_blocks, hq // hkv, qk_scale, softcap_pre,
            params.mask.window_left, params.mask.window_right, plan.num_tiles, plan.hb_chunk,
            lse, lse, lse, 0)  # the fp8 arguments, unused
    grid = packed_grid(plan, total_q, seq.batch, hq)
    if bound is None or not bound((grid,), args):
        _launcher()[(grid, )](*args, **plan.constexprs)
    return out, lse, args


def packed_grid(plan: LaunchPlan, total_q: int, batch: int, hq: int) -> int:
    """The launch's grid: the plan's, or on the plain grid over packed sequences (in order)
    hq·(total_q // 128 + batch) CTAs, so that no query block past a sequence's end gets one
    (`sched.packed_tile`; total_q varies between calls of one plan)."""
    c = plan.constexprs
    if c["PERSISTENT"] or c["UNIFORM"] or c["LPT"]:
        return plan.grid
    return hq * (total_q // (2 * BLOCK_M_WG) + batch)


def input_descriptors(q, k, v, d: int, dv: int, block_n: int, padded: bool):
    """TMA descriptors of q, k, v for kernel widths (d, dv). 2-D views (rows, heads*dim): a
    head is a column offset, so one descriptor serves all heads and sequences; rows past a
    sequence end are masked (keys) or not stored (queries). Padded head dims, and inputs
    whose heads do not lie side by side in a row, take (rows, heads, dim) boxes instead.
    q and k boxes span the head, or at d = 192 a 64-column piece (`piece_cols`: the kernel
    loads three per head)."""
    cols = piece_cols(d)
    if padded or not (rows_dense(q) and rows_dense(k) and rows_dense(v)):
        return tma_heads(q, 64, cols), tma_heads(k, block_n, cols), tma_heads(v, block_n, dv)
    return (tma_rows(q, (64, cols)), tma_rows(k, (block_n, cols)),
            tma_rows(v, (block_n, dv)))


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


# --- fp8 (e4m3) forward -----------------------------------------------------------------
# FA3's semantics: attention of q·q_descale, k·k_descale, v·v_descale, descales fp32
# (batch, nheads_kv), out bf16, lse fp32. q and k are read as they are (e4m3 tiles by TMA,
# S = Q·Kᵀ by fp8 wgmma: K's (keys, d) rows are already K-major). wgmma takes fp8 operands
# K-major only, and for P·V the K dimension is the keys: V's tiles must have the keys
# contiguous, so the host writes Vᵀ once (one read and one write of V, about 1 % of the
# attention's time at 16k keys) instead of a transpose in shared memory inside the key loop.

FP8_KEY_GROUP = 32  # keys per group of `fp8_key_order`: one k32 wgmma step


def fp8_key_order(n: int) -> torch.Tensor:
    """Position j of a group of n keys (n a multiple of 32) holds key order[j]: the order in
    which the kernel's e4m3 P operand holds the keys of a block (`epilogue.p_operand_fp8`):
    A column 16h + 4t + 2a + b is S column 8(2h + a) + 2t + b."""
    idx = torch.arange(n).view(n // FP8_KEY_GROUP, 2, 2, 4, 2)  # (.., h, a, t, b)
    return idx.permute(0, 1, 3, 2, 4).reshape(n)  # (.., h, t, a, b)


def transpose_v_fp8(v: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """(Vᵀ, key columns per sequence) of a dense e4m3 v (batch · seqlen_k, nheads_kv, dv):
    Vᵀ is (nheads_kv · dv, batch · cols), cols = seqlen_k rounded up to 32 (zeros past the
    end: P is 0 there, and 0 · 0 stays 0 where stale bytes could be NaN), the keys of each
    32-key group in `fp8_key_order`. One copy of V, fused in one torch op where possible."""
    total, hkv, dv = v.shape
    seqlen = total // batch
    cols = -(-seqlen // FP8_KEY_GROUP) * FP8_KEY_GROUP
    src = v.reshape(batch, seqlen, hkv, dv)
    if cols != seqlen:
        src = torch.cat([src, src.new_zeros(batch, cols - seqlen, hkv, dv)], dim=1)
    groups = cols // FP8_KEY_GROUP
    # keys (g, h, a, t, b) -> columns (g, h, t, a, b); rows (head, dim)
    vt = src.view(batch, groups, 2, 2, 4, 2, hkv, dv).permute(6, 7, 0, 1, 2, 4, 3, 5)
    return vt.reshape(hkv * dv, batch * cols), cols


def _matrix_desc(t: torch.Tensor, block) -> "TensorDescriptor":
    """TMA descriptor of a contiguous 2-D tensor (rows, cols) with box `block`."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), [t.stride(0), 1]
    desc.block_shape, desc.padding = list(block), "zero"
    desc.layout, desc.asym_token = layout_and_token(tuple(block), t.dtype)
    return desc


def fp8_unsupported(q, k, v, seq: SeqInfo, params: AttnParams | None,
                    sink=None) -> str | None:
    """None when the fp8 kernel computes the call (q, k, v e4m3, dense), else why not (the
    caller then runs the 16-bit kernels on host-cast inputs, `api/fp8.py`). params None: the
    caller checked softcap itself (`api/fp8.kernel_reason`)."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    from ....runtime.dispatch import SM90_TESTED_TRITON, sm90_triton_allowed

    if not sm90_triton_allowed(triton.__version__):
        return f"sm90 fp8 forward verified with triton {SM90_TESTED_TRITON}"
    fp8 = torch.float8_e4m3fn
    if not (q.dtype == k.dtype == v.dtype == fp8):
        return "the sm90 fp8 forward takes e4m3 q, k and v"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "sm90 fp8 forward needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "sm90 fp8 forward needs an sm_90 (Hopper) GPU"
    d, dv = q.shape[-1], v.shape[-1]
    if d != dv or d not in FP8_HEAD_DIMS:
        return f"sm90 fp8 forward supports head dims {FP8_HEAD_DIMS} (d == dv), got {d}/{dv}"
    if not seq.uniform or seq.seqused_k is not None:
        # Vᵀ's key columns are per dense sequence (`transpose_v_fp8`)
        return "sm90 fp8 forward: dense sequences only"
    if (params is not None and params.softcap > 0) or sink is not None:
        return "sm90 fp8 forward: no softcap or sink"
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        return f"nheads_q {hq} is not a multiple of nheads_kv {hkv}"
    if q.shape[0] == 0 or k.shape[0] == 0 or seq.max_seqlen_q == 0:
        return "empty q or k"
    if max(q.shape[0], k.shape[0]) >= 2**31 - 3 * BLOCK_M:
        return "sequence rows exceed int32 TMA coordinates"
    if any(t.stride(-1) != 1 for t in (q, k)):
        return "sm90 fp8 forward needs q and k with a contiguous head dim"
    return None


def forward_fp8(q, k, v, seq: SeqInfo, params: AttnParams, descales,
                cfg: FwdConfig | None = None):
    """The fp8 forward (`fp8_unsupported` is None): q (total_q, Hq, d), k, v (total_k, Hkv,
    d) e4m3, descales (q, k, v) fp32 (batch, Hkv) or None (1). Returns out (total_q, Hq, d)
    bf16 and lse (Hq, total_q) fp32, natural log."""
    batch = seq.batch
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    # the 2-D (rows, heads · d) reads of q and k need the heads of a row side by side and
    # TMA's 16-byte alignment, else a fresh (aligned) copy
    q = q if rows_dense(q) and tma_layout_reason(q, "q") is None else \
        q.clone(memory_format=torch.contiguous_format)
    k = k if rows_dense(k) and tma_layout_reason(k, "k") is None else \
        k.clone(memory_format=torch.contiguous_format)
    vt, v_cols = transpose_v_fp8(v, batch)
    ones = None
    scales = []
    for s in descales:
        if s is None:
            if ones is None:
                ones = torch.ones((batch, hkv), dtype=torch.float32, device=q.device)
            s = ones
        scales.append(s.float().contiguous())
    plan = launch_plan(d, d, seq.max_seqlen_q, seq.max_seqlen_k, True, False,
                       params.mask.window_left, params.mask.window_right, False, False,
                       batch, hq, hkv, sm_count(q.device), cfg,
                       NO_TRICKS if cfg is not None else fa4_tricks(), True)
    out = torch.empty((total_q, hq, d), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    block_n = plan.cfg.block_n
    qk_scale, softcap_pre = exp2_scales(params)
    args = (tma_rows(q, (64, d)), tma_rows(k, (block_n, d)), _matrix_desc(vt, (d, block_n)),
            tma_rows(out, (64, plan.o_width)), out, lse, seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.cu_seqlens_q, lse, seq.max_seqlen_q, seq.max_seqlen_k, total_q, hq, batch,
            plan.num_m_blocks, hq // hkv, qk_scale, softcap_pre, params.mask.window_left,
            params.mask.window_right, plan.num_tiles, plan.hb_chunk, *scales, v_cols)
    _launcher()[(plan.grid, )](*args, **plan.constexprs)
    return out, lse
