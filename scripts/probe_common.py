"""Shared by the sm90 probe scripts: load the GPU test modules where pytest is missing."""

from __future__ import annotations

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
    """Import a copy of the kernel module `src` (a Path in asymflash/backends/sm90) with
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
        name = f"asymflash.backends.sm90.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        path.unlink()
    return mod
