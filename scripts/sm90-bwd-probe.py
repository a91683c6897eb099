"""Correctness and speed of the sm90 Gluon backward on one H200, beside cuDNN and portable.

    PYTHONPATH=. python3 scripts/sm90-bwd-probe.py [--full] [--budget SECONDS]

1. correctness: cases of tests/gpu/test_sm90_bwd_gpu.py against the fp32 reference gradients
   (FA rule), each in its own process, all in parallel; the same time, one process per
   (head dim, causal) compiles the kernels the timing needs (the on-disk Triton cache
   carries them over);
2. timing: bf16, model dim 2048 (nheads = 2048 / d), batch = 16384 / seqlen, d = 64/128/256,
   causal 0/1, seqlen 1k/4k/16k; TFLOP/s of the backward (FLOPs = 2.5 · 4·b·h·s²·d, halved
   when causal) for ours (preprocess + main kernel + dQ postprocess), asymflash's portable
   backward and torch SDPA cuDNN (autograd.grad of its output). Every timed cell first checks
   ours against the portable gradients (max error relative to the largest gradient).

--heads Q:KV (e.g. 64:8, Llama-3-70B's GQA) and --tokens N (batch · seqlen) set the timed
shape's heads and size in place of model dim 2048 over 16k tokens.
--dims / --seqlens / --causal narrow the timed grid (a dims token D/DV times a head dim of V
apart, e.g. --dims 192/128: DeepSeek-V3's MLA shape); --set FIELD=VALUE times a BwdConfig variant.
--variant NAME:FIELD=VALUE,... adds a column timing ours with those BwdConfig fields (and
`deterministic`) changed from the config the call's dispatch picks, in the same process as
the default; --no-peers skips the portable and cuDNN timings (portable still computes the
reference gradients).
Every step runs in a child process: a crash (illegal address, hang) costs its cell, never
the table. The whole probe stays within --budget seconds (default 55).
Prints a compact table; writes JSON to $OUT/sm90-bwd-probe.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import ensure_pytest  # noqa: E402

DIMS = (64, 128, 256)
SEQLENS = (1024, 4096, 16384)
CELL_TIMEOUT = 12.0  # seconds one timed cell may take (16k d=256 portable: the slowest)
START_TIMEOUT = 20.0  # seconds a bench process may take to import torch and reach a cell
QUICK_CASES = ("d128", "d64-causal-fp16", "d128-gqa-causal-sq<sk", "d128-local",
               "d64-softcap-sink", "d128-varlen-causal", "d64-varlen-seqused",
               "d256-causal-fp16", "d256-local-softcap-sink")


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    return env


def _emit(obj):
    print("@@" + json.dumps(obj), flush=True)


def _import_test_module():
    """tests/gpu/test_sm90_bwd_gpu.py (and tests/helpers.py), with a pytest stand-in if needed."""
    ensure_pytest()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT))
    import test_sm90_bwd_gpu as t

    return t


# ----------------------------------------------------------------------------------------------
# workers (child processes)
# ----------------------------------------------------------------------------------------------


def worker_case(name):
    import torch

    t = _import_test_module()
    from helpers import max_err

    case = next(c for c in t.CASES if c["name"] == name)
    t0 = time.time()
    try:
        res = t.run_case(case)
    except NotImplementedError as exc:
        _emit({"case": name, "status": f"refused: {exc}"})
        return
    worst, status = 0.0, "ok"
    for g_name, (g, r32, rlow, atol) in res.items():
        err, base = max_err(g, r32), max_err(rlow, r32)
        rounding = max_err((r32.float() + 0.3 - 0.3).to(g.dtype), r32) \
            if g.dtype != torch.float32 else 0.0
        bound = 2 * base + atol + 2 * rounding
        worst = max(worst, err / bound)
        if torch.isnan(g).any() or err > bound:
            status = f"WRONG {g_name} err {err:.2e} > {bound:.2e}"
            break
    _emit({"case": name, "status": status, "err/bound": round(worst, 3),
           "s": round(time.time() - t0, 1)})


def _widths(token):
    """(head dim, head dim of V) of a --dims token: 128, or 192/128."""
    d, _, dv = str(token).partition("/")
    return int(d), int(dv or d)


def _heads(d):
    """(q heads, kv heads): --heads Q:KV (ASYMFLASH_PROBE_HEADS for the workers), else model
    dim 2048 without GQA (2048 / d each)."""
    given = os.environ.get("ASYMFLASH_PROBE_HEADS")
    if given:
        hq, hkv = (int(x) for x in given.split(":"))
        return hq, hkv
    return 2048 // d, 2048 // d


def _bench_inputs(token, causal, seqlen):
    import torch

    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    d, dv = _widths(token)
    hq, hkv = _heads(d)
    batch = max(1, int(os.environ.get("ASYMFLASH_PROBE_TOKENS", 16384)) // seqlen)
    total = batch * seqlen
    dev = "cuda"
    q, k, v, dout = (torch.randn(total, h, width, device=dev, dtype=torch.bfloat16)
                     for h, width in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    seq = SeqInfo.dense(batch, seqlen, seqlen, dev)
    params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1))
    return q, k, v, dout, seq, params, batch, hq


def _forward(q, k, v, seq, params, batch, seqlen):
    """out, lse for the backward from torch's flash forward (no Triton compile: a compile per
    cell would eat the time budget); the portable forward if that op is missing."""
    import torch

    try:
        hq, dv = q.shape[1], v.shape[2]
        group = hq // k.shape[1]  # torch's flash forward takes no GQA: the kv heads repeated
        qb, kb, vb = (t.view(batch, seqlen, -1, t.shape[2]).transpose(1, 2)
                      .repeat_interleave(r, dim=1) for t, r in ((q, 1), (k, group), (v, group)))
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            qb, kb, vb, 0.0, params.mask.causal, False, scale=params.softmax_scale)
        out = res[0].transpose(1, 2).reshape(batch * seqlen, hq, dv).contiguous()
        lse = res[1][..., :seqlen].permute(1, 0, 2).reshape(hq, batch * seqlen).contiguous()
        return out, lse.float()
    except Exception:  # noqa: BLE001 - fall back to asymflash's own forward
        from asymflash.backends import portable

        return portable.forward(q, k, v, seq, params, None)


def _grad_error(got, ref):
    """(largest error of dq, dk, dv relative to the largest reference value, any NaN)."""
    import torch

    torch.cuda.synchronize()
    rel = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
              .item() for g, r in zip(got[:3], ref[:3]))
    return rel, any(torch.isnan(g).any().item() for g in got[:3])


def _bench_cell(d, causal, seqlen, warm_only):
    import torch
    import triton

    from asymflash.backends import portable
    from asymflash.backends.sm90.bwd import host as bwd

    res = {"d": d, "causal": causal, "seqlen": seqlen}
    q, k, v, dout, seq, params, batch, hq = _bench_inputs(d, causal, seqlen)
    width, width_v = _widths(d)
    flops = 2.5 * 2 * batch * hq * seqlen * seqlen * (width + width_v) / (2 if causal else 1)

    def tflops(fn):
        # ASYMFLASH_PROBE_REP: ms of timed calls per column (25 by default; a 16k call takes
        # ~5 ms, so more where columns a few percent apart are compared)
        ms = triton.testing.do_bench(fn, warmup=5, rep=float(os.environ.get(
            "ASYMFLASH_PROBE_REP", 25)), return_mode="median")
        return round(flops / ms * 1e-9, 1)

    try:
        out, lse = _forward(q, k, v, seq, params, batch, seqlen)
        ref = portable.backward(dout, q, k, v, out, lse, None, seq, params, None)
        if not warm_only and not os.environ.get("ASYMFLASH_PROBE_NO_PEERS"):
            res["portable"] = tflops(
                lambda: portable.backward(dout, q, k, v, out, lse, None, seq, params, None))
    except Exception as exc:  # noqa: BLE001 - report, go on
        traceback.print_exc(limit=3)
        res["portable"] = f"ERR {repr(exc)[:50]}"
        return res
    why = bwd.unsupported_backward(q, k, v, seq, params, None)
    timed = {}  # column -> the call it times (ours and its variants)
    cfg = None
    if why is None and os.environ.get("ASYMFLASH_PROBE_CFG"):
        cfg = dataclasses.replace(bwd.select_config(width),
                                  **json.loads(os.environ["ASYMFLASH_PROBE_CFG"]))
    if why is not None:
        res["ours"] = "refused"
        res["why"] = why
    else:
        try:
            rel, nan = _grad_error(
                bwd.backward(dout, q, k, v, out, lse, None, seq, params, None, cfg), ref)
            res["rel_err"] = float(f"{rel:.2e}")
            # ASYMFLASH_PROBE_NOCHECK=1 times a wrong result too: for diagnostic patches that
            # drop work on purpose (e.g. the dQ reductions), never for numbers to report.
            if (nan or rel > 5e-2) and not os.environ.get("ASYMFLASH_PROBE_NOCHECK"):
                res["ours"] = f"WRONG rel {rel:.1e}"
            else:
                timed["ours"] = (
                    lambda: bwd.backward(dout, q, k, v, out, lse, None, seq, params, None, cfg))
        except Exception as exc:  # noqa: BLE001 - report, go on
            traceback.print_exc(limit=3)
            res["ours"] = f"ERR {repr(exc)[:50]}"
        for name, fields in _variants().items():
            fn = _checked_variant(fields, (dout, q, k, v, out, lse, seq, params), ref)
            if callable(fn):
                timed[name] = fn
                res.setdefault(name, "ok")
            else:
                res[name] = fn
        if not warm_only:
            res.update(_time_rounds(timed, tflops))
    if not warm_only and not os.environ.get("ASYMFLASH_PROBE_NO_PEERS"):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention as sdpa

            qb, kb, vb = (x.view(batch, seqlen, -1, x.shape[2]).transpose(1, 2).detach()
                          .requires_grad_(True) for x in (q, k, v))
            dob = dout.view(batch, seqlen, hq, width_v).transpose(1, 2)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = sdpa(qb, kb, vb, is_causal=bool(causal), enable_gqa=kb.shape[1] != hq)
            res["cudnn"] = tflops(
                lambda: torch.autograd.grad(o, (qb, kb, vb), dob, retain_graph=True))
        except Exception as exc:  # noqa: BLE001 - report, go on
            res["cudnn"] = f"ERR {repr(exc)[:50]}"
    return res


def _variants() -> dict:
    return json.loads(os.environ.get("ASYMFLASH_PROBE_VARIANTS", "{}"))


def _checked_variant(fields, inputs, ref):
    """The call of ours with BwdConfig fields (and `deterministic`) changed, once checked
    against the reference gradients; or a string saying why not."""

    from asymflash.backends.sm90.bwd import host as bwd

    dout, q, k, v, out, lse, seq, params = inputs
    fields = dict(fields)
    det = bool(fields.pop("deterministic", False))
    params = dataclasses.replace(params, deterministic=det)
    # The base is the config this call's dispatch picks (its longest query sequence and its
    # mask's left edge), so a short call's variant changes the short-call build.
    base = bwd.select_config(q.shape[-1], deterministic=det, masked=params.mask.is_local,
                             max_seqlen_q=seq.max_seqlen_q,
                             window=params.mask.window_left >= 0)
    cfg = dataclasses.replace(base, **fields)

    def call():
        return bwd.backward(dout, q, k, v, out, lse, None, seq, params, None, cfg)

    try:
        rel, nan = _grad_error(call(), ref)
    except Exception as exc:  # noqa: BLE001 - report, go on
        traceback.print_exc(limit=3)
        return f"ERR {repr(exc)[:50]}"
    return f"WRONG rel {rel:.1e}" if rel > 5e-2 or nan else call


def _time_rounds(timed, tflops):
    """TFLOP/s of each column. ASYMFLASH_PROBE_ROUNDS=N (default 1) times the columns in turn
    N times and keeps each one's median: clocks drift between cells and processes by several
    percent (d=128 causal 16k read 537 and 576 in two processes), and
    interleaving puts a column and its variants under the same drift."""

    rounds = max(1, int(os.environ.get("ASYMFLASH_PROBE_ROUNDS", 1)))
    reads = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            try:
                reads[name].append(tflops(fn))
            except Exception as exc:  # noqa: BLE001 - report, go on
                traceback.print_exc(limit=3)
                reads[name].append(f"ERR {repr(exc)[:50]}")
    res = {}
    for name, values in reads.items():
        errors = [v for v in values if isinstance(v, str)]
        res[name] = errors[0] if errors else sorted(values)[len(values) // 2]
    return res


def worker_bench(cells, warm_only):
    import torch

    for d, causal, seqlen in cells:
        _emit({"start": {"d": d, "causal": causal, "seqlen": seqlen}})
        _emit({"cell": _bench_cell(d, causal, seqlen, warm_only)})
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------


def _spawn(args, stderr=subprocess.PIPE):
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=_child_env())


def _pump(stream, lines):
    """Forward a child's stdout lines into a queue; None marks its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _records(text):
    return [json.loads(line[2:]) for line in text.splitlines() if line.startswith("@@")]


