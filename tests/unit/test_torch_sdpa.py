"""torch SDPA integration on the CPU: the kernels registered for SDPA's flash op, called
directly and through the aten op with its autograd formula (registered here for the CPU
key, where torch has no kernel for these ops), against F.scaled_dot_product_attention's
math backend and asymflash.reference; which calls go to torch's kernel; register() and
unregister() round trips. The CUDA dispatch itself is tests/gpu/test_torch_sdpa_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from asymflash.integrations import torch_sdpa
from asymflash.reference import attention_ref

aten = torch.ops.aten


def qkv(b, hq, hk, sq, sk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_()
            for h, s in ((hq, sq), (hk, sk), (hk, sk))]


def math_sdpa(q, k, v, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def ref_lse(q, k, scale, causal_bottom_right):
    """logsumexp of the scaled scores, (b, h, sq), fp64."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(group, 1))
    s = s * scale
    if causal_bottom_right:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return torch.logsumexp(s, -1)


@pytest.fixture
def on_cpu_key():
    """The two kernels registered for the CPU key, for the duration of a test."""
    handle = torch_sdpa.install("CPU")
    torch_sdpa.stats.clear()
    yield
    handle.remove()


# (batch, hq, hk, sq, sk, d, is_causal, scale): odd sizes, GQA, MQA, explicit scale
CASES = [(1, 1, 1, 1, 1, 8, False, None), (2, 4, 2, 17, 17, 16, True, None),
         (1, 2, 2, 113, 113, 32, True, 0.3), (2, 6, 3, 17, 113, 24, False, None),
         (1, 4, 1, 113, 17, 8, False, 1.7), (1, 3, 3, 1, 17, 16, False, None)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_through_the_aten_op_matches_math_sdpa(on_cpu_key, case):
    """Forward values and lse, and gradients through torch's autograd formula for the op
    (which calls the backward op, also ours), against F.sdpa's math backend."""
    b, hq, hk, sq, sk, d, causal, scale = case
    q, k, v = qkv(b, hq, hk, sq, sk, d)
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    assert out.shape == q.shape and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert lse.is_contiguous() and out.stride() == q.stride()
    assert res[4:6] == (sq, sk)
    assert res[6].dtype == torch.uint64 and res[6].shape == (2,)
    assert res[8].numel() == 0
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = math_sdpa(qr, kr, vr, is_causal=causal, scale=scale, enable_gqa=hq != hk)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    s = d ** -0.5 if scale is None else scale
    torch.testing.assert_close(lse.double(), ref_lse(q, k, s, causal), atol=2e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    assert torch_sdpa.stats == {"asymflash_forward": 1, "asymflash_backward": 1}


@pytest.mark.parametrize("sq,sk", [(17, 113), (1, 17)])
def test_causal_inside_the_op_is_bottom_right(on_cpu_key, sq, sk):
    """The op's causal is FA2's (bottom-right, what the op computes when called directly,
    e.g. by context parallel); F.sdpa never sends non-square causal to the flash backend
    (its top-left meaning runs on torch's other kernels), so nothing is remapped."""
    q, k, v = qkv(1, 2, 2, sq, sk, 16)
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    ref, ref_l = attention_ref(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_l, atol=2e-5, rtol=1e-4)
    top_left = math_sdpa(q, k, v, is_causal=True)
    assert (out - top_left).abs().max() > 1e-2


def test_adapter_functions_directly_bf16():
    """The registered functions called as the dispatcher would, bf16 inputs in a
    (batch, seq, heads, dim) memory layout (what a projection's view gives)."""
    b, hq, hk, s, d = 2, 4, 2, 33, 64
    q, k, v = (t.detach().to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
               for t in qkv(b, hq, hk, s, s, d))
    torch_sdpa.stats.clear()
    res = torch_sdpa.sdpa_flash_forward(q, k, v, 0.0, True, False, scale=None)
    out, lse = res[0], res[1]
    assert out.dtype == torch.bfloat16 and out.stride() == q.stride()
    ref, ref_l = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.float(), ref.transpose(1, 2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_l, atol=1e-2, rtol=1e-3)
    do = torch.randn_like(out)
    dq, dk, dv = torch_sdpa.sdpa_flash_backward(do, q, k, v, out, lse, None, None, s, s, 0.0,
                                                True, res[6], res[7], scale=None)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    math_sdpa(qr, kr, vr, is_causal=True, enable_gqa=True).backward(do.float())
    for got, want, t in ((dq, qr.grad, q), (dk, kr.grad, k), (dv, vr.grad, v)):
        assert got.dtype == torch.bfloat16 and got.shape == t.shape
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    assert torch_sdpa.stats == {"asymflash_forward": 1, "asymflash_backward": 1}


def _args(hq=4, hk=2, sq=17, sk=17, d=16, dtype=torch.float16, dv=None):
    q = torch.zeros(1, hq, sq, d, dtype=dtype)
    k = torch.zeros(1, hk, sk, d, dtype=dtype)
    v = torch.zeros(1, hk, sk, d if dv is None else dv, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("kw,why", [
    (dict(dropout_p=0.1), "dropout"), (dict(return_debug_mask=True), "debug"),
    (dict(args=_args(d=12)), "head dims"), (dict(args=_args(d=264)), "head dims"),
    (dict(args=_args(dv=12)), "head dims"), (dict(args=_args(hq=3, hk=2)), "multiple"),
    (dict(args=_args(sq=0)), "empty"), (dict(args=_args(dtype=torch.float64)), "dtype"),
    (dict(args=_args(sq=18, sk=17), is_causal=True), "causal"),
])
def test_unsupported_calls_go_to_torch(monkeypatch, kw, why):
    """What asymflash does not take reaches torch's own kernels (FA2 through
    aten::_flash_attention_forward/_backward, replaced here by a recorder), forward and
    backward alike."""
    args = kw.pop("args", _args())
    reason = torch_sdpa.unsupported_reason(*args, **kw)
    assert reason is not None and why in reason
    calls = []
    monkeypatch.setattr(torch_sdpa, "_torch_forward", lambda *a: calls.append("fwd"))
    monkeypatch.setattr(torch_sdpa, "_torch_backward", lambda *a: calls.append("bwd"))
    torch_sdpa.sdpa_flash_forward(*args, kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                                  kw.get("return_debug_mask", False))
    if not kw.get("return_debug_mask"):
        q, k, v = args
        torch_sdpa.sdpa_flash_backward(q, q, k, v, q, torch.zeros(q.shape[:3]), None, None,
                                       q.shape[2], k.shape[2], kw.get("dropout_p", 0.0),
                                       kw.get("is_causal", False), None, None)
    assert calls == (["fwd"] if kw.get("return_debug_mask") else ["fwd", "bwd"])


def test_supported_reasons():
    assert torch_sdpa.unsupported_reason(*_args()) is None
    assert torch_sdpa.unsupported_reason(*_args(sq=17, sk=40), is_causal=True) is None
    assert torch_sdpa.unsupported_reason(*_args(hq=8, hk=1, d=256)) is None
    q, k, v = _args()
    assert "contiguous" in torch_sdpa.unsupported_reason(q.transpose(2, 3).contiguous()
                                                         .transpose(2, 3), k, v)


def test_torch_fallback_calls_torchs_flash_ops(monkeypatch):
    """The fallback is what torch's CUDA kernel for the SDPA op does: transpose to
    (batch, seq, heads, dim), aten::_flash_attention_forward, transpose back."""
    seen = {}

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, scale=None):
        seen["fwd"] = (q.shape, cu_q, max_q, max_k, dropout_p, causal, debug, scale)
        return q.clone(), torch.zeros(q.shape[0], q.shape[2], q.shape[1]), "rng", "x", "dbg"

    def bwd(go, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, seed, off,
            scale=None):
        seen["bwd"] = (go.shape, max_q, max_k, dropout_p, causal, seed, off, scale)
        return q, k, v

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", bwd)
    q, k, v = _args(sk=9)
    res = torch_sdpa.sdpa_flash_forward(q, k, v, 0.25, False, False, scale=0.5)
    assert seen["fwd"] == ((1, 17, 4, 16), None, 17, 9, 0.25, False, False, 0.5)
    assert res[0].shape == q.shape and res[2:] == (None, None, 17, 9, "rng", "x", "dbg")
    dq, dk, dv = torch_sdpa.sdpa_flash_backward(q, q, k, v, q, res[1], None, None, 17, 9,
                                                0.25, False, "rng", "x", scale=0.5)
    assert seen["bwd"] == ((1, 17, 4, 16), 17, 9, 0.25, False, "rng", "x", 0.5)
    assert dq.shape == q.shape and dk.shape == k.shape


def test_register_round_trip():
    attention = torch.nn.attention
    before = list(torch._C._get_sdp_priority_order())
    flash = int(SDPBackend.FLASH_ATTENTION)
    torch_sdpa.register()
    try:
        assert torch_sdpa.is_registered()
        if hasattr(attention, "current_flash_attention_impl"):
            assert attention.current_flash_attention_impl() == torch_sdpa.NAME
            assert torch_sdpa.NAME in attention.list_flash_attention_impls()
        assert torch._C._get_sdp_priority_order()[0] == flash
        assert sorted(torch._C._get_sdp_priority_order()) == sorted(before)
        torch_sdpa.register()  # again: harmless
        assert torch_sdpa.is_registered()
    finally:
        torch_sdpa.unregister()
    assert not torch_sdpa.is_registered()
    assert list(torch._C._get_sdp_priority_order()) == before
    torch_sdpa.unregister()  # again: harmless
    # CPU SDPA never uses these ops: registered or not, F.sdpa gives torch's result.
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 17, 17, 16))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch_sdpa.register()
    try:
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   ref)
    finally:
        torch_sdpa.unregister()


