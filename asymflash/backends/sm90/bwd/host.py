"""FlashAttention backward for Hopper (sm_90a), written in Gluon.

`kernel.py`'s synchronous body runs d=64 with softcap, a sliding window, or a causal mask
below 2k rows, and d=128 with softcap; other d=64 and d=128 calls and d=192 run
`kernel_ws.py`'s warp-specialised version of the same plan (warpgroups out of phase,
BwdConfig.split_warpgroups), d=256 (and d=192 deterministic or with softcap) `kernel.py`'s
wide body. The host side here serves all
three, through one launch entry (`entry.py`).

One CTA owns BLOCK_N keys of one (sequence, kv head) and keeps K, V (shared memory) and the
dK, dV accumulators (registers) for its whole life. It walks every query block, of every q
head of the GQA group, that can see those keys. Per query block (two warpgroups, each owning
BLOCK_N / 2 of the keys, 8 warps in all):

    Sᵀ  = K·Qᵀ            (wgmma, A = K and B = Qᵀ from shared memory)
    dPᵀ = V·dOᵀ           (wgmma, issued right behind Sᵀ, overlaps the exponentials)
    Pᵀ  = exp2(Sᵀ·scale·log2 e − lse₂)               lse₂ = +inf for rows with lse = −inf
    dV += Pᵀ·dO           (wgmma, Pᵀ stays in registers as the A operand)
    dSᵀ = Pᵀ ∘ (dPᵀ − delta)  [softcap: ∘ (1 − tanh²)]
    dK += dSᵀ·Q           (wgmma, dSᵀ in registers)
    dQ  = dS·K            (wgmma, dSᵀ staged in shared memory and read transposed)
    dQ_acc += dQ          (fp32, staged in shared memory, one TMA reduce-add into a
                           (total_q, Hq, D) buffer)

Computing the transposed products puts the key dimension on the wgmma M axis, so Pᵀ and dSᵀ
come out of their MMAs already in the accumulator layout the dV and dK MMAs take as register
A operands (FA3/FA4 trick): only dSᵀ makes a trip through shared memory, for dQ, whose M axis
is the query rows.

Q and dO stream through a two-slot TMA ring (one mbarrier per slot). The kernel is not
warp-specialised: every thread runs the loop, the loads of the next query block are issued
right after the CTA-wide barrier that publishes dSᵀ (at that point every warp has retired the
previous block's MMAs, so its slot is free), and dSᵀ is double-buffered so one warpgroup can
write block i while the other still reads block i-1 in its dQ MMA. lse and delta of the next
block are staged through shared memory one step ahead (loaded while the MMAs run, read back in
the MMA layout only where needed: at d=128 every live register counts, the kernel sits at the
255-register limit).

Masks (bottom-right aligned, `core/params.py`) are applied only on the query blocks that cut
the causal diagonal or window edges, or when the key block runs past the sequence; query rows
past the sequence end need no mask (their lse reads as +inf, so P = 0 there).

dQ partials of all key blocks meet in dQ_acc. Per-thread fp32 atomics cost +40 % at d=128
16k in L2 reduction traffic (measured with them predicated off); one TMA
reduce-add per step (cp.reduce.async.bulk.tensor, issued from the staged tile by one thread
per warp of the first warpgroup, one 32-column box each) moves the same bytes as whole lines
(much faster: see docs/tuning.md). Rows past the sequence add exact zeros (P = 0), so the box needs
no mask; the staging tile is rewritten after `tma.store_wait` and the step's main barrier.
Either way the summation order is whatever order the CTAs arrive in.

`deterministic=True` fixes it with one semaphore per (sequence, q head, query block)
(FA3/FA4's scheme): the CTA of key block j adds its dQ partial for a query block only after
the key blocks before it in a fixed order have added theirs, then bumps the counter.
The key blocks that see a query block form one contiguous range [n_first, n_last] (a band
mask), so "my turn" is counter == j - n_first (ascending order), or n_last - j for causal
masks (descending: there the top key block reaches each query block first, so ascending turns
would serialise the CTAs into a wavefront; measured +110-130 % vs +20-35 % for non-causal).
The grid runs in turn order (x), so every CTA waited on has started earlier: no deadlock.
Masks without a window walk staggered instead (`_constexprs`, sched.walk_start): key
block j starts at step j·(steps // key blocks), and a query block's turns follow the order in
which that schedule visits it, so CTAs running at the same pace never wait; a CTA then may
wait for one launched after it, so this needs every key block of a sequence resident at once
(key blocks <= SMs; else ascending turns). With TMA reduces a turn passes on only once the
reduce has written (parts.release_dq_turn_after_tma), in the same step or one step later
(BwdConfig.turn_release), and a CTA waits for its turn while its last MMAs run. fp32 sums in
a fixed order make dQ bitwise reproducible; dK and dV are written once anyway. It costs
most at d=256 (see docs/tuning.md): the semaphore round trips and barriers sit on every
step's critical path: taking them off needs a warp of its own for the dQ
reduce, which the 255-register budget of d=128/256 does not leave room for.

The postprocess (dQ_acc -> q.dtype; the softmax scale is applied before the reduction) and the
preprocess (delta = rowsum(dO∘O) − dlse, the portable tl kernel) are separate small launches.
Lengths, head counts, windows and scales are runtime arguments: one compile per (dtype, head
dim, config, feature switches).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from asymflash.core.params import AttnParams, SeqInfo

from ....runtime.launch import DirectLaunch, LaunchSite, sm_count
from .. import common
from ..common import GLUON_ERROR
from . import dq_fragments, entry
from .config import (  # noqa: F401 - re-exported: tests and scripts read them here
    _DEFAULT_CONFIGS,
    HEADS_FIRST_L2_BYTES,
    BwdConfig,
    _splits_warpgroups,
    head_chunk,
    heads_first,
    select_config,
)
from .plan import (  # noqa: F401 - re-exported: tests and scripts read them here
    FIRST_STORES_MAX_KEYS,
    PERSISTENT_ROWS,
    PIECE_HI,
    LaunchPlan,
    _constexprs,
    _dq_block,
    _dq_box_and_layout,
    _dq_layout,
    _dq_tile,
    _fragments,
    _key_rows,
    _kind,
    _launch_options,
    backward_widths,
    first_stores,
    kv_tma_store,
    launch_plan,
    persists,
    piece_cols,
)

if GLUON_ERROR is None:
    import triton

# 64 and 128 run kernel.py's synchronous body (or kernel_ws.py's), 256 its wide one (the
# warpgroups split the head dim), 192 kernel_ws.py's or the wide one, as a 128- and a
# 64-wide piece: `_kind`.
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256)


@functools.lru_cache(maxsize=None)
def _launcher_for(head_dim: int, split: bool = False) -> DirectLaunch:
    """The backward kernel, launched without Triton's per-call binding once compiled."""
    return DirectLaunch(_kernel_for(head_dim, split))


