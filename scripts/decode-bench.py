"""Decode bandwidth: flash_attn_with_kvcache against the GPU's copy bandwidth and its peers.

Decode reads the whole KV cache once per step and does little arithmetic with it, so the
figure of merit is bandwidth: bytes of K/V read / median time (triton.testing.do_bench,
L2 flushed between runs), next to the bandwidth of a device-to-device copy measured in the
same run (read + write bytes / time), which is about what the HBM can deliver.

Cases: bf16, head dim 128, GQA 8:1 (32 q heads, 4 kv heads), seqlen_q 1, batch 8 and 32,
every sequence holding 4k, 16k or 64k tokens, in a paged cache (page 64, pages shuffled) and
a contiguous one. Peers: FA4's kvcache path (flash_attn.cute's varlen entry with seqused_k
and, for the paged rows, the same page table) when importable, and torch SDPA (enable_gqa)
and FlexAttention (compiled) on the
contiguous (gathered) cache. asymflash-fp8 reads an e4m3 copy of the cache (k/v descales,
half the bytes: its % copy counts those bytes; its time beside asymflash's is the fp8
cache's tokens/s gain). A peer that fails is listed as failed, never fatal; once the
time budget is spent the remaining cells are listed as skipped.

    python scripts/decode-bench.py --out out/decode-bench        # on the GPU, < 90 s
    python scripts/decode-bench.py --smoke --out /tmp/decode     # tiny sizes, any machine

Two timings per cell: eager (do_bench of the Python call: what a plain loop sees, host
issue time included) and graph (the call captured once in a CUDA graph and replayed, as
serving engines run decode steps: GPU time alone, plus the ~4 us launch of a one-node
graph). Values are checked once, eagerly, before any timing (never under capture). For
caches up to 600 MB every provider also gets a step column: 8 calls on 8 caches in one graph,
the time per call (a serving step captures every layer in one graph, so a call there pays no
graph launch of its own): each provider is timed the same three ways. --host adds host
issue time per call for three decode calls (as scripts/host-overhead.py); --sweep times tile
configs and split counts of the portable kernel under graph replay (tuning).

Prints a markdown table and writes decode-bench.json to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe_common import forced_decode_config  # noqa: E402

from asymflash import flash_attn_with_kvcache  # noqa: E402
from asymflash.bench.core import capture_graph, host_issue_us, profile_calls  # noqa: E402

HQ, HKV, D, PAGE = 32, 4, 128, 64
DTYPE = torch.bfloat16


def short(exc: BaseException, limit: int = 120) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def timer(smoke: bool):
    if not smoke:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")

    def cpu_median(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_median


def graph_timer(smoke: bool, bench):
    """ms per replay of `fn` captured in a CUDA graph (None on the CPU)."""
    if smoke:
        return None
    return lambda fn: bench(capture_graph(fn).replay)


def copy_bandwidth(device, smoke: bool, bench) -> float:
    """GB/s of dst.copy_(src), counting the bytes read and the bytes written."""
    n = (1 << 20) if smoke else (1 << 30)  # 1 GiB each way: far past the L2
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def same_bytes_copy_pct(graph, nbytes, copy_gbs, device) -> tuple:
    """% of the (1 GiB) copy bandwidth that a copy moving only `nbytes` (read + write)
    reaches under graph replay, alone and as STEP_CALLS copies of different buffers in one
    graph (as the step column runs decode calls): the ceiling for a kernel reading that many
    bytes, where launch and ramp-up costs show at small sizes. The step figure is None above
    STEP_MAX_BYTES (no step column there)."""
    src = torch.ones(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = graph(lambda: dst.copy_(src))
    alone = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs
    if nbytes > STEP_MAX_BYTES:
        return alone, None
    pairs = [(torch.ones_like(src), torch.empty_like(src)) for _ in range(STEP_CALLS)]

    def step():
        for s, d in pairs:
            d.copy_(s)
    ms = graph(step) / STEP_CALLS
    return alone, 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs


STEP_CALLS = 8  # decode calls per captured "step" (one per layer in a serving engine)
STEP_MAX_BYTES = 600e6  # the step column only where fixed per-call costs matter


def step_caches(case):
    """STEP_CALLS (k_cache, v_cache) pairs of the case's sizes, the case's own first; kept in
    `case` for the next use (the sweep times many configs on one case)."""
    if "step_caches" not in case:
        case["step_caches"] = [(case["k_cache"], case["v_cache"])] + [
            (torch.randn_like(case["k_cache"]), torch.randn_like(case["v_cache"]))
            for _ in range(STEP_CALLS - 1)]
    return case["step_caches"]


def step_graph_ms(case, graph, num_splits: int = 0, calls=None) -> float:
    """ms per call of STEP_CALLS decode calls on as many different caches (same sizes and
    page table), captured in one CUDA graph: serving engines capture a whole decode step
    (every layer) as one graph, so a call there pays no graph launch of its own, unlike the
    one-call replay of the graph column. calls: the STEP_CALLS zero-argument calls (a
    provider's, one per cache); default: asymflash with num_splits."""
    if calls is None:
        calls = [lambda kc=kc, vc=vc: flash_attn_with_kvcache(
            case["q"], kc, vc, cache_seqlens=case["seqlens"], page_table=case["page_table"],
            num_splits=num_splits, check_values=False) for kc, vc in step_caches(case)]

    def step():
        for call in calls:
            call()
    return graph(step) / STEP_CALLS


def make_case(batch, seqlen, paged, device, seed=0, ragged=False):
    """A decode case: q, the cache (paged or not, `seqlen` slots per sequence) and its
    lengths: all `seqlen`, or with `ragged` as a serving batch holds them (the models
    suite's decode cases): the first `seqlen`, the rest uniform in [seqlen / 4, seqlen]."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=DTYPE)

    q = randn(batch, 1, HQ, D)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    if ragged and batch > 1:
        seqlens[1:] = torch.randint(seqlen // 4, seqlen + 1, (batch - 1,), generator=g,
                                    device=device, dtype=torch.int32)
    if paged:
        pages = batch * seqlen // PAGE
        k_cache, v_cache = randn(pages, PAGE, HKV, D), randn(pages, PAGE, HKV, D)
        table = torch.randperm(pages, generator=g, device=device).view(batch, -1)
        table = table.to(torch.int32)
        k = k_cache[table.long()].flatten(1, 2)  # (batch, seqlen, hkv, d): for the peers
        v = v_cache[table.long()].flatten(1, 2)
    else:
        k_cache, v_cache = randn(batch, seqlen, HKV, D), randn(batch, seqlen, HKV, D)
        table, k, v = None, k_cache, v_cache
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table, seqlens=seqlens,
                k=k, v=v)


def providers(case, smoke, caches=None):
    """name -> zero-argument callable returning out (batch, 1, hq, d). caches: another
    (k_cache, v_cache) pair of the case's sizes to read instead of its own (the step graph's
    calls each read their own cache, as a model's layers do)."""
    q, table = case["q"], case["page_table"]
    k_cache, v_cache = caches or (case["k_cache"], case["v_cache"])
    # The peers without a page table read the gathered copy (paged rows: values only).
    k, v = (case["k"], case["v"]) if table is not None else (k_cache, v_cache)

    def asym(splits):
        def run():
            return flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=case["seqlens"],
                page_table=table, num_splits=splits, check_values=False)
        return run

    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
        return out.transpose(1, 2)

    flex_fn = {}

    def flex():
        if "fn" not in flex_fn:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn["fn"] = flex_attention if smoke else torch.compile(flex_attention)
        return flex_fn["fn"](qb, kb, vb, enable_gqa=True).transpose(1, 2)

    def fa4():
        # FA4's own kvcache path: its varlen entry over the cache (paged or not) with
        # seqused_k. One split: on sm90 it refuses split-KV ("SplitKV not supported on SM
        # 9.0", 4.0.0b36, H200), which its heuristic (num_splits=0) picks at batch
        # 8. Missing (no flash_attn.cute, e.g. without .peers/fa4-b/activate.sh, or
        # PYTHONPATH reset after it) or failing: listed as failed, never fatal.
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        out = fa4_varlen(q, k_cache, v_cache, seqused_k=case["seqlens"],
                         max_seqlen_q=1, max_seqlen_k=int(case["k"].shape[1]),
                         page_table=table, num_splits=1)
        return out[0] if isinstance(out, tuple) else out

    # SDPA first: it is the yardstick the others' outputs are compared with.
    return {"SDPA": sdpa, "asymflash": asym(0), "asymflash-nosplit": asym(1), "Flex": flex,
            "FA4": fa4, "asymflash-fp8": fp8_cache(case, caches)}


