"""The sm90 Gluon forward against a plain fp32 torch attention, on a Hopper GPU.

Tolerance (the FA rule): error vs the fp32 reference <= 2 x the error of the same reference
computed with the inputs' dtype (P rounded before P·V, output rounded) + a small atol.
"""

from __future__ import annotations

import math

import pytest
import torch

from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

pytestmark = pytest.mark.gpu


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def ref_attention(q, k, v, seq: SeqInfo, params: AttnParams, sink=None, low_precision=False,
                  q_rows=None):
    """Plain attention, one sequence at a time; fp32 unless `low_precision`.

    Returns out (total_q, Hq, Dv) fp32 and lse (Hq, total_q) fp32. `q_rows`, a (start, end)
    pair of packed row indices inside one sequence, limits the work for long sequences (rows
    outside it are left at 0 / -inf).
    """
    total_q, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    out = torch.zeros(total_q, hq, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    cu_q, cu_k = seq.cu_seqlens_q.tolist(), seq.cu_seqlens_k.tolist()
    used = seq.seqused_k.tolist() if seq.seqused_k is not None else None
    wl, wr = params.mask.window_left, params.mask.window_right
    for b in range(seq.batch):
        qs, qe, ks = cu_q[b], cu_q[b + 1], cu_k[b]
        sq = qe - qs
        sk = used[b] if used is not None else cu_k[b + 1] - ks
        r0, r1 = (qs, qe) if q_rows is None else (max(q_rows[0], qs), min(q_rows[1], qe))
        if r1 <= r0:
            continue
        qb = q[r0:r1].float()
        kb = k[ks:ks + sk].float().repeat_interleave(hq // hkv, dim=1)
        vb = v[ks:ks + sk].float().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb, kb) * params.softmax_scale
        if params.softcap > 0:
            s = params.softcap * torch.tanh(s / params.softcap)
        i = torch.arange(r0 - qs, r1 - qs, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        ok = torch.ones_like(i + j, dtype=torch.bool)
        if wr >= 0:
            ok &= j <= i + wr
        if wl >= 0:
            ok &= j >= i - wl
        s = s.masked_fill(~ok, -math.inf)
        logits = s
        if sink is not None:
            col = sink.float()[:, None, None].expand(hq, r1 - r0, 1)
            logits = torch.cat([s, col], dim=-1)
        lse_b = torch.logsumexp(logits, dim=-1)
        safe = torch.where(torch.isinf(lse_b), torch.zeros_like(lse_b), lse_b)
        p = torch.exp(s - safe[..., None])
        if low_precision:
            p = p.to(q.dtype).float()
        o = torch.einsum("hij,jhd->ihd", p, vb)
        if low_precision:
            o = o.to(q.dtype).float()
        out[r0:r1] = o
        lse[:, r0:r1] = lse_b
    return out, lse


def check_forward(fwd_mod, q, k, v, seq, params, sink=None, q_rows=None, cfg=None):
    """Runs the kernel and returns (out_err, lse_err, out_tol); raises on NaN."""
    why = fwd_mod.unsupported(q, k, v, seq, params, sink)
    assert why is None, why
    out, lse = fwd_mod.forward(q, k, v, seq, params, sink, cfg=cfg)
    torch.cuda.synchronize()
    ref_o, ref_l = ref_attention(q, k, v, seq, params, sink, q_rows=q_rows)
    low_o, _ = ref_attention(q, k, v, seq, params, sink, low_precision=True, q_rows=q_rows)
    if q_rows is not None:
        out, lse = out[q_rows[0]:q_rows[1]], lse[:, q_rows[0]:q_rows[1]]
        ref_o, low_o = ref_o[q_rows[0]:q_rows[1]], low_o[q_rows[0]:q_rows[1]]
        ref_l = ref_l[:, q_rows[0]:q_rows[1]]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    out_err = (out.float() - ref_o).abs().max().item()
    finite = torch.isfinite(ref_l)
    assert torch.equal(finite, torch.isfinite(lse)), "lse -inf pattern differs"
    lse_err = (lse[finite] - ref_l[finite]).abs().max().item() if finite.any() else 0.0
    tol = 2 * (low_o - ref_o).abs().max().item() + 2e-3
    return out_err, lse_err, tol


def make_inputs(batch, sq, sk, hq, hkv, d, dv, dtype, varlen=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if varlen:
        lens_q = torch.randint(1, sq + 1, (batch,), generator=g, device="cuda")
        lens_k = torch.randint(1, sk + 1, (batch,), generator=g, device="cuda")
        lens_k[0] = 0 if batch > 2 else lens_k[0]  # an empty key sequence
        zero = torch.zeros(1, dtype=torch.int32, device="cuda")
        cu_q = torch.cat([zero, lens_q.cumsum(0).int()])
        cu_k = torch.cat([zero, lens_k.cumsum(0).int()])
        seq = SeqInfo(cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), None, False)
        tq, tk = int(cu_q[-1]), max(int(cu_k[-1]), 1)
    else:
        seq = SeqInfo.dense(batch, sq, sk, "cuda")
        tq, tk = batch * sq, batch * sk
    q = torch.randn(tq, hq, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(tk, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(tk, hkv, dv, generator=g, device="cuda").to(dtype)
    return q, k, v, seq


CASES = [
    # (batch, sq, sk, hq, hkv, d, dtype, window, softcap, sink, varlen)
    (2, 1024, 1024, 4, 4, 128, torch.bfloat16, (-1, -1), 0.0, False, False),
    (2, 1024, 1024, 4, 4, 128, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 1000, 1000, 4, 2, 128, torch.float16, (-1, 0), 0.0, False, False),
    (1, 300, 700, 4, 1, 64, torch.bfloat16, (-1, 0), 0.0, False, False),
    (1, 700, 300, 4, 4, 64, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 777, 777, 2, 2, 256, torch.bfloat16, (-1, -1), 0.0, False, False),
    (2, 512, 512, 2, 2, 256, torch.float16, (-1, 0), 0.0, False, False),
    # whole 64-row tiles at d=256: O leaves by TMA through the Q buffer (epilogue.o_staging);
    # 64 rows leave the second warpgroup without rows
    (3, 384, 384, 2, 2, 256, torch.bfloat16, (-1, -1), 0.0, False, False),
    (4, 64, 64, 2, 1, 256, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 640, 900, 4, 2, 128, torch.bfloat16, (100, 50), 0.0, False, False),
    # d=256 with a right bound: 64-key blocks, so a warpgroup whose rows end a block before
    # its tile's last row skips the tile's last blocks (fwd.kernel._warpgroup_end); more query rows
    # than keys leave rows without keys; window and varlen shift where each warpgroup ends
    (2, 640, 900, 4, 2, 256, torch.bfloat16, (100, 50), 0.0, False, False),
    (3, 203, 113, 2, 1, 256, torch.float16, (-1, 0), 0.0, False, False),
    (5, 300, 400, 2, 2, 256, torch.bfloat16, (-1, 0), 0.0, True, True),
    (2, 640, 640, 4, 4, 64, torch.bfloat16, (-1, -1), 30.0, True, False),
    (5, 300, 400, 4, 2, 128, torch.bfloat16, (-1, 0), 0.0, True, True),
    (5, 300, 400, 4, 4, 64, torch.float16, (-1, -1), 0.0, False, True),
    # d=64 without a mask from 2k query rows: three consumer warpgroups by default; 2100 rows
    # leave a ragged last 192-row tile
    (2, 2100, 2300, 4, 4, 64, torch.bfloat16, (-1, -1), 0.0, False, False),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm90_forward_matches_reference(case):
    # cfg None: the config each call picks by default (`fwd.launch_plan`)
    _forward_case_matches(case, lambda cfg: None, bitwise=False)


# Head dims the kernel runs zero-padded (fwd.forward_widths): 96 -> 128, 80 -> 128,
# 128/64 -> 128, 160 -> 256, through (rows, heads, dim) TMA descriptors that zero-fill the
# missing columns; 100 (not a multiple of 8, only reachable by calling the backend directly)
# from zero-padded copies. 192/128 runs its own build (D192_CASES below).
PADDED_CASES = [
    # (batch, sq, sk, hq, hkv, d, dv, dtype, window, softcap, sink, varlen)
    (2, 1000, 1000, 4, 2, 96, 96, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 640, 900, 4, 4, 192, 128, torch.bfloat16, (-1, -1), 0.0, True, False),
    (5, 300, 400, 4, 2, 96, 96, torch.float16, (-1, -1), 0.0, False, True),
    (2, 512, 512, 4, 4, 80, 80, torch.bfloat16, (100, 50), 20.0, False, False),
    (2, 700, 700, 4, 4, 128, 64, torch.bfloat16, (-1, 0), 0.0, False, False),
    (1, 300, 700, 4, 1, 160, 160, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 192, 192, 4, 2, 160, 160, torch.bfloat16, (-1, 0), 0.0, False, False),  # O in Q
    (3, 16, 1000, 16, 2, 96, 96, torch.bfloat16, (-1, -1), 0.0, False, False),  # GQA packed
    (2, 333, 333, 2, 2, 100, 100, torch.bfloat16, (-1, 0), 0.0, False, False),
    (2, 300, 300, 4, 2, 256, 128, torch.bfloat16, (-1, 0), 0.0, False, False),  # 256/128
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", PADDED_CASES,
                         ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm90_forward_padded_head_dims_match_reference(case):
    from asymflash.backends.sm90.fwd import host as fwd

    batch, sq, sk, hq, hkv, d, dv, dtype, window, softcap, use_sink, varlen = case
    q, k, v, seq = make_inputs(batch, sq, sk, hq, hkv, d, dv, dtype, varlen=varlen)
    before = [t.clone() for t in (q, k, v)]
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(*window), softcap=softcap)
    sink = torch.randn(hq, device="cuda") if use_sink else None
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params, sink)
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err
    out, _ = fwd.forward(q, k, v, seq, params, sink)
    assert out.shape == (q.shape[0], hq, dv) and out.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))  # inputs untouched


# GQA packing (fwd.packs_gqa, off by default until timed): the q heads of a kv head as rows.
PACKED_GQA_CASES = [
    # (batch, sq, sk, hq, hkv, d, dtype, window, softcap, varlen)
    (3, 1, 4000, 32, 4, 128, torch.bfloat16, (-1, 0), 0.0, True),  # decode, causal
    (2, 17, 1000, 8, 2, 64, torch.float16, (-1, -1), 0.0, False),
    (4, 64, 777, 16, 2, 256, torch.bfloat16, (-1, -1), 30.0, True),
    (2, 33, 5000, 8, 1, 128, torch.bfloat16, (-1, -1), 0.0, False),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", PACKED_GQA_CASES,
                         ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm90_forward_packed_gqa_matches_reference(case, monkeypatch):
    from asymflash.backends.sm90.fwd import host as fwd

    batch, sq, sk, hq, hkv, d, dtype, window, softcap, varlen = case
    q, k, v, seq = make_inputs(batch, sq, sk, hq, hkv, d, d, dtype, varlen=varlen)
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(*window), softcap=softcap)
    assert fwd.packs_gqa(q.shape[0], hq, hkv, seq, params, None)
    before = q.clone()
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params, None)
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err
    assert torch.equal(q, before)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("emu,thr", [(4, 0.0), (2, 8.0)])
def test_sm90_forward_fa4_switches(emu, thr):
    from dataclasses import replace

    from asymflash.backends.sm90.fwd import host as fwd

    q, k, v, seq = make_inputs(2, 1024, 1024, 4, 4, 64, 64, torch.bfloat16)
    params = AttnParams(softmax_scale=0.125, mask=MaskSpec(-1, 0))
    cfg = replace(fwd.select_config(64, 64, params), exp2_emu_every=emu, rescale_threshold=thr)
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params, None, cfg=cfg)
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d,causal,batch,seqlen", [(64, True, 2, 2048), (64, False, 1, 1000),
                                                   (128, True, 2, 1000), (256, False, 1, 700)])
