"""The models suite of the benchmark (`bench --suite models`) on the CPU, at its smoke sizes.

What is checked: the cases' shapes and published head counts survive the smoke scaling, the
document-length draw (fixed, capped, summing to the tokens), the FLOP counts against the
masks, the suite's reference against an independent whole-matrix computation, the paged
inputs against the contiguous cache, the correctness gate on a case (a provider wrong in
one layer or one document is WRONG), the whole suite run by the CLI on the CPU path, and
the report's table, JSON and merge.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch

from asymflash.bench import cli as bench
from asymflash.bench import model_calls
from asymflash.bench.core import NA, OK, WRONG, Provider, attention_flops, cpu_timer
from asymflash.bench.models import (
    ModelRunner,
    doc_lengths,
    make_model_inputs,
    model_reference,
    models_suite,
    select_cases,
    window_pairs,
)
from asymflash.core.masks import allowed, normalize_window
from asymflash.reference import attention_ref

SUITE = models_suite()
SMOKE = [c.smoke() for c in SUITE]


def _case(prefix):
    return select_cases(SMOKE, [prefix])[0]


def test_suite_covers_every_kind_with_published_heads():
    kinds = {c.kind for c in SUITE}
    assert kinds == {"dense", "varlen", "hybrid", "decode"}
    by_name = {c.name: c for c in SUITE}
    mla = by_name["mla-prefill-deepseek-v3"]
    assert (mla.nheads, mla.hdim, mla.hdim_v) == (128, 192, 128)
    assert by_name["long-128k-llama3-8b"].seqlen_q == 131072
    assert (by_name["train-8k-llama3-70b"].nheads, by_name["train-8k-llama3-70b"].nheads_kv) \
        == (64, 8)
    assert by_name["swa-4k-mistral-7b"].window == (4095, 0)
    assert by_name["softcap-gemma2-9b"].softcap == 50.0
    assert not by_name["vit-l16-4k"].causal and by_name["vit-l16-4k"].hdim == 64
    decode = [c for c in SUITE if c.kind == "decode"]
    assert {c.batch for c in decode} == {8, 32}
    assert {bool(c.page_size) for c in decode} == {True, False}
    assert len({c.name for c in SUITE}) == len(SUITE)


def test_smoke_scaling_keeps_the_kind_dims_and_gqa():
    for full, small in zip(SUITE, SMOKE):
        assert small.kind == full.kind and small.name == full.name + "-smoke"
        assert (small.hdim, small.hdim_v, small.causal, small.softcap) == \
            (full.hdim, full.hdim_v, full.causal, full.softcap)
        assert small.nheads // small.nheads_kv == min(4, full.nheads // full.nheads_kv)
        assert small.seqlen_k <= 96 and small.dtype == "fp32"
        if full.window[0] >= 0:  # the window keeps its share of the context
            share = full.window[0] / full.seqlen_k
            assert abs(small.window[0] / small.seqlen_k - share) < 0.02
        if full.kind == "varlen":
            assert sum(small.doc_lens) == small.seqlen_q and len(small.doc_lens) > 3
        if full.kind == "decode":
            assert max(small.cache_lens) == small.seqlen_k and min(small.cache_lens) >= 1


def test_doc_lengths_fixed_capped_and_skewed():
    lens = doc_lengths(65536, 8192, 1024, 1.2, seed=0)
    assert lens == doc_lengths(65536, 8192, 1024, 1.2, seed=0)
    assert lens != doc_lengths(65536, 8192, 1024, 1.2, seed=1)
    assert sum(lens) == 65536 and max(lens) <= 8192 and min(lens) >= 1
    body = sorted(lens[:-1])  # the last one is cut to fit
    median = body[len(body) // 2]
    assert 400 < median < 2600  # log-normal with median 1024
    assert max(body) > 4 * median  # heavy tail: some documents far above the median
    assert SUITE[0].doc_lens == doc_lengths(65536, 8192, 1024, 1.2, seed=0)


def _mask_pairs(sq, sk, causal, window):
    return allowed(sq, sk, normalize_window(causal, window)).sum().item()


@pytest.mark.parametrize("sq,sk,window", [(40, 40, (5, 0)), (30, 50, (7, 3)),
                                          (50, 30, (4, -1)), (33, 33, (-1, 2))])
def test_window_pairs_count_the_mask(sq, sk, window):
    assert window_pairs(sq, sk, *window) == _mask_pairs(sq, sk, False, window)


def test_flops_of_each_kind_follow_its_masks():
    swa = _case("swa")
    want = _mask_pairs(swa.seqlen_q, swa.seqlen_k, True, swa.window)
    assert swa.pairs() == want
    hybrid = _case("hybrid")
    local = _mask_pairs(hybrid.seqlen_q, hybrid.seqlen_k, True, hybrid.window)
    full = hybrid.seqlen_q * hybrid.seqlen_k / 2  # the grid's causal convention
    assert hybrid.pairs() == hybrid.local_per_global * local + full
    varlen = _case("varlen")
    assert varlen.pairs() == sum(n * n / 2 for n in varlen.doc_lens)
    decode = _case("decode-b8")
    per_token = 2 * decode.nheads * (decode.hdim + decode.hdim_v)
    assert attention_flops(decode, "fwd") == per_token * sum(decode.cache_lens)
    assert decode.modes == ("fwd",)
    per_key = decode.nheads_kv * (decode.hdim + decode.hdim_v) * 4  # fp32 at smoke size
    assert decode.kv_bytes() == per_key * sum(decode.cache_lens)
    assert varlen.kv_bytes() is None


def _masked_whole(q, k, v, ok, softcap=0.0):
    """Attention over a whole packed sequence with an explicit (sq, sk) mask, in fp64: an
    independent computation of what the suite's reference assembles piece by piece."""
    group = q.shape[-2] // k.shape[-2]
    k, v = (t.double().repeat_interleave(group, dim=-2) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def test_varlen_reference_is_block_diagonal_causal():
    case = _case("varlen")
    inputs = make_model_inputs(case, "cpu")
    ref = model_reference(attention_ref, inputs, case, with_grads=True)
    doc = torch.repeat_interleave(torch.arange(len(case.doc_lens)),
                                  torch.tensor(case.doc_lens))
    pos = torch.arange(case.seqlen_q)
    ok = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    want = _masked_whole(inputs.q, inputs.k, inputs.v, ok)
    torch.testing.assert_close(ref.out.double(), want, atol=1e-5, rtol=1e-5)
    assert ref.grads[0].shape == inputs.q.shape and ref.grads[0].abs().sum() > 0


def test_hybrid_reference_stacks_local_and_global_layers():
    case = _case("hybrid")
    inputs = make_model_inputs(case, "cpu")
    ref = model_reference(attention_ref, inputs, case, with_grads=False)
    assert ref.out.shape == case.out_shape == (6, 1, 96, 2, 256)
    q, k, v = (t[0] for t in (inputs.q, inputs.k, inputs.v))
    pos = torch.arange(96)
    causal = pos[None, :] <= pos[:, None]
    local = causal & (pos[None, :] >= pos[:, None] - case.window[0])
    torch.testing.assert_close(ref.out[0, 0].double(), _masked_whole(q, k, v, local),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.out[-1, 0].double(), _masked_whole(q, k, v, causal),
                               atol=1e-5, rtol=1e-5)
    assert (ref.out[0] - ref.out[-1]).abs().max() > 1e-2  # the window changes the result


def test_softcap_reference_caps_the_scores():
    case = _case("softcap")
    case = dataclasses.replace(case, softcap=0.5)  # small enough to change the result
    inputs = make_model_inputs(case, "cpu")
    ref = model_reference(attention_ref, inputs, case, with_grads=False)
    q, k, v = (t[1] for t in (inputs.q, inputs.k, inputs.v))
    pos = torch.arange(case.seqlen_q)
    ok = pos[None, :] <= pos[:, None]
    torch.testing.assert_close(ref.out[1].double(), _masked_whole(q, k, v, ok, 0.5),
                               atol=1e-5, rtol=1e-5)


def test_paged_inputs_hold_the_contiguous_cache():
    case = _case("decode-paged-b32")
    inputs = make_model_inputs(case, "cpu")
    table, kp = inputs.aux["page_table"], inputs.aux["k_paged"]
    ps = case.page_size
    assert table.dtype == torch.int32 and sorted(table.flatten().tolist()) == \
        list(range(table.numel()))
    assert table.flatten().tolist() != list(range(table.numel()))  # shuffled
    for b in range(case.batch):
        for j in (0, case.seqlen_k - 1, 17):
            torch.testing.assert_close(kp[table[b, j // ps], j % ps], inputs.k[b, j])
    ref = model_reference(attention_ref, inputs, case, with_grads=True)
    assert ref.grads is None  # decode: forward only
    b, n = 1, case.cache_lens[1]
    want, _ = attention_ref(inputs.q[b:b + 1], inputs.k[b:b + 1, :n], inputs.v[b:b + 1, :n])
    torch.testing.assert_close(ref.out[b:b + 1], want)


# --------------------------------------------------------------------------------------------
# The correctness gate and the run


def _ref_model(wrong=None):
    """A provider computing each case with the reference itself; `wrong` spoils one part."""
    def make_model(case, inputs, q, k, v):
        def fn():
            if case.kind == "hybrid":
                outs = [attention_ref(q, k, v, causal=case.causal, window_size=w)[0]
                        for w in case.layer_windows]
                if wrong == "layer":  # the first local layer without its window
                    outs[0] = attention_ref(q, k, v, causal=case.causal)[0]
                return torch.stack(outs)
            if case.kind == "varlen":
                cu = inputs.aux["cu_seqlens"].tolist()
                outs = [attention_ref(q[a:b][None], k[a:b][None], v[a:b][None],
                                      causal=case.causal)[0][0] for a, b in zip(cu, cu[1:])]
                if wrong == "doc":  # the last two documents attend to each other
                    a = cu[-3]
                    outs[-2:] = [attention_ref(q[a:][None], k[a:][None], v[a:][None],
                                               causal=True)[0][0]]
                return torch.cat(outs)
            raise NotImplementedError("only varlen and hybrid here")
        return fn
    return make_model


def _runner(*providers):
    return ModelRunner(list(providers), ("fwd", "bwd"), cpu_timer(reps=1, warmup=0), "cpu",
                       attention_ref)


def _status(results, provider, mode="fwd"):
    return next(r for r in results if r.provider == provider and r.mode == mode)


def test_gate_flags_a_wrong_layer_or_document():
    good = Provider("good", None, make_model=_ref_model())
    bad_layer = Provider("bad", None, make_model=_ref_model("layer"))
    bad_doc = Provider("baddoc", None, make_model=_ref_model("doc"))
    runner = _runner(good, bad_layer, bad_doc)
    hybrid = runner.run_case(_case("hybrid"))
    assert _status(hybrid, "good").status == OK and _status(hybrid, "good", "bwd").status == OK
    assert _status(hybrid, "bad").status == WRONG
    assert _status(hybrid, "bad").ms is None
    varlen = runner.run_case(_case("varlen"))
    assert _status(varlen, "good").status == OK
    assert _status(varlen, "baddoc").status == WRONG
    assert "out err" in _status(varlen, "baddoc").reason
    dense = runner.run_case(_case("vit"))
    assert _status(dense, "good").status == NA  # raised NotImplementedError


def test_grid_only_provider_is_na_in_the_suite():
    grid_only = Provider("gridonly", lambda q, k, v, causal: None)
    results = _runner(grid_only).run_case(_case("vit"))
    assert {r.status for r in results} == {NA}
    assert "not in the models suite" in results[0].reason


def test_flex_mask_mod_matches_the_reference_masks():
    """The Flex peer's mask_mod (documents, windows, decode lengths) over every index pair
    equals the masks the reference uses."""
    swa = _case("swa")
    mask = model_calls._mask_mod(swa, swa.window)
    i, j = torch.meshgrid(torch.arange(96), torch.arange(96), indexing="ij")
    assert torch.equal(mask(0, 0, i, j), allowed(96, 96, normalize_window(True, swa.window)))
    varlen = _case("varlen")
    doc = model_calls._doc_ids(varlen, "cpu")
    got = model_calls._mask_mod(varlen, varlen.window, doc)(0, 0, i, j)
    assert torch.equal(got, (doc[i] == doc[j]) & (j <= i))
    dec = _case("decode-b8")
    lens = torch.tensor(dec.cache_lens)
    kv = torch.arange(dec.seqlen_k)
    for b, n in enumerate(dec.cache_lens):
        got = model_calls._mask_mod(dec, dec.window, lens=lens)(b, 0, torch.tensor(0), kv)
        assert got.sum().item() == n and bool(got[:n].all())


def test_cli_runs_the_whole_suite_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    code = bench.main(["--suite", "models", "--out", str(out), "--no-plots",
                       "--providers", "asymflash-cpu", "--mode", "fwd,bwd"])
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    assert record["suite"] == "models"
    cells = record["results"]
    assert {c["name"] for c in cells} == {c.name for c in SMOKE}
    for c in cells:
        decode_bwd = c["kind"] == "decode" and c["mode"] == "bwd"
        assert c["status"] == (NA if decode_bwd else OK), (c["name"], c["mode"], c["reason"])
        if not decode_bwd:
            assert c["errors"]["out"]["max_abs_err"] <= c["errors"]["out"]["bound"]
        if c["kind"] == "decode" and c["status"] == OK:
            assert c["kv_gb_per_s"] > 0
    markdown = (out / "results.md").read_text()
    assert "| case | shape |" in markdown and "hybrid-gemma3-12b-smoke" in markdown
    merged = tmp_path / "merged"
    assert bench.main(["--merge", str(out), "--out", str(merged), "--no-plots"]) == 0
    again = json.loads((merged / "results.json").read_text())["results"]
    assert [(c["name"], c["mode"], c["status"]) for c in again] == \
        [(c["name"], c["mode"], c["status"]) for c in cells]
    assert again[0]["doc_lens"] == cells[0]["doc_lens"]


def test_cli_case_selection_and_refusals(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--suite", "models", "--list-cases", "--case", "decode"]) == 0
    listed = capsys.readouterr().out.split("\n")
    assert sum(1 for line in listed if line.startswith("decode-")) == 4
    for argv, message in ((["--suite", "models", "--hdim", "64"], "--hdim"),
                          (["--suite", "models", "--case", "nope"], "unknown case"),
                          (["--list-cases"], "--suite models")):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_flex_peer_passes_the_check_on_every_kind_it_expresses():
    """The Flex peer's calls (block masks for documents, windows and cache lengths, the
    softcap score_mod) run eagerly on the CPU and pass the suite's check, forward."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = Provider("flex-eager", None, make_model=model_calls.flex(lambda: flex_attention))
    runner = ModelRunner([flex], ("fwd",), cpu_timer(reps=1, warmup=0), "cpu", attention_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        results = [r for name in ("varlen", "swa", "softcap", "decode-b8", "decode-paged-b8")
                   for r in runner.run_case(_case(name))]
    for r in results:
        want = NA if r.case.page_size else OK
        assert r.status == want, (r.case.name, r.reason)


def test_models_suite_defaults_to_forward_and_training_step(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    assert bench.main(["--suite", "models", "--case", "vit", "--out", str(out), "--no-plots",
                       "--providers", "asymflash-cpu"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["modes"] == ["fwd", "fwdbwd"]
    assert {(c["mode"], c["status"]) for c in record["results"]} == {("fwd", OK),
                                                                     ("fwdbwd", OK)}