# One descale for every (sequence, KV head): the bf16 randn cache stays inside +-6, which
# maps to 6 / FP8_SCALE = 384 < 448 in e4m3. Its max_diff column then includes the
# quantisation error (the values are checked in tests/unit/test_fp8.py, not here).
FP8_SCALE = 6.0 / 384


def fp8_cache_args(case, caches=None):
    """k_cache, v_cache (an e4m3 copy of the case's cache, or of `caches`) and their
    descales, as flash_attn_with_kvcache keywords (the case's own kept in `case`)."""
    if caches is None and "fp8" in case:
        return case["fp8"]
    k8, v8 = ((t.float() / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn)
              for t in (caches or (case["k_cache"], case["v_cache"])))
    descale = torch.full((case["q"].shape[0], HKV), FP8_SCALE, device=case["q"].device)
    kw = dict(k_cache=k8, v_cache=v8, k_descale=descale, v_descale=descale)
    if caches is None:
        case["fp8"] = kw
    return kw


def fp8_cache(case, caches=None):
    """asymflash over an e4m3 copy of the case's cache, or of `caches` (half the bytes per
    token)."""
    q, table = case["q"], case["page_table"]
    kw = fp8_cache_args(case, caches)

    def run():
        return flash_attn_with_kvcache(q, cache_seqlens=case["seqlens"], page_table=table,
                                       check_values=False, **kw)
    return run


