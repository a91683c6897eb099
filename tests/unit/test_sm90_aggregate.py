"""`sm90.common.aggregate`: the constructor it gives a class without one, and the kernel-cache
key that constructor carries (no GPU needed)."""

from __future__ import annotations

import pytest

from asymflash.backends.sm90 import common

pytestmark = pytest.mark.skipif(common.GLUON_ERROR is not None, reason=str(common.GLUON_ERROR))
gl = getattr(common, "gl", None)  # the annotations below resolve in this module's globals


def _pair():
    @common.aggregate
    class Ab:
        a: gl.tensor
        b: gl.constexpr

    @common.aggregate
    class Ba:
        b: gl.constexpr
        a: gl.tensor

    return Ab, Ba


def test_a_changed_field_order_changes_the_kernel_cache_key():
    """The generated constructor's source is the same for every class: the fields must key
    Triton's cache, or a reordered aggregate would reuse a kernel built for the old order."""
    ab, ba = _pair()
    key_ab, key_ba = ab.hash_attrs[0].cache_key, ba.hash_attrs[0].cache_key
    assert key_ab != key_ba
    assert key_ab == _pair()[0].hash_attrs[0].cache_key  # and the same fields, the same key