def _kernel_for(head_dim: int, split: bool = False):
    """The launch entry; which body it runs is the KIND constexpr (`_kind`). One binary per
    distinct set of constexprs, KIND among them, as with a JIT function per body."""
    return entry.attn_bwd_kernel


@functools.lru_cache(maxsize=None)
def _unused_semaphore(device: torch.device) -> torch.Tensor:
    """The semaphore argument of calls that are not deterministic (never read): one per
    device instead of a fresh zeroed tensor (an allocation and a fill launch) per call."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def kernel_signature(head_dim, head_dim_v, cfg: BwdConfig, split: bool, dtype,
                     heads_axis: bool = False) -> dict:
    """The launch entry's runtime arguments as `triton.compile` types (compile checks)."""
    ty = common.SIG_DTYPES[dtype]

    def rows_desc(block):
        dims = ", ".join(map(str, block))
        return f"tensordesc<{ty}[{dims}],{common.smem_layout(block, dtype)!r}>"

    def desc(block):
        if heads_axis:  # q, k, v, dO through common.tma_heads (head dims between the widths)
            return rows_desc([block[0], 1, block[1]])
        return rows_desc(block)

    dq_block, dq_layout = _dq_box_and_layout(head_dim, cfg, split)
    cols = piece_cols(head_dim)
    signature = {
        "q_desc": desc([cfg.block_m, cols]), "k_desc": desc([cfg.block_n, cols]),
        "v_desc": desc([cfg.block_n, head_dim_v]), "do_desc": desc([cfg.block_m, head_dim_v]),
        "dq_desc": f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{dq_layout!r}>",
        "dk_desc": rows_desc([_key_rows(cfg, split), cols]),
        "dv_desc": rows_desc([_key_rows(cfg, split), head_dim_v]),
        "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dk_ptr": f"*{ty}",
        "dv_ptr": f"*{ty}", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "used_k_ptr": "*i32",
        "sem_ptr": "*i32", "seqlen_q": "i32", "seqlen_k": "i32", "total_q": "i32",
        "n_heads": "i32", "n_kv_heads": "i32", "group": "i32", "num_m_blocks": "i32",
        "qk_scale": "fp32", "softmax_scale": "fp32",
        "softcap_pre": "fp32", "window_left": "i32", "window_right": "i32"}
    return signature