def test_sm90_fa4_switches_through_the_api(monkeypatch, d, causal, batch, seqlen):
    """ASYMFLASH_SM90_EXP2_EMU / _RESCALE on every call (the benchmark's on/off columns):
    values against the reference, on shapes that take the persistent grid (d=64 2k causal)
    and the plain one (1000 rows), with scores that rise along the keys so that the running
    max moves from block to block."""
    from helpers import assert_fa_close, reference_pair

    from asymflash import flash_attn_func
    from asymflash.backends.sm90.fwd import host as fwd
    from asymflash.runtime.dispatch import use_backend

    torch.manual_seed(d + seqlen)
    q = torch.randn(batch, seqlen, 4, d, device="cuda", dtype=torch.bfloat16)
    rising = torch.linspace(0, 3, seqlen, device="cuda")[:, None, None]
    k = (torch.randn_like(q) + rising).to(q.dtype)
    v = torch.randn_like(q)
    q = q.abs() * 0.5  # positive q: scores grow with the keys' offset
    out32, outlow = (r[0] for r in reference_pair(q, k, v, None, causal=causal))
    for emu, thr in (("8", "0"), ("0", "8"), ("4", "8")):
        monkeypatch.setenv(fwd.EXP2_EMU_SWITCH, emu)
        monkeypatch.setenv(fwd.RESCALE_SWITCH, thr)
        with use_backend("sm90"):
            out = flash_attn_func(q, k, v, causal=causal)
        assert_fa_close(f"out emu={emu} thr={thr}", out, out32, outlow, atol=2e-3)


