"""`python -m asymflash bench`: asymflash against its peers, side by side, in one process.

The protocol is the project's BENCHMARK.md (shared/): the FlashAttention papers' grid (bf16,
model dim 2048, nheads = 2048 / hdim, batch = 16384 / seqlen), every cell checked against the fp32
reference before it is timed, median CUDA-event times, FLOPs 4*b*h*sq*sk*d (halved when
causal), backward timed alone as 2.5x the forward FLOPs.

`--suite models` runs named workloads of real models instead (bench/models.py, the calls in
bench/model_calls.py; docs/benchmark.md lists the cases) through the same check, timing and
report.

Layout of the harness:
    bench.py            command line, grid, the run (this file)
    bench_core.py       Case / Provider / Result, FLOP counts, the check, timing, Runner
    bench_providers.py  asymflash backends and the peers (SDPA flash/cuDNN/efficient, Flex,
                        FA4, FA3, flash-attn 2)
    bench_report.py     markdown, JSON (numbers + environment), PNG charts

Without CUDA the harness says so and runs a small CPU comparison (asymflash's CPU path vs
torch SDPA math) instead of failing. Exit status: 0, or 1 when an asymflash cell is WRONG.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from . import providers as bench_providers
from . import report as bench_report
from .core import (
    DTYPES,
    MODES,
    WRONG,
    Case,
    Provider,
    Result,
    Runner,
    Timer,
    cpu_timer,
    cuda_timer,
    probe,
)
from .fp8 import FP8, Fp8Runner, fp8_providers
from .models import ModelCase, ModelRunner

MODEL_DIM = 2048
TOKENS = 16384


@dataclass(frozen=True)
class Grid:
    hdims: tuple
    seqlens: tuple
    causals: tuple
    dtype: str
    batch: int | None = None  # None: TOKENS // seqlen
    nheads: int | None = None  # None: MODEL_DIM // hdim
    nheads_kv: int | None = None  # None: nheads (no GQA)
    hdim_v: int | None = None  # None: hdim
    seqlen_k: int | None = None  # None: = seqlen (e.g. 4k keys behind one query: decode)


FULL_GRID = Grid(hdims=(64, 128, 256), seqlens=(512, 1024, 2048, 4096, 8192, 16384),
                 causals=(False, True), dtype="bf16")
QUICK_GRID = Grid(hdims=(64, 128), seqlens=(1024, 4096), causals=(False, True), dtype="bf16")
# Small enough for the plain math path and a tiled CPU path to finish in seconds.
CPU_GRID = Grid(hdims=(64, 128), seqlens=(128, 512), causals=(False, True), dtype="fp32",
                batch=2, nheads=4)


# --------------------------------------------------------------------------------------------
# Command line


def _size(text: str) -> int:
    """'512' -> 512, '4k' -> 4096."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def _list(convert):
    def parse(text: str) -> tuple:
        try:
            return tuple(convert(t) for t in text.split(",") if t.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


def _bool(text: str) -> tuple:
    text = text.strip().lower()
    if text in ("both", "all"):
        return (False, True)
    table = {"0": False, "1": True, "false": False, "true": True, "off": False, "on": True}
    if text not in table:
        raise ValueError("use 0, 1, or both")
    return (table[text],)


def _causal(text: str) -> tuple:
    try:
        values = sum((_bool(t) for t in text.split(",") if t.strip()), ())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return tuple(sorted(set(values)))


def _mode(text: str) -> str:
    if text not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m asymflash bench",
        description="Benchmark asymflash against torch SDPA (FA2, cuDNN, efficient), "
                    "FlexAttention, FA4 and flash-attn 2/3 when installed. Lists take "
                    "commas: --hdim 64,128 --seqlen 1k,16k.")
    p.add_argument("--mode", type=_list(_mode),
                   help="fwd, bwd, fwdbwd, comma-separated (default fwd,bwd; the models "
                        "suite: fwd,fwdbwd, a training step's forward and backward)")
    p.add_argument("--hdim", type=_list(int), help="head dims (default 64,128,256)")
    p.add_argument("--hdim-v", type=int, help="head dim of V (default: = hdim)")
    p.add_argument("--seqlen", type=_list(_size), help="sequence lengths (default 512..16k)")
    p.add_argument("--seqlen-k", type=_size,
                   help="keys per sequence for every case (default: = seqlen); e.g. "
                        "--seqlen 1 --seqlen-k 4k --batch 32 for decode-like calls")
    p.add_argument("--batch", type=int, help=f"batch size (default {TOKENS} / seqlen)")
    p.add_argument("--nheads", type=int, help=f"query heads (default {MODEL_DIM} / hdim)")
    p.add_argument("--nheads-kv", type=int, help="key/value heads, for GQA (default nheads)")
    p.add_argument("--causal", type=_causal, help="0, 1 or both (default both)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="default bf16 (fp32 on CPU); fp8: e4m3 inputs with per-head descales, "
                        "forward only, beside asymflash's bf16 path and cuDNN fp8")
    p.add_argument("--providers", type=_list(str),
                   help="only these providers (names as in the table; 'asymflash' = all "
                        "its backends)")
    p.add_argument("--out", type=Path,
                   help="output folder (default benchmarks/results/<date>-<gpu>)")
    p.add_argument("--quick", action="store_true",
                   help="small subset for smoke tests: hdim 64,128, seqlen 1k,4k")
    p.add_argument("--warmup", type=int, default=25, help="warm-up per cell, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="timed time per cell, ms (default 100)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    p.add_argument("--flex-seqlens", default="all",
                   help="seqlens at which FlexAttention runs (each shape compiles anew), "
                        "e.g. 4k,16k; default all")
    p.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                   help="combine the results.json of earlier runs into one report in --out")
    p.add_argument("--list-providers", action="store_true",
                   help="list the providers and whether they can run here, then exit")
    p.add_argument("--suite", choices=("grid", "models"), default="grid",
                   help="grid: the FlashAttention papers' grid (default); models: named "
                        "workloads shaped like real models (bench/models.py)")
    p.add_argument("--case", type=_list(str),
                   help="models suite: only these cases (names or prefixes, see --list-cases)")
    p.add_argument("--smoke", action="store_true",
                   help="models suite: every case at its tiny CPU scaling (the default "
                        "without CUDA)")
    p.add_argument("--list-cases", action="store_true",
                   help="models suite: list the cases, then exit")
    return p