def _finish(proc, deadline):
    """(stdout, stderr, timed_out) of a child, killed at the deadline."""
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.time()))
        return out, err, False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return out, err, True


def _field_value(text):
    return int(text) if text.lstrip("-").isdigit() else text.lower() in ("true", "yes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="every correctness case of the test")
    ap.add_argument("--budget", type=float, default=55.0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="time ours with this BwdConfig field changed (true/false or an integer), "
                         "e.g. --set dv_overlap=true")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="an extra column: ours with these BwdConfig fields (or deterministic) "
                         "changed, e.g. det:deterministic=true,stagger=false")
    ap.add_argument("--no-peers", action="store_true", help="skip portable and cuDNN timings")
    ap.add_argument("--dims", default=",".join(map(str, DIMS)),
                    help="head dims, e.g. 256 or 192/128 (q·k / V)")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="e.g. 2048,16384")
    ap.add_argument("--causal", default="0,1", help="0, 1 or 0,1")
    ap.add_argument("--heads", help="q:kv heads, e.g. 64:8 (default 2048/d each, no GQA)")
    ap.add_argument("--tokens", type=int, help="batch * seqlen (default 16384)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.set:  # the children read it
        fields = dict(f.split("=", 1) for f in args.set)
        os.environ["ASYMFLASH_PROBE_CFG"] = json.dumps(
            {k: _field_value(v) for k, v in fields.items()})
    if args.variant:
        os.environ["ASYMFLASH_PROBE_VARIANTS"] = json.dumps(
            {name: {k: _field_value(v) for k, v in (f.split("=", 1) for f in rest.split(","))}
             for name, rest in (spec.split(":", 1) for spec in args.variant)})
    if args.no_peers:
        os.environ["ASYMFLASH_PROBE_NO_PEERS"] = "1"
    if args.heads:
        os.environ["ASYMFLASH_PROBE_HEADS"] = args.heads
    if args.tokens:
        os.environ["ASYMFLASH_PROBE_TOKENS"] = str(args.tokens)
    if args.worker:
        kind, rest = args.worker[0], args.worker[1:]
        if kind == "case":
            worker_case(rest[0])
        else:
            worker_bench(json.loads(rest[0]), kind == "warm")
        return

    t_start = time.time()
    deadline = t_start + args.budget
    dims = [x if "/" in x else int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    causals = [int(x) for x in args.causal.split(",")]
    cells = [(d, c, s) for d in dims for c in causals for s in seqlens]

    # Phase 1, all in parallel: compiling the timed kernels (the 1k cell specialises like the
    # others: every length and count is a multiple of 16), and the correctness cases.
    phase1_end = t_start + 0.55 * args.budget
    procs = [("warm", (d, c), _spawn(["--worker", "warm", json.dumps([[d, c, seqlens[0]]])]))
             for d in dims for c in causals]
    if args.full:
        names = [c["name"] for c in _import_test_module().CASES]
    else:  # no torch import in the parent: it would only delay the children
        names = list(QUICK_CASES)
    procs += [("case", n, _spawn(["--worker", "case", n])) for n in names]
    results = {"cases": {}, "cells": [], "notes": []}
    for kind, key, proc in procs:
        out, err, timed_out = _finish(proc, phase1_end)
        recs = _records(out)
        if kind == "case":
            rec = next((r for r in recs if "case" in r), None)
            if rec is None:
                tail = err.strip().splitlines()[-1:] if err.strip() else ["no output"]
                rec = {"case": key, "status": ("TIMEOUT" if timed_out else
                                               f"CRASH rc={proc.returncode}: {tail[0][:100]}")}
            results["cases"][key] = rec
        elif timed_out or proc.returncode != 0:
            results["notes"].append(f"warm-up {key}: {'timeout' if timed_out else 'crashed'}")

    # Phase 2: timed cells, one process at a time. A cell that crashes its process or runs
    # past CELL_TIMEOUT (a hung kernel) is marked and the rest go on in a fresh process.
    todo = list(cells)
    while todo and time.time() < deadline - 3:
        errfile = tempfile.TemporaryFile(mode="w+")  # a pipe could fill up and block it
        proc = _spawn(["--worker", "bench", json.dumps(todo)], stderr=errfile)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        in_cell, failure = False, None
        while True:
            cell_limit = CELL_TIMEOUT * (1 + len(_variants()))
            limit = min(deadline, time.time() + (cell_limit if in_cell else START_TIMEOUT))
            try:
                line = lines.get(timeout=max(0.1, limit - time.time()))
            except queue.Empty:
                failure = "timeout"
                break
            if line is None:
                proc.wait()
                failure = f"crash rc={proc.returncode}"
                break
            if not line.startswith("@@"):
                continue
            rec = json.loads(line[2:])
            if "start" in rec:
                in_cell = True
            elif "cell" in rec:
                in_cell = False
                results["cells"].append(rec["cell"])
                todo.pop(0)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if not todo:
            break
        if in_cell:
            d, c, s = todo.pop(0)
            results["cells"].append({"d": d, "causal": c, "seqlen": s, "ours": failure})
        else:
            errfile.seek(0)
            err = errfile.read()[-300:]
            results["notes"].append(f"bench worker died before a cell ({failure}): {err}")
            break
    for d, c, s in todo:
        results["cells"].append({"d": d, "causal": c, "seqlen": s, "ours": "skipped (time)"})

    print("correctness (error / FA bound, must be <= 1):")
    for name in names:
        rec = results["cases"].get(name, {"status": "?"})
        print(f"  {name:26s} {rec.get('status')}  {rec.get('err/bound', '')}")
    print(f"\nbackward TFLOP/s, bf16, heads {args.heads or '2048/d'}, batch*seqlen = "
          f"{args.tokens or 16384}")
    print(f"{'d':>7} {'causal':>6} {'seqlen':>6} {'ours':>16} {'portable':>10} {'cudnn':>10} "
          f"{'ours/cudnn':>10} {'rel_err':>9}")
    for r in sorted(results["cells"], key=lambda r: (_widths(r["d"]), r["causal"], r["seqlen"])):
        ratio = ""
        if isinstance(r.get("ours"), float) and isinstance(r.get("cudnn"), float):
            ratio = f"{r['ours'] / r['cudnn']:.2f}"
        print(f"{str(r['d']):>7} {r['causal']:>6} {r['seqlen']:>6} {str(r.get('ours', '')):>16} "
              f"{str(r.get('portable', '')):>10} {str(r.get('cudnn', '')):>10} {ratio:>10} "
              f"{str(r.get('rel_err', '')):>9}"
              + "".join(f" {name}={r.get(name, '')}" for name in _variants()))
    for note in results["notes"]:
        print("note:", note)
    print(f"total {time.time() - t_start:.1f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sm90-bwd-probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
