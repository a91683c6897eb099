"""Work a process's first kernel launch would otherwise wait for, started at import.

Triton keys its disk cache of compiled kernels on a hash of its own installation, its
~400-500 MB shared library included (`triton.runtime.cache.triton_key`, computed once per
process): ~0.3 s of a process's first launch even when every kernel comes from the disk
cache. Hashing and file reads release the GIL, so a daemon thread started at import does it
while the program builds its model and initialises CUDA; the first launch then finds it
done. The result is Triton's own (its lru_cache): nothing here decides a cache key.

Only on a CUDA build of torch (where a launch can follow); a launch that comes before the
thread is done computes the same value itself, as it would without this.
"""

from __future__ import annotations

import threading

import torch

_started = False


def _hash_triton() -> None:
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:
        pass  # a Triton without it: the first launch meets the problem and reports it


def prefetch_triton_key():
    """Start hashing Triton's installation in the background, once per process; returns
    the thread, or None where nothing started."""
    global _started
    if _started or torch.version.cuda is None:
        return None
    try:
        # Imported here: an import inside the thread could contend with the program's own.
        import triton.runtime.cache  # noqa: F401
    except Exception:  # no Triton, or a broken one: the backends report it when asked
        return None
    _started = True
    thread = threading.Thread(target=_hash_triton, name="asymflash-triton-key", daemon=True)
    thread.start()
    return thread
