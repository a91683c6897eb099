"""The grid's fp8 mode, `python -m asymflash bench --dtype fp8`: the same shapes, forward only.

Inputs: bf16 random normal tensors quantised to e4m3 with one scale per tensor, handed on
in FlashAttention-3's (batch, kv head) descale form (`make_fp8_inputs(per_tensor=True)`), so
cuDNN's fp8 SDPA, which takes one descale per tensor, reads the same bytes and scales. Every
provider computes attention of the same dequantised values, so all are checked against one
reference, fp32 attention of those values. The tolerance's baseline (the FA rule,
core.error_and_bound) is a bf16 computation of them whose P is rounded to e4m3 before P·V:
fp8 kernels run P·V on fp8 tensor cores, and a row's few large weights rounded to e4m3's
3-bit mantissa are off by ~2^-4 of themselves, which a bf16 P's baseline cannot bound (the
sm90 fp8 kernel's causal cells, whose first rows see few keys, failed that rule while the
non-causal ones passed: docs/tuning.md). Each cell's error is kept in the results, so the
fp8 path's error stands beside the bf16 kernel's and cuDNN's on the same values.

An fp8 provider's make_fwd takes (inputs, causal), inputs being Fp8Inputs. asymflash-fp8
times flash_attn_func on the e4m3 tensors: on Hopper the sm90 fp8 kernel (the Vᵀ copy
included), elsewhere the host cast to bf16 and the 16-bit kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch

from ..core.fp8 import FP8_MAX, dequantize, quantize
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


def _per_tensor(x: torch.Tensor, nheads_kv: int):
    """`quantize` with one scale for the whole tensor, handed on in FA3's (batch, nheads_kv)
    form: what cuDNN's fp8 SDPA, which takes one descale per tensor, can read too."""
    x8, descale = quantize(x.reshape(1, -1, 1, x.shape[-1]))  # one "head" holding it all
    return x8.view(x.shape), descale.expand(x.shape[0], nheads_kv).contiguous()


def make_fp8_inputs(case: Case, device, seed: int = 0, per_tensor: bool = False) -> Fp8Inputs:
    """The case's bf16 inputs in e4m3: one descale per (batch, kv head), or with per_tensor
    one per tensor (the grid's fp8 mode: so cuDNN reads the same bytes and scales)."""
    base = make_inputs(dataclasses.replace(case, dtype="bf16"), device, seed)
    if per_tensor:
        (q8, qd), (k8, kd), (v8, vd) = (_per_tensor(t, case.nheads_kv)
                                        for t in (base.q, base.k, base.v))
        deq = [dequantize(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
        return Fp8Inputs(*deq, dout=base.dout, q8=q8, k8=k8, v8=v8, descales=(qd, kd, vd))
    q8, qd = quantize(base.q, case.nheads_kv)
    k8, kd = quantize(base.k)
    v8, vd = quantize(base.v)
    deq = [dequantize(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    return Fp8Inputs(*deq, dout=base.dout, q8=q8, k8=k8, v8=v8, descales=(qd, kd, vd))


class Fp8Runner(Runner):
    """Runner with fp8 inputs, their reference, and providers called with Fp8Inputs."""

    def make_inputs(self, case: Case) -> Fp8Inputs:
        return make_fp8_inputs(case, self.device, self.seed, per_tensor=True)

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
    import cudnn

    # The frontend loads a cuDNN of its own finding: beside torch's nvidia-cudnn package when
    # installed into the same site-packages, else the first libcudnn.so on the loader's path
    # (an H100 machine's was older than torch's 9.19 and refused fp8 SDPA, which needs 9.13).
    loaded = getattr(cudnn, "backend_version", lambda: None)()
    if loaded is not None and loaded < 91300:
        return (f"nvidia-cudnn-frontend loaded cuDNN {loaded} (fp8 SDPA needs 9.13+; torch has "
                f"{torch.backends.cudnn.version()}): install the frontend into the "
                "site-packages holding torch's nvidia-cudnn package")
    return None


def _cudnn_fp8(inputs: Fp8Inputs, causal: bool):
    """cuDNN's fp8 SDPA (nvidia-cudnn-frontend's `sdpa_fp8`) on the same e4m3 bytes and
    descales (one per tensor: the grid's inputs), O in bf16, P rounded to e4m3 at scale 448
    (its amax is 1). The BSHD tensors are described as (b, h, s, d) with their own strides.
    Written from the frontend's API (its graph validates under 1.32 on the CPU; the GPU
    machine takes 1.16, which needs no other package: scripts/gpu-check.sh fp8); not yet run
    on a GPU."""
    q8, k8, v8 = inputs.q8, inputs.k8, inputs.v8
    if any(not torch.equal(d, d.flatten()[:1].expand_as(d)) for d in inputs.descales):
        raise NotImplementedError("cuDNN fp8 SDPA takes one descale per tensor")
    if causal and q8.shape[1] != k8.shape[1]:
        raise NotImplementedError("cuDNN's causal mask is top-left aligned; asymflash's "
                                  "bottom-right")
    import cudnn

    dev = q8.device
    out = torch.empty(*q8.shape[:3], v8.shape[3], dtype=torch.bfloat16, device=dev)

    def bhsd(t):
        st = t.stride()
        return dict(dim=[t.shape[0], t.shape[2], t.shape[1], t.shape[3]],
                    stride=[st[0], st[2], st[1], st[3]])

    def scalar(value):
        return torch.full((1, 1, 1, 1), float(value), dtype=torch.float32, device=dev)

    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=fp32,
                          compute_data_type=fp32, handle=handle)
    pack = {}

    def bind(name, t, data_type, layout):
        desc = graph.tensor(name=name, data_type=data_type, **layout)
        pack[desc] = t
        return desc

    one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1])
    q, k, v = (bind(n, t, fp8, bhsd(t)) for n, t in (("q", q8), ("k", k8), ("v", v8)))
    qd, kd, vd = (bind(n, scalar(d.flatten()[0].item()), fp32, one)
                  for n, d in zip(("descale_q", "descale_k", "descale_v"), inputs.descales))
    descale_s, scale_s, scale_o = (bind(n, scalar(x), fp32, one) for n, x in (
        ("descale_s", 1 / FP8_MAX), ("scale_s", FP8_MAX), ("scale_o", 1.0)))
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=q, k=k, v=v, descale_q=qd, descale_k=kd, descale_v=vd, descale_s=descale_s,
        scale_s=scale_s, scale_o=scale_o, generate_stats=False,
        attn_scale=q8.shape[-1] ** -0.5, use_causal_mask=causal)
    o.set_output(True).set_dim(bhsd(out)["dim"]).set_stride(bhsd(out)["stride"]) \
        .set_data_type(cudnn.data_type.BFLOAT16)
    pack[o] = out
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim(one["dim"]).set_stride(one["stride"]).set_data_type(fp32)
        pack[amax] = scalar(0.0)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=dev)

    def call():
        graph.execute(pack, workspace, handle=handle)
        return out
    return call


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
