"""Correctness and speed of the sm90 Gluon forward on one H200, beside torch SDPA.

    PYTHONPATH=. python3 scripts/sm90-probe.py [--quick] [--cells d:causal:seqlen,...]

1. the correctness cases of tests/gpu/test_sm90_gpu.py (loaded without needing pytest),
2. timing cells of the benchmark grid (bf16, model dim 2048, batch = 16384 / seqlen): ours with
   the default config and FA4-switch variants, torch SDPA cuDNN and flash backends. Every timed
   cell is first checked against the fp32 reference on a slice of rows.
Prints a compact table; writes JSON to $OUT/sm90-probe.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import ensure_pytest  # noqa: E402

sys.path.insert(0, str(ROOT))

from asymflash.backends.sm90.fwd import host as fwd
from asymflash.core.params import AttnParams, MaskSpec


def _load_test_module():
    """tests/gpu/test_sm90_gpu.py, with a stand-in for pytest where it is not installed."""
    ensure_pytest()
    path = ROOT / "tests" / "gpu" / "test_sm90_gpu.py"
    spec = importlib.util.spec_from_file_location("t_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def correctness(t):
    rows = []
    cases = list(t.CASES)
    for case in cases:
        batch, sq, sk, hq, hkv, d, dtype, window, softcap, use_sink, varlen = case
        name = (f"b{batch} sq{sq} sk{sk} h{hq}/{hkv} d{d} {str(dtype)[6:]} w{window} "
                f"cap{softcap} sink{int(use_sink)} var{int(varlen)}")
        try:
            q, k, v, seq = t.make_inputs(batch, sq, sk, hq, hkv, d, d, dtype, varlen=varlen)
            params = AttnParams(d ** -0.5, MaskSpec(*window), softcap)
            sink = torch.randn(hq, device="cuda") if use_sink else None
            oe, le, tol = t.check_forward(fwd, q, k, v, seq, params, sink)
            ok = oe <= tol and le <= 1e-3
            rows.append({"case": name, "out_err": oe, "lse_err": le, "tol": tol, "ok": ok})
        except Exception as exc:  # noqa: BLE001 - report, go on  # keep going: one bad case must not hide the others
            traceback.print_exc(limit=3)
            rows.append({"case": name, "ok": False, "error": repr(exc)[:200]})
        r = rows[-1]
        print(f"{'PASS' if r['ok'] else 'FAIL'} {name}  out_err={r.get('out_err', -1):.2e} "
              f"tol={r.get('tol', -1):.2e} lse_err={r.get('lse_err', -1):.2e} "
              f"{r.get('error', '')}", flush=True)
    for emu, thr in [(4, 0.0), (2, 8.0), (8, 8.0)]:
        q, k, v, seq = t.make_inputs(2, 1024, 1024, 4, 4, 64, 64, torch.bfloat16)
        params = AttnParams(0.125, MaskSpec(-1, 0))
        cfg = replace(fwd.select_config(64, 64, params), exp2_emu_every=emu, rescale_threshold=thr)
        try:
            oe, le, tol = t.check_forward(fwd, q, k, v, seq, params, None, cfg=cfg)
            ok = oe <= tol and le <= 1e-3
        except Exception as exc:  # noqa: BLE001 - report, go on
            traceback.print_exc(limit=3)
            oe = le = tol = -1.0
            ok = False
            print(repr(exc)[:200])
        rows.append({"case": f"switch emu{emu} thr{thr}", "out_err": oe, "lse_err": le,
                     "tol": tol, "ok": ok})
        print(f"{'PASS' if ok else 'FAIL'} switches emu={emu} thr={thr} out_err={oe:.2e} "
              f"tol={tol:.2e} lse_err={le:.2e}", flush=True)
    return rows


def _field_value(cfg, name, text):
    """FwdConfig field from the command line; bool and `None`-default fields take true/false."""
    cur = getattr(cfg, name)
    if cur is None or isinstance(cur, bool):
        return text.lower() in ("1", "true", "yes")
    return type(cur)(text)


def _timer(graph):
    if graph:
        # GPU time of CUDA-graph replays: no host launch cost in the number.
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    return lambda fn: triton.testing.do_bench(fn, return_mode="median")


def warm_cell(t, d, causal, variants):
    """Compile (and run once) each variant on a tiny input of the cell's kernel signature."""
    q, k, v, seq = t.make_inputs(2, 256, 256, 2048 // d, 2048 // d, d, d, torch.bfloat16)
    params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1))
    for _, cfg in variants:
        fwd.forward(q, k, v, seq, params, None, cfg=cfg)
    torch.cuda.synchronize()


