"""The grid's fp8 mode, `python -m asymflash bench --dtype fp8`: the same shapes, forward only.

Inputs: bf16 random normal tensors quantised to e4m3 with one descale per (batch, KV head),
FlashAttention-3's form (core/fp8.quantize). Every provider computes attention of the same
dequantised values, so all are checked against one reference: fp32 attention of the
dequantised tensors, with a bf16 computation of those values whose P is rounded to e4m3
before P·V as the tolerance's baseline (the FA rule, core.error_and_bound): fp8 kernels run
P·V on fp8 tensor cores, and a row's few large weights rounded to e4m3's 3-bit mantissa are
off by ~2^-4 of themselves, which a bf16 P's baseline cannot bound (the H100, 2026-12-05: the
sm90 fp8 kernel's causal cells, whose first rows see few keys, were 0.055 off where the bf16
baseline allowed 0.034; the non-causal ones passed). Each cell's error is kept in the
results, so the fp8 path's error stands beside the bf16 kernel's on the same values.

An fp8 provider's make_fwd takes (inputs, causal), inputs being Fp8Inputs. asymflash-fp8
times flash_attn_func on the e4m3 tensors: on Hopper the sm90 fp8 kernel (the Vᵀ copy
included), elsewhere the host cast to bf16 and the 16-bit kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch

from ..core.fp8 import dequantize, quantize
from .core import Case, Inputs, Provider, Reference, Runner, chunked_attention, make_inputs

FP8 = "fp8"


@dataclass
class Fp8Inputs(Inputs):
    """q, k, v: the dequantised values (fp32, what the reference sees); q8, k8, v8 and
    descales: what an fp8 kernel gets."""

    q8: torch.Tensor = None
    k8: torch.Tensor = None
    v8: torch.Tensor = None
    descales: tuple = ()


def make_fp8_inputs(case: Case, device, seed: int = 0) -> Fp8Inputs:
    base = make_inputs(dataclasses.replace(case, dtype="bf16"), device, seed)
    q8, qd = quantize(base.q, case.nheads_kv)
    k8, kd = quantize(base.k)
    v8, vd = quantize(base.v)
    deq = [dequantize(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    return Fp8Inputs(*deq, dout=base.dout, q8=q8, k8=k8, v8=v8, descales=(qd, kd, vd))


class Fp8Runner(Runner):
    """Runner with fp8 inputs, their reference, and providers called with Fp8Inputs."""

    def make_inputs(self, case: Case) -> Fp8Inputs:
        return make_fp8_inputs(case, self.device, self.seed)

    def reference(self, inputs: Fp8Inputs, case: Case, with_grads: bool) -> Reference:
        if with_grads:
            raise ValueError("the fp8 mode is forward only")
        with torch.no_grad():
            out = chunked_attention(self.reference_fn, inputs.q, inputs.k, inputs.v,
                                    case.causal, True)
            plain = chunked_attention(self.reference_fn,
                                      *(t.to(torch.bfloat16) for t in (inputs.q, inputs.k,
                                                                       inputs.v)),
                                      case.causal, False, p_dtype=torch.float8_e4m3fn)
        return Reference(out, plain)

    def make_call(self, provider: Provider, case: Case, inputs: Fp8Inputs, q, k, v):
        return provider.make_fwd(inputs, case.causal)


def _asymflash_fp8(inputs: Fp8Inputs, causal: bool):
    from .. import flash_attn_func

    qd, kd, vd = inputs.descales
    q8, k8, v8 = inputs.q8, inputs.k8, inputs.v8
    return lambda: flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                   v_descale=vd)


def _asymflash_bf16(inputs: Fp8Inputs, causal: bool):
    from .. import flash_attn_func

    q, k, v = (t.to(torch.bfloat16) for t in (inputs.q, inputs.k, inputs.v))
    return lambda: flash_attn_func(q, k, v, causal=causal)


def _cudnn_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not installed (pip install nvidia-cudnn-frontend)"
    return None


def _cudnn_fp8(inputs: Fp8Inputs, causal: bool):
    # cuDNN's sdpa_fp8 takes one descale per tensor, not per (batch, head): its inputs need a
    # quantisation of their own, and the graph has not been written and checked on a GPU yet.
    raise NotImplementedError("cuDNN fp8 SDPA graph (per-tensor descales) not written yet")


def _exp2_emulated(every: int) -> Provider:
    """asymflash-fp8 with one exponential in `every` on the FMA pipe (FA4's trick, the
    forward's ASYMFLASH_SM90_EXP2_EMU switch): fp8 halves the MMA time per tile, so the
    exponentials weigh twice what they do in bf16, where the trick lost. Asked for by name:
    --providers asymflash-fp8,asymflash-fp8-exp2emu8."""
    from ..backends.sm90.fwd.host import EXP2_EMU_SWITCH
    from .providers import switch_set

    return Provider(f"asymflash-fp8-exp2emu{every}", _asymflash_fp8, is_asymflash=True,
                    modes=("fwd",), opt_in=True,
                    context=lambda: switch_set(EXP2_EMU_SWITCH, str(every)),
                    description=f"asymflash-fp8 with {EXP2_EMU_SWITCH}={every}: one "
                                f"exponential in {every} on the FMA pipe")


def fp8_providers() -> list:
    return [
        Provider("cuDNN-fp8", _cudnn_fp8, available=_cudnn_reason, modes=("fwd",),
                 description="cuDNN fp8 SDPA through nvidia-cudnn-frontend"),
        Provider("asymflash-bf16", _asymflash_bf16, is_asymflash=True, modes=("fwd",),
                 description="asymflash's bf16 path on the dequantised values"),
        Provider("asymflash-fp8", _asymflash_fp8, is_asymflash=True, modes=("fwd",),
                 headline=True, description="flash_attn_func on e4m3 q/k/v with per-head "
                                            "descales"),
        *(_exp2_emulated(every) for every in (2, 4, 8)),
    ]
