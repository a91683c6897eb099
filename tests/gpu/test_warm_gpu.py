"""`python -m asymflash warm` (marker `gpu`): after it, a fresh process making the same call
compiles nothing (Triton's cache gains no entry) and its first call is fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

_CALL = r"""
import sys, time, torch
from asymflash import flash_attn_func
q, k, v = (torch.randn(2, 1024, h, 128, dtype=torch.bfloat16, device="cuda",
                       requires_grad=True) for h in (16, 4, 4))
torch.cuda.synchronize()
start = time.perf_counter()
out = flash_attn_func(q, k, v, causal=True)
out.backward(torch.ones_like(out))
torch.cuda.synchronize()
print(f"first call {time.perf_counter() - start:.3f} s")
"""


def test_a_warmed_process_compiles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                            "TRITON_ALWAYS_COMPILE")}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    warm = subprocess.run([sys.executable, "-m", "asymflash", "warm", "--heads", "16",
                           "--kv-heads", "4", "--head-dim", "128", "--seqlen", "1024",
                           "--batch", "2", "--causal"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert entries, "warm put nothing in Triton's cache"
    again = subprocess.run([sys.executable, "-c", _CALL], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    after = sorted(p.name for p in (tmp_path / "cache").iterdir())
    # each cache entry is a directory of one kernel's files (<kernel name>.json, .cubin, ...)
    new = {e: sorted(f.name for f in (tmp_path / "cache" / e).iterdir())
           for e in set(after) - set(entries)}
    assert after == entries, (
        f"the warmed process compiled kernels warm did not: {again.stdout} new: {new}")
    print(warm.stdout, again.stdout)