# Both grids on every case above, plus shapes with many tiles per CTA (the grid is one CTA
# per SM), so that ring positions and Q-barrier parities carry across tiles.
PERSISTENT_CASES = CASES + [
    (8, 1024, 1024, 32, 8, 128, torch.bfloat16, (-1, 0), 0.0, False, False),
    (16, 512, 512, 32, 32, 64, torch.bfloat16, (-1, -1), 0.0, False, False),
    (4, 1024, 1536, 16, 16, 256, torch.float16, (-1, 0), 0.0, False, False),
    (6, 1000, 1000, 32, 4, 128, torch.bfloat16, (200, 0), 0.0, True, False),
    (6, 640, 640, 32, 32, 64, torch.bfloat16, (-1, 0), 30.0, False, False),
    (40, 700, 900, 16, 4, 128, torch.bfloat16, (-1, 0), 0.0, False, True),
    (40, 700, 900, 16, 16, 64, torch.float16, (-1, -1), 0.0, True, True),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("grid", ["plain-grid", "persistent", "plain-pingpong",
                                  "persistent-pingpong", "persistent-3wg", "persistent-2q",
                                  "persistent-3wg-2q", "persistent-3wg-pingpong"])
@pytest.mark.parametrize("case", PERSISTENT_CASES,
                         ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm90_forward_grid_matches_reference(case, grid):
    # Both grids forced, each with and without ping-pong between the consumer warpgroups,
    # the persistent one also with three consumer warpgroups and/or a second Q buffer each:
    # the default (`use_persistent`, pingpong off) picks one per shape; three warpgroups
    # take their turns round robin ("3wg-pingpong"); ping-pong is checked also for the same
    # bits on every repeat (a slot refilled while a warp still read it would show as a
    # change).
    from dataclasses import replace

    d = case[5]
    flags = grid.split("-")
    if "3wg" in flags and d != 64:
        pytest.skip("three consumer warpgroups are built for d=64 only")
    if "2q" in flags and d > 128:
        pytest.skip("a second Q buffer is built for d <= 128 only")

    def configure(cfg):
        cfg = replace(cfg, persistent="persistent" in flags, pingpong="pingpong" in flags,
                      consumer_wgs=3 if "3wg" in flags else 2,
                      q_buffers=2 if "2q" in flags else 1)
        return cfg

    # (races could also change bits)
    _forward_case_matches(case, configure, bitwise=bool(
        {"pingpong"} & set(flags)))


def _forward_case_matches(case, configure, bitwise):
    """The forward of one case (`CASES` tuple) with `configure(select_config(...))`
    against the reference; bitwise: 10 repeats must give the same bits."""
    from asymflash.backends.sm90.fwd import host as fwd

    batch, sq, sk, hq, hkv, d, dtype, window, softcap, use_sink, varlen = case
    q, k, v, seq = make_inputs(batch, sq, sk, hq, hkv, d, d, dtype, varlen=varlen)
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(*window), softcap=softcap)
    sink = torch.randn(hq, device="cuda") if use_sink else None
    cfg = configure(fwd.select_config(d, d, params))
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params, sink, cfg=cfg)
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err
    if bitwise:
        first = fwd.forward(q, k, v, seq, params, sink, cfg=cfg)
        for _ in range(10):
            again = fwd.forward(q, k, v, seq, params, sink, cfg=cfg)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# Warpgroups that stop at their own last key block (FwdConfig.tail_skip: short masked calls
