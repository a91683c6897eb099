"""Values computed from a tensor's contents, kept while that tensor is unchanged.

Reading a CUDA tensor on the host (`.tolist()`, `int(t.max())`) waits for every kernel queued
before it. Code called once per layer with the same small tensor (cu_seqlens, a padding mask)
pays that wait in every layer unless it remembers what it read. `TensorMemo` remembers a
value per (tensor object, what) for as long as the object lives and its version counter,
which torch bumps on every in-place change to it or its views, is unchanged. (Writes that
bypass torch, such as a custom kernel writing through the data pointer, are not seen.)
"""

from __future__ import annotations

import weakref

import torch

_MISSING = object()


class TensorMemo:
    def __init__(self):
        self._values: dict = {}

    def get(self, t: torch.Tensor, what, default=None):
        """The value put for (t, what), or `default` if t changed or was never seen."""
        entry = self._values.get((id(t), what), _MISSING)
        if entry is _MISSING or entry[0]() is not t or entry[1] != t._version:
            return default
        return entry[2]

    def put(self, t: torch.Tensor, what, value) -> None:
        key = (id(t), what)
        values = self._values
        values[key] = (weakref.ref(t, lambda _ref, key=key: values.pop(key, None)),
                       t._version, value)
