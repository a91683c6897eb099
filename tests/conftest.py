"""Test setup: on a machine without CUDA, the portable Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before Triton decorates the kernels, so before asymflash is
imported; on a GPU machine the kernels are compiled as usual.

With pytest-xdist installed (the `test` extra), a run without `-n` takes two worker
processes (`-n 0` runs in one process, `-p no:xdist` without the plugin).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


WORKERS = 2  # CI's machine has 2 cores; the suite is CPU-bound


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # Before xdist's own hook (a conftest's runs first among tryfirst ones), so `-n` given
    # here is as if typed; not in xdist's workers (which run this hook too), not for
    # --collect-only (xdist never distributes that) or --pdb.
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses is None
            and not config.option.collectonly and not config.option.usepdb
            and (os.cpu_count() or 1) > 1):
        config.option.numprocesses = WORKERS


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N contiguous slices of the collected tests "
                          "(scripts/gpu-check.sh spreads its slowest file over processes)")


def _take_shard(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {shard}: need 0 <= I < N")
    # Contiguous slices keep neighbouring parametrizations, which share compiled kernels,
    # in one process.
    lo, hi = len(items) * i // n, len(items) * (i + 1) // n
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


def pytest_collection_modifyitems(config, items):
    _take_shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