def compile_for_target(head_dim=128, head_dim_v=None, dtype=torch.bfloat16,
                       cfg: BwdConfig | dict | None = None, arch=90, heads_axis=False,
                       **features):
    """Compile the backward kernel without a GPU (CI check); returns triton's CompiledKernel.
    cfg: a config, or a dict of overrides of the one `select_config` picks for these
    features; heads_axis: with the (rows, heads, dim) descriptors of head dims between the
    widths."""
    if GLUON_ERROR is not None:
        raise RuntimeError(GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
             "softcap": False, "deterministic": False}
    feats.update(features)
    overrides = cfg if isinstance(cfg, dict) else None
    cfg = select_config(head_dim, None if overrides is not None else cfg, feats["softcap"],
                        feats["deterministic"], feats["has_left"] or feats["has_right"],
                        window=feats["has_left"])
    if overrides:
        cfg = select_config(head_dim, replace(cfg, **overrides))
    feats.setdefault("kv_tma_store", feats["uniform"] and not feats["has_seqused"])
    split = _splits_warpgroups(head_dim, cfg, feats["softcap"])
    signature = kernel_signature(head_dim, head_dim_v, cfg, split, dtype, heads_axis)
    constexprs = _constexprs(head_dim, head_dim_v, cfg, split=split, **feats)
    for name in constexprs:
        signature[name] = "constexpr"
    src = GluonASTSource(_kernel_for(head_dim, split), signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=_launch_options(split, cfg))


def unsupported_backward(q, k, v, seq: SeqInfo, params: AttnParams, sink) -> str | None:
    """None when this kernel computes the gradients exactly, else why not (for dispatch)."""
    d, dv = q.shape[-1], v.shape[-1]
    if common.kernel_head_dim(d, dv) is None:
        return (f"sm90 backward supports head dims 64/64, 128/128, 256/256 and (zero-padded) "
                f"any d, dv with 64 < max(d, dv) <= 256; got {d}/{dv}")
    why = common.hopper_input_reason(q, k, v, sink, None, "backward")
    if why is not None:
        return why
    if seq.batch > 65535 or k.shape[1] > 65535:
        return "grid dimensions y/z (kv heads, batch) are limited to 65535"
    if max(q.shape[0], k.shape[0]) >= 2**31 - 1024:
        return "sequence rows exceed int32 TMA coordinates"
    return None


def backward(dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink,
             cfg: BwdConfig | None = None):
    """(dq, dk, dv, dsink) for out = attention(q, k, v); shapes as in `core/params.py`."""
    d, dvd = q.shape[-1], v.shape[-1]
    width, width_v = backward_widths(d, dvd)
    # As the forward: zero columns add nothing to q·k, dO·vᵀ or rowsum(dO∘O), and the
    # gradients' padded columns are dropped. q, k, v and dO are read through (rows, heads,
    # dim) TMA boxes that zero-fill them (common.tma_heads), or, for dims TMA cannot address
    # per head (not multiples of 8), padded copies.
    padded = (d, dvd) != (width, width_v)
    if padded and (d % 8 or dvd % 8):
        pad = common.pad_head_dim
        dq, dk, dv, dsink = backward(pad(dout, width_v), pad(q, width), pad(k, width),
                                     pad(v, width_v), pad(out, width_v), lse, dlse, seq, params,
                                     sink, cfg)
        return (dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :dvd].contiguous(),
                dsink)
    q, k, v = common.tma_ready(q), common.tma_ready(k), common.tma_ready(v)
    plan = _plan_of(width, width_v, q, k, seq, params, cfg)
    dq, dk, dv, dsink = _run(plan, width, width_v, padded, dout, q, k, v, out, lse, dlse, seq,
                             params, sink)
    if padded:
        dk, dv = dk[..., :d].contiguous(), dv[..., :dvd].contiguous()
    return dq, dk, dv, dsink


def _plan_of(width, width_v, q, k, seq: SeqInfo, params: AttnParams, cfg) -> LaunchPlan:
    """launch_plan for kernel widths (width, width_v) and this call."""
    wl, wr = params.mask.window_left, params.mask.window_right
    has_seqused = seq.seqused_k is not None
    return launch_plan(width, width_v, seq.max_seqlen_q, seq.max_seqlen_k,
                       bool(seq.uniform and not has_seqused), has_seqused, wl, wr,
                       params.softcap > 0, params.deterministic, seq.batch, k.shape[1],
                       sm_count(q.device), cfg, q.shape[1])