# by default, `fwd.default_for_call`) on both grids: every case with a right bound (d=64
# and d=128 on 64-key blocks, as fwd.SHORT_MASKED builds them), whatever its length, with 10
# bitwise repeats (the blocks a warpgroup skips are released unread: an arrival counted
# toward the wrong fill of a ring slot would race).
TAIL_SKIP_CASES = [c for c in PERSISTENT_CASES if c[7][1] >= 0]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("persistent", [False, True], ids=["plain-grid", "persistent"])
@pytest.mark.parametrize("case", TAIL_SKIP_CASES,
                         ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm90_forward_tail_skip_matches_reference(case, persistent):
    from dataclasses import replace

    from asymflash.backends.sm90.fwd import host as fwd

    d = case[5]
    _forward_case_matches(
        case, lambda cfg: replace(cfg, **fwd.SHORT_MASKED[d][1], persistent=persistent),
        bitwise=True)


# Packed documents on the plain grid in order: each CTA finds its document by searching
# cu_seqlens_q (`sched.packed_tile`: every stride-th document, then the ones between; more
# than 128 documents take both levels), the grid sized by the total rows
# (`host.packed_grid`). Lengths skewed, some empty; the packed rows start past row 0 and end
# before the tensor does (rows no sequence owns are not compared).
PACKED_DOC_CASES = [
    # (documents, seed, d, window, different key lengths)
    (300, 0, 128, (-1, 0), False),
    (129, 1, 64, (-1, -1), True),
    (130, 2, 256, (100, 50), True),
    (7, 3, 128, (-1, 0), True),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", PACKED_DOC_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm90_forward_packed_documents_find_their_tiles(case):
    from asymflash.backends.sm90.fwd import host as fwd

    docs, seed, d, window, own_keys = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv = 4, 2

    def lengths():
        lens = (torch.randn(docs, generator=g, device="cuda") * 1.2).exp() * 150
        lens = lens.int().clamp(0, 1500)
        lens[torch.randint(0, docs, (max(docs // 20, 1),), generator=g, device="cuda")] = 0
        return lens

    lens_q = lengths()
    lens_k = lengths() if own_keys else lens_q
    lead, trail = 5, 7
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"),
                      lens_q.cumsum(0).int()]) + lead
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"),
                      lens_k.cumsum(0).int()])
    seq = SeqInfo(cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), None, False)
    total_q, total_k = int(cu_q[-1]) + trail, max(int(cu_k[-1]), 1)
    q = torch.randn(total_q, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(total_k, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(total_k, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(*window))
    plan = fwd.launch_plan(d, d, seq.max_seqlen_q, seq.max_seqlen_k, False, False, *window,
                           False, False, docs, hq, hkv, 132, None)
    assert not (plan.constexprs["LPT"] or plan.constexprs["PERSISTENT"]), plan
    assert fwd.packed_grid(plan, total_q, docs, hq) == hq * (total_q // 128 + docs)
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params,
                                          q_rows=(lead, total_q - trail))
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err


# d_qk 192 / d_v <= 128 (DeepSeek-V3's MLA prefill): the 192/128 build (fwd.forward_widths),
# Q and K as a 128- and a 64-wide piece read as 64-column TMA boxes, S from two wgmmas into
# one accumulator, O staged in Q's 128-wide piece (plain grid) or in one turn-shared tile
# (persistent grid). lens: "dense", or (lens_q, lens_k) of packed sequences.
D192_CASES = [
    # (batch, sq, sk, hq, hkv, d, dv, dtype, window, softcap, sink, lens)
    (2, 1024, 1024, 8, 8, 192, 128, torch.bfloat16, (-1, -1), 0.0, False, "dense"),
    (2, 1024, 1024, 8, 8, 192, 128, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    # GQA, more keys than queries, ragged last tiles (the default takes 64-key blocks and the
    # tail skip up to 1k causal rows)
    (2, 777, 900, 8, 2, 192, 128, torch.float16, (-1, 0), 0.0, False, "dense"),
    (3, 203, 113, 4, 1, 192, 128, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    # 64 rows: the second warpgroup has none (O staged in Q: nothing stored from it)
    (4, 64, 64, 4, 1, 192, 128, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    # short GQA queries, packed (fwd.packs_gqa): a group's 8 q heads as rows of one tile
    (3, 16, 1000, 16, 2, 192, 128, torch.bfloat16, (-1, -1), 0.0, False, "dense"),
    # many tiles per CTA on the persistent grid (ring positions and Q parities carry over)
    (8, 1024, 1024, 32, 8, 192, 128, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    (2, 2048, 2048, 16, 16, 192, 128, torch.bfloat16, (-1, -1), 0.0, False, "dense"),
    # packed sequences of odd lengths, an empty key sequence
    (4, 0, 0, 4, 2, 192, 128, torch.bfloat16, (-1, 0), 0.0, False,
     ([1, 17, 113, 203], [17, 1, 203, 113])),
    (4, 0, 0, 4, 4, 192, 128, torch.bfloat16, (-1, -1), 0.0, False,
     ([203, 113, 17, 1], [113, 0, 1, 203])),
    # windows, softcap (64-key blocks: fwd.SOFTCAP_FIELDS) and a sink
    (2, 640, 900, 8, 2, 192, 128, torch.bfloat16, (100, 50), 0.0, False, "dense"),
    (2, 640, 640, 4, 4, 192, 128, torch.bfloat16, (-1, 0), 30.0, True, "dense"),
    (4, 0, 0, 4, 2, 192, 128, torch.float16, (40, 9), 15.0, True,
     ([1, 17, 113, 203], [17, 33, 203, 113])),
    # head dims run on the 192 build zero-padded: 160/128 and 136/64 through 3-D boxes that
    # zero-fill the 64-wide piece (and V), 190/126 from zero-padded copies
    (2, 640, 640, 4, 2, 160, 128, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    (2, 300, 500, 4, 4, 136, 64, torch.bfloat16, (-1, -1), 0.0, True, "dense"),
    (2, 333, 333, 2, 1, 190, 126, torch.bfloat16, (-1, 0), 0.0, False, "dense"),
    (4, 0, 0, 4, 2, 160, 128, torch.bfloat16, (-1, 0), 0.0, False,
     ([1, 17, 113, 203], [17, 1, 203, 113])),
]


def _d192_inputs(case):
    batch, sq, sk, hq, hkv, d, dv, dtype, window, softcap, use_sink, lens = case
    if lens == "dense":
        q, k, v, seq = make_inputs(batch, sq, sk, hq, hkv, d, dv, dtype)
    else:
        g = torch.Generator(device="cuda").manual_seed(sum(lens[0]) + d)
        cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda") for n in lens]
        seq = SeqInfo(cu[0], cu[1], max(lens[0]), max(lens[1]), None, False)
        tq, tk = sum(lens[0]), max(sum(lens[1]), 1)
        q = torch.randn(tq, hq, d, generator=g, device="cuda").to(dtype)
        k = torch.randn(tk, hkv, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(tk, hkv, dv, generator=g, device="cuda").to(dtype)
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(*window), softcap=softcap)
    sink = torch.randn(hq, device="cuda") if use_sink else None
    return q, k, v, seq, params, sink


def _d192_ids(c):
    return "-".join(map(str, c)).replace("torch.", "").replace(" ", "")


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("grid", ["default", "plain-grid", "persistent", "plain-pingpong",
                                  "persistent-pingpong", "tail-skip", "persistent-tail-skip"])
@pytest.mark.parametrize("case", D192_CASES, ids=_d192_ids)
def test_sm90_forward_d192_matches_reference(case, grid):
    # The default config of each call (`launch_plan`), and both grids forced, with and
    # without ping-pong, and 64-key blocks with the tail skip (fwd.SHORT_MASKED[192]): the
    # forced variants ten times more, for the same bits (a ring slot or Q piece refilled
    # while a warpgroup still read it would show as a change).
    from dataclasses import replace

    from asymflash.backends.sm90.fwd import host as fwd

    q, k, v, seq, params, sink = _d192_inputs(case)
    d, dv = case[5], case[6]
    assert fwd.forward_widths(d, dv) == (192, 128)
    flags = grid.split("-")
    cfg = None
    if grid != "default":
        if "tail" in flags and params.mask.window_right < 0:
            pytest.skip("the tail skip needs a right bound")
        cfg = replace(fwd.select_config(192, 128, params), persistent="persistent" in flags,
                      pingpong="pingpong" in flags)
        if "tail" in flags:
            cfg = replace(cfg, **fwd.SHORT_MASKED[192][1])
    before = [t.clone() for t in (q, k, v)]
    out_err, lse_err, tol = check_forward(fwd, q, k, v, seq, params, sink, cfg=cfg)
    assert out_err <= tol, (out_err, tol)
    assert lse_err <= 1e-3, lse_err
    out, lse = fwd.forward(q, k, v, seq, params, sink, cfg=cfg)
    assert out.shape == (q.shape[0], q.shape[1], dv) and out.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))  # inputs untouched
    if cfg is not None:
        for _ in range(10):
            again = fwd.forward(q, k, v, seq, params, sink, cfg=cfg)
            assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_forward_d192_through_the_api(causal):
    """flash_attn_func with DeepSeek-V3's head dims (192/128) on the sm90 backend: the
    planned call (`forward_runner`, a bound launch from the third call) against the
    reference, strided q and k (views of one buffer, as a fused projection leaves them)."""
    from helpers import assert_fa_close, reference_pair

    from asymflash import flash_attn_func
    from asymflash.runtime.dispatch import use_backend

    torch.manual_seed(192 + causal)
    qk = torch.randn(2, 1000, 2, 8, 192, device="cuda", dtype=torch.bfloat16)
    q, k = qk.unbind(2)
    v = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    out32, outlow = (r[0] for r in reference_pair(q, k, v, None, causal=causal))
    with use_backend("sm90"):
        for _ in range(3):
            out = flash_attn_func(q, k, v, causal=causal)
            assert out.shape == (2, 1000, 8, 128)
            assert_fa_close("out", out, out32, outlow, atol=2e-3)
