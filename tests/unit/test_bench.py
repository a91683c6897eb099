"""The benchmark harness on the CPU, with fake providers: no kernel is needed.

What is checked: FLOP counts (causal, GQA, dv != d), the correctness gate (a wrong forward or
backward is flagged WRONG and never timed or counted in the ratio), the listing of missing
and failing providers, the table / JSON / PNG outputs, and the CPU fallback of the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import sys

import pytest
import torch

from asymflash.bench import cli as bench
from asymflash.bench import providers as bench_providers
from asymflash.bench import report as bench_report
from asymflash.bench.core import (
    ERROR,
    NA,
    OK,
    WRONG,
    Case,
    Provider,
    Result,
    attention_flops,
    chunked_attention,
    visible_pairs,
)
from asymflash.reference import attention_ref

# The charts need the `bench` extra; without it the bench writes tables and JSON only.
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

SMALL = Case(batch=2, seqlen_q=64, seqlen_k=64, nheads=4, nheads_kv=2, hdim=32, hdim_v=32,
             causal=True, dtype="bf16")


# --------------------------------------------------------------------------------------------
# FLOPs


def test_flops_noncausal_is_4bhssd():
    case = Case(2, 128, 128, 4, 4, 64, 64, False)
    assert attention_flops(case, "fwd") == 4 * 2 * 4 * 128 * 128 * 64


def test_flops_causal_square_is_half_and_modes_scale():
    dense = Case(2, 128, 128, 4, 4, 64, 64, False)
    causal = Case(2, 128, 128, 4, 4, 64, 64, True)
    assert attention_flops(causal, "fwd") == attention_flops(dense, "fwd") / 2
    assert attention_flops(causal, "bwd") == 2.5 * attention_flops(causal, "fwd")
    assert attention_flops(causal, "fwdbwd") == 3.5 * attention_flops(causal, "fwd")


def test_flops_gqa_counts_query_heads():
    mha = Case(1, 256, 256, 8, 8, 128, 128, False)
    gqa = Case(1, 256, 256, 8, 2, 128, 128, False)
    assert attention_flops(gqa, "fwd") == attention_flops(mha, "fwd")


def test_flops_dv_differs_from_d():
    case = Case(1, 64, 64, 2, 2, 192, 128, False)
    assert attention_flops(case, "fwd") == 2 * 1 * 2 * 64 * 64 * (192 + 128)


def test_causal_pairs_rectangular_are_bottom_right():
    # 2 queries, 4 keys: query 0 sits at key 2 (sees 3), query 1 at key 3 (sees 4).
    assert visible_pairs(2, 4, True) == 7
    # 4 queries, 2 keys: queries 0 and 1 see nothing, then 1 and 2 keys.
    assert visible_pairs(4, 2, True) == 3
    assert visible_pairs(3, 5, False) == 15


# --------------------------------------------------------------------------------------------
# The chunked reference


@pytest.mark.parametrize("sq,sk,causal", [(50, 50, True), (30, 70, True), (40, 40, False)])
def test_chunked_reference_matches_whole(sq, sk, causal):
    torch.manual_seed(0)
    q = torch.randn(1, sq, 2, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, sk, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, sk, 2, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, sq, 2, 8, dtype=torch.float64)

    def ref64(q, k, v, causal, upcast):
        return attention_ref(q, k, v, causal=causal, upcast=upcast,
                             compute_dtype=torch.float64)

    whole = ref64(q, k, v, causal, True)[0]
    whole_grads = torch.autograd.grad(whole, (q, k, v), dout)
    # max_elems forces blocks of 7 query rows (7 * sk * 2 heads elements).
    part = chunked_attention(ref64, q, k, v, causal, True, dout=dout, max_elems=7 * sk * 2)
    torch.testing.assert_close(part, whole.detach())
    for got, want in zip((q.grad, k.grad, v.grad), whole_grads):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------------
# Fake providers


def _correct(q, k, v, causal):
    return lambda: attention_ref(q, k, v, causal=causal)[0].to(q.dtype)


class _DoubleGrad(torch.autograd.Function):
    """Identity forward, doubled gradient: right forward, wrong backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def fake(name, make_fwd=_correct, available=lambda: None, asym=False):
    return Provider(name, make_fwd, available, is_asymflash=asym, description="fake")


