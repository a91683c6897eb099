"""asymflash.flex_attention and flash_attn_func's mods under torch.compile (CPU).

Calls whose mods are all built in (flash_attn_func's causal / window / softcap / ALiBi, or
flex_attention without mods) compile into one graph around the custom op
asymflash::flex_fwd; a user's score_mod / mask_mod / BlockMask costs one graph break
(traced eagerly), after which the op and the captured tensors are in the next graph.
Values and gradients (q, k, v and a learned bias table) are checked against eager calls
and the reference."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import asymflash
from asymflash import flash_attn_func
from asymflash.api import flex, flex_compiled, flex_ops
from asymflash.core import flex_ir, flex_trace
from asymflash.reference import flex_attention_ref

torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

BACKENDS = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None,
    reason="CPU inductor needs a C++ compiler"))]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Inductor's on-disk caches key on the graph, not on the ops' fake implementations:
    # code compiled against an older asymflash could be served back.
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def _bhsd(batch, hq, hkv, sq, sk, d=16):
    return [torch.randn(batch, h, s, d).requires_grad_(True)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


def _grads(fn, args, tensors):
    """fn(*args) and the gradients of tensors from a weighted sum of its output."""
    for t in tensors:
        t.grad = None
    out = fn(*args)
    out = out if isinstance(out, torch.Tensor) else out[0]
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


def _same(got, want, tol=1e-5):
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


class BiasedBlock(torch.nn.Module):
    """Attention with a learned relative-position bias table and a document mask."""

    def __init__(self, heads, seqlen):
        super().__init__()
        self.table = torch.nn.Parameter(0.5 * torch.randn(heads, 2 * seqlen))
        self.seqlen = seqlen

    def forward(self, q, k, v, block_mask):
        def score_mod(s, b, h, i, j):
            return s + self.table[h, i - j + self.seqlen]

        return asymflash.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        enable_gqa=True, return_lse=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learned_bias_and_block_mask(backend):
    """Values, lse and gradients (q, k, v, the bias table) of the compiled model equal the
    eager ones, and the eager ones the reference; repeated calls compile once."""
    torch.manual_seed(0)
    sq = sk = 113 if backend != "inductor" else 17
    doc = torch.randint(0, 3, (sk,)).sort().values
    block_mask = torch_flex.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None,
                                              None, sq, sk, device="cpu", BLOCK_SIZE=16)
    model = BiasedBlock(4, sk)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter if backend == "eager" else backend)
    for step in range(3):
        q, k, v = _bhsd(2, 4, 2, sq, sk)
        leaves = [q, k, v, model.table]
        got, got_grads = _grads(compiled, (q, k, v, block_mask), leaves)
        want, want_grads = _grads(model, (q, k, v, block_mask), leaves)
        _same(got, want)
        for g, w in zip(got_grads, want_grads):
            _same(g, w)
        if step == 0:
            frames = counter.frame_count
    ref, _ = flex_attention_ref(q, k, v, lambda s, b, h, i, j: s + model.table[h, i - j + sk],
                                block_mask, enable_gqa=True)
    _same(want, ref, 1e-4)
    assert counter.frame_count == frames  # no recompile per call
    assert want_grads[3].abs().sum() > 0  # the bias table did get a gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_builtin_mods_fullgraph(backend):
    """causal + softcap + ALiBi: no user callable, so one graph with fullgraph=True."""
    torch.manual_seed(1)
    slopes = torch.rand(2, 4)
    q, k, v = (torch.randn(2, s, h, 16, requires_grad=True)
               for s, h in ((17, 4), (29, 2), (29, 2)))

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes,
                               return_lse=True)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    got, got_grads = _grads(compiled, (q, k, v), [q, k, v])
    want, want_grads = _grads(fn, (q, k, v), [q, k, v])
    _same(got, want)
    for g, w in zip(got_grads, want_grads):
        _same(g, w)


def test_flex_without_mods_fullgraph_and_lse():
    torch.manual_seed(2)
    q, k, v = _bhsd(1, 3, 3, 17, 113)

    def fn(q, k, v):
        return asymflash.flex_attention(q, k, v, scale=0.3, return_lse=True)

    got_out, got_lse = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    want_out, want_lse = flex_attention_ref(q, k, v, scale=0.3)
    _same(got_out, want_out, 1e-5)
    _same(got_lse, want_lse, 1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flash_attn_func_user_mods(backend):
    """score_mod and mask_mod through flash_attn_func, with causal: one graph break."""
    torch.manual_seed(3)
    slopes = torch.rand(4)
    q, k, v = (torch.randn(1, 17, 4, 16, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                               score_mod=lambda s, b, h, i, j: s * 0.5,
                               mask_mod=lambda b, h, i, j: (i - j) < 9)

    got, got_grads = _grads(torch.compile(fn, backend=backend), (q, k, v), [q, k, v])
    want, want_grads = _grads(fn, (q, k, v), [q, k, v])
    _same(got, want)
    for g, w in zip(got_grads, want_grads):
        _same(g, w)


def test_fullgraph_with_a_user_mod_names_the_graph_break():
    q, k, v = _bhsd(1, 2, 2, 17, 17)
    fn = torch.compile(lambda q, k, v: asymflash.flex_attention(
        q, k, v, score_mod=lambda s, b, h, i, j: s + h), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="asymflash traces score_mod"):
        fn(q, k, v)


def test_changing_lengths_do_not_recompile_each_call():
    """A spec without a BlockMask does not name the sequence lengths: after the one
    recompile that makes the lengths dynamic, new lengths reuse the graphs."""
    torch.manual_seed(6)
    table = torch.randn(2, 300)
    slopes = torch.rand(2)

    def user(q, k, v):
        return asymflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j:
                                        s + table[h, i - j + 150])

    def builtin(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    counters = [CompileCounter(), CompileCounter()]
    compiled = [torch.compile(user, backend=counters[0]),
                torch.compile(builtin, backend=counters[1], fullgraph=True)]
    frames = []
    for n in (17, 23, 40, 113):
        q, k, v = _bhsd(1, 2, 2, n, n)
        _same(compiled[0](q, k, v), user(q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        _same(compiled[1](q, k, v), builtin(q, k, v))
        frames.append([c.frame_count for c in counters])
    assert frames[-1] == frames[1]


class ScaledMod(torch.nn.Module):
    """A mod closing over a Python scalar that changes between calls."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, q, k, v):
        factor = self.factor
        return asymflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j:
                                        s * factor + (i - j) * 0.01)


