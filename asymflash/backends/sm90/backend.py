"""The sm90 backend as dispatch sees it: the Gluon forward and backward.

The backward is new and gated: it runs only with ASYMFLASH_SM90_BWD=1 until the GPU suite and
the benchmark have passed with it on an H200 (then the default flips; benchmarks/NOTES.md).
With it off, the dispatcher sends backwards to the portable kernels.
"""

from __future__ import annotations

import os

from .bwd import backward, unsupported_backward  # noqa: F401 - the backend protocol
from .fwd import forward, unsupported  # noqa: F401 - the backend protocol

NAME = "sm90"


def backward_enabled() -> bool:
    """Read at each call, so a process can switch it (the benchmark, the tests)."""
    return os.environ.get("ASYMFLASH_SM90_BWD", "0") == "1"