def _wrong_forward(q, k, v, causal):
    return lambda: attention_ref(q, k, v, causal=not causal)[0].to(q.dtype)


def _wrong_backward(q, k, v, causal):
    return lambda: _DoubleGrad.apply(attention_ref(q, k, v, causal=causal)[0].to(q.dtype))


def _wrong_shape(q, k, v, causal):
    return lambda: attention_ref(q, k, v, causal=causal)[0][:, :-1].to(q.dtype)


def _wrong_in_last_head_of_last_sequence(q, k, v, causal):
    """Right everywhere but one head of one batch entry: a check of a slice would miss it."""
    def fn():
        out = attention_ref(q, k, v, causal=causal)[0].to(q.dtype)
        bug = torch.zeros_like(out)
        bug[-1, :, -1] = 1.0
        return out + bug
    return fn


def _wrong_when_repeated(q, k, v, causal):
    """Right on its first call only, as a stale call plan or a badly bound launch would be."""
    calls = []

    def fn():
        calls.append(1)
        return attention_ref(q, k, v, causal=causal and len(calls) == 1)[0].to(q.dtype)
    return fn


def _raises(q, k, v, causal):
    raise RuntimeError("kernel exploded\nsecond line of the traceback text")


def _not_implemented(q, k, v, causal):
    raise NotImplementedError("hdim 32 unsupported")


def _fixed_timer(ms):
    """Calls the function like a real timer would, returns a fixed time."""

    def timer(fn, grad_to_none):
        for _ in range(2):
            for t in grad_to_none:
                t.grad = None
            fn()
        return ms

    return timer


def _run(providers, modes=("fwd", "bwd"), cases=(SMALL,), ms=2.0):
    result = bench.run(list(cases), providers, modes, "cpu", _fixed_timer(ms), attention_ref)
    return result, {(r.provider, r.mode): r for r in result.results}


def test_correct_provider_is_timed_with_flops():
    _, cells = _run([fake("good")])
    for mode in ("fwd", "bwd"):
        r = cells[("good", mode)]
        assert r.status == OK, r.reason
        assert r.ms == 2.0
        assert r.tflops == pytest.approx(attention_flops(SMALL, mode) / 2e-3 / 1e12)
        assert all(err <= bound for err, bound in r.errors.values())
    assert set(cells[("good", "bwd")].errors) == {"out", "dq", "dk", "dv"}


def test_wrong_results_are_flagged_and_not_timed():
    _, cells = _run([fake("fwd-bug", _wrong_forward), fake("bwd-bug", _wrong_backward),
                     fake("shape-bug", _wrong_shape)])
    assert cells[("fwd-bug", "fwd")].status == WRONG
    assert "out err" in cells[("fwd-bug", "fwd")].reason
    assert cells[("bwd-bug", "fwd")].status == OK  # its forward is right
    bwd = cells[("bwd-bug", "bwd")]
    assert bwd.status == WRONG and "dq" in bwd.reason
    assert "shape" in cells[("shape-bug", "fwd")].reason
    for key, r in cells.items():
        if r.status == WRONG:
            assert r.ms is None and r.tflops is None, key


def test_every_batch_and_head_is_checked():
    _, cells = _run([fake("last-head-bug", _wrong_in_last_head_of_last_sequence)],
                    modes=("fwd",))
    assert cells[("last-head-bug", "fwd")].status == WRONG


def test_the_repeated_call_is_checked_too():
    """The timed calls are repeated calls: a provider right only on its first call is
    WRONG (SMALL is causal, so the repeated call's non-causal output differs)."""
    _, cells = _run([fake("stale-repeat", _wrong_when_repeated)], modes=("fwd",))
    r = cells[("stale-repeat", "fwd")]
    assert r.status == WRONG and r.reason.startswith("repeated call")