def test_priority_order_change_is_undone():
    """prefer_flash moves flash to the front of a custom order and restores that order."""
    order = [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION),
             int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.MATH),
             int(SDPBackend.OVERRIDEABLE)]
    before = list(torch._C._get_sdp_priority_order())
    torch._C._set_sdp_priority_order(order)
    try:
        torch_sdpa.register()
        assert list(torch._C._get_sdp_priority_order()) == [order[2], order[0], order[1],
                                                            *order[3:]]
        torch_sdpa.unregister()
        assert list(torch._C._get_sdp_priority_order()) == order
        torch_sdpa.register(prefer_flash=False)
        assert list(torch._C._get_sdp_priority_order()) == order
        torch_sdpa.unregister()
        if hasattr(torch.nn.attention, "restore_flash_attention_impl"):
            # torch's own restore undoes the registration and the order alike
            torch_sdpa.register()
            assert list(torch._C._get_sdp_priority_order())[0] == order[2]
            torch.nn.attention.restore_flash_attention_impl()
            assert not torch_sdpa.is_registered()
            assert list(torch._C._get_sdp_priority_order()) == order
    finally:
        torch._C._set_sdp_priority_order(before)


class _FlashRoute(torch.overrides.TorchFunctionMode):
    """What torch's CUDA SDPA does with a call its flash backend accepts (no mask, no
    dropout, causal only when square): the flash op's output. Here on the CPU key."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            causal = kwargs.get("is_causal", False)
            if (kwargs.get("attn_mask") is None and not kwargs.get("dropout_p")
                    and (not causal or q.shape[2] == k.shape[2])):
                return aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, causal, False, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


class _Block(torch.nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        a = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def _train(route):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(2, 17, 32, generator=g)
        with _FlashRoute() if route else contextlib.nullcontext():
            loss = (model(x) - x.roll(1, 1)).square().mean()
            opt.zero_grad()
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_model_written_for_sdpa_trains_the_same(on_cpu_key):
    """A GQA causal block trained through the flash op (asymflash, fp32 on the CPU) and
    through torch's own SDPA: the same losses step by step."""
    base = _train(route=False)
    got = _train(route=True)
    assert torch_sdpa.stats == {"asymflash_forward": 8, "asymflash_backward": 8}
    assert base[-1] < base[0]
    torch.testing.assert_close(got, base, atol=1e-5, rtol=1e-5)


def test_torch_compile_runs_the_registered_kernels(on_cpu_key):
    """torch.compile traces the op with torch's meta function and calls the registered
    kernels at run time: their outputs must fit what the meta function promised."""
    def f(q, k, v):
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                       scale=0.25)[0]
        return (out * out).sum()

    torch._dynamo.reset()
    q, k, v = qkv(2, 4, 2, 17, 17, 16)
    loss = torch.compile(f)(q, k, v)
    loss.backward()
    assert torch_sdpa.stats["asymflash_forward"] >= 1
    assert torch_sdpa.stats["asymflash_backward"] == 1
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = math_sdpa(qr, kr, vr, is_causal=True, scale=0.25, enable_gqa=True)
    ref = (out * out).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
