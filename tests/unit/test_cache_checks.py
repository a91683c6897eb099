"""flash_attn_with_kvcache's index checks on the device (api/cache_checks.py).

On CUDA the default call must never read cache_seqlens (or the page table, batch index,
left padding) on the host: each read waits for the GPU. What is checked here, on the CPU:
the clamps keep every value in range and flag exactly the wrong ones; the assert fails on a
wrong value; and the whole API path taken on CUDA (forced on here, with a recording decode
backend) calls no host read (tolist, item, cpu, numpy, bool/int conversion) on any tensor,
on its first call and its planned repeats, while the CPU path keeps its named host errors.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from asymflash import flash_attn_with_kvcache
from asymflash.api import cache_checks, kvcache
from asymflash.api.cache_checks import CacheGeometry, checked, clamped
from asymflash.runtime import plans


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


GEOM = CacheGeometry(extra=2, capacity=64, num_rows=6, page_size=16, batch_cache=4,
                     appending=True)


def test_good_values_pass_unchanged():
    lens, table = _i32([0, 62, 17]), _i32([[5, 0, 1, 2], [3, 4, 1, 0], [2, 1, -7, 99]])
    (got_lens, got_table, got_idx, got_pad), ok = clamped(
        lens, GEOM, page_table=table, batch_idx=None, leftpad=None)
    assert ok.item() is True
    assert torch.equal(got_lens, lens) and got_lens.dtype == torch.int32
    # the third sequence uses 2 pages ((17 + 2) / 16): its unused entries may be anything
    assert torch.equal(got_table[:, :2], table[:, :2])
    (_, _, idx, pad), ok = clamped(lens, GEOM, batch_idx=_i32([3, 0, 1]),
                                   leftpad=_i32([0, 62, 5]))
    assert ok.item() is True and idx.tolist() == [3, 0, 1] and pad.tolist() == [0, 62, 5]


@pytest.mark.parametrize("kwargs,name", [
    (dict(lens=_i32([0, 63, 1])), "length past capacity - new tokens"),
    (dict(lens=_i32([-1, 3, 1])), "negative length"),
    (dict(page_table=_i32([[0, 1, 2, 3], [6, 0, 0, 0], [0, 0, 0, 0]])), "page past the cache"),
    (dict(page_table=_i32([[0, 1, 2, 3], [0, 0, 0, 0], [0, -1, 0, 0]])), "negative page"),
    (dict(batch_idx=_i32([0, 4, 1])), "cache row past the cache"),
    (dict(batch_idx=_i32([1, 0, 1])), "repeated row while appending"),
    (dict(leftpad=_i32([0, 3, 1])), "start past the sequence's end"),
])
def test_each_wrong_value_is_flagged_and_clamped_into_range(kwargs, name):
    args = dict(lens=_i32([0, 2, 17]), page_table=None, batch_idx=None, leftpad=None)
    args.update(kwargs)
    given = args.pop("lens")
    (lens, table, idx, pad), ok = clamped(given, GEOM, **args)
    assert ok.item() is False, name
    assert lens.min() >= 0 and lens.max() <= GEOM.capacity - GEOM.extra
    if table is not None:
        assert table.min() >= 0 and table.max() < GEOM.num_rows
    if idx is not None:
        assert idx.min() >= 0 and idx.max() < GEOM.batch_cache
    if pad is not None:
        assert bool((pad >= 0).all()) and bool((pad <= lens).all())
    with pytest.raises(RuntimeError, match="out of range"):
        checked(given, GEOM, **args)


def test_checks_run_on_the_device_except_on_the_cpu():
    assert not cache_checks.on_device(torch.empty(1))
    assert cache_checks.on_device(torch.empty(1, device="meta"))


# --------------------------------------------------------------------------------------------
# The API path taken on CUDA reads nothing on the host


HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__",
              "__float__", "nonzero", "unique"}


class NoHostReads(TorchFunctionMode):
    """Fails on any torch call that copies tensor values to the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise AssertionError(f"host read: {name}")
        if name == "to" and any(isinstance(a, (str, torch.device)) and str(a) == "cpu"
                                for a in args[1:]):
            raise AssertionError("host read: .to('cpu')")
        return func(*args, **(kwargs or {}))


