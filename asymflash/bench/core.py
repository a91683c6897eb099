"""The measuring part of `asymflash bench`: cells, FLOP counts, the correctness check, timing.

One *case* is a problem shape (batch, seqlens, heads, head dims, causal, dtype). One *cell*
is a case x mode ("fwd", "bwd", "fwdbwd") x provider; every cell ends as a `Result` whose
status is OK (checked, then timed), NA (the provider cannot run it), ERROR (it raised) or
WRONG (it ran but disagrees with the fp32 reference; never timed, never counted as a win).

Nothing here knows about particular libraries: providers come in as `Provider` objects
(bench_providers.py has the real ones; tests inject fakes).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

OK, NA, ERROR, WRONG = "ok", "n/a", "error", "WRONG"
MODES = ("fwd", "bwd", "fwdbwd")
# FLOPs of a mode as a multiple of the forward's (FlashAttention papers: backward = 2.5 x).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# fp8: e4m3 inputs with per-head descales, forward only (bench/fp8.py makes its inputs).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.float8_e4m3fn}

# Extra absolute slack of the tolerance, relative to the reference's largest magnitude. The
# FlashAttention rule alone (2 x the error of a same-dtype plain computation) is zero in fp32,
# where the plain computation *is* the reference, so some slack is needed; 2^-10 is far below
# what a real bug (wrong mask, scale, or head mapping) produces, which is O(1) relative.
ATOL_REL = 2.0**-10

FwdFn = Callable[[], torch.Tensor]
Timer = Callable[[Callable[[], object], Sequence[torch.Tensor]], float]


@dataclass(frozen=True)
class Case:
    """One problem shape; tensors are BSHD (batch, seqlen, nheads, headdim)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    hdim: int
    hdim_v: int
    causal: bool
    dtype: str = "bf16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        gqa = f" kv_heads={self.nheads_kv}" if self.nheads_kv != self.nheads else ""
        dv = f" hdim_v={self.hdim_v}" if self.hdim_v != self.hdim else ""
        seq = (str(self.seqlen_q) if self.seqlen_q == self.seqlen_k
               else f"{self.seqlen_q}x{self.seqlen_k}")
        return f"hdim={self.hdim}{dv} causal={int(self.causal)} seqlen={seq}{gqa}"

    @property
    def out_shape(self) -> tuple:
        return (self.batch, self.seqlen_q, self.nheads, self.hdim_v)

    @property
    def modes(self) -> tuple:
        """The modes this case has (every one; decode cases of the models suite: fwd)."""
        return MODES

    def pairs(self) -> float:
        """Visible (query, key) pairs per sequence (visible_pairs)."""
        return visible_pairs(self.seqlen_q, self.seqlen_k, self.causal)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """(query, key) pairs that take part, by the FlashAttention papers' convention.

    Causal with seqlen_q == seqlen_k counts half the square (s^2 / 2, not s(s+1)/2) so our
    numbers compare with the published ones. Other causal shapes count the keys each query
    sees under the bottom-right-aligned mask exactly, since "half" means nothing there.
    """
    if not causal:
        return float(seqlen_q * seqlen_k)
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2.0
    shift = seqlen_k - seqlen_q  # query i sees keys 0 .. i + shift
    return float(sum(min(max(i + shift + 1, 0), seqlen_k) for i in range(seqlen_q)))


def attention_flops(case: Case, mode: str) -> float:
    """Matmul FLOPs: QK^T costs 2*d and PV 2*dv per visible pair and query head.

    Query heads count, not kv heads: GQA shares K/V but every query head does its own work.
    """
    fwd = 2.0 * case.batch * case.nheads * (case.hdim + case.hdim_v) * case.pairs()
    return fwd * MODE_FLOP_FACTOR[mode]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass
class Provider:
    """One way of computing attention, benchmarked side by side with the others.

    make_fwd(q, k, v, causal) receives BSHD tensors and returns a no-argument function that
    computes the BSHD output. Everything that is not the attention itself (layout changes,
    block masks, imports, compilation handles) belongs in make_fwd, outside the timed region.
    It may raise NotImplementedError (the cell is listed n/a) or anything else (error).
    available() returns why the provider cannot run at all in this process, or None.
    context() is entered around the check and the timing of each cell (e.g. forcing an SDPA
    or asymflash backend), so its cost stays out of the timed function.
    """

    name: str
    make_fwd: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], FwdFn]
    available: Callable[[], str | None] = lambda: None
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    is_asymflash: bool = False
    description: str = ""
    modes: tuple | None = None  # the modes it runs (None: all); others are listed n/a
    opt_in: bool = False  # runs only when named in --providers (variants of a backend)
    # The asymflash provider the "asymflash / best peer" ratio reports: flash_attn_func's
    # default path on this device (variants and other backends are shown, never counted).
    headline: bool = False
    # The models suite's call: make_model(case, inputs, q, k, v) -> FwdFn, with q/k/v as the
    # case's kind lays them out (bench/models.py); None: the provider is not in that suite.
    make_model: Callable | None = None


@dataclass
class Result:
    case: Case
    mode: str
    provider: str
    status: str
    ms: float | None = None
    tflops: float | None = None
    reason: str = ""
    # tensor name -> (max abs error vs fp32 reference, allowed bound)
    errors: dict = field(default_factory=dict)
    # Python time to issue one call (CUDA only): close to ms * 1000, the cell measured the
    # host, not the kernel (H200: our 512-row backwards, 430-900 us per call)
    host_us: float | None = None


# --------------------------------------------------------------------------------------------
# Inputs and the reference


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor

    def leaves(self) -> tuple:
        """Views of q, k, v that require grad: the backward providers' inputs.

        They share storage with the forward inputs, so every provider sees the same values.
        """
        return tuple(t.detach().requires_grad_(True) for t in (self.q, self.k, self.v))