GRID_ONLY = ("hdim", "hdim_v", "seqlen", "seqlen_k", "batch", "nheads", "nheads_kv", "causal",
             "quick", "flex_seqlens")


def resolve_model_cases(args: argparse.Namespace, cuda: bool) -> list:
    """The models suite's cases: full size on CUDA, the smoke scaling on the CPU or with
    --smoke. Raises ValueError for grid options (they do not apply) or an unknown case."""
    from .models import models_suite, select_cases

    given = [f"--{n.replace('_', '-')}" for n in GRID_ONLY
             if getattr(args, n) not in (None, False, "all")]
    if given:
        raise ValueError(f"{', '.join(given)} shape(s) the grid; the models suite's cases "
                         "have their own shapes (select them with --case)")
    cases = select_cases(models_suite(), [n.removesuffix("-smoke") for n in args.case or ()])
    if args.smoke or not cuda:
        cases = [c.smoke() for c in cases]
    if args.dtype:
        cases = [dataclasses.replace(c, dtype=args.dtype) for c in cases]
    return cases


def resolve_grid(args: argparse.Namespace, cuda: bool) -> Grid:
    """Explicit options win over the --quick / CPU defaults, which win over the full grid."""
    base = FULL_GRID if cuda and not args.quick else QUICK_GRID if cuda else CPU_GRID
    return Grid(
        hdims=args.hdim or base.hdims,
        seqlens=args.seqlen or base.seqlens,
        causals=args.causal or base.causals,
        dtype=args.dtype or base.dtype,
        batch=args.batch or base.batch,
        nheads=args.nheads or base.nheads,
        nheads_kv=args.nheads_kv or base.nheads_kv,
        hdim_v=args.hdim_v or base.hdim_v,
        seqlen_k=args.seqlen_k or base.seqlen_k,
    )