def test_a_changed_mod_is_not_served_a_stale_graph():
    torch.manual_seed(4)
    model = ScaledMod()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    q, k, v = _bhsd(1, 2, 2, 17, 17)
    outs, frames = {}, []
    for factor in (1.0, 3.0, 1.0, 3.0):
        model.factor = factor
        got = compiled(q, k, v)
        _same(got, model(q, k, v))
        outs.setdefault(factor, got)
        frames.append(counter.frame_count)
    assert not torch.allclose(outs[1.0], outs[3.0])
    # the second mod compiles its own graph; both are reused when their mod returns
    assert frames[1] > frames[0] and frames[3] == frames[2] == frames[1]


def test_trace_cache_sees_rebound_scalars():
    factor = 1.0

    def score_mod(s, b, h, i, j):
        return s * factor

    first = flex_trace.traced(score_mod, "score")
    factor = 2.0  # noqa: F841 - read through the closure cell
    second = flex_trace.traced(score_mod, "score")
    assert first.root != second.root


def test_spec_round_trip():
    """The IR's string form gives equal trees back, shared subtrees and -inf included."""
    table = torch.randn(4, 40)

    def score_mod(s, b, h, i, j):
        t = torch.tanh(s / 7.0)
        return torch.where(i >= j, t * t + table[h, i - j], -float("inf"))

    mod = flex_trace.trace(score_mod, "score")
    mask = flex_trace.trace(lambda b, h, i, j: (i // 3) % 2 == 0, "mask")
    assert flex_ir.loads(flex_ir.dumps(mod.root, None, mask.root)) == (mod.root, None,
                                                                      mask.root)
    q, k, v = _bhsd(1, 4, 4, 17, 17)
    problem = flex.prepare(q, k, v, score_mod, None, 0.25, False)
    spec = flex_ops.encode(problem)
    assert flex_ops._decode(spec)[:2] == (problem.score.root, None)
    assert flex_ops._decode(spec)[5] == 0.25


def test_repeated_op_calls_reuse_the_problem():
    """The op's one-block layout is a fresh tensor per compiled call; the problem (and what
    backends cache on it) is found again all the same."""
    spec = flex_ops.encode(flex.prepare(*_bhsd(1, 2, 2, 17, 17), None, None, None, False))
    first = flex_ops._problem(spec, flex_compiled._one_block(True), ())
    assert flex_ops._problem(spec, flex_compiled._one_block(True), ()) is first
    assert flex_ops._problem(spec, flex_compiled._one_block(False), ()) is not first


def test_opcheck():
    """torch.library.opcheck: schema, fake implementation, autograd registration and AOT
    dispatch of asymflash::flex_fwd, with a captured tensor that requires grad."""
    torch.manual_seed(5)
    table = torch.randn(2, 34, requires_grad=True)
    q, k, v = _bhsd(1, 2, 2, 17, 17)
    problem = flex.prepare(q, k, v, lambda s, b, h, i, j: s + table[h, i - j + 17], None,
                           None, False)
    args = (q, k, v, problem.layout.kinds, [table], flex_ops.encode(problem), True)
    torch.library.opcheck(torch.ops.asymflash.flex_fwd.default, args)