def splits_chosen(case):
    """The split count num_splits=0 picks (the portable kernel's heuristic)."""
    try:
        from asymflash.backends.portable import decode as dec
        from asymflash.core.params import CacheSpec

        q = case["q"]
        spec = CacheSpec(case["k_cache"], case["v_cache"], case["seqlens"], 0,
                         case["page_table"], None, None, 1, case["k"].shape[1], q.shape[0])
        return dec.plan(q, spec, 0)[3]
    except Exception as e:  # informative only
        return f"? ({short(e, 60)})"


def host_cases(device):
    """The decode calls of scripts/host-overhead.py: contiguous 4k cache, one token appended."""
    for batch, splits in ((8, 1), (8, 0), (32, 0)):
        q = torch.randn(batch, 1, HQ, D, device=device, dtype=DTYPE)
        kc = torch.randn(batch, 4096, HKV, D, device=device, dtype=DTYPE)
        vc = torch.randn_like(kc)
        lens = torch.full((batch,), 4095, dtype=torch.int32, device=device)
        kn = torch.randn(batch, 1, HKV, D, device=device, dtype=DTYPE)

        def dec(q=q, kc=kc, vc=vc, lens=lens, kn=kn, splits=splits):
            return flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens,
                                           num_splits=splits, check_values=False)
        yield f"decode b{batch} 4k splits={splits or 'auto'}", dec, 2 * kc.numel() * 2