def build_cases(grid: Grid) -> list:
    """Cases in table order: hdim, then causal, then seqlen.

    Raises ValueError for a shape that cannot exist (heads not a multiple of kv heads).
    """
    cases = []
    for hdim in grid.hdims:
        nheads = grid.nheads or max(1, MODEL_DIM // hdim)
        nheads_kv = grid.nheads_kv or nheads
        if nheads % nheads_kv:
            raise ValueError(f"nheads ({nheads}) must be a multiple of --nheads-kv "
                             f"({nheads_kv})")
        for causal in grid.causals:
            for seqlen in grid.seqlens:
                batch = grid.batch or max(1, TOKENS // seqlen)
                cases.append(Case(batch, seqlen, grid.seqlen_k or seqlen, nheads, nheads_kv, hdim,
                                  grid.hdim_v or hdim, causal, grid.dtype))
    return cases


# --------------------------------------------------------------------------------------------
# Progress


class Progress:
    """tqdm on stderr when installed, else one "[i/n] cell" line per cell."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.count, self.stream = total, 0, stream
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=stream, unit="cell", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def __call__(self, desc: str) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.set_description_str(desc, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.count}/{self.total}] {desc}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------
# The run


def default_reference() -> Callable:
    from ..reference import attention_ref

    return attention_ref


@dataclass
class Run:
    """What one invocation measured, ready to report."""

    results: list
    runner: Runner
    cases: list
    device: str


def run(cases: Sequence[Case], providers: list, modes: Sequence[str], device: str,
        timer: Timer, reference_fn: Callable, progress: Callable | None = None,
        after_case: Callable | None = None, runner_cls: type = Runner) -> Run:
    """after_case(partial Run) is called after each shape: a run stopped by a time limit
    still leaves every finished shape on disk. runner_cls: Runner (the grid) or
    models.ModelRunner (the models suite)."""
    progress = progress or (lambda desc: None)
    runner = runner_cls(providers, modes, timer, device, reference_fn, progress)
    done = Run([], runner, [], device)
    for case in cases:
        done.results.extend(runner.run_case(case))
        done.cases.append(case)
        if after_case is not None:
            after_case(done)
    return done


def write_outputs(out_dir: Path, result: Run, env: dict, extra: dict,
                  plots: bool = True) -> str:
    """Write results.md, results.json and the charts; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ours = {p.name for p in result.runner.providers if p.is_asymflash}
    headline = next((p.name for p in result.runner.providers if p.headline), None)
    title = f"{env['device']}, {result.cases[0].dtype}" if result.cases else env["device"]
    markdown = bench_report.markdown_report(result.results, ours, title, headline)
    (out_dir / "results.md").write_text(markdown)
    record = bench_report.json_record(result.results, env, list(result.runner.providers),
                                      result.runner.unavailable, ours, extra, headline)
    bench_report.write_json(out_dir / "results.json", record)
    if plots and result.results:
        if importlib.util.find_spec("matplotlib") is None:
            print("asymflash bench: matplotlib is not installed, so no charts (pip install "
                  "'asymflash[bench]'); the tables and JSON are written", file=sys.stderr)
        else:
            bench_report.write_charts(out_dir, result.results, env["device"])
    return markdown


def _result_from_record(rec: dict) -> Result:
    cls = ModelCase if "kind" in rec else Case
    fields = {f.name: rec[f.name] for f in dataclasses.fields(cls)}
    for name in ("window", "doc_lens", "cache_lens", "doc_dist"):  # JSON gives lists
        if name in fields:
            fields[name] = tuple(fields[name])
    case = cls(**fields)
    errors = {k: (e["max_abs_err"], e["bound"]) for k, e in rec.get("errors", {}).items()}
    return Result(case, rec["mode"], rec["provider"], rec["status"], rec["ms"], rec["tflops"],
                  rec.get("reason", ""), errors, rec.get("host_us"))


def merge(dirs: list, out_dir: Path | None, plots: bool = True) -> int:
    """One report from several runs (e.g. one process per head dim on the GPU machine).

    Peers must have been measured side by side within each run; merging only concatenates
    cells, it never mixes numbers of different runs within one cell.
    """
    results, providers, unavailable, envs, commands = [], {}, {}, [], []
    for d in dirs:
        record = json.loads((Path(d) / "results.json").read_text())
        results += [_result_from_record(r) for r in record["results"]]
        for p in record["providers"]:
            providers.setdefault(p["name"], Provider(p["name"], None, is_asymflash=p["asymflash"],
                                                     description=p["description"],
                                                     headline=p.get("headline", False)))
            if p.get("unavailable"):
                unavailable[p["name"]] = p["unavailable"]
        envs.append(record["env"])
        commands.append(record["env"].get("command", ""))
    env = dict(envs[0], command=" ; ".join(commands), merged_from=[str(d) for d in dirs])
    out_dir = out_dir or _default_out(env)
    runner = SimpleNamespace(providers=list(providers.values()), unavailable=unavailable)
    cases = list(dict.fromkeys(r.case for r in results))
    markdown = write_outputs(out_dir, Run(results, runner, cases, env["device"]), env,
                             {"merged_from": env["merged_from"]}, plots=plots)
    print(markdown)
    return 0


def _default_out(env: dict) -> Path:
    """Outside any checkout: results are the user's, not the repository's."""
    day = env["date"][:10]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "asymflash" / "bench" / f"{day}-{bench_report.device_slug(env['device'])}"


def _list_providers(providers: list) -> int:
    for p in providers:
        reason = probe(p.available)
        status = "ok" if not reason else f"n/a ({reason})"
        print(f"{p.name:16s} {status}  {p.description}")
    return 0


def main(argv: list | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, plots=not args.no_plots)
    cuda = torch.cuda.is_available()
    if not cuda:
        print("asymflash bench: CUDA is not available. Running a small CPU comparison "
              "instead (asymflash CPU path vs torch SDPA math: correctness and time); the "
              "GPU grid needs a CUDA device.", file=sys.stderr)
    device = "cuda" if cuda else "cpu"
    flex_seqlens = None if args.flex_seqlens == "all" else set(_list(_size)(args.flex_seqlens))
    providers = (bench_providers.gpu_providers(device, flex_seqlens) if cuda
                 else bench_providers.cpu_providers())
    timer = cuda_timer(args.warmup, args.rep) if cuda else cpu_timer()
    models = args.suite == "models"
    fp8 = args.dtype == FP8
    if fp8:
        if models:
            parser.error("--dtype fp8 runs the grid (the models suite has no fp8 cases)")
        if args.mode and tuple(args.mode) != ("fwd",):
            parser.error("--dtype fp8 is forward only: --mode fwd")
        args.mode = ("fwd",)
        providers = fp8_providers()
    if not args.mode:
        args.mode = ("fwd", "fwdbwd") if models else ("fwd", "bwd")
    try:
        providers = bench_providers.select(providers, args.providers)
        cases = (resolve_model_cases(args, cuda) if models
                 else build_cases(resolve_grid(args, cuda)))
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    if args.list_providers:
        return _list_providers(providers)
    if args.list_cases:
        if not models:
            parser.error("--list-cases lists the models suite's cases: add --suite models")
        for c in cases:
            print(f"{c.name:36s} {c.model}")
        return 0
    command = "python -m asymflash bench " + " ".join(shlex.quote(a) for a in argv)
    env = bench_report.collect_env(device, command.strip())
    progress = Progress(len(cases) * len(providers) * len(args.mode))
    out_dir = args.out or _default_out(env)
    extra = {"argv": argv, "suite": args.suite, "modes": list(args.mode),
             "timer": f"do_bench median, warmup {args.warmup} ms, rep {args.rep} ms"
             if cuda else "CPU wall clock, median of 5 after 1 warm-up",
             "check": "every batch and head, the first call and a repeated (planned) one, "
                      "vs asymflash.reference.attention_ref in fp32, chunked over queries; "
                      "pass if max|x - ref| <= 2 * max|plain - ref| + 2^-10 * max|ref|, "
                      "plain = attention_ref(upcast=False) in the input dtype" + (
                          "; fp8: the reference and plain see the dequantised inputs "
                          "(plain in bf16, its P rounded to e4m3 before P·V as fp8 kernels run it)"
                          if fp8 else "")}

    def checkpoint(partial: Run) -> None:
        write_outputs(out_dir, partial, env, dict(extra, partial=True), plots=False)

    try:
        result = run(cases, providers, args.mode, device, timer, default_reference(), progress,
                     after_case=checkpoint if cuda else None,
                     runner_cls=ModelRunner if models else Fp8Runner if fp8 else Runner)
    finally:
        progress.close()
    markdown = write_outputs(out_dir, result, env, extra, plots=not args.no_plots)
    print(markdown)
    print(f"asymflash bench: wrote {out_dir}/results.md and results.json", file=sys.stderr)
    ours = {p.name for p in providers if p.is_asymflash}
    wrong = [r for r in result.results if r.provider in ours and r.status == WRONG]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
