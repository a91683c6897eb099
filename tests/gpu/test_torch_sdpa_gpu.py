"""torch SDPA integration on the GPU (marker `gpu`): after torch_sdpa.register(),
F.scaled_dot_product_attention runs asymflash (counted by torch_sdpa.stats) and matches
torch's own kernels in values and gradients; what asymflash does not take (dropout, masks,
top-left non-square causal) gives torch's results exactly; a small transformer written for
SDPA trains the same with and without registration; torch.compile goes through it too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_fa_close
from torch.nn.attention import SDPBackend, sdpa_kernel

from asymflash.integrations import torch_sdpa

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = "cuda"


def qkv(b, hq, hk, sq, sk, d, dtype=torch.bfloat16, seed=0, bshd=True):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def make(h, s):
        if bshd:  # what a projection's .view(b, s, h, d).transpose(1, 2) gives
            return torch.randn(b, s, h, d, generator=g, device=DEV, dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, generator=g, device=DEV, dtype=dtype)

    return [make(h, s).requires_grad_() for h, s in ((hq, sq), (hk, sk), (hk, sk))]


def run(q, k, v, **kw):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, **kw)
    g = torch.Generator(device=DEV).manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g, device=DEV, dtype=out.dtype))
    return out.detach(), qs.grad, ks.grad, vs.grad


def torch_run(q, k, v, backends, **kw):
    with sdpa_kernel(backends):
        return run(q, k, v, **kw)


def math32(q, k, v, **kw):
    return torch_run(*(t.detach().float() for t in (q, k, v)), SDPBackend.MATH, **kw)


def _atol(name, ref):
    return 1e-3 if name == "out" else 1e-2 * max(1.0, ref.abs().max().item())


def test_register_puts_flash_first_and_unregister_restores():
    t = torch.zeros(1, 1, 1, 8, device=DEV, dtype=torch.float16)
    torch._fused_sdp_choice(t, t, t)  # torch's default order is set on the first choice
    before = list(torch._C._get_sdp_priority_order())
    torch_sdpa.register()
    try:
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.FLASH_ATTENTION)
    finally:
        torch_sdpa.unregister()
    assert list(torch._C._get_sdp_priority_order()) == before


# (batch, hq, hk, seqlen_q, seqlen_k, d, is_causal, bshd layout)
CASES = [(2, 8, 8, 1024, 1024, 128, True, True), (2, 16, 4, 1000, 1000, 64, True, True),
         (1, 8, 2, 113, 2047, 128, False, False), (3, 4, 4, 17, 17, 256, False, True),
         (1, 12, 12, 777, 777, 80, True, False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sdpa_runs_asymflash_and_matches_torch(registered, case):
    b, hq, hk, sq, sk, d, causal, bshd = case
    q, k, v = qkv(b, hq, hk, sq, sk, d, bshd=bshd)
    kw = dict(is_causal=causal, enable_gqa=hq != hk)
    got = run(q, k, v, **kw)
    assert torch_sdpa.stats["asymflash_forward"] == 1
    assert torch_sdpa.stats["asymflash_backward"] == 1
    assert torch_sdpa.stats["torch_forward"] == torch_sdpa.stats["torch_backward"] == 0
    assert got[0].stride() == q.stride() and got[1].stride() == q.stride()
    ref32 = math32(q, k, v, **kw)
    torch_sdpa.unregister()
    low = torch_run(q, k, v, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.MATH], **kw)  # torch's own bf16 kernels
    for name, x, r, lo in zip(("out", "dq", "dk", "dv"), got, ref32, low):
        assert x.shape == lo.shape and x.dtype == lo.dtype
        assert_fa_close(name, x, r, lo, _atol(name, r))


@pytest.mark.parametrize("causal", [False, True])
def test_op_outputs_as_torchs(causal):
    """The flash op's tuple as torch's kernel gives it: out, logsumexp fp32 (b, h, sq)
    contiguous in natural log (what context parallel merges by), max_q/max_k, rng state."""
    q, k, v = (t.detach() for t in qkv(2, 8, 2, 1000, 1000, 128))
    op = torch.ops.aten._scaled_dot_product_flash_attention
    want = op(q, k, v, 0.0, causal, False, scale=0.1)
    torch_sdpa.register()
    torch_sdpa.stats.clear()
    try:
        got = op(q, k, v, 0.0, causal, False, scale=0.1)
    finally:
        torch_sdpa.unregister()
    assert torch_sdpa.stats["asymflash_forward"] == 1
    assert got[1].shape == want[1].shape == (2, 8, 1000) and got[1].dtype == torch.float32
    assert got[1].is_contiguous()
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert got[4:6] == want[4:6] == (1000, 1000)
    assert got[6].shape == (2,) and got[6].dtype == torch.uint64  # as torch's meta function


def test_scale_and_head_dim_padding(registered):
    """SDPA pads a head dim that is not a multiple of 8 before the op and passes the scale
    of the original dim: asymflash sees d = 72 with scale 1/sqrt(70)."""
    q, k, v = qkv(2, 4, 4, 300, 300, 70)
    got = run(q, k, v, scale=0.2)
    assert torch_sdpa.stats["asymflash_forward"] == 1
    ref32 = math32(q, k, v, scale=0.2)
    torch_sdpa.unregister()
    low = torch_run(q, k, v, SDPBackend.FLASH_ATTENTION, scale=0.2)
    for name, x, r, lo in zip(("out", "dq", "dk", "dv"), got, ref32, low):
        assert_fa_close(name, x, r, lo, _atol(name, r))


FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _exact_torch_result(q, k, v, seed, **kw):
    # Both runs with flash first (register()'s order), so torch picks the same backends.
    torch.manual_seed(seed)
    with sdpa_kernel(FLASH_FIRST, set_priority=True):
        return run(q, k, v, **kw)


@pytest.mark.parametrize("kw", [dict(dropout_p=0.2), dict(attn_mask="bool"),
                                dict(is_causal=True, sq=100), dict(attn_mask="float")],
                         ids=["dropout", "bool-mask", "top-left-causal", "float-mask"])
def test_what_asymflash_does_not_take_gives_torchs_result(kw):
    """Dropout reaches the op and goes to torch's FA2 with torch's rng stream (bitwise the
    same as unregistered); masks and non-square causal never reach the flash backend."""
    kw = dict(kw)
    sq = kw.pop("sq", 256)
    q, k, v = qkv(2, 4, 4, sq, 256, 64)
    if "attn_mask" in kw:
        m = torch.rand(sq, 256, device=DEV) > 0.3
        kw["attn_mask"] = m if kw["attn_mask"] == "bool" else torch.randn(
            sq, 256, device=DEV, dtype=q.dtype)
    want = _exact_torch_result(q, k, v, 3, **kw)
    torch_sdpa.register()
    torch_sdpa.stats.clear()
    try:
        got = _exact_torch_result(q, k, v, 3, **kw)
    finally:
        torch_sdpa.unregister()
    assert torch_sdpa.stats["asymflash_forward"] == 0
    if kw.get("dropout_p"):
        assert torch_sdpa.stats["torch_forward"] == torch_sdpa.stats["torch_backward"] == 1
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # forwards: deterministic
    for x, y in zip(got[1:], want[1:]):  # backwards accumulate with atomics
        torch.testing.assert_close(x, y)


class Block(torch.nn.Module):
    """A pre-norm transformer block written for F.scaled_dot_product_attention (GQA)."""

    def __init__(self, dim=256, heads=8, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        a = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def train(steps=8, compile_=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block()).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn = torch.compile(model) if compile_ else model
    g = torch.Generator(device=DEV).manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 512, 256, generator=g, device=DEV)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (fn(x) - x.roll(1, 1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_transformer_trains_the_same(compile_, monkeypatch):
    if compile_:
        torch._dynamo.reset()
        # SDPA's backend is chosen when the graph is traced (on the H200 before register():
        # cuDNN), and Inductor's FX-graph and AOTAutograd caches would hand the second run
        # that graph back: compile it afresh, as a process that registers first does
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
        monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    base = train(compile_=compile_)
    torch_sdpa.register()
    torch_sdpa.stats.clear()
    try:
        if compile_:
            torch._dynamo.reset()
        got = train(compile_=compile_)
    finally:
        torch_sdpa.unregister()
    assert torch_sdpa.stats["asymflash_forward"] >= 8 * 2  # more if compile recomputes it
    assert torch_sdpa.stats["asymflash_backward"] == 8 * 2
    assert torch_sdpa.stats["torch_forward"] == 0
    assert base[-1] < base[0]
    for a, b in zip(got, base):
        assert abs(a - b) <= 2e-2 * abs(b), (got, base)