def host_report(bench, graph, copy_gbs, profile=False):
    rows = []
    for name, fn, nbytes in host_cases("cuda"):
        h = host_issue_us(fn)
        e, g = bench(fn) * 1e3, graph(fn) * 1e3
        rows.append(dict(call=name, host_us=h, eager_us=e, graph_us=g,
                         graph_pct_copy=100 * nbytes / (g * 1e-6) / 1e9 / copy_gbs))
        print(f"{name:28s} host {h:7.1f} us  eager {e:7.1f} us  graph {g:7.1f} us "
              f"({rows[-1]['graph_pct_copy']:.0f}% of copy)")
        if profile and "auto" in name:
            print(profile_calls(fn, top=14))
            profile = False
    return rows


# (block_n, warps, stages); --sweep-configs picks others.
SWEEP_CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4)]


def sweep(graph, copy_gbs, budget_s, t_start, cases=None, configs=None, splits_list=None,
          fp8=False, ragged=False):
    """Graph-replay time of the portable kernel per (tile config, split count), and per call
    in an 8-call step graph where the caches are small enough for the step column. fp8: over
    the e4m3 copy of each cache (its bytes; no step column). ragged: lengths as a serving
    batch holds them (`make_case`; % of copy counts the keys held)."""
    from asymflash.backends.portable import decode as dec

    results = []
    cases = cases or [(8, 4096), (8, 16384), (32, 4096), (32, 16384), (8, 65536)]
    for paged in (True, False):
        for batch, seqlen in cases:
            case = make_case(batch, seqlen, paged, "cuda", ragged=ragged)
            keys = int(case["seqlens"].sum())
            kv_bytes = keys * HKV * 2 * D * (1 if fp8 else DTYPE.itemsize)
            auto = splits_chosen(case)
            for block_n, warps, stages in configs or SWEEP_CONFIGS:
                cfg = dec.DecodeConfig(16, block_n, True, warps, stages)
                line = []
                for splits in splits_list or ((4, 8, 16, 32, 64) if batch == 8
                                              else (1, 2, 4, 8)):
                    if time.time() - t_start > budget_s:
                        break
                    spec_kw = dict(q=case["q"], k_cache=case["k_cache"],
                                   v_cache=case["v_cache"], page_table=case["page_table"],
                                   cache_seqlens=case["seqlens"], num_splits=splits,
                                   check_values=False)
                    if fp8:
                        spec_kw.update(fp8_cache_args(case))
                    try:
                        with forced_decode_config(cfg):
                            ms = graph(lambda kw=spec_kw: flash_attn_with_kvcache(**kw))
                            step = (step_graph_ms(case, graph, splits)
                                    if kv_bytes <= STEP_MAX_BYTES and not fp8 else None)
                        pct = 100 * kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs
                        step_pct = (100 * kv_bytes / (step * 1e-3) / 1e9 / copy_gbs
                                    if step else None)
                        line.append(f"s{splits}:{ms * 1e3:.1f}us/{pct:.0f}%"
                                    + (f" step {step * 1e3:.1f}us/{step_pct:.0f}%"
                                       if step else ""))
                        results.append(dict(paged=paged, batch=batch, seqlen=seqlen,
                                            config=[block_n, warps, stages], splits=splits,
                                            us=ms * 1e3, pct_copy=pct, step_pct=step_pct))
                    except Exception as e:  # noqa: BLE001 - a config that fails is listed
                        line.append(f"s{splits}:{short(e, 60)}")
                print(f"sweep {'fp8 ' if fp8 else ''}{'paged' if paged else 'contig'} "
                      f"b{batch} {seqlen} "
                      f"(auto={auto}) n{block_n} w{warps} st{stages}: " + " ".join(line),
                      flush=True)
            del case
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/decode-bench")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, runs without a GPU")
    ap.add_argument("--budget-s", type=float, default=75.0,
                    help="cells after this many seconds are skipped (listed as skipped)")
    ap.add_argument("--host", action="store_true", help="host issue time of 3 decode calls")
    ap.add_argument("--sweep", action="store_true", help="tile/split sweep (graph replay)")
    ap.add_argument("--sweep-configs", default=None,
                    help="block_n:warps:stages,... for --sweep")
    ap.add_argument("--sweep-splits", default=None, help="comma-separated split counts")
    ap.add_argument("--sweep-fp8", action="store_true", help="--sweep over e4m3 caches")
    ap.add_argument("--ragged", action="store_true",
                    help="--sweep with lengths uniform in [n/4, n] (the table's peers read "
                         "whole caches, so it applies to the sweep)")
    ap.add_argument("--profile", action="store_true", help="with --host: cProfile a call")
    ap.add_argument("--no-table", action="store_true", help="skip the main table")
    ap.add_argument("--lengths", default=None, help="comma-separated seqlen_k (default 4k,16k,64k)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 8,32)")
    args = ap.parse_args(argv)
    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("decode-bench: no CUDA device; use --smoke for a CPU dry run")
        return 0
    bench = timer(args.smoke)
    graph = graph_timer(args.smoke, bench)
    batches = (2,) if args.smoke else (8, 32)
    if args.batches:
        batches = tuple(int(x) for x in args.batches.split(","))
    lengths = (128, 256) if args.smoke else (4096, 16384, 65536)
    if args.lengths:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    info = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, smoke=args.smoke)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    copy_gbs = copy_bandwidth(device, args.smoke, bench)
    info["copy_GBps"] = round(copy_gbs, 1)
    print(f"# decode bandwidth — {info['device']}; device-to-device copy {copy_gbs:.0f} GB/s "
          f"(read + write)\n")
    result = dict(info=info)
    if args.host and graph is not None:
        result["host"] = host_report(bench, graph, copy_gbs, args.profile)
    if args.sweep and graph is not None:
        cases = ([(b, n) for b in batches for n in lengths]
                 if args.lengths or args.batches else None)
        configs = ([tuple(int(x) for x in c.split(":")) for c in args.sweep_configs.split(",")]
                   if args.sweep_configs else None)
        splits_list = ([int(x) for x in args.sweep_splits.split(",")]
                       if args.sweep_splits else None)
        result["sweep"] = sweep(graph, copy_gbs, args.budget_s, t_start, cases, configs,
                                splits_list, args.sweep_fp8, args.ragged)
    rows = [] if args.no_table else table_rows(args, device, bench, graph, batches, lengths,
                                               copy_gbs, t_start)
    result["rows"] = rows
    info["elapsed_s"] = round(time.time() - t_start, 1)
    print(f"\n{info['elapsed_s']} s")
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / "decode-bench.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return 0


