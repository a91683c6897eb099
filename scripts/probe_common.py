"""Shared by the probe scripts: load the GPU test modules where pytest is missing; force a
decode config."""

from __future__ import annotations

import contextlib
import sys
import types


def ensure_pytest() -> None:
    """Install a stand-in `pytest` (marks and skip as no-ops) when the real one is absent, so
    the probes can import tests/test_sm90_*_gpu.py for their cases and checks."""
    try:
        import pytest  # noqa: F401
        return
    except ImportError:
        pass
    stub = types.ModuleType("pytest")

    class _Mark:
        def __getattr__(self, name):
            def deco(*a, **k):
                if len(a) == 1 and callable(a[0]) and not k:
                    return a[0]
                return lambda f: f
            return deco

    stub.mark = _Mark()
    stub.skip = lambda *a, **k: None
    sys.modules["pytest"] = stub


def patched_module(src, edits, tag: str):
    """Import a copy of the kernel module `src` (a Path under asymflash/backends/sm90) with
    `edits` applied: (old, new, count) exact text replacements, each of which must match
    `count` times (the diagnostic exits naming the first that does not, e.g. after a
    refactor). The copy sits next to `src` so its relative imports resolve, under a name
    ending in `tag`, and is removed once imported (Triton has read the kernels' source)."""
    import importlib.util
    import os

    text = src.read_text()
    for old, new, count in edits:
        found = text.count(old)
        if found != count:
            sys.exit(f"{tag}: expected {count} of {old[:70]!r} in {src.name}, found {found}")
        text = text.replace(old, new)
    path = src.with_name(f"_{tag.replace('-', '_')}_{os.getpid()}.py")
    path.write_text(text)
    try:
        package = ".".join(path.parent.parts[path.parent.parts.index("asymflash"):])
        name = f"{package}.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        path.unlink()
    return mod


def backward_cell(d: int, seqlen: int, causal: bool):
    """(arguments of `bwd.backward`, batch, heads) of one README-shaped cell: bf16, model dim
    2048, batch · seqlen = 16k, its forward run by the sm90 forward."""
    import torch

    from asymflash.backends.sm90.fwd import host as fwd
    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    batch, heads = 16384 // seqlen, 2048 // d
    q = torch.randn(batch * seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    seq = SeqInfo.dense(batch, seqlen, seqlen, q.device)
    params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1), 0.0, False)
    out, lse = fwd.forward(q, k, v, seq, params, None)
    return (torch.randn_like(out), q, k, v, out, lse, None, seq, params, None), batch, heads


def time_stamped_ws(ws_kernel, stamps, args, cfg=None) -> tuple[float, float]:
    """`bwd.backward(*args, cfg=cfg)` timed as it is and with the launch entry of bwd_ws
    calls swapped for `ws_kernel` (a stamped copy of `entry.attn_bwd_kernel`, one whose
    bwd_ws body is stamped: `patched_module`), the stamp buffer passed where the
    semaphore goes (read by neither deterministic calls nor persistent grids, which `cfg`
    must rule out); (plain, stamped) milliseconds. `stamps` holds one call's stamps
    afterwards."""
    import torch
    from triton.testing import do_bench

    from asymflash.backends.sm90.bwd import host as bwd
    from asymflash.runtime.launch import DirectLaunch

    launcher = DirectLaunch(ws_kernel)
    real_launcher, real_sem = bwd._launcher_for, bwd._unused_semaphore
    plain = do_bench(lambda: bwd.backward(*args, cfg=cfg), warmup=10, rep=40)
    bwd._launcher_for = lambda w, split=False: launcher if split else real_launcher(w, split)
    bwd._unused_semaphore = lambda device: stamps
    try:
        stamped = do_bench(lambda: bwd.backward(*args, cfg=cfg), warmup=10, rep=40)
        stamps.zero_()
        bwd.backward(*args, cfg=cfg)
        torch.cuda.synchronize()
    finally:
        bwd._launcher_for, bwd._unused_semaphore = real_launcher, real_sem
    return plain, stamped


# `patched_module` edits that hand bwd_ws's compute partitions the semaphore argument (unread
# without deterministic mode), which the stamping scripts use as their stamp buffer.
WS_COMPUTE_TAKES_SEM = [
    ("    def _ws_compute(shared, WG: gl.constexpr,",
     "    def _ws_compute(shared, sem_ptr, WG: gl.constexpr,", 1),
    ("(_ws_compute, (shared, 0,", "(_ws_compute, (shared, sem_ptr, 0,", 1),
    ("(_ws_compute, (shared, 1,", "(_ws_compute, (shared, sem_ptr, 1,", 1),
]


# Gluon source the stamping scripts patch into bwd_ws.py's copy (`patched_module`): a special
# register (%clock, %smid, ...) read as an int32 tensor; x, any int32 operand, orders the read
# after it.
STAMP_READ = '''
    @gluon.jit
    def _stamp_read(x, WHAT: gl.constexpr):
        return gl.inline_asm_elementwise("mov.u32 $0, " + WHAT + ";", "=r,r", [x],
                                         dtype=gl.int32, is_pure=False, pack=1)
'''


@contextlib.contextmanager
def forced_decode_config(cfg):
    """Within the block the portable decode kernel runs `cfg` (a DecodeConfig) on every call.

    Both caches that would hide it are emptied on the way in and out: the kernel's plans per
    size and flash_attn_with_kvcache's call plans, which keep one bound runner per call
    signature (a sweep that only replaced `select_config` timed the first config it saw)."""
    from asymflash.backends.portable import decode as dec
    from asymflash.runtime import plans

    chosen = dec.select_config
    dec.select_config = lambda *a, **k: cfg
    dec._plan.cache_clear()
    plans.clear()
    try:
        yield
    finally:
        dec.select_config = chosen
        dec._plan.cache_clear()
        plans.clear()
