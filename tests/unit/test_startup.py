"""The import-time prefetch of Triton's installation hash (runtime/startup.py)."""

from __future__ import annotations

import pytest
import torch

from asymflash.runtime import startup

cache = pytest.importorskip("triton.runtime.cache")


def test_prefetch_fills_tritons_own_cache(monkeypatch):
    monkeypatch.setattr(startup, "_started", False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    cache.triton_key.cache_clear()
    thread = startup.prefetch_triton_key()
    assert thread is not None
    thread.join(timeout=60)
    assert cache.triton_key.cache_info().currsize == 1
    prefetched = cache.triton_key()
    assert cache.triton_key.cache_info().hits >= 1
    cache.triton_key.cache_clear()
    assert cache.triton_key() == prefetched  # the same key Triton computes itself
    assert startup.prefetch_triton_key() is None  # once per process


def test_no_prefetch_on_a_cpu_build(monkeypatch):
    monkeypatch.setattr(startup, "_started", False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert startup.prefetch_triton_key() is None


def test_import_does_not_import_dynamo():
    """`import asymflash` leaves Dynamo unimported (~1 s of a process's start on the CPU
    machine): the torch.compile paths import it when a trace calls them
    (api/flex_compiled.py)."""
    import subprocess
    import sys

    code = ("import sys, torch; loaded = 'torch._dynamo' in sys.modules; import asymflash; "
            "print(loaded, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    if out[0] == "True":
        pytest.skip("this torch imports Dynamo itself")
    assert out[1] == "False", "import asymflash imported torch._dynamo"