def make_inputs(case: Case, device, seed: int = 0) -> Inputs:
    """Random normal inputs (never zeros: zeros hide masking and scaling bugs)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=case.torch_dtype)

    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    return Inputs(
        q=randn(b, sq, case.nheads, case.hdim),
        k=randn(b, sk, case.nheads_kv, case.hdim),
        v=randn(b, sk, case.nheads_kv, case.hdim_v),
        dout=randn(b, sq, case.nheads, case.hdim_v),
    )


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def chunked_attention(ref_fn, q, k, v, causal: bool, upcast: bool, dout=None,
                      max_elems: int = 2**26, **kw):
    """ref_fn over blocks of queries, so the score matrix never exists whole.

    A block of queries [a, a + c) under the bottom-right-aligned causal mask sees keys up to
    a + c + (sk - sq); handing ref_fn exactly that many keys puts the block's last query on
    the last key, which is the same alignment, so each block is computed exactly.
    With dout, each block is differentiated right away (grads accumulate in the leaves) so
    the autograd graph of only one block is alive at a time. Returns the output (detached).
    kw (window_size, softcap) go to ref_fn: trimming keys at the end keeps each query's
    position, so windows are computed exactly too.
    """
    sq, sk = q.shape[1], k.shape[1]
    rows = max(1, max_elems // max(1, sk * q.shape[0] * q.shape[2]))
    outs = []
    for a in range(0, sq, rows):
        c = min(rows, sq - a)
        kend = min(sk, max(0, a + c + sk - sq)) if causal else sk
        out = _first(ref_fn(q[:, a:a + c], k[:, :kend], v[:, :kend], causal=causal,
                            upcast=upcast, **kw))
        if dout is not None:
            out.backward(dout[:, a:a + c].to(out.dtype))
        outs.append(out.detach())
    return torch.cat(outs, dim=1)


@dataclass
class Reference:
    """fp32 reference and same-dtype plain results of one case, every batch and head: a
    kernel that mishandles one head or one sequence of a batch must not pass."""

    out: torch.Tensor
    out_plain: torch.Tensor
    grads: tuple | None = None  # dq, dk, dv
    grads_plain: tuple | None = None


def _reference_run(ref_fn, inputs: Inputs, case: Case, upcast, with_grads):
    dtype = torch.float32 if upcast else case.torch_dtype
    q, k, v = (t.to(dtype) for t in (inputs.q, inputs.k, inputs.v))
    if not with_grads:
        with torch.no_grad():
            return chunked_attention(ref_fn, q, k, v, case.causal, upcast), None
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = inputs.dout.to(dtype)
    out = chunked_attention(ref_fn, q, k, v, case.causal, upcast, dout=dout)
    return out, tuple(t.grad.detach() for t in (q, k, v))


def compute_reference(ref_fn, inputs: Inputs, case: Case, with_grads: bool) -> Reference:
    out, grads = _reference_run(ref_fn, inputs, case, True, with_grads)
    plain, grads_plain = _reference_run(ref_fn, inputs, case, False, with_grads)
    return Reference(out, plain, grads, grads_plain)


def error_and_bound(got: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor) -> tuple:
    """The FlashAttention tolerance rule on one tensor.

    A result passes when max|got - ref| <= 2 * max|plain - ref| + ATOL_REL * max|ref|, where
    ref is fp32 and plain is the same math done in the input dtype: a kernel may be at most
    twice as inexact as the straightforward computation in its own precision.
    """
    ref = ref.float()
    err = (got.float() - ref).abs().max().item()
    plain_err = (plain.float() - ref).abs().max().item()
    return err, 2.0 * plain_err + ATOL_REL * ref.abs().max().item()


# --------------------------------------------------------------------------------------------
# Timing


def cuda_timer(warmup_ms: int = 25, rep_ms: int = 100) -> Timer:
    """Median of CUDA-event timings after warm-up (compilation happened in the check)."""

    def timer(fn, grad_to_none):
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none),
                        return_mode="median")

    return timer


def cpu_timer(reps: int = 5, warmup: int = 1) -> Timer:
    """Median wall time; do_bench needs a GPU driver, the CPU fallback has none."""

    def timer(fn, grad_to_none):
        samples = []
        for i in range(warmup + reps):
            for t in grad_to_none:
                t.grad = None
            start = time.perf_counter()
            fn()
            if i >= warmup:
                samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return timer


# --------------------------------------------------------------------------------------------
# Running cells


def host_issue_us(fn: Callable[[], object], n: int = 200) -> float:
    """Python time to issue one call (no sync inside the loop), averaged over n calls: when
    it exceeds the GPU time the GPU idles and a benchmark measures the host, not the kernel."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """`fn` captured in a CUDA graph (warmed up on a side stream first, replayed once), as
    serving engines run decode steps: replaying it times the GPU work alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and workspaces happen outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def profile_calls(fn: Callable[[], object], n: int = 200, top: int = 18) -> str:
    """cProfile of n calls of fn (GPU synchronised after), the `top` heaviest functions by
    own time, from the table's header line: where a short call's host time goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:start + top + 1])


def probe(fn: Callable[[], object]) -> str | None:
    """Run a probe (an import, an availability check); its failure as a short reason.

    Peers fail in many ways at import time (ImportError, CUDA or ABI errors, assertion in a
    package's __init__); the harness lists every one of them rather than dying on it.
    """
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here"
        return short_reason(exc)
    return result if isinstance(result, str) and result else None


def short_reason(exc: BaseException, limit: int = 200) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_shape(out, case: Case):
    want = case.out_shape
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"out": (math.inf, 0.0)}, f"output shape {got}, expected {want}"
    return None, ""


def check_cell(mode: str, fn: FwdFn, leaves, inputs: Inputs, ref: Reference, case: Case):
    """Run the provider once and compare it with the reference; returns (errors, reason).

    reason is empty when every tensor is within its bound.
    """
    out = fn()
    errors, reason = _check_shape(out, case)
    if errors:
        return errors, reason
    errors = {"out": error_and_bound(out, ref.out, ref.out_plain)}
    if mode != "fwd":
        for t in leaves:
            t.grad = None
        out.backward(inputs.dout)
        for name, t, r, p in zip(("dq", "dk", "dv"), leaves, ref.grads, ref.grads_plain):
            got = t.grad if t.grad is not None else torch.full_like(r, math.nan)
            errors[name] = error_and_bound(got, r, p)
            t.grad = None
    # `not err <= bound` also catches NaN, which compares false with everything.
    bad = [name for name, (err, bound) in errors.items() if not err <= bound]
    reason = ", ".join(f"{n} err {errors[n][0]:.3g} > {errors[n][1]:.3g}" for n in bad)
    return errors, reason


def cell_call(mode: str, fn: FwdFn, dout: torch.Tensor) -> Callable[[], object]:
    """What a cell times: the forward, the backward alone, or both."""
    if mode == "fwd":
        return fn
    if mode == "bwd":
        # The forward runs once here, outside the timed region; the graph is kept so the
        # same backward can be replayed (grads are reset to None by the timer each time).
        out = fn()
        return lambda: out.backward(dout, retain_graph=True)
    return lambda: fn().backward(dout)


def time_cell(mode: str, fn: FwdFn, leaves, dout: torch.Tensor, timer: Timer) -> float:
    return timer(cell_call(mode, fn, dout), leaves if mode != "fwd" else ())


def cell_host_us(mode: str, fn: FwdFn, leaves, dout: torch.Tensor, n: int = 20) -> float:
    """host_issue_us of a cell's call, grads reset between calls as the timer does."""
    call = cell_call(mode, fn, dout)

    def issue():
        for t in leaves:
            t.grad = None
        call()
    return host_issue_us(issue, n)


@dataclass
class Runner:
    """Runs every (case, provider, mode) cell; one instance per benchmark run."""

    providers: Sequence[Provider]
    modes: Sequence[str]
    timer: Timer
    device: str
    reference_fn: Callable
    progress: Callable[[str], None] = lambda desc: None
    seed: int = 0
    unavailable: dict = field(default_factory=dict)  # provider name -> reason

    def __post_init__(self):
        for p in self.providers:
            reason = probe(p.available)
            if reason:
                self.unavailable[p.name] = reason

    def run(self, cases: Sequence[Case]) -> list:
        results = []
        for case in cases:
            results.extend(self.run_case(case))
        return results

    # The three things a suite of another kind of case replaces (bench/models.py).
    def make_inputs(self, case: Case) -> Inputs:
        return make_inputs(case, self.device, self.seed)

    def reference(self, inputs: Inputs, case: Case, with_grads: bool) -> Reference:
        return compute_reference(self.reference_fn, inputs, case, with_grads)

    def make_call(self, provider: Provider, case: Case, inputs: Inputs, q, k, v) -> FwdFn:
        return provider.make_fwd(q, k, v, case.causal)

    def run_case(self, case: Case) -> list:
        inputs = self.make_inputs(case)
        with_grads = any(m != "fwd" for m in self.modes if m in case.modes)
        ref = self.reference(inputs, case, with_grads)
        results = []
        for provider in self.providers:
            for mode in self.modes:
                self.progress(f"{case.label} {mode} {provider.name}")
                results.append(self.run_cell(provider, case, mode, inputs, ref))
        return results

    def _host_us(self, mode, fn, leaves, dout) -> float | None:
        """cell_host_us on CUDA; None elsewhere or if it fails (the timing stands)."""
        if self.device != "cuda":
            return None
        try:
            return cell_host_us(mode, fn, leaves, dout)
        except Exception:  # noqa: BLE001 - a diagnostic, never a reason to drop a cell
            return None

    def run_cell(self, provider: Provider, case: Case, mode: str, inputs: Inputs,
                 ref: Reference) -> Result:
        def result(status, **kw):
            return Result(case, mode, provider.name, status, **kw)

        if provider.name in self.unavailable:
            return result(NA, reason=self.unavailable[provider.name])
        if provider.modes is not None and mode not in provider.modes:
            return result(NA, reason=f"runs only {', '.join(provider.modes)}")
        if mode not in case.modes:
            return result(NA, reason=f"the case has only {', '.join(case.modes)}")
        leaves = inputs.leaves() if mode != "fwd" else ()
        q, k, v = leaves or (inputs.q, inputs.k, inputs.v)
        try:
            with provider.context():
                fn = self.make_call(provider, case, inputs, q, k, v)
                # Twice: a repeated call takes another path than the first (call plans,
                # bound launches), and that path is the one timed.
                for call in ("first call", "repeated call"):
                    errors, wrong = check_cell(mode, fn, leaves, inputs, ref, case)
                    if wrong:
                        return result(WRONG, reason=f"{call}: {wrong}", errors=errors)
                ms = time_cell(mode, fn, leaves, inputs.dout, self.timer)
                host = self._host_us(mode, fn, leaves, inputs.dout)
        except NotImplementedError as exc:
            return result(NA, reason=short_reason(exc))
        except Exception as exc:  # noqa: BLE001 - a failing peer is a result, not a crash
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # an OOM in one cell should not doom the next ones
            return result(ERROR, reason=short_reason(exc))
        return result(OK, ms=ms, tflops=tflops(attention_flops(case, mode), ms), errors=errors,
                      host_us=host)
