"""fp8 (e4m3) inputs for the public entry points, as FlashAttention-3 takes them.

q, k, v in torch.float8_e4m3fn (or only k/v: an fp8 KV cache beside 16-bit queries) with
fp32 descales (batch, nheads_kv); the result is attention of the dequantised tensors
(reference.attention_fp8_ref), out in bf16 (or out_dtype), lse fp32.

How it is computed, on every backend: every e4m3 value is exact in bf16 and fp16 (3
mantissa bits, exponents 2^-9 .. 2^8), so k and v widen without rounding, and the descales
are folded where they are linear: q_descale * k_descale into q (scores are (q qd) . (k kd) =
(q qd kd) . k, so softcap and masks see the same scores), v_descale onto the output
(P (v vd) = vd (P v)). The only rounding added is q's (one bf16 rounding) and the output's
before its scale. flash_attn_with_kvcache and paged prefill run on the decode kernels
(portable Triton, CPU), which read the e4m3 cache in place and widen its tiles in registers
(api/kvcache_fp8.py; the Triton decode kernel to fp16, q's rows scaled into its range);
flash_attn_with_kvcache hands them k_descale and v_descale to apply themselves. Dense e4m3
q, k, v on Hopper run the sm90 fp8 kernel
(`kernel_forward`: e4m3 tiles, fp8 wgmmas, the descales folded in the kernel,
backends/sm90/fwd/host.py `forward_fp8`); the other forward calls (varlen, softcap, sink,
other head dims, other GPUs) cast k and v on the host first (a copy) and run the 16-bit
kernels.
"""

from __future__ import annotations

import functools

import torch

from ..core.fp8 import ALL_FP8, FP8, REFUSED_FP8, dequantize, is_fp8
from . import validation as check

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DESCALES = ("q_descale", "k_descale", "v_descale")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def reads_e4m3(device: torch.device) -> bool:
    """Whether the decode kernels can load e4m3 on this device: the CPU (tiled torch, or the
    interpreter), and CUDA from sm_89 (Triton has no e4m3 type before Ada: an sm_80 build
    fails to compile, tests/compile/test_portable_compile.py); elsewhere the cache is cast."""
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else
                       torch.cuda.current_device()) >= (8, 9)


def wanted(q, k, v, descales, out_dtype) -> bool:
    """Whether a call takes the fp8 path (cheap: dtype compares on every call)."""
    q_descale, k_descale, v_descale = descales
    return is_fp8(q) or is_fp8(k) or is_fp8(v) or out_dtype is not None or \
        q_descale is not None or k_descale is not None or v_descale is not None


def check_inputs(q, k, v, descales, out_dtype, batch, names=("q", "k", "v"),
                 forward_only=False):
    """Every fp8-specific refusal, before anything is computed or written."""
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            check._fail(TypeError, name, f"is a {type(t).__name__}", "expected a torch.Tensor")
        if t.dtype in REFUSED_FP8:
            check._fail(TypeError, name, f"has dtype {t.dtype}",
                        "the fp8 format supported is torch.float8_e4m3fn (as FlashAttention-3)")
    q_name, k_name, v_name = names
    if batch is None:  # the caller found no batch: q's rank fits none of the entry's forms
        check._fail(ValueError, q_name, f"has shape {tuple(q.shape)}",
                    "expected (batch, seqlen, nheads, headdim), or (total_q, nheads, headdim) "
                    "with cu_seqlens_q")
    if is_fp8(k) != is_fp8(v):
        check._fail(TypeError, f"{k_name}/{v_name}", f"have dtypes {k.dtype}/{v.dtype}",
                    "both fp8 (e4m3fn) or neither")
    if is_fp8(q) and not is_fp8(k):
        check._fail(TypeError, q_name, f"is fp8 while {k_name}/{v_name} are {k.dtype}",
                    "fp8 queries need fp8 keys and values (fp8 k/v beside 16-bit q is fine)")
    if not is_fp8(k):
        given = [n for n, d in zip(DESCALES, descales) if d is not None] or ["out_dtype"]
        check._fail(ValueError, given[0], f"was given with {k_name}/{v_name} in {k.dtype}",
                    "descales and out_dtype apply to fp8 (torch.float8_e4m3fn) inputs")
    if is_fp8(q) is False and descales[0] is not None:
        check._fail(ValueError, "q_descale", f"was given with {q_name} in {q.dtype}",
                    "only an fp8 q has a descale (pass None)")
    nheads_kv = k.shape[-2] if k.dim() >= 2 else None
    for name, d in zip(DESCALES, descales):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor):
            check._fail(TypeError, name, f"is a {type(d).__name__}",
                        "expected an fp32 tensor (batch, nheads_kv) or None")
        if d.dtype != torch.float32:
            check._fail(TypeError, name, f"has dtype {d.dtype}", "expected torch.float32")
        if d.device != q.device:
            check._fail(ValueError, name, f"is on {d.device}", f"{q_name} is on {q.device}")
        if tuple(d.shape) != (batch, nheads_kv):
            check._fail(ValueError, name, f"has shape {tuple(d.shape)}",
                        f"expected (batch, nheads_kv) = ({batch}, {nheads_kv}), as FA3: one "
                        "scale per sequence and KV head (query heads use their KV head's)")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        check._fail(TypeError, "out_dtype", f"is {out_dtype!r}", f"allowed: {OUT_DTYPES}")
    if not forward_only and torch.is_grad_enabled():
        grads = [n for n, t in zip(names + DESCALES, (q, k, v) + tuple(descales))
                 if t is not None and t.requires_grad]
        if grads:
            raise NotImplementedError(
                f"asymflash: {', '.join(grads)} require grad in an fp8 call; the backward of "
                "fp8 attention is not implemented (fp8 is for inference: detach, or run "
                "under torch.no_grad())")