def pct(ms, nbytes, copy_gbs):
    gbps = nbytes / (ms * 1e-3) / 1e9
    return gbps, 100 * gbps / copy_gbs


def table_rows(args, device, bench, graph, batches, lengths, copy_gbs, t_start):
    rows = []
    for paged in (True, False):
        for batch in batches:
            for seqlen in lengths:
                row = dict(layout="paged" if paged else "contiguous", batch=batch,
                           seqlen_k=seqlen, cells={})
                rows.append(row)
                kv_bytes = batch * seqlen * HKV * 2 * D * DTYPE.itemsize
                row["kv_MB"] = round(kv_bytes / 1e6, 1)
                if graph is not None and not paged:
                    row["floor_pct"], row["floor_step_pct"] = same_bytes_copy_pct(
                        graph, kv_bytes, copy_gbs, device)
                try:
                    case = make_case(batch, seqlen, paged, device)
                except Exception as e:  # e.g. out of memory: the whole row is failed
                    row["error"] = short(e)
                    continue
                row["splits"] = splits_chosen(case)
                with_step = graph is not None and kv_bytes <= STEP_MAX_BYTES
                expected = None
                for name, fn in providers(case, args.smoke).items():
                    # The peers have no page table: they read the gathered copy, the same
                    # work as the contiguous row, so in paged rows SDPA only checks values.
                    timed = not (paged and name in ("SDPA", "Flex"))
                    if not timed and name == "Flex":
                        continue
                    if time.time() - t_start > args.budget_s:
                        row["cells"][name] = dict(status="skipped (time budget)")
                        continue
                    try:
                        out = fn().float()  # eager, outside any capture: values checked here
                        if expected is None:  # the first provider's output is the yardstick
                            expected, ref_name = out, name
                        err = (out - expected).abs().max().item()
                        if not timed:
                            row["check_vs_SDPA"] = err
                            continue
                        ms = bench(fn)
                        # An e4m3 cache holds the same tokens in half the bytes.
                        nbytes = kv_bytes // 2 if name.endswith("fp8") else kv_bytes
                        gbps, pc = pct(ms, nbytes, copy_gbs)
                        cell = dict(status="ok", ms=ms, GBps=gbps, pct_copy=pc,
                                    max_diff=err, vs=ref_name)
                        if graph is not None:
                            try:
                                gms = graph(fn)
                                cell.update(graph_ms=gms,
                                            graph_pct_copy=pct(gms, nbytes, copy_gbs)[1])
                            except Exception as e:  # e.g. a peer that cannot be captured
                                cell["graph"] = f"failed: {short(e, 60)}"
                        if with_step:  # every provider timed the same way: all three columns
                            try:
                                calls = [providers(case, args.smoke, c)[name]
                                         for c in step_caches(case)]
                                cell["step_pct_copy"] = pct(
                                    step_graph_ms(case, graph, calls=calls), nbytes,
                                    copy_gbs)[1]
                            except Exception as e:  # noqa: BLE001 - listed, never fatal
                                cell["step"] = f"failed: {short(e, 40)}"
                        # fp8's difference includes its quantisation (~2^-4 relative per
                        # value, averaged over the keys): a wrong kernel is off by O(1).
                        limit = 0.25 if name.endswith("fp8") else 5e-2
                        if not math.isfinite(err) or err > limit:
                            cell["status"] = f"wrong? (max diff {err:.3g} vs {ref_name})"
                    except Exception as e:
                        cell = dict(status=f"failed: {short(e)}")
                        if device == "cuda":
                            torch.cuda.empty_cache()
                    row["cells"][name] = cell
                del case
                if device == "cuda":
                    torch.cuda.empty_cache()
    names = ["asymflash", "asymflash-nosplit", "asymflash-fp8", "SDPA", "Flex", "FA4"]
    head = "| layout | batch | seqlen_k | K/V MB | copy of these bytes, graph / 8-call " \
        "step graph (% copy) | splits | " + \
        " | ".join(f"{n} µs eager / graph (% copy) / step graph % copy" for n in names) + " |"
    print(head)
    print("|" + "---|" * (6 + len(names)))
    for row in rows:
        cells = []
        for n in names:
            c = row["cells"].get(n)
            if c is None:
                cells.append("(see contiguous)" if row["layout"] == "paged" else "—")
            elif c["status"] == "ok":
                text = f"{c['ms'] * 1e3:.1f} ({c['pct_copy']:.0f}%)"
                if "graph_ms" in c:
                    text += f" / {c['graph_ms'] * 1e3:.1f} ({c['graph_pct_copy']:.0f}%)"
                elif "graph" in c:
                    text += f" / graph {c['graph']}"
                if "step_pct_copy" in c:
                    text += f" / {c['step_pct_copy']:.0f}%"
                elif "step" in c:
                    text += f" / step {c['step']}"
                cells.append(text)
            else:
                cells.append(c["status"])
        if "error" in row:
            cells = [f"failed: {row['error']}"] + [""] * (len(names) - 1)
        floor = f"{row['floor_pct']:.0f}%" if "floor_pct" in row else ""
        if row.get("floor_step_pct") is not None:
            floor += f" / {row['floor_step_pct']:.0f}%"
        print(f"| {row['layout']} | {row['batch']} | {row['seqlen_k']} | {row['kv_MB']} | "
              f"{floor} | {row.get('splits', '')} | " + " | ".join(cells) + " |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