def test_missing_and_failing_providers_are_listed_not_dropped():
    _, cells = _run([fake("missing", available=lambda: "No module named 'peer'"),
                     fake("broken-probe", available=lambda: 1 / 0),
                     fake("raises", _raises), fake("cannot", _not_implemented)])
    assert len(cells) == 8
    assert cells[("missing", "fwd")].status == NA
    assert cells[("missing", "bwd")].reason == "No module named 'peer'"
    assert cells[("broken-probe", "fwd")].status == NA
    assert "ZeroDivisionError" in cells[("broken-probe", "fwd")].reason
    assert cells[("raises", "fwd")].status == ERROR
    assert cells[("raises", "fwd")].reason == "RuntimeError: kernel exploded"
    assert cells[("cannot", "bwd")].status == NA
    assert "hdim 32" in cells[("cannot", "bwd")].reason


def test_backward_is_timed_without_the_forward():
    calls = {"fwd": 0}

    def counting(q, k, v, causal):
        inner = _correct(q, k, v, causal)

        def fwd():
            calls["fwd"] += 1
            return inner()

        return fwd

    timed = {}

    def timer(fn, grad_to_none):
        before = calls["fwd"]
        for _ in range(3):
            fn()
        timed["fwd_calls"] = calls["fwd"] - before
        timed["grads"] = len(grad_to_none)
        return 1.0

    bench.run([SMALL], [fake("counting", counting)], ("bwd",), "cpu", timer, attention_ref)
    assert timed == {"fwd_calls": 0, "grads": 3}


def test_ratio_ignores_wrong_peers():
    # A wrong peer has no time, so it can never become the best peer.
    result, _ = _run([fake("peer"), fake("fast-but-wrong", _wrong_forward),
                      fake("asymflash-x", asym=True)], modes=("fwd",))
    assert {r.provider: r.status for r in result.results}["fast-but-wrong"] == WRONG
    rt = bench_report.ratio(result.results, {"asymflash-x"})
    assert rt.peer == "peer" and rt.asymflash == "asymflash-x"
    assert rt.value == pytest.approx(1.0)


def test_ratio_reports_the_headline_provider_not_our_best_variant():
    """An opt-in variant that beats the default must not lift the ratio: it reports what
    flash_attn_func runs by default (the headline provider)."""
    def timed(ms):
        return Result(SMALL, "fwd", "", OK, ms=ms, tflops=10.0 / ms)
    cells = [dataclasses.replace(timed(1.0), provider="peer"),
             dataclasses.replace(timed(2.0), provider="asymflash-default"),
             dataclasses.replace(timed(0.5), provider="asymflash-variant")]
    ours = {"asymflash-default", "asymflash-variant"}
    rt = bench_report.ratio(cells, ours, headline="asymflash-default")
    assert rt.asymflash == "asymflash-default" and rt.value == pytest.approx(0.5)
    assert bench_report.ratio(cells, ours).value == pytest.approx(2.0)  # no headline: best
    md = bench_report.markdown_report(cells, ours, "t", headline="asymflash-default")
    assert "0.50 vs peer" in md


# --------------------------------------------------------------------------------------------
# Reports


def _mixed_run():
    cases = [Case(1, s, s, 2, 2, 32, 32, c, "bf16") for c in (False, True) for s in (32, 64)]
    providers = [fake("peer"), fake("missing", available=lambda: "not installed"),
                 fake("raises", _raises), fake("wrong", _wrong_forward),
                 fake("asymflash-fake", asym=True)]
    return bench.run(cases, providers, ("fwd", "bwd"), "cpu", _fixed_timer(1.0), attention_ref)


