"""The sm90 backend as dispatch sees it: the Gluon forward and backward.

The Gluon backward is on by default since the GPU suite passed with it on the H200
(2026-11-29, after the seqlen-1 compile fix); ASYMFLASH_SM90_BWD=0 switches it off, and the
dispatcher then sends backwards to the portable kernels (a fallback for bug reports).
"""

from __future__ import annotations

import os

from .bwd import backward, backward_runner, unsupported_backward  # noqa: F401 - the backend protocol
from .fwd import forward, forward_runner, unsupported  # noqa: F401 - the backend protocol

NAME = "sm90"


def backward_enabled() -> bool:
    """Read at each call, so a process can switch it (the benchmark, the tests)."""
    return os.environ.get("ASYMFLASH_SM90_BWD", "1") != "0"