def _run(plan: LaunchPlan, width, width_v, padded, dout, q, k, v, out, lse, dlse,
         seq: SeqInfo, params: AttnParams, sink, sites: BackwardSites | None = None,
         flex: tuple | None = None):
    """(dq, dk, dv, dsink) of one backward: allocate, build the descriptors, launch the
    preprocess, the main kernel and the dQ postprocess (through `sites`, a call plan
    runner's bound launches, where given). dk and dv are `width` (width_v) wide: `backward`
    cuts padded ones. q, k, v: `tma_ready`; dout and lse as the caller has them. flex: (the
    flex entry's extra arguments, its constexprs), which launches
    `entry.attn_bwd_flex_kernel` instead (`sm90/flex.py`)."""
    # The portable preprocess and the sink gradient are shared with the portable backend.
    from ....core.softmax import sink_grad
    from ...portable import row_delta

    d, dvd = q.shape[-1], v.shape[-1]
    total_q, hq, _ = q.shape
    hkv = k.shape[1]
    wl, wr = params.mask.window_left, params.mask.window_right
    has_seqused = seq.seqused_k is not None
    cfg = plan.cfg
    # The dO descriptor shares Q's compiled element type and needs TMA-friendly strides.
    # (Each no-op conversion still costs host time: convert only what needs it.)
    if dout.dtype != q.dtype or not dout.is_contiguous() or dout.data_ptr() % 16:
        dout = dout.to(q.dtype).clone(memory_format=torch.contiguous_format)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.float().contiguous()
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()
    if sites is not None and not sites.admits(out, lse, dlse):
        sites = None
    # The kernel's tensors are `width` (V side: width_v) wide: dQ_acc, dK, dV are cut below.
    # The preprocess (delta) zeroes dQ_acc: one launch instead of two (unless FIRST_STORES).
    extra = PERSISTENT_ROWS if plan.persistent and not params.deterministic else 0
    # The preprocess zeroes power-of-two widths only (its column range): 192 gets a fill.
    zero_here = not plan.constexprs.get("FIRST_STORES") and width != piece_cols(width)
    if plan.dq_fragment:
        dq_acc = dq_fragments.fragment_buffer(total_q, seq.batch, hq, width, q.device,
                                              extra_rows=extra)
    else:
        dq_acc = (torch.zeros if zero_here else torch.empty)(
            (total_q + extra, hq, width), dtype=torch.float32, device=q.device)
    # Deterministic mode's first turns may store instead (`first_stores`): no zeroing then.
    delta = row_delta(out, dout, dlse,
                   zero=None if plan.constexprs.get("FIRST_STORES") or zero_here else dq_acc,
                   site=None if sites is None else sites.of_dlse(dlse))
    if extra:  # its tile counter: zeroed rows past dQ_acc's (bwd_ws._ws_tiles)
        dq_acc, tile_counter = dq_acc[:-extra], dq_acc[-extra:].view(torch.int32)
    # Varlen rows that belong to no sequence are never written: they must read as zero.
    alloc = torch.empty if seq.uniform and not has_seqused else torch.zeros
    dk = alloc((k.shape[0], hkv, width), dtype=k.dtype, device=k.device)
    dv = alloc((v.shape[0], hkv, width_v), dtype=v.dtype, device=v.device)

    cols = piece_cols(width)  # q and k boxes: the head, or at 192 its 64-column pieces
    if padded or not (common.rows_dense(q) and common.rows_dense(k) and common.rows_dense(v)):
        q_desc = common.tma_heads(q, cfg.block_m, cols)
        do_desc = common.tma_heads(dout, cfg.block_m, width_v)
        k_desc = common.tma_heads(k, cfg.block_n, cols)
        v_desc = common.tma_heads(v, cfg.block_n, width_v)
    else:
        q_desc = common.tma_rows(q, (cfg.block_m, cols))
        do_desc = common.tma_rows(dout, (cfg.block_m, dvd))
        k_desc = common.tma_rows(k, (cfg.block_n, cols))
        v_desc = common.tma_rows(v, (cfg.block_n, dvd))
    dq_desc = common.tma_rows(dq_fragments.tiles_view(dq_acc) if plan.dq_fragment else dq_acc,
                            plan.dq_block, plan.dq_layout)
    dk_desc = common.tma_rows(dk, (_key_rows(cfg, plan.split), cols))
    dv_desc = common.tma_rows(dv, (_key_rows(cfg, plan.split), width_v))

    qk_scale, softcap_pre = common.exp2_scales(params)
    # One dQ turn counter per (sequence, q head, query block); only read when deterministic.
    # A persistent grid's tile counter: the word after them, or dQ_acc's extra row.
    if params.deterministic:
        sem = torch.zeros((seq.batch * hq * plan.num_m_blocks + plan.persistent,),
                          dtype=torch.int32, device=q.device)
    elif plan.persistent:
        sem = tile_counter
    else:
        sem = _unused_semaphore(q.device)
    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, lse, delta, dk, dv,
            seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.seqused_k if has_seqused else seq.cu_seqlens_k, sem,
            seq.max_seqlen_q, seq.max_seqlen_k, total_q, hq, hkv, hq // hkv, plan.num_m_blocks,
            qk_scale, params.softmax_scale, softcap_pre, wl, wr)
    if flex is not None:
        entry.attn_bwd_flex_kernel[plan.grid](*args, *flex[0], **flex[1])
    elif sites is None:
        _launcher_for(width, plan.split)[plan.grid](*args, **plan.constexprs)
    else:
        sites.main(_launcher_for(width, plan.split), plan.grid, args, plan.constexprs)
    # The kernel folded softmax_scale into its dQ partial sums.
    if plan.dq_fragment:
        cols = _dq_tile(width, cfg, plan.split)[1]
        dq = dq_fragments.dq_from_fragments(dq_acc, seq.cu_seqlens_q, seq.max_seqlen_q,
                                            total_q, hq, d, width, cols, q.dtype,
                                            site=None if sites is None else sites.post)
    else:
        dq = dq_acc[..., :d].to(q.dtype, memory_format=torch.contiguous_format)
    return dq, dk, dv, sink_grad(sink, lse, delta)


