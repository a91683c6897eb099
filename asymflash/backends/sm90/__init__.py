"""Hopper (sm_90a) fast paths written in Gluon.

`fwd/` holds the warp-specialised forward (kernel, host, config); `bwd` the backward; what
both share: `common` (import guard, descriptors, small device helpers), `bounds` (mask
bounds), `sched` (tile orders). Importing this package never needs a GPU: the Gluon kernels
are only defined when `triton.experimental.gluon` imports, and every entry point reports
through `unsupported()` why it cannot run on the current machine.
"""
