"""Hopper (sm_90a) fast paths written in Gluon.

`fwd` holds the warp-specialised forward; `bwd` the backward (its d=256 kernel in `bwd_wide`,
the pieces both share in `bwd_parts`). Importing this package never needs a GPU: the Gluon
kernels are only defined when `triton.experimental.gluon` imports, and every entry point
reports through `unsupported()` why it cannot run on the current machine.
"""

from . import fwd

__all__ = ["fwd"]