def bench_cell(t, d, causal, seqlen, variants, graph=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    hq = 2048 // d
    batch = 16384 // seqlen
    q, k, v, seq = t.make_inputs(batch, seqlen, seqlen, hq, hq, d, d, torch.bfloat16)
    params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1))
    flops = 4 * batch * hq * seqlen * seqlen * d / (2 if causal else 1)
    res = {"d": d, "causal": causal, "seqlen": seqlen}
    # Check the last rows of sequence 0 (the most keys under a causal mask) and the first.
    rows_chk = (max(0, seqlen - 512), seqlen)
    for name, cfg in variants:
        try:
            oe, le, tol = t.check_forward(fwd, q, k, v, seq, params, None, q_rows=rows_chk, cfg=cfg)
            oe0, _, tol0 = t.check_forward(fwd, q, k, v, seq, params, None, q_rows=(0, 256),
                                           cfg=cfg)
            if oe > tol or oe0 > tol0 or le > 1e-3:
                res[name] = f"WRONG({oe:.1e}/{tol:.1e})"
                continue
            ms = _timer(graph)(lambda c=cfg: fwd.forward(q, k, v, seq, params, None, cfg=c))
            res[name] = round(flops / ms * 1e-9, 1)
            res[name + "_us"] = round(ms * 1e3, 1)
        except Exception as exc:  # noqa: BLE001 - report, go on
            traceback.print_exc(limit=3)
            res[name] = f"ERR {repr(exc)[:60]}"
    qb = q.view(batch, seqlen, hq, d).transpose(1, 2)
    kb = k.view(batch, seqlen, hq, d).transpose(1, 2)
    vb = v.view(batch, seqlen, hq, d).transpose(1, 2)
    peers = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)]
    for name, backend in peers[:1] if graph else peers:
        try:
            with sdpa_kernel(backend):
                ms = _timer(graph)(lambda: sdpa(qb, kb, vb, is_causal=bool(causal)))
            res[name] = round(flops / ms * 1e-9, 1)
            res[name + "_us"] = round(ms * 1e3, 1)
        except Exception as exc:  # noqa: BLE001 - report, go on
            res[name] = f"ERR {repr(exc)[:40]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small case, then exit")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    ap.add_argument("--cells", default="128:0:16384,128:1:16384,64:0:16384,64:1:16384,"
                    "256:0:16384,256:1:16384,128:0:512,128:1:512,128:0:2048")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra config to time, D:NAME:field=value[,field=value] (e.g. "
                         "64:st4:stages=4); applied to the cells with head dim D")
    ap.add_argument("--overhead", action="store_true",
                    help="time a one-CTA call (host launch cost floor) beside SDPA cuDNN")
    ap.add_argument("--persistent", action="store_true",
                    help="time the plain grid ('ours') against the persistent grid ('pers')")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (GPU time)")
    ap.add_argument("--warm-only", action="store_true",
                    help="only compile the cells' kernels (run several at once to fill the cache)")
    ap.add_argument("--call-defaults", action="store_true",
                    help="start from each cell's per-call default (three warpgroups, short "
                         "masked tiles: fwd_config.default_for_call) instead of the head "
                         "dim's table entry")
    ap.add_argument("--fa4-switches", action="store_true",
                    help="also time the FA4 switches and the LPT order where they apply")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
               "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "command": " ".join(sys.argv)}
    print(env, flush=True)
    t = _load_test_module()
    if args.quick:
        q, k, v, seq = t.make_inputs(1, 256, 256, 2, 2, 128, 128, torch.bfloat16)
        oe, le, tol = t.check_forward(fwd, q, k, v, seq, AttnParams(128 ** -0.5), None)
        print(f"quick: out_err={oe:.2e} tol={tol:.2e} lse_err={le:.2e}", flush=True)
        return
    out = {"env": env}
    if args.overhead:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        q, k, v, seq = t.make_inputs(1, 128, 128, 1, 1, 128, 128, torch.bfloat16)
        p = AttnParams(128 ** -0.5)
        ms = triton.testing.do_bench(lambda: fwd.forward(q, k, v, seq, p, None),
                                     return_mode="median")
        qb, kb, vb = (x.view(1, 128, 1, 128).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms_c = triton.testing.do_bench(lambda: sdpa(qb, kb, vb), return_mode="median")
        t0 = time.perf_counter()
        for _ in range(200):
            fwd.forward(q, k, v, seq, p, None)
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"one-CTA call: ours {ms * 1e3:.1f} us, cudnn {ms_c * 1e3:.1f} us, "
              f"host cost of forward() {host_us:.1f} us", flush=True)
        out["overhead_us"] = {"ours": ms * 1e3, "cudnn": ms_c * 1e3, "host": host_us}
    if not args.no_check:
        out["correctness"] = correctness(t)
    cells = []
    header = None
    for cell in args.cells.split(","):
        d, causal, seqlen = map(int, cell.split(":"))
        if args.call_defaults:  # dense, plain calls without a window, as the grid's are
            base = fwd.default_for_call(d, False, bool(causal), seqlen, True, True)
        else:
            base = fwd.select_config(d, d, AttnParams(1.0, MaskSpec(-1, 0 if causal else -1)))
        variants = [("ours", base)]
        if args.persistent:
            variants = [("ours", replace(base, persistent=False)),
                        ("pers", replace(base, persistent=True))]
        if args.warm_only:
            warm_cell(t, d, causal, variants)
            print(f"warm {cell}", flush=True)
            continue
        if d <= 128 and seqlen >= 4096 and not causal and args.fa4_switches:
            variants += [
                ("emu8", replace(base, exp2_emu_every=8)),
                ("emu4", replace(base, exp2_emu_every=4)),
                ("resc8", replace(base, rescale_threshold=8.0)),
            ]
        if causal and seqlen >= 4096 and d == 128 and args.fa4_switches:
            variants.append(("nolpt", replace(base, lpt=False)))
        for spec in args.variant:
            vd, vname, fields = spec.split(":")
            if int(vd) == d:
                kw = {f.split("=")[0]: _field_value(base, *f.split("="))
                      for f in fields.split(",")}
                variants.append((vname, replace(base, **kw)))
        t0 = time.time()
        r = bench_cell(t, d, causal, seqlen, variants, graph=args.graph)
        r["cfg"] = asdict(base)
        cells.append(r)
        keys = ["ours", "pers", "ours_us", "pers_us", "cudnn_us", "emu8", "emu4", "resc8",
                "nolpt", "cudnn", "fa2"]
        keys += [s.split(":")[1] for s in args.variant]
        if header is None:
            header = "d    causal seqlen " + " ".join(f"{x:>8}" for x in keys)
            print(header)
        print(f"{d:<4} {causal:<6} {seqlen:<6} " + " ".join(f"{r.get(x, '-')!s:>8}" for x in keys)
              + f"   ({time.time() - t0:.0f}s)", flush=True)
    out["cells"] = cells
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sm90-probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