class BackwardSites:
    """A backward runner's bound launches (`launch.LaunchSite`): the main kernel's, the dQ
    postprocess's, and the preprocess's per dlse kind (its HAS_DLSE binary). They stand for
    one specialisation class of the tensors the caller passes: `admits` checks the ones a
    call plan's key does not fix (out, lse and dlse come from autograd)."""

    __slots__ = ("main", "post", "pre", "pre_dlse")

    def __init__(self):
        self.main, self.post = LaunchSite(), LaunchSite()
        self.pre, self.pre_dlse = LaunchSite(), LaunchSite()

    def of_dlse(self, dlse) -> LaunchSite:
        return self.pre if dlse is None else self.pre_dlse

    @staticmethod
    def admits(out, lse, dlse) -> bool:
        """Whether this call's autograd tensors fall in the class the sites were bound for:
        out contiguous (its strides are the preprocess's int arguments), all 16-byte aligned
        (dO and lse are already contiguous, dO aligned: `_run` converts them)."""
        ptrs = out.data_ptr() | lse.data_ptr() | (0 if dlse is None else dlse.data_ptr())
        return ptrs % 16 == 0 and out.is_contiguous()


class BackwardRunner:
    """`backward` for one call signature with its launch plan made once: the dispatcher's call
    plans (`asymflash.runtime.plans`) keep one per signature and call it as `backward` (the plan's
    seq and params). The launches bind their binaries at the first call and go through them
    from the second (`BackwardSites`): no specialisation keys, no plan lookup per call."""

    def __init__(self, q, k, v, seq: SeqInfo, params: AttnParams):
        self.width, self.width_v = q.shape[-1], v.shape[-1]
        self.plan = _plan_of(self.width, self.width_v, q, k, seq, params, None)
        self.sites = BackwardSites()

    def __call__(self, dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink):
        q, k, v = common.tma_ready(q), common.tma_ready(k), common.tma_ready(v)
        return _run(self.plan, self.width, self.width_v, False, dout, q, k, v, out, lse, dlse,
                    seq, params, sink, self.sites)


def backward_runner(q, k, v, seq: SeqInfo, params: AttnParams, sink):
    """A BackwardRunner for calls with this signature, or None where `backward` does more
    than the plain launches (padded head dims): those keep calling `backward`."""
    if backward_widths(q.shape[-1], v.shape[-1]) != (q.shape[-1], v.shape[-1]):
        return None
    return BackwardRunner(q, k, v, seq, params)
