"""Portable backend: triton.language kernels for any CUDA GPU Triton supports.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how CI exercises the
kernel code itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ...core.params import AttnParams, SeqInfo, cdiv
from ...runtime.dispatch import interpreting
from ...runtime.launch import DirectLaunch, launch_fitting
from .bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from .fwd import attn_fwd_kernel

NAME = "portable"


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile candidates per kernel and head-dim class (block_m, block_n, warps, stages). The first
# is the fixed choice (used with deterministic=True, so the block order, and with it the
# rounding, never depends on a timing); the rest join an autotuning run at the first call of
# each (head dims, mask kind), Triton caching the winner for the process. Chosen from a sweep
# of sm_90a builds (block_m, block_n in 32/64/128, 4 or 8 warps; causal build;
# cuobjdump/nvdisasm): every first choice of fwd and dQ compiles with no local-memory spills
# and uses wgmma; the earlier 64x64 tiles spilled 12-975 LDL/STL per kernel at d >= 128.
_CANDIDATES = {
    # d <= 64: the tile the first GPU suite passed with. The d=40/dv=24 failures once blamed
    # on the split-mask loops came from the 64/32 column widths (see `head_blocks`).
    "fwd": {64: [(128, 64, 4, 3)], 128: [(128, 32, 8, 2), (64, 32, 8, 2)],
            256: [(32, 32, 8, 2), (64, 32, 8, 2)]},
    # dK/dV: the tiles the first GPU suite passed with (they spill at d >= 128; see bwd.py)
    "dkdv": {64: [(64, 64, 4, 2)], 128: [(64, 64, 8, 2)], 256: [(32, 32, 4, 1)]},
    "dq": {64: [(64, 64, 8, 2), (128, 64, 8, 2)], 128: [(64, 32, 8, 2), (64, 64, 8, 2)],
           256: [(32, 32, 8, 2), (64, 32, 8, 2)]},
}
_INTERPRETER_CONFIG = Config(16, 16, 4, 1)  # the interpreter's cost grows with tile area
_TUNE_KEY = ["D", "DV", "LEFT", "RIGHT", "SOFTCAP"]


def candidates(kernel: str, d: int, dv: int) -> list:
    width = max(d, dv)
    cls = 64 if width <= 64 else 128 if width <= 128 else 256
    return [Config(*c) for c in _CANDIDATES[kernel][cls]]


@functools.cache
def _autotuned(kernel, configs: tuple):
    return triton.autotune(
        [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                       num_stages=c.num_stages) for c in configs],
        key=_TUNE_KEY,
    )(kernel)


def launch(kernel, name: str, grid, args, meta: dict, deterministic: bool):
    """Run `kernel` with a fixed config (interpreter, deterministic) or autotuned.

    grid(block_m, block_n) gives the launch grid for a tile shape.
    """
    configs = candidates(name, meta["D"], meta["DV"])
    if interpreting() or deterministic or len(configs) == 1:
        c = _INTERPRETER_CONFIG if interpreting() else configs[0]
        # (the autotuner below drops a candidate the GPU's shared memory refuses; a fixed
        # tile gets fewer stages instead)
        launch_fitting(kernel, grid(c.block_m, c.block_n), args,
                       dict(meta, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps,
                            num_stages=c.num_stages))
        return
    tuned = _autotuned(kernel, tuple(configs))
    tuned[lambda m: grid(m["BLOCK_M"], m["BLOCK_N"])](*args, **meta)


def unsupported(q, k, v, seq, params, sink):
    if k.dtype != q.dtype or v.dtype != q.dtype:  # fp8 k/v come cast by api/fp8.py
        return f"k/v in {k.dtype}/{v.dtype} beside {q.dtype} q (the forward needs one dtype)"
    return unsupported_input(q)


def unsupported_input(q):
    """What every portable kernel needs of its inputs (device, interpreter, dtype)."""
    if q.device.type == "cpu" and not interpreting():
        return "CPU tensors need TRITON_INTERPRET=1"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device} is not supported"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (needs fp16 or bf16)"
    return None


unsupported_backward = unsupported



def pow2_block(n: int) -> int:
    """The tile width for n columns: the next power of two, at least 16 (tl.dot's minimum).
    Plain Python: triton.next_power_of_2 is a constexpr function costing ~15 us per call."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def head_blocks(d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV) of the attention kernels. Up to 64 columns both get the wider
    width: on the H200 (triton 3.6) the forward with BLOCK_D = 64 and BLOCK_DV = 32 (e.g.
    d=40, dv=24) hit illegal addresses or wrong results with every 64-key tile, at 1 to 3
    stages, while d=40/dv=40 (64/64) passed with all of them (docs/tuning.md). Padding costs
    little at these widths; the masks still stop at d and dv."""
    block_d, block_dv = pow2_block(d), pow2_block(dv)
    if max(block_d, block_dv) <= 64:
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv



def _alloc(seq: SeqInfo):
    """Kernels write only rows that belong to a sequence. Varlen tensors may hold rows that
    belong to none (offsets past cu_seqlens, keys past seqused_k): those must read as zero."""
    if seq.uniform:
        return lambda shape, like: torch.empty(shape, dtype=like.dtype, device=like.device)
    return lambda shape, like: torch.zeros(shape, dtype=like.dtype, device=like.device)


def _mask_flags(params: AttnParams):
    m = params.mask
    return dict(LEFT=m.window_left >= 0, RIGHT=m.window_right >= 0)


def _seq_args(seq: SeqInfo, sentinel):
    used = seq.seqused_k if seq.seqused_k is not None else sentinel
    return seq.cu_seqlens_q, seq.cu_seqlens_k, used


def forward(q, k, v, seq: SeqInfo, params: AttnParams, sink):
    total_q, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = _alloc(seq)((total_q, hq, dv), q)
    lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    sink_arg = sink if sink is not None else lse  # never read when HAS_SINK is False
    args = (q, k, v, out, lse, sink_arg, *_seq_args(seq, seq.cu_seqlens_k),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), hq, hq // hkv, seq.max_seqlen_q,
            params.softmax_scale, params.softcap, params.mask.window_left,
            params.mask.window_right)
    block_d, block_dv = head_blocks(d, dv)
    meta = dict(D=d, DV=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                SOFTCAP=params.softcap > 0, HAS_SINK=sink is not None,
                HAS_USED_K=seq.seqused_k is not None,
                **_mask_flags(params))
    launch(attn_fwd_kernel, "fwd",
           lambda bm, bn: (seq.batch * hq, cdiv(max(seq.max_seqlen_q, 1), bm)),
           args, meta, params.deterministic)
    return out, lse


_PREPROCESS = DirectLaunch(bwd_preprocess_kernel)


def row_delta(out, dout, dlse, zero=None, block_t=None, num_warps=4, site=None):
    """delta (hq, total_q) fp32 = rowsum(dO * O) - dlse; also zeroes `zero`, a contiguous
    fp32 (rows, hq, width) tensor with a power-of-two width (rows >= 1, any count), when
    given. block_t (rows per program) and num_warps: the default tiling, or a probe's.
    site: a `launch.LaunchSite` of a call plan's runner (one specialisation class), or None."""
    total_q, hq, dv = out.shape
    delta = torch.empty(hq, total_q, dtype=torch.float32, device=out.device)
    if block_t is None:  # H200, 16k tokens x model dim 2048 (docs/tuning.md): 32 rows
        block_t = 16 if interpreting() else 32  # 77-81 us with dQ_acc zeroed (64 rows: 79-85)
    zero_rows = 0 if zero is None else zero.shape[0]
    blocks = cdiv(max(total_q, zero_rows), block_t)
    grid = (blocks * hq,)  # a row block's heads side by side (bwd_preprocess_kernel)
    z = delta if zero is None else zero
    args = (out, dout, dlse if dlse is not None else delta, delta, total_q,
            out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
            z, z.stride(0), z.stride(1) if zero is not None else 0, zero_rows, hq)
    kwargs = dict(DV=dv, BLOCK_DV=pow2_block(dv), BLOCK_T=block_t, HAS_DLSE=dlse is not None,
                  ZERO_D=0 if zero is None else zero.shape[2], num_warps=num_warps)
    if site is None:
        _PREPROCESS[grid](*args, **kwargs)
    else:
        site(_PREPROCESS, grid, args, kwargs)
    return delta


def backward(dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink):
    from ...core.softmax import sink_grad

    total_q, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if dlse is not None:
        dlse = dlse.contiguous()
    delta = row_delta(out, dout, dlse)
    alloc = _alloc(seq)
    dq, dk, dvv = alloc(q.shape, q), alloc(k.shape, k), alloc(v.shape, v)
    block_d, block_dv = head_blocks(d, dv)
    meta = dict(D=d, DV=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                SOFTCAP=params.softcap > 0, HAS_USED_K=seq.seqused_k is not None,
                **_mask_flags(params))
    scalars = (params.softmax_scale, params.softcap, params.mask.window_left,
               params.mask.window_right)
    common = (q, k, v, dout, lse, delta)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1))
    seq_args = _seq_args(seq, seq.cu_seqlens_k)
    launch(attn_bwd_dkdv_kernel, "dkdv",
           lambda bm, bn: (seq.batch * hkv, cdiv(max(seq.max_seqlen_k, 1), bn)),
           (*common, dk, dvv, *seq_args, *strides, dk.stride(0), dk.stride(1), dvv.stride(0),
            dvv.stride(1), lse.stride(0), hkv, hq // hkv, *scalars),
           meta, params.deterministic)
    launch(attn_bwd_dq_kernel, "dq",
           lambda bm, bn: (seq.batch * hq, cdiv(max(seq.max_seqlen_q, 1), bm)),
           (*common, dq, *seq_args, *strides, dq.stride(0), dq.stride(1), lse.stride(0), hq,
            hq // hkv, seq.max_seqlen_q, *scalars),
           meta, params.deterministic)
    dsink = sink_grad(sink, lse, delta)
    return dq, dk, dvv, dsink
