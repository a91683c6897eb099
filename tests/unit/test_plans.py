"""Call plans (runtime/plans.py): a repeated flash_attn_func signature skips the checks and
the dispatcher, so every call through a plan must give what the full path gives, and no
input the checks refuse may ever find a plan. Runs on the machine's default backend (CPU
here; on the GPU box the sm90 forward's runner, launched through a bound binary)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_lse_close, forced

from asymflash import flash_attn_func
from asymflash.reference import attention_ref
from asymflash.runtime import plans

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The sm90 kernels' head dims on the GPU; the CPU backend takes any.
D = 64 if DEVICE == "cuda" else 24
# lse leaves in fp32 (the CPU backend's is within 1e-6 of the reference's here). Tight, so
# that a plan computing over one key too many or too few fails: dropping any single key of
# these 203 moves some row's lse by 0.035 or more (the relative 2e-2 this had let 0.1 pass).
LSE_ATOL = 1e-3 if DEVICE == "cuda" else 1e-5


@pytest.fixture(autouse=True)
def _fresh_plans():
    plans.clear()
    yield
    plans.clear()


def qkv(b=2, sq=113, sk=203, hq=4, hkv=2, d=D, grad=False):
    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE).requires_grad_(grad)

    return rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d)


def assert_close_to_reference(out, lse, q, k, v, **kw):
    ref_out, ref_lse = attention_ref(q.detach().float(), k.detach().float(),
                                     v.detach().float(), **kw)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert_lse_close(lse.float(), ref_lse, atol=LSE_ATOL)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(17, 1)),
                                dict(softcap=5.0, softmax_scale=0.3)])
def test_planned_calls_match_the_reference_on_fresh_inputs(kw):
    for call in range(3):  # the first call plans, the next two run the plan
        q, k, v = qkv()
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        assert_close_to_reference(out, lse, q, k, v, **kw)
        assert len(plans._PLANS) == 1, f"call {call}: one signature, one plan"


def test_planned_gradients_match_the_reference():
    sink = torch.randn(4, device=DEVICE, requires_grad=True)
    for _ in range(3):
        q, k, v = qkv(grad=True)
        dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=DEVICE)
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        sink_leaf = sink.detach().clone().requires_grad_(True)
        ref, _ = attention_ref(*leaves, causal=True, learnable_sink=sink_leaf)
        ref_grads = torch.autograd.grad(ref, (*leaves, sink_leaf), dout.float())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    assert len(plans._PLANS) == 1


def test_no_grad_and_grad_calls_get_plans_of_their_own():
    q, k, v = qkv(grad=True)
    with torch.no_grad():
        out_a = flash_attn_func(q, k, v)
        out_a = flash_attn_func(q, k, v)
    assert not out_a.requires_grad
    out_b = flash_attn_func(q, k, v)
    out_b = flash_attn_func(q, k, v)
    assert out_b.requires_grad
    torch.testing.assert_close(out_a, out_b.detach(), atol=0, rtol=0)
    assert sorted(key[0] for key in plans._PLANS) == [False, True]


REFUSED_AFTER_A_GOOD_CALL = [
    # Arguments equal (==) to accepted ones but of a type the checks refuse.
    (dict(softcap=True), "softcap"),
    (dict(softmax_scale=True), "softmax_scale"),
    (dict(window_size=(True, -1)), "window_size"),
    (dict(window_size=[2, 0, 1]), "window_size"),
    (dict(softmax_scale=float("inf")), "softmax_scale"),
]


@pytest.mark.parametrize("bad, words", REFUSED_AFTER_A_GOOD_CALL)
def test_refused_inputs_never_find_a_plan(bad, words):
    q, k, v = qkv()
    good = dict(softcap=1, softmax_scale=1, window_size=(1, -1))
    for _ in range(2):
        flash_attn_func(q, k, v, **good)
    with pytest.raises((ValueError, TypeError), match=words):
        flash_attn_func(q, k, v, **{**good, **bad})


def test_a_refused_layout_never_finds_a_plan():
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    strided = q.transpose(1, 3).contiguous().transpose(1, 3)  # same shape, last stride != 1
    with pytest.raises(ValueError, match="stride"):
        flash_attn_func(strided, k, v)


def test_a_new_signature_or_switch_makes_a_new_plan(monkeypatch):
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q[:, :17].contiguous(), k, v)  # another shape
    flash_attn_func(q, k, v, causal=True)  # another mask
    monkeypatch.setenv("ASYMFLASH_SM90_RESCALE", "8")  # a per-call switch
    flash_attn_func(q, k, v)
    assert len(plans._PLANS) == 4
    with forced("cpu" if DEVICE == "cpu" else "portable"):  # a forced backend
        out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert len(plans._PLANS) == 5
    assert_close_to_reference(out, lse, q, k, v)


def test_inputs_are_not_modified_by_planned_calls():
    q, k, v = qkv()
    copies = [t.clone() for t in (q, k, v)]
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


@pytest.mark.skipif(DEVICE != "cuda", reason="the sm90 runner launches on an H100/H200")
def test_sm90_runner_binds_and_launches_directly():
    from asymflash.backends.sm90.fwd import host as fwd

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs sm_90")
    for _ in range(3):
        q, k, v = qkv(b=3, sq=128, sk=256, hq=8, hkv=8, d=128)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert_close_to_reference(out, lse, q, k, v, causal=True)
    (plan,) = plans._PLANS.values()
    assert isinstance(plan.forward, fwd.ForwardRunner)
    assert plan.forward.bound is not None  # the third call went through the bound launcher


@pytest.mark.skipif(DEVICE != "cuda", reason="the sm90 runner launches on an H100/H200")
@pytest.mark.parametrize("d,causal,deterministic", [(64, True, False), (128, False, True),
                                                     (256, True, False), (128, True, False)])
def test_sm90_backward_runner_matches_the_reference(d, causal, deterministic):
    """Planned backwards go through bwd.BackwardRunner: its launches bind at its first call
    and go through the bound binaries after. Calls alternate between a loss without and with
    the lse term (dlse None or a tensor: two preprocess binaries), fresh inputs each time."""
    from asymflash.backends.sm90.bwd import host as bwd

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs sm_90")
    for call in range(5):
        q, k, v = qkv(b=2, sq=113, sk=203, hq=4, hkv=2, d=d, grad=True)
        dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=DEVICE)
        dlse = torch.randn(2, 4, 113, device=DEVICE) if call % 2 else None
        out, lse = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                   return_lse=True)
        loss = (out.float() * dout.float()).sum()
        if dlse is not None:
            loss = loss + (lse * dlse).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        ref, ref_lse = attention_ref(*leaves, causal=causal)
        ref_loss = (ref * dout.float()).sum()
        if dlse is not None:
            ref_loss = ref_loss + (ref_lse * dlse).sum()
        for got, want in zip(grads, torch.autograd.grad(ref_loss, leaves)):
            torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    (plan,) = plans._PLANS.values()
    runner = plan.backward[0]
    assert isinstance(runner, bwd.BackwardRunner)
    sites = runner.sites
    # calls 2-5 ran the plan: both preprocess kinds, the main kernel (and the dQ
    # postprocess where dQ_acc holds fragment-order tiles) bound after their first launch
    assert sites.pre.bound is not None and sites.pre_dlse.bound is not None
    assert sites.main.bound is not None
    assert (sites.post.bound is not None) == runner.plan.dq_fragment


def test_switches_follow_the_environment(monkeypatch):
    """Plans key on the per-call environment switches, read through os.environ's own dict:
    a change made while the process runs must show at once."""
    from asymflash.runtime import env
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert env.per_call_values() == (None,) * len(env.PER_CALL)
    monkeypatch.setenv("ASYMFLASH_SM90_RESCALE", "0")
    got = dict(zip(env.PER_CALL, env.per_call_values()))
    assert got["ASYMFLASH_SM90_RESCALE"] in ("0", b"0")
    assert got["ASYMFLASH_SM90_EXP2_EMU"] is None
    # one switch at a time: os.environ.get's answer
    monkeypatch.setenv("ASYMFLASH_SM90_EXP2_EMU", "4")
    for name in env.SWITCHES:
        assert env.get(name) == os.environ.get(name), name
    with pytest.raises(KeyError, match="not an asymflash switch"):
        env.get("ASYMFLASH_NOT_A_SWITCH")


# flash_attn_varlen_func: the offsets tensors are part of the key by identity and version.
def varlen_inputs(lens_q=(1, 113, 0, 17), lens_k=(5, 203, 17, 17), hq=4, hkv=2, d=D,
                  grad=False):
    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE).requires_grad_(grad)

    cu_q, cu_k = (torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
                  for lens in (lens_q, lens_k))
    q, k, v = rnd(sum(lens_q), hq, d), rnd(sum(lens_k), hkv, d), rnd(sum(lens_k), hkv, d)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def varlen_reference(q, k, v, cu_q, cu_k, seqused_k=None, **kw):
    """(out, lse) of attention_ref one sequence at a time, fp32 (differentiable)."""
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[b])
        o, lse = attention_ref(q[q0:q1][None].float(), k[k0:k1][None].float(),
                               v[k0:k1][None].float(), **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def test_planned_varlen_calls_match_the_reference():
    from asymflash import flash_attn_varlen_func
    cu_fixed = None
    for call in range(3):
        q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
        if cu_fixed is None:
            cu_fixed = (cu_q, cu_k)  # one offsets pair for every call, as a model's layers
        out, lse = flash_attn_varlen_func(q, k, v, *cu_fixed, mq, mk, causal=True,
                                          return_lse=True)
        ref_out, ref_lse = varlen_reference(q, k, v, *cu_fixed, causal=True)
        torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
        assert_lse_close(lse.float(), ref_lse, atol=LSE_ATOL)
        assert len(plans._PLANS) == 1, f"call {call}: one signature, one plan"


def test_planned_varlen_gradients_match_the_reference():
    from asymflash import flash_attn_varlen_func
    _, _, _, cu_q, cu_k, mq, mk = varlen_inputs()
    used = torch.tensor([5, 150, 0, 9], dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        q, k, v, *_ = varlen_inputs(grad=True)
        dout = torch.randn(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=DEVICE)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(31, 3),
                                     seqused_k=used)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        ref, _ = varlen_reference(*leaves, cu_q, cu_k, used, window_size=(31, 3))
        ref_grads = torch.autograd.grad(ref, leaves, dout.float())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    assert len(plans._PLANS) == 1


def test_changed_offsets_never_reuse_a_plan():
    """An in-place change of cu_seqlens after good calls (here to values the checks refuse)
    goes through the checks again; a new tensor of equal values gets a plan of its own."""
    from asymflash import flash_attn_varlen_func
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    for _ in range(2):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    cu_k[2] = cu_k[1] - 1  # decreasing: refused
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    _, _, _, cu_q2, cu_k2, _, _ = varlen_inputs()
    out = flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, mq, mk)
    torch.testing.assert_close(out.float(), varlen_reference(q, k, v, cu_q2, cu_k2)[0],
                               atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="max_seqlen_k"):  # another value: checked again
        flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, mq, 3)
    assert len(plans._PLANS) == 2