class RecordingDecode(types.SimpleNamespace):
    """A decode backend that records the CacheSpec it is handed and returns zeros."""

    KVCACHE_FUSED = True

    def __init__(self):
        super().__init__(specs=[])

    def decode_runner(self, q, spec, params, sink, num_splits, need_lse=False):
        def runner(q, spec, sink):
            self.specs.append(spec)
            b, sq, hq = q.shape[:3]
            return (q.new_zeros(b, sq, hq, spec.v.shape[-1]),
                    torch.zeros(hq, b * sq, dtype=torch.float32))
        return runner


@pytest.fixture
def cuda_path(monkeypatch):
    """The CUDA code path on CPU tensors: checks on the device, a recording backend."""
    backend = RecordingDecode()
    monkeypatch.setattr(cache_checks, "on_device", lambda q: True)
    monkeypatch.setattr(kvcache, "_pick", lambda q, spec, params, sink: backend)
    plans.clear()
    yield backend
    plans.clear()


def _paged_call(lens, table, append=True):
    q = torch.randn(3, 1, 4, 16, dtype=torch.bfloat16)
    k_cache = torch.randn(6, 16, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    new = torch.randn(3, 1, 2, 16, dtype=torch.bfloat16) if append else None
    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lens,
                                           page_table=table, causal=True), k_cache


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_cuda_path_reads_no_value_on_the_host(cuda_path, layout):
    lens = _i32([0, 31, 17])
    if layout == "paged":
        table = _i32([[5, 0], [3, 4], [2, 1]])
        call, _ = _paged_call(lens, table)
    else:
        q = torch.randn(3, 1, 4, 16, dtype=torch.bfloat16)
        kc = torch.randn(4, 32, 2, 16, dtype=torch.bfloat16)
        new = torch.randn(3, 1, 2, 16, dtype=torch.bfloat16)
        idx, pad = _i32([3, 0, 1]), _i32([0, 30, 2])

        def call():
            return flash_attn_with_kvcache(q, kc, kc.clone(), new, new, cache_seqlens=lens,
                                           cache_batch_idx=idx, cache_leftpad=pad,
                                           causal=True)
    with NoHostReads():
        for _ in range(3):  # the full path, then the planned one
            call()
    assert len(cuda_path.specs) == 3
    assert sum(1 for key in plans._PLANS if key[0] == "kvcache") == 1  # repeats were planned
    for spec in cuda_path.specs:
        assert torch.equal(spec.seqlens_k, lens) and spec.k_extra == 1
        assert spec.max_seqlen_k == 32  # the capacity: an upper bound, never read back


def test_cuda_path_still_refuses_wrong_values(cuda_path):
    """On the CPU the device assert fails at once; on CUDA it fails asynchronously, with the
    kernels reading the clamped values meanwhile."""
    call, k_cache = _paged_call(_i32([0, 32, 17]), _i32([[5, 0], [3, 4], [2, 1]]))
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        call()
    assert torch.equal(k_cache, before)  # refused before the append
    call, _ = _paged_call(_i32([0, 3, 17]), _i32([[5, 0], [6, 4], [2, 1]]))
    with pytest.raises(RuntimeError, match="out of range"):
        call()
    assert not cuda_path.specs


def test_cpu_path_keeps_its_named_host_errors():
    plans.clear()
    call, _ = _paged_call(_i32([0, 32, 17]), _i32([[5, 0], [3, 4], [2, 1]]))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] is 32"):
        call()
    call, _ = _paged_call(_i32([0, 3, 17]), _i32([[5, 0], [6, 4], [2, 1]]))
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] is 6"):
        call()


def test_the_detector_sees_the_cpu_paths_host_reads(monkeypatch):
    """NoHostReads does catch the host checks (what the CUDA path must not do)."""
    monkeypatch.setattr(kvcache, "_pick", lambda q, spec, params, sink: RecordingDecode())
    plans.clear()
    call, _ = _paged_call(_i32([0, 31, 17]), _i32([[5, 0], [3, 4], [2, 1]]))
    with NoHostReads(), pytest.raises(AssertionError, match="host read"):
        call()