def test_markdown_table_has_a_row_per_case_and_a_column_per_provider():
    result = _mixed_run()
    md = bench_report.markdown_report(result.results, {"asymflash-fake"}, "test")
    fwd = md.split("### fwd")[1].split("### bwd")[0]
    rows = [ln for ln in fwd.splitlines() if ln.startswith("| 32 ")]
    assert len(rows) == 4
    header = next(ln for ln in fwd.splitlines() if ln.startswith("| hdim"))
    for name in ("peer", "missing", "raises", "wrong", "asymflash-fake", "best peer"):
        assert name in header
    assert "| n/a |" in rows[0] and "| error |" in rows[0] and "| WRONG |" in rows[0]
    assert "1.00 vs peer" in rows[0]
    assert "- missing: n/a (not installed) -- all cells" in md
    assert "- raises: error (RuntimeError: kernel exploded) -- all cells" in md


def test_outputs_json_and_png(tmp_path):
    result = _mixed_run()
    env = bench_report.collect_env("cpu", "python -m asymflash bench --test")
    md = bench.write_outputs(tmp_path, result, env, {"argv": ["--test"]})
    assert (tmp_path / "results.md").read_text() == md
    record = json.loads((tmp_path / "results.json").read_text())
    for key in ("date", "command", "device", "torch", "triton", "cudnn", "flash_attn"):
        assert key in record["env"]
    digest = record["env"]["asymflash_source_sha256"]
    assert len(digest) == 12 and int(digest, 16) >= 0 and digest == bench_report.source_digest()
    assert record["argv"] == ["--test"]
    assert len(record["results"]) == 4 * 5 * 2
    statuses = {r["provider"]: r["status"] for r in record["results"]}
    assert statuses == {"peer": OK, "missing": NA, "raises": ERROR, "wrong": WRONG,
                        "asymflash-fake": OK}
    first = record["results"][0]
    assert first["flops"] == attention_flops(result.cases[0], first["mode"])
    assert {p["name"]: p["unavailable"] for p in record["providers"]}["missing"] == \
        "not installed"
    assert all(r["ratio"] == pytest.approx(1.0) for r in record["ratios"])
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    wanted = [f"{m}_hdim32_causal{c}.png" for m in ("bwd", "fwd") for c in (0, 1)]
    assert pngs == (wanted if HAS_MATPLOTLIB else [])
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_record_has_no_inf_or_nan():
    bad = Result(SMALL, "fwd", "shape-bug", WRONG, errors={"out": (math.inf, 0.0),
                                                           "dq": (math.nan, 1.0)})
    text = json.dumps(bench_report.result_record(bad, 1.0), allow_nan=False)
    assert '"max_abs_err": "inf"' in text and '"max_abs_err": "nan"' in text


def test_host_bound_cells_are_named_and_kept_through_json():
    slow_host = Result(SMALL, "bwd", "ours", OK, ms=0.5, tflops=1.0, host_us=480.0)
    gpu_bound = Result(SMALL, "fwd", "ours", OK, ms=0.5, tflops=1.0, host_us=120.0)
    untimed = Result(SMALL, "fwd", "peer", OK, ms=0.5, tflops=1.0)
    notes = bench_report.host_bound_notes([slow_host, gpu_bound, untimed])
    assert notes == [f"- ours: {SMALL.label} bwd (480 of 500 us)"]
    md = bench_report.markdown_report([slow_host, gpu_bound, untimed], {"ours"}, "t")
    assert "Host-bound cells" in md and "480 of 500 us" in md
    rec = json.loads(json.dumps(bench_report.result_record(slow_host, 1.0)))
    assert rec["host_us"] == 480.0
    assert bench._result_from_record(rec).host_us == 480.0


def test_device_slug():
    assert bench_report.device_slug("NVIDIA H200") == "h200"
    assert bench_report.device_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"


# --------------------------------------------------------------------------------------------
# Command line


def test_grid_defaults_follow_the_papers():
    args = bench.build_parser().parse_args([])
    cases = bench.build_cases(bench.resolve_grid(args, cuda=True))
    assert len(cases) == 3 * 2 * 6
    for c in cases:
        assert c.nheads * c.hdim == 2048 and c.batch * c.seqlen_q == 16384
        assert c.dtype == "bf16" and c.nheads_kv == c.nheads
    assert [c.seqlen_q for c in cases[:6]] == [512, 1024, 2048, 4096, 8192, 16384]


