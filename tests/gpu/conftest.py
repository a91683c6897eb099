"""Fixtures the GPU test files share."""

from __future__ import annotations

import pytest


@pytest.fixture
def registered():
    """asymflash behind torch's SDPA flash ops for one test, its call counts cleared."""
    from asymflash.integrations import torch_sdpa

    torch_sdpa.register()
    torch_sdpa.stats.clear()
    yield
    torch_sdpa.unregister()