def fold_q(q, descales, batch_of_row=None):
    """(q in the compute dtype with q_descale * k_descale folded in, the compute dtype).

    The compute dtype is bf16 for fp8 queries, else q's own (an fp8 cache beside fp16 q).
    batch_of_row: each packed q row's sequence (varlen), None for (batch, seqlen, ...) q.
    """
    q_descale, k_descale, _ = descales
    work = torch.bfloat16 if is_fp8(q) else q.dtype
    factor = q_descale
    if k_descale is not None:
        factor = k_descale if factor is None else factor * k_descale
    if factor is None or (q.dim() == 3 and batch_of_row is None):  # no sequences: out is 0
        return q.to(work), work
    return dequantize(q, factor, batch_of_row).to(work), work


def rewrite(q, k, v, descales, batch_of_row=None):
    """(q, k, v, compute dtype): q as fold_q, k and v cast (exactly) to the compute dtype,
    for the kernels that read 16-bit k/v only (a copy of k and v)."""
    q2, work = fold_q(q, descales, batch_of_row)
    return q2, k.to(work), v.to(work), work


def kernel_reason(q, k, v, softcap=0.0, sink=None) -> str | None:
    """None where flash_attn_func's dense fp8 call runs the sm90 fp8 kernel
    (`kernel_forward`), else why the host cast runs instead: no Hopper, the sm90 backend not
    allowed or another backend forced, 16-bit q, softcap, sink, head dims, or shapes that
    the 16-bit path's checks are left to refuse."""
    if not (is_fp8(q) and is_fp8(k) and is_fp8(v)):
        return "the fp8 kernel takes e4m3 q, k and v"
    if not q.is_cuda:
        return "the fp8 kernel needs CUDA tensors"
    if sink is not None or softcap:
        return "the fp8 kernel has no softcap or sink"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.device != q.device or \
            v.device != q.device or k.shape[:-1] != v.shape[:-1] or \
            k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        return "shapes for the 16-bit path's checks"
    from ..runtime.dispatch import backend_names, forced_backend

    if forced_backend() not in (None, "sm90") or "sm90" not in backend_names(q.device):
        return "the sm90 backend does not run here"
    from ..backends.sm90.fwd import host

    return host.fp8_unsupported(*_rows(q, k, v), _dense_seq(q, k), None)


def _rows(q, k, v):
    """(total, heads, dim) views of dense (batch, seqlen, heads, dim) q, k, v."""
    return tuple(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))


def _dense_seq(q, k):
    from ..core.params import SeqInfo

    return SeqInfo.dense(q.shape[0], q.shape[1], k.shape[1], q.device)


def kernel_forward(q, k, v, descales, softmax_scale, causal, window_size, softcap, sink):
    """(out (batch, seqlen_q, nheads_q, dv) bf16, lse (nheads_q, batch * seqlen_q) fp32) of
    flash_attn_func's dense fp8 call from the sm90 fp8 kernel, every descale applied; None
    where `kernel_reason` names a reason (the caller then casts on the host).
    check_inputs ran already."""
    if kernel_reason(q, k, v, softcap, sink) is not None:
        return None
    from ..backends.sm90.fwd import host
    from ..core.masks import normalize_window
    from ..core.params import AttnParams

    check.check_scalars(softmax_scale, window_size, softcap)
    batch, seqlen_q, hq, d = q.shape
    scale = 1.0 / d ** 0.5 if softmax_scale is None else float(softmax_scale)
    params = AttnParams(scale, normalize_window(causal, window_size))
    out, lse = host.forward_fp8(*_rows(q, k, v), _dense_seq(q, k), params, descales)
    return out.view(batch, seqlen_q, hq, out.shape[-1]), lse


def finish(result, v_descale, batch_of_row, out_dtype):
    """The entry point's result with v's descale applied to out and out cast to out_dtype."""
    out = result[0] if isinstance(result, tuple) else result
    if v_descale is not None and (out.dim() == 4 or batch_of_row is not None):
        out = dequantize(out, v_descale, batch_of_row)
    out = out.to(out_dtype)
    return (out, *result[1:]) if isinstance(result, tuple) else out


def rows_to_batch(cu_seqlens_q, total: int, batch: int):
    """Each packed row's sequence; rows outside every sequence (their out is 0) get the last
    one, whose scale then multiplies zeros."""
    if batch <= 0:
        return None
    rows = torch.arange(total, device=cu_seqlens_q.device)
    return torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True).clamp_(max=batch - 1)


__all__ = ["ALL_FP8", "FP8", "check_inputs", "finish", "fold_q", "kernel_forward",
           "kernel_reason", "rewrite",
           "reads_e4m3", "rows_to_batch", "wanted"]