def test_grid_options():
    args = bench.build_parser().parse_args(
        ["--quick", "--seqlen", "2k", "--causal", "1", "--nheads", "16", "--nheads-kv", "4",
         "--mode", "fwd,fwdbwd", "--dtype", "fp16"])
    cases = bench.build_cases(bench.resolve_grid(args, cuda=True))
    assert args.mode == ("fwd", "fwdbwd")
    assert [(c.hdim, c.seqlen_q, c.causal, c.nheads, c.nheads_kv, c.batch, c.dtype)
            for c in cases] == [(64, 2048, True, 16, 4, 8, "fp16"),
                                (128, 2048, True, 16, 4, 8, "fp16")]


def test_seqlen_k_option_for_decode_like_cases():
    args = bench.build_parser().parse_args(
        ["--hdim", "128", "--seqlen", "1,17", "--seqlen-k", "4k", "--batch", "3", "--causal",
         "0", "--nheads", "32", "--nheads-kv", "4"])
    cases = bench.build_cases(bench.resolve_grid(args, cuda=True))
    assert [(c.seqlen_q, c.seqlen_k, c.batch) for c in cases] == [(1, 4096, 3), (17, 4096, 3)]


@pytest.mark.parametrize("argv", [["--nheads", "6", "--nheads-kv", "4"],
                                  ["--providers", "no-such-peer"], ["--mode", "sideways"],
                                  ["--causal", "maybe"]])
def test_bad_arguments_exit_2(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2


def test_provider_selection_keeps_column_order():
    providers = [fake("FA2"), fake("cuDNN"), fake("asymflash-a", asym=True),
                 fake("asymflash-b", asym=True)]
    names = [p.name for p in bench_providers.select(providers, ["asymflash", "fa2"])]
    assert names == ["FA2", "asymflash-a", "asymflash-b"]


def test_opt_in_providers_run_only_when_named(monkeypatch):
    import dataclasses

    variant = dataclasses.replace(fake("asymflash-v", asym=True), opt_in=True)
    providers = [fake("FA2"), fake("asymflash-a", asym=True), variant]
    for names in (None, ["asymflash"]):
        assert variant not in bench_providers.select(providers, names)
    assert bench_providers.select(providers, ["asymflash-v"]) == [variant]


def test_fa4_trick_providers_switch_the_forward_on_and_off(monkeypatch):
    import os

    from asymflash.runtime import dispatch
    monkeypatch.setattr(dispatch, "backend_names", lambda device: ["sm90", "portable"])
    monkeypatch.delenv("ASYMFLASH_SM90_EXP2_EMU", raising=False)
    by_name = {p.name: p for p in bench_providers.asymflash_providers("cuda")}
    emu = by_name["asymflash-sm90-exp2emu8"]
    assert emu.opt_in and emu.modes == ("fwd",)
    monkeypatch.setattr(dispatch, "use_backend", lambda name: contextlib.nullcontext())
    with emu.context():
        assert os.environ["ASYMFLASH_SM90_EXP2_EMU"] == "8"
    assert "ASYMFLASH_SM90_EXP2_EMU" not in os.environ


def test_progress_without_tqdm_counts_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    stream = io.StringIO()
    progress = bench.Progress(2, stream=stream)
    progress("a")
    progress("b")
    progress.close()
    assert stream.getvalue() == "[1/2] a\n[2/2] b\n"


def test_cli_without_cuda_runs_the_cpu_comparison(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = bench.main(["--hdim", "32", "--seqlen", "64", "--causal", "1",
                       "--providers", "SDPA-math", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "CUDA is not available" in err
    assert "| 32 | 1 | 64 | 2 | 4 |" in out
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["env"]["device"] == "cpu"
    assert {r["status"] for r in record["results"]} == {OK}
    assert all(math.isfinite(r["tflops"]) for r in record["results"])
    assert len(list(tmp_path.glob("*.png"))) == (2 if HAS_MATPLOTLIB else 0)
    assert HAS_MATPLOTLIB or "matplotlib is not installed" in err
