"""Test setup: on a machine without CUDA, the portable Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before Triton decorates the kernels, so before asymflash is
imported; on a GPU machine the kernels are compiled as usual.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
