"""Input checks for the public API: every bad input is refused before any kernel runs.

Each error names the argument, what was received and what is allowed.
"""

from __future__ import annotations

import math

import torch

MAX_HEAD_DIM = 256


def _fail(exc, arg, got, allowed):
    raise exc(f"asymflash: {arg} {got}; {allowed}")


def allowed_dtypes(device: torch.device):
    # fp32 only on the CPU path: the GPU kernels are tensor-core kernels for 16-bit inputs.
    base = (torch.float16, torch.bfloat16)
    return base + (torch.float32,) if device.type == "cpu" else base


def check_tensors(q, k, v, rank: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, f"is a {type(t).__name__}", "expected a torch.Tensor")
        if t.dim() != rank:
            _fail(ValueError, name, f"has shape {tuple(t.shape)}", f"expected {rank} dims {layout}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            _fail(ValueError, name, f"is on {t.device}", f"q is on {q.device}: use one device")
    ok = allowed_dtypes(q.device)
    if q.dtype not in ok:
        _fail(TypeError, "q", f"has dtype {q.dtype}", f"allowed on {q.device.type}: {ok}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(TypeError, name, f"has dtype {t.dtype}", f"must match q's dtype {q.dtype}")
        if t.shape[:-1] != k.shape[:-1]:
            _fail(ValueError, name, f"has shape {tuple(t.shape)}",
                  f"k and v must agree except in the last dim (k: {tuple(k.shape)})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 0 and t.stride(-1) != 1:
            _fail(ValueError, name, f"has last-dim stride {t.stride(-1)}",
                  "the head dim must be contiguous (stride 1): call .contiguous()")
    nheads_q, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads_q % nheads_kv != 0:
        _fail(ValueError, "nheads", f"q has {nheads_q} heads and k/v have {nheads_kv}",
              "nheads_q must be a positive multiple of nheads_kv")
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        _fail(ValueError, "k", f"has head_dim {k.shape[-1]}", f"must equal q's head_dim {d}")
    for name, hd in (("q", d), ("v", dv)):
        if hd <= 0 or hd % 8 != 0 or hd > MAX_HEAD_DIM:
            _fail(ValueError, f"{name} head_dim", f"is {hd}",
                  f"allowed: a multiple of 8 from 8 to {MAX_HEAD_DIM}")


def check_scalars(softmax_scale, window_size, softcap):
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or \
                not math.isfinite(softmax_scale):
            _fail(ValueError, "softmax_scale", f"is {softmax_scale!r}",
                  "expected a finite float or None")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        _fail(ValueError, "window_size", f"is {window_size!r}", "expected a pair of ints")
    if min(window_size) < -1:
        _fail(ValueError, "window_size", f"is {tuple(window_size)}",
              "each side must be >= 0, or -1 for unbounded")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or \
            not math.isfinite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", f"is {softcap!r}", "expected a finite float >= 0 (0 = off)")


def check_sink(sink, q, nheads_q: int):
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        _fail(TypeError, "learnable_sink", f"is a {type(sink).__name__}",
              "expected a torch.Tensor or None")
    if tuple(sink.shape) != (nheads_q,):
        _fail(ValueError, "learnable_sink", f"has shape {tuple(sink.shape)}",
              f"expected ({nheads_q},): one logit per q head")
    if not sink.is_floating_point():
        _fail(TypeError, "learnable_sink", f"has dtype {sink.dtype}", "expected a float dtype")
    if sink.device != q.device:
        _fail(ValueError, "learnable_sink", f"is on {sink.device}", f"q is on {q.device}")


def check_int_vector(t, name, length, device):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, f"is a {type(t).__name__}", "expected an int32 torch.Tensor")
    if t.dtype != torch.int32:
        _fail(TypeError, name, f"has dtype {t.dtype}", "expected torch.int32")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        _fail(ValueError, name, f"has shape {tuple(t.shape)}", f"expected {want}")
    if t.device != device:
        _fail(ValueError, name, f"is on {t.device}", f"q is on {device}")


def check_cu_seqlens(cu, name, total, max_seqlen, max_name):
    """Values checks need the numbers on the host: one small copy, skipped under compile."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        _fail(ValueError, max_name, f"is {max_seqlen!r}", "expected an int >= 0")
    if torch.compiler.is_compiling():
        return
    vals = cu.tolist()
    if vals and vals[0] < 0:
        _fail(ValueError, name, f"starts at {vals[0]}", "offsets must be >= 0")
    steps = [b - a for a, b in zip(vals, vals[1:])]
    if any(s < 0 for s in steps):
        _fail(ValueError, name, f"is {vals[:8]}...", "must be non-decreasing")
    if vals and vals[-1] > total:
        _fail(ValueError, name, f"ends at {vals[-1]}", f"beyond the tensor's {total} tokens")
    if steps and max(steps) > max_seqlen:
        _fail(ValueError, max_name, f"is {max_seqlen}",
              f"below the longest sequence in {name} ({max(steps)})")


def check_seqused(seqused, cu_k):
    if torch.compiler.is_compiling():
        return
    used, cu = seqused.tolist(), cu_k.tolist()
    for b, u in enumerate(used):
        if u < 0 or u > cu[b + 1] - cu[b]:
            _fail(ValueError, "seqused_k", f"[{b}] is {u}",
                  f"allowed: 0..{cu[b + 1] - cu[b]} (that sequence's keys in cu_seqlens_k)")
