"""fp8 (e4m3) helpers shared by the API, the benchmark and the tests.

FlashAttention-3's form: a tensor in torch.float8_e4m3fn plus an fp32 descale per (batch,
KV head); the value it stands for is t * descale (reference.dequantize). Only e4m3fn is
accepted: its 3 mantissa bits suit activations; e5m2 (gradients) and the fnuz variants
(AMD) are refused by name.
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
REFUSED_FP8 = tuple(getattr(torch, name) for name in (
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, name))
ALL_FP8 = (FP8,) + REFUSED_FP8


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in ALL_FP8


def dequantize(t: torch.Tensor, descale: torch.Tensor | None, batch_of_row=None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value an fp8 tensor stands for: t * descale, in `dtype`.

    t: (batch, seqlen, nheads, d), or packed (total, nheads, d) with batch_of_row (total,)
    naming each row's sequence. descale: fp32 (batch, nheads_kv) as FlashAttention-3 takes
    it, or None for 1. Query heads share their KV head's descale (head h of nheads uses column
    h // (nheads / nheads_kv)), which is why q_descale has the KV head count too.
    """
    out = t.to(dtype)
    if descale is None:
        return out
    heads = t.shape[-2]
    per_head = descale.to(dtype).repeat_interleave(heads // descale.shape[1], dim=1)
    if t.dim() == 4:
        return out * per_head[:, None, :, None]
    return out * per_head[batch_of_row.long()][:, :, None]


def quantize(x: torch.Tensor, nheads_kv: int | None = None, batch_of_row=None,
             batch: int | None = None):
    """(x in e4m3, descale fp32 (batch, nheads_kv)) with x ≈ dequantize(x8, descale).

    One scale per (sequence, KV head): the amax over that head's rows (and over the query
    heads of its GQA group) maps to e4m3's largest value 448, so no element saturates.
    x: (batch, seqlen, nheads, d), or packed (total, nheads, d) with batch_of_row (total,)
    and batch. An all-zero slice gets descale 1.
    """
    heads = x.shape[-2]
    nheads_kv = heads if nheads_kv is None else nheads_kv
    group = heads // nheads_kv
    a = x.detach().float().abs()
    if a.numel() == 0:  # no values (empty sequences): amax has nothing to reduce
        amax = torch.zeros(x.shape[0] if x.dim() == 4 else batch, nheads_kv, device=x.device)
    elif x.dim() == 4:
        amax = a.amax(dim=(1, 3)).view(x.shape[0], nheads_kv, group).amax(dim=2)
    else:
        per_row = a.amax(dim=2).view(-1, nheads_kv, group).amax(dim=2)
        amax = torch.zeros(batch, nheads_kv, device=x.device)
        index = batch_of_row.long()[:, None].expand_as(per_row)
        amax.scatter_reduce_(0, index, per_row, "amax")
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_head = descale.repeat_interleave(group, dim=1)
    if x.dim() == 4:
        scaled = x.float() / per_head[:, None, :, None]
    else:
        scaled = x.float() / per_head[batch_of_row.long()][:, :, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), descale.contiguous()


@functools.lru_cache(maxsize=16)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:  # Sylvester's construction: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H in fp32, H the orthonormal Hadamard matrix of x's head dim (a power of two).

    FlashAttention-3's incoherent processing: rotate q and k alike before quantising them;
    scores are unchanged ((q H)(k H)^T = q k^T) while an outlier channel spreads over all
    channels, so the per-head scale no longer crushes the others. Measured (CPU, d 128,
    outlier channels 30x, docs/api.md): fp8 rms error 3.0e-1 -> 1.1e-1; no change without
    outliers.
    """
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"asymflash: hadamard_rotate: head dim {d}; needs a power of two")
    return x.float() @ _hadamard(d, x.device)
