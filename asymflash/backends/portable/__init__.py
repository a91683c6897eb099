"""Portable backend: triton.language kernels for any CUDA GPU Triton supports.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how CI exercises the
kernel code itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...core.params import AttnParams, SeqInfo
from ...dispatch import interpreting
from .bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from .fwd import attn_fwd_kernel

NAME = "portable"


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def select_config(d: int, dv: int, direction: str, override: Config | None = None) -> Config:
    """Tile sizes: big enough for tensor cores, small enough to stay in registers/smem.

    The interpreter gets small tiles (its cost grows with tile area, not program count).
    """
    if override is not None:
        return override
    if interpreting():
        return Config(16, 16, 4, 1)
    width = max(d, dv)
    if direction == "fwd":
        if width <= 64:
            return Config(128, 64, 4, 3)
        if width <= 128:
            return Config(128, 64, 8, 3)
        return Config(64, 64, 4, 2)
    if width <= 64:
        return Config(64, 64, 4, 2)
    if width <= 128:
        return Config(64, 64, 8, 2)
    return Config(32, 32, 4, 1)


def unsupported(q, k, v, seq, params, sink):
    if q.device.type == "cpu" and not interpreting():
        return "CPU tensors need TRITON_INTERPRET=1"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device} is not supported"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (needs fp16 or bf16)"
    return None


unsupported_backward = unsupported


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


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
    cfg = select_config(d, dv, "fwd")
    num_m = triton.cdiv(max(seq.max_seqlen_q, 1), cfg.block_m)
    sink_arg = sink if sink is not None else lse  # never read when HAS_SINK is False
    grid = (seq.batch * hq, num_m)
    attn_fwd_kernel[grid](
        q, k, v, out, lse, sink_arg, *_seq_args(seq, seq.cu_seqlens_k),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), hq, hq // hkv, num_m,
        params.softmax_scale, params.softcap, params.mask.window_left,
        params.mask.window_right,
        D=d, DV=dv, BLOCK_D=_block(d), BLOCK_DV=_block(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SOFTCAP=params.softcap > 0, HAS_SINK=sink is not None,
        HAS_USED_K=seq.seqused_k is not None, **_mask_flags(params),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def _delta(out, dout, dlse):
    total_q, hq, dv = out.shape
    delta = torch.empty(hq, total_q, dtype=torch.float32, device=out.device)
    block_t = 16 if interpreting() else 64
    grid = (triton.cdiv(total_q, block_t), hq)
    bwd_preprocess_kernel[grid](
        out, dout, dlse if dlse is not None else delta, delta, total_q,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        DV=dv, BLOCK_DV=_block(dv), BLOCK_T=block_t, HAS_DLSE=dlse is not None,
    )
    return delta


def backward(dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink):
    from ..cpu import sink_grad

    total_q, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if dlse is not None:
        dlse = dlse.contiguous()
    delta = _delta(out, dout, dlse)
    alloc = _alloc(seq)
    dq, dk, dvv = alloc(q.shape, q), alloc(k.shape, k), alloc(v.shape, v)
    cfg = select_config(d, dv, "bwd")
    common = dict(
        D=d, DV=dv, BLOCK_D=_block(d), BLOCK_DV=_block(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SOFTCAP=params.softcap > 0,
        HAS_USED_K=seq.seqused_k is not None, **_mask_flags(params),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    scalars = (params.softmax_scale, params.softcap, params.mask.window_left,
               params.mask.window_right)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1))
    seq_args = _seq_args(seq, seq.cu_seqlens_k)
    num_n = triton.cdiv(max(seq.max_seqlen_k, 1), cfg.block_n)
    attn_bwd_dkdv_kernel[(seq.batch * hkv, num_n)](
        q, k, v, dout, lse, delta, dk, dvv, *seq_args, *strides,
        dk.stride(0), dk.stride(1), dvv.stride(0), dvv.stride(1), lse.stride(0),
        hkv, hq // hkv, *scalars, **common,
    )
    num_m = triton.cdiv(max(seq.max_seqlen_q, 1), cfg.block_m)
    attn_bwd_dq_kernel[(seq.batch * hq, num_m)](
        q, k, v, dout, lse, delta, dq, *seq_args, *strides,
        dq.stride(0), dq.stride(1), lse.stride(0), hq, hq // hkv, num_m, *scalars, **common,
    )
    dsink = sink_grad(sink, lse, delta)
    return dq, dk, dvv, dsink
