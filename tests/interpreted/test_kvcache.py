"""flash_attn_with_kvcache and paged flash_attn_varlen_func against the reference.

The reference runs on keys gathered from the cache by this file's own indexing (not the
library's), sequence by sequence; the expected cache after an append is built the same way,
so both the in-place write and the attention are checked. On a CPU machine both the CPU
path and the portable Triton kernels (in the interpreter) are exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, forced

from asymflash import flash_attn_varlen_func, flash_attn_with_kvcache
from asymflash.reference import attention_ref
from asymflash.runtime import dispatch, plans

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [n for n in dispatch.backend_names(DEVICE) if n in dispatch._DECODE_MODULES]
PAGE = 16


class Cache:
    """A KV cache of `capacity` slots per sequence, paged (shuffled pages) or contiguous.

    `slot(b, j)` is where key j of sequence b lives, written out independently of the library
    so the tests check its indexing instead of repeating it.
    """

    def __init__(self, layout, batch, hkv, d, dv, capacity, dtype=torch.bfloat16, page=PAGE):
        self.layout, self.batch, self.page = layout, batch, page
        self.page_table = self.batch_idx = None
        if layout == "paged":
            pages_per_seq = capacity // page
            num_pages = batch * pages_per_seq + 3  # spare pages nobody uses
            shape = (num_pages, page)
            self.page_table = torch.randperm(num_pages)[:batch * pages_per_seq].view(
                batch, pages_per_seq).to(torch.int32).to(DEVICE)
        else:
            rows = batch + 2 if layout == "indexed" else batch
            shape = (rows, capacity)
            if layout == "indexed":  # sequences live in shuffled rows, two rows unused
                self.batch_idx = torch.randperm(rows)[:batch].to(torch.int32).to(DEVICE)
        self.k = torch.randn(*shape, hkv, d, dtype=dtype, device=DEVICE)
        self.v = torch.randn(*shape, hkv, dv, dtype=dtype, device=DEVICE)

    def slot(self, b, j):
        if self.layout == "paged":
            return int(self.page_table[b, j // self.page]), j % self.page
        return (int(self.batch_idx[b]) if self.batch_idx is not None else b), j

    def keys(self, b, n, k=None, v=None):
        """Keys and values 0..n-1 of sequence b, from (k, v) (default: the cache itself)."""
        k = self.k if k is None else k
        v = self.v if v is None else v
        slots = [self.slot(b, j) for j in range(n)]
        return (torch.stack([k[s] for s in slots]) if slots else k[0, :0],
                torch.stack([v[s] for s in slots]) if slots else v[0, :0])

    def expected_after_append(self, lens, k_new, v_new):
        k, v = self.k.clone(), self.v.clone()
        for b, n0 in enumerate(lens):
            for t in range(k_new.shape[1]):
                s = self.slot(b, n0 + t)
                k[s], v[s] = k_new[b, t], v_new[b, t]
        return k, v

    def kwargs(self):
        return dict(page_table=self.page_table, cache_batch_idx=self.batch_idx)


def reference(q, cache, k, v, lens_k, sink=None, **kw):
    """(out32, out_low, lse32): per-sequence reference on the gathered keys, stacked."""
    outs32, outs_low, lses = [], [], []
    for b, n in enumerate(lens_k):
        kb, vb = cache.keys(b, n, k, v)
        qb, kb, vb = q[b:b + 1], kb.unsqueeze(0), vb.unsqueeze(0)
        o32, lse = attention_ref(qb, kb, vb, learnable_sink=sink, **kw)
        olow, _ = attention_ref(qb, kb, vb, learnable_sink=sink, upcast=False, **kw)
        outs32.append(o32)
        outs_low.append(olow)
        lses.append(lse)
    return torch.cat(outs32), torch.cat(outs_low), torch.cat(lses)


CASES = {
    # name: (seqlen_q, nheads_q, nheads_kv, seqlen_new, cache_seqlens, mask/feature kwargs)
    "decode-gqa8": (1, 8, 1, 1, [0, 40, 113], dict(causal=True)),
    "decode-no-append": (1, 8, 1, 0, [1, 0, 113], dict()),
    "decode-softcap-sink": (1, 4, 2, 1, [17, 0, 100], dict(causal=True, softcap=5.0,
                                                           sink=True)),
    "prefill-17": (17, 8, 1, 17, [0, 31, 100], dict(causal=True)),
    "prefill-window": (17, 4, 2, 17, [15, 0, 96], dict(causal=True, window_size=(23, 0),
                                                       softcap=3.0, sink=True)),
    "append-5-local": (5, 4, 4, 5, [12, 0, 113], dict(window_size=(9, 2))),
}
LAYOUTS = ["paged", "contiguous", "indexed"]


def run_case(backend, layout, name, splits, dtype=torch.bfloat16, d=32, dv=32):
    sq, hq, hkv, new, lens, kw = CASES[name]
    kw = dict(kw)
    batch = len(lens)
    cache = Cache(layout, batch, hkv, d, dv, capacity=128, dtype=dtype)
    q = torch.randn(batch, sq, hq, d, dtype=dtype, device=DEVICE)
    k_new = torch.randn(batch, new, hkv, d, dtype=dtype, device=DEVICE) if new else None
    v_new = torch.randn(batch, new, hkv, dv, dtype=dtype, device=DEVICE) if new else None
    sink = torch.randn(hq, device=DEVICE) if kw.pop("sink", False) else None
    want_k, want_v = (cache.expected_after_append(lens, k_new, v_new) if new
                      else (cache.k.clone(), cache.v.clone()))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with forced(backend):
        out, lse = flash_attn_with_kvcache(
            q, cache.k, cache.v, k_new, v_new, cache_seqlens=seqlens, learnable_sink=sink,
            num_splits=splits, return_lse=True, **cache.kwargs(), **kw)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), "append"
    assert out.shape == (batch, sq, hq, dv) and lse.shape == (batch, hq, sq)
    r32, rlow, rlse = reference(q, cache, want_k, want_v, [n + new for n in lens], sink, **kw)
    assert_fa_close("out", out, r32, rlow, atol=1e-3)
    assert_lse_close(lse, rlse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_reference(backend, layout, name):
    run_case(backend, layout, name, splits=0)


@pytest.mark.parametrize("splits", [1, 3, 7, 0])
@pytest.mark.parametrize("name", ["decode-gqa8", "decode-softcap-sink", "prefill-window"])
def test_split_kv(splits, name):
    """Split counts only change how the portable kernel divides the keys, never the answer."""
    if "portable" not in BACKENDS:
        pytest.skip("the portable kernels need a GPU or TRITON_INTERPRET=1")
    run_case("portable", "paged", name, splits=splits)


@pytest.mark.parametrize("pack", [True, False])
def test_gqa_packing_on_and_off(pack, monkeypatch):
    """Both tile shapes of the portable kernel: (position, head) rows, or one head per tile."""
    if "portable" not in BACKENDS:
        pytest.skip("the portable kernels need a GPU or TRITON_INTERPRET=1")
    from asymflash.backends.portable import decode

    chosen = decode.select_config

    def forced_pack(*args, **kwargs):
        return dataclasses.replace(chosen(*args, **kwargs), pack_gqa=pack)

    monkeypatch.setattr(decode, "select_config", forced_pack)
    run_case("portable", "indexed", "prefill-17", splits=3)


def test_fp16_and_head_dims():
    """fp16, d != dv, odd head count ratios: the portable kernel's masking of dims."""
    backend = BACKENDS[-1]
    run_case(backend, "paged", "decode-softcap-sink", splits=3, dtype=torch.float16, d=64,
             dv=40)


def test_int_cache_seqlens_and_defaults():
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn_like(k)
    want_k, want_v = cache.expected_after_append([47, 47], k, v)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=47)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    r32, rlow, _ = reference(q, cache, want_k, want_v, [48, 48])
    assert_fa_close("out", out, r32, rlow, atol=1e-3)
    # no cache_seqlens: the whole cache is attended to
    out_full = flash_attn_with_kvcache(q, cache.k, cache.v)
    assert_fa_close("out", out_full, r32, rlow, atol=1e-3)


def test_runs_without_grad():
    cache = Cache("paged", 2, 1, 32, 32, capacity=32)
    q = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=5, **cache.kwargs())
    assert not out.requires_grad


def test_unused_page_table_entries_are_not_checked():
    """Serving engines pad page-table rows past a sequence's pages with anything."""
    cache = Cache("paged", 2, 1, 32, 32, capacity=64)
    cache.page_table[0, 2:] = -1  # sequence 0 uses 20 keys + 1 new: pages 0 and 1 only
    cache.page_table[1, 1:] = 10**6
    q = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = [20, 15]
    want_k, want_v = cache.expected_after_append(lens, k, k)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, k, k.clone(),
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE),
                                  **cache.kwargs())
    r32, rlow, _ = reference(q, cache, want_k, want_v, [21, 16])
    assert_fa_close("out", out, r32, rlow, atol=1e-3)


# On CUDA, index values (cache_seqlens, page_table, cache_batch_idx) are checked on the
# device: a wrong one fails a device-side assert, which loses the CUDA context
# (tests/gpu/test_decode_no_sync_gpu.py runs that in a subprocess). Here they run on the CPU.
VALUE_CHECKS = ("page index too big", "page index negative", "beyond capacity",
                "negative length")
DEVICE_CHECKED = "CUDA checks index values on the device (a device-side assert)"
on_device_checks = pytest.mark.skipif(DEVICE == "cuda", reason=DEVICE_CHECKED)


def _bad_cases():
    """(name, change to the call's arguments, exception, words in the message)."""
    i32 = dict(dtype=torch.int32, device=DEVICE)

    def table(fn):
        return lambda a: dict(page_table=fn(a["page_table"].clone()))

    def page_out_of_range(t):
        t[1, 1] = 999
        return t

    def page_negative(t):
        t[2, 0] = -3
        return t

    return [
        ("page index too big", table(page_out_of_range), ValueError,
         r"page_table\[1, 1\] is 999"),
        ("page index negative", table(page_negative), ValueError, r"page_table\[2, 0\] is -3"),
        ("beyond capacity", lambda a: dict(cache_seqlens=torch.tensor([0, 60, 63], **i32)),
         ValueError, r"cache_seqlens\[2\] is 63 .*capacity of 64"),
        ("negative length", lambda a: dict(cache_seqlens=torch.tensor([0, -1, 3], **i32)),
         ValueError, r"cache_seqlens\[1\] is -1"),
        ("int length too big", lambda a: dict(cache_seqlens=63), ValueError, "cache_seqlens"),
        ("page_table int64", table(lambda t: t.long()), TypeError, "page_table has dtype"),
        ("page_table 1-D", table(lambda t: t.flatten()), ValueError, "page_table has shape"),
        ("page_table rows", table(lambda t: t[:2]), ValueError, "page_table has shape"),
        ("page_table list", lambda a: dict(page_table=a["page_table"].tolist()), TypeError,
         "page_table is a list"),
        ("page size 24", lambda a: dict(k_cache=a["k_cache"].new_zeros(99, 24, 2, 32),
                                        v_cache=a["v_cache"].new_zeros(99, 24, 2, 32)),
         ValueError, r"page size \(dim 1\) is 24"),
        ("batch_idx with pages", lambda a: dict(cache_batch_idx=torch.zeros(3, **i32)),
         ValueError, "cache_batch_idx"),
        ("k without v", lambda a: dict(v=None), ValueError, "only k"),
        ("k heads", lambda a: dict(k=a["k"].repeat(1, 1, 2, 1), v=a["v"].repeat(1, 1, 2, 1)),
         ValueError, "k has shape"),
        ("k dtype", lambda a: dict(k=a["k"].half()), TypeError, "k has dtype"),
        ("v_cache dtype", lambda a: dict(v_cache=a["v_cache"].half()), TypeError,
         "v_cache has dtype"),
        ("seqlens int64", lambda a: dict(cache_seqlens=torch.zeros(3, dtype=torch.int64,
                                                                   device=DEVICE)),
         TypeError, "cache_seqlens has dtype"),
        ("num_splits", lambda a: dict(num_splits=-1), ValueError, "num_splits is -1"),
        ("softcap", lambda a: dict(softcap=-1.0), ValueError, "softcap"),
        ("sink shape", lambda a: dict(learnable_sink=torch.zeros(3, device=DEVICE)), ValueError,
         "learnable_sink"),
    ]


BAD = _bad_cases()


@pytest.mark.parametrize("i", range(len(BAD)), ids=[c[0] for c in BAD])
def test_refused_calls_leave_the_cache_untouched(i):
    name, change, exc, words = BAD[i]
    if DEVICE == "cuda" and name in VALUE_CHECKS:
        pytest.skip(DEVICE_CHECKED)
    cache = Cache("paged", 3, 2, 32, 32, capacity=64)
    args = dict(q=torch.randn(3, 2, 4, 32, dtype=torch.bfloat16, device=DEVICE),
                k_cache=cache.k, v_cache=cache.v,
                k=torch.randn(3, 2, 2, 32, dtype=torch.bfloat16, device=DEVICE),
                v=torch.randn(3, 2, 2, 32, dtype=torch.bfloat16, device=DEVICE),
                cache_seqlens=torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE),
                page_table=cache.page_table)
    args.update(change(args))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    with pytest.raises(exc, match=words):
        flash_attn_with_kvcache(**args)
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)


@pytest.mark.parametrize("change,words", [
    pytest.param(lambda c: dict(cache_batch_idx=torch.tensor([0, 4], dtype=torch.int32,
                                                             device=DEVICE)),
                 r"cache_batch_idx\[1\] is 4", marks=on_device_checks),
    pytest.param(lambda c: dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32,
                                                             device=DEVICE)),
                 "repeats a cache row", marks=on_device_checks),
    (lambda c: dict(cache_batch_idx=None, k_cache=c.k[:3], v_cache=c.v[:3]),
     "k_cache has batch 3"),
])
def test_refused_contiguous_calls_leave_the_cache_untouched(change, words):
    cache = Cache("indexed", 2, 1, 16, 16, capacity=20)  # 4 cache rows
    args = dict(q=torch.randn(2, 1, 2, 16, dtype=torch.bfloat16, device=DEVICE),
                k_cache=cache.k, v_cache=cache.v,
                k=torch.randn(2, 1, 1, 16, dtype=torch.bfloat16, device=DEVICE),
                v=torch.randn(2, 1, 1, 16, dtype=torch.bfloat16, device=DEVICE),
                cache_seqlens=3, cache_batch_idx=cache.batch_idx)
    args.update(change(cache))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    with pytest.raises(ValueError, match=words):
        flash_attn_with_kvcache(**args)
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths_from", ["seqused_k", "cu_seqlens_k"])
def test_paged_varlen_prefill(backend, lengths_from):
    lens_q, lens_k = [17, 0, 1, 30], [17, 5, 113, 40]
    hq, hkv, d = 4, 2, 32
    cache = Cache("paged", 4, hkv, d, d, capacity=128)
    q = torch.randn(sum(lens_q), hq, d, dtype=torch.bfloat16, device=DEVICE)
    sink = torch.randn(hq, device=DEVICE)
    lengths = dict(seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
                   cu_seqlens_k=None, max_seqlen_k=None) if lengths_from == "seqused_k" \
        else dict(cu_seqlens_k=_cu(lens_k), max_seqlen_k=max(lens_k))
    with forced(backend):
        out, lse = flash_attn_varlen_func(q, cache.k, cache.v, _cu(lens_q),
                                          max_seqlen_q=max(lens_q), causal=True,
                                          learnable_sink=sink, page_table=cache.page_table,
                                          return_lse=True, **lengths)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    start = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        kb, vb = cache.keys(b, sk)
        qb = q[start:start + sq].unsqueeze(0)
        r32, rlse = attention_ref(qb, kb[None], vb[None], causal=True, learnable_sink=sink)
        rlow, _ = attention_ref(qb, kb[None], vb[None], causal=True, learnable_sink=sink,
                                upcast=False)
        assert_fa_close(f"out[{b}]", out[start:start + sq], r32[0], rlow[0], atol=1e-3)
        assert_lse_close(lse[:, start:start + sq], rlse[0])
        start += sq


def test_paged_varlen_refusals():
    cache = Cache("paged", 2, 1, 16, 16, capacity=32)
    q = torch.randn(3, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    base = dict(cu_seqlens_q=_cu([1, 2]), cu_seqlens_k=None, max_seqlen_q=2,
                max_seqlen_k=None, page_table=cache.page_table)
    with pytest.raises(ValueError, match="cu_seqlens_k is None and so is seqused_k"):
        flash_attn_varlen_func(q, cache.k, cache.v, **base)
    too_long = torch.tensor([3, 33], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] is 33"):
        flash_attn_varlen_func(q, cache.k, cache.v, **base, seqused_k=too_long)
    with pytest.raises(ValueError, match="q has shape"):
        flash_attn_varlen_func(q[None], cache.k, cache.v, **base, seqused_k=too_long)
    with pytest.raises(ValueError, match="cu_seqlens_k is None"):  # the dense-k form
        flash_attn_varlen_func(q, q, q, _cu([1, 2]), None, 2, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False])
def test_decode_realistic_sizes(paged):
    """bf16, hdim 128, GQA 8:1, ragged caches of a few thousand tokens, heuristic splits."""
    batch, hq, hkv, d, page = 4, 32, 4, 128, 64
    lens = [4000, 1, 2500, 3333]
    cap = 4096
    q = torch.randn(batch, 1, hq, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(batch, 1, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn_like(k)
    if paged:
        num_pages = batch * cap // page
        kc = torch.randn(num_pages, page, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        table = torch.randperm(num_pages, device=DEVICE).view(batch, -1).to(torch.int32)
        extra = dict(page_table=table)
    else:
        kc = torch.randn(batch, cap, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        extra = {}
    vc = torch.randn_like(kc)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                       return_lse=True, **extra)
    for b, n in enumerate(lens):
        n += 1
        if paged:
            pages = table[b, :-(-n // page)].long()
            kb, vb = kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n]
        else:
            kb, vb = kc[b, :n], vc[b, :n]
        r32, rlse = attention_ref(q[b:b + 1], kb[None], vb[None], causal=True)
        rlow, _ = attention_ref(q[b:b + 1], kb[None], vb[None], causal=True, upcast=False)
        assert_fa_close(f"out[{b}]", out[b:b + 1], r32, rlow, atol=1e-3)
        assert_lse_close(lse[b:b + 1], rlse)


def test_split_heuristic():
    from asymflash.backends.portable.decode import MAX_SPLITS, num_splits_heuristic

    # H200 decode, batch 8, 4 kv heads packed, one query tile: 32 programs for 132 SMs
    assert num_splits_heuristic(tiles=32, key_blocks=4096 // 128, sms=132) == 8
    # batch 32: 128 programs, 2 splits give about 2 per SM
    assert num_splits_heuristic(tiles=128, key_blocks=16384 // 128, sms=132) == 2
    # contiguous caches aim for one program per SM
    assert num_splits_heuristic(tiles=32, key_blocks=32, sms=132, per_sm=1) == 4
    assert num_splits_heuristic(tiles=128, key_blocks=32, sms=132, per_sm=1) == 1
    # already 2+ programs per SM: splitting only adds the merge
    assert num_splits_heuristic(tiles=1024, key_blocks=1024, sms=132) == 1
    # short caches: every split keeps at least 4 key blocks
    assert num_splits_heuristic(tiles=4, key_blocks=9, sms=132) == 2
    assert num_splits_heuristic(tiles=1, key_blocks=10**6, sms=132) == MAX_SPLITS
    assert num_splits_heuristic(tiles=4, key_blocks=0, sms=132) == 1


def test_check_values_off_gives_the_same_answer():
    cache = Cache("paged", 2, 1, 32, 32, capacity=64)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([7, 50], dtype=torch.int32, device=DEVICE)
    on = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens, **cache.kwargs())
    off = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens, check_values=False,
                                  **cache.kwargs())
    assert torch.equal(on, off)


@pytest.mark.parametrize("layout", ["paged", "indexed"])
def test_split_tickets_are_reset_and_lse_optional(layout):
    """The split merge leaves its per-tile counters at 0, so calls can follow one another
    (and share the scratch); without return_lse the same output comes back."""
    if "portable" not in BACKENDS:
        pytest.skip("the portable kernels need a GPU or TRITON_INTERPRET=1")
    from asymflash.backends.portable import decode

    cache = Cache(layout, 2, 2, 32, 32, capacity=96)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([70, 0], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, num_splits=4, **cache.kwargs())
    with forced("portable"):
        first, lse = flash_attn_with_kvcache(q, cache.k, cache.v, return_lse=True, **kw)
        again = flash_attn_with_kvcache(q, cache.k, cache.v, **kw)
    assert torch.equal(first, again)
    assert all(int(ws[1].abs().sum()) == 0 for ws in decode._WORKSPACES.values())
    r32, rlow, rlse = reference(q, cache, cache.k, cache.v, [70, 0])
    assert_fa_close("out", first, r32, rlow, atol=1e-3)
    assert_lse_close(lse, rlse)


def test_lengths_known_on_the_host_need_no_device_read(monkeypatch):
    """cache_seqlens None (full caches) or an int, without page_table or cache_batch_idx:
    nothing to read back from the device (a sync per call, per layer in a decode step).
    A lengths tensor is still read and checked on the host on CPU; on CUDA it is checked on
    the device (no host read either)."""
    from asymflash.api import kvcache
    reads = []
    real = kvcache.check.check_cache_values
    monkeypatch.setattr(kvcache.check, "check_cache_values",
                        lambda *a, **kw: (reads.append(1), real(*a, **kw))[1])
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k_cache = torch.randn(2, 24, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    full = flash_attn_with_kvcache(q, k_cache, v_cache)
    part = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=19)
    assert reads == []
    lens = torch.tensor([19, 24], dtype=torch.int32, device=DEVICE)
    mixed = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert reads == ([] if q.is_cuda else [1])
    for out, n in ((full, (24, 24)), (part, (19, 19)), (mixed, (19, 24))):
        for b in range(2):
            ref, _ = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n[b]], v_cache[b:b + 1, :n[b]])
            torch.testing.assert_close(out[b:b + 1].float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "indexed"])
@pytest.mark.parametrize("name", ["decode-gqa8", "decode-no-append", "prefill-window",
                                  "append-5-local"])
def test_cache_leftpad_matches_reference(backend, layout, name):
    """A left-padded batch: sequence b's cache starts at position leftpad[b] (0, inside, or
    at its end: no cached keys of its own); the new tokens still land at cache_seqlens[b]."""
    sq, hq, hkv, new, lens, kw = CASES[name]
    kw = dict(kw)
    batch = len(lens)
    cache = Cache(layout, batch, hkv, 32, 32, capacity=128)
    starts = [0, min(lens[1], 7), lens[2]][:batch]
    q = torch.randn(batch, sq, hq, 32, dtype=torch.bfloat16, device=DEVICE)
    k_new = torch.randn(batch, new, hkv, 32, dtype=torch.bfloat16, device=DEVICE) if new else None
    v_new = torch.randn_like(k_new) if new else None
    sink = torch.randn(hq, device=DEVICE) if kw.pop("sink", False) else None
    want_k, want_v = (cache.expected_after_append(lens, k_new, v_new) if new
                      else (cache.k.clone(), cache.v.clone()))
    with forced(backend):
        out, lse = flash_attn_with_kvcache(
            q, cache.k, cache.v, k_new, v_new,
            cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            cache_leftpad=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            learnable_sink=sink, num_splits=3, return_lse=True, **cache.kwargs(), **kw)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), "append"
    for b in range(batch):
        row = cache.slot(b, 0)[0]
        kb = want_k[row, starts[b]:lens[b] + new].unsqueeze(0)
        vb = want_v[row, starts[b]:lens[b] + new].unsqueeze(0)
        o32, lse32 = attention_ref(q[b:b + 1], kb, vb, learnable_sink=sink, **kw)
        olow, _ = attention_ref(q[b:b + 1], kb, vb, learnable_sink=sink, upcast=False, **kw)
        assert_fa_close("out", out[b:b + 1], o32, olow, atol=1e-3)
        assert_lse_close(lse[b:b + 1], lse32)


def test_bad_cache_leftpad_is_refused_and_the_cache_untouched():
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    before = cache.k.clone()
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)
    bad = [(torch.tensor([0, 1], dtype=torch.int64, device=DEVICE), TypeError, "int32"),
           (torch.tensor([0], dtype=torch.int32, device=DEVICE), ValueError, "shape")]
    if DEVICE != "cuda":  # CUDA checks values on the device (a device-side assert)
        bad += [(torch.tensor([0, 21], dtype=torch.int32, device=DEVICE), ValueError,
                 r"cache_leftpad\[1\] is 21"),
                (torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE), ValueError,
                 r"cache_leftpad\[0\] is -1")]
    for leftpad, exc, match in bad:
        with pytest.raises(exc, match=match):
            flash_attn_with_kvcache(q, cache.k, cache.v, k, k.clone(), cache_seqlens=lens,
                                    cache_leftpad=leftpad)
        assert torch.equal(cache.k, before)
    paged = Cache("paged", 2, 2, 32, 32, capacity=48)
    with pytest.raises(ValueError, match="cache_leftpad was given with page_table"):
        flash_attn_with_kvcache(q, paged.k, paged.v, cache_seqlens=lens,
                                cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                **paged.kwargs())


def _rotate_complex(x, c, s, interleaved):
    """Independent rotary: each channel pair as a complex number times (c + i·s);
    x (batch, n, heads, d), c and s (batch, n, rotary_dim / 2)."""
    half = c.shape[-1]
    part = x[..., :2 * half].float()
    pairs = part.unflatten(-1, (half, 2)) if interleaved else \
        torch.stack((part[..., :half], part[..., half:]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous()) * torch.complex(c, s).unsqueeze(2)
    turned = torch.view_as_real(z)
    turned = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]),
                                                              dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal,sq", [(True, 3), (False, 2)])
def test_rotary_matches_reference(backend, layout, interleaved, causal, sq):
    """rotary_cos/sin: the new keys are written rotated at their positions; q rotates at
    cache_seqlens + i (causal) or all at cache_seqlens (not causal); 16 of 32 channels."""
    lens, hq, hkv, d, new = [0, 9, 50], 4, 2, 32, sq
    batch = len(lens)
    cache = Cache(layout, batch, hkv, d, d, capacity=64)
    inv_freq = 1.0 / (100.0 ** (torch.arange(8, device=DEVICE) / 8))
    angles = torch.arange(70, device=DEVICE).unsqueeze(1) * inv_freq  # seqlen_ro 70 >= 64
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    q = torch.randn(batch, sq, hq, d, dtype=torch.bfloat16, device=DEVICE)
    k_new = torch.randn(batch, new, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_new = torch.randn_like(k_new)
    q_before = q.clone()
    start = torch.tensor(lens, device=DEVICE).unsqueeze(1)
    k_idx = start + torch.arange(new, device=DEVICE)
    q_idx = start + torch.arange(sq, device=DEVICE) if causal else start.expand(batch, sq)
    k_rot = _rotate_complex(k_new, cos.float()[k_idx], sin.float()[k_idx], interleaved)
    q_rot = _rotate_complex(q, cos.float()[q_idx], sin.float()[q_idx], interleaved)
    want_k, want_v = cache.expected_after_append(lens, k_rot, v_new)
    with forced(backend):
        out = flash_attn_with_kvcache(
            q, cache.k, cache.v, k_new, v_new,
            cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=causal,
            **cache.kwargs())
    assert torch.equal(q, q_before), "q was modified"
    # rotated keys in the cache: the same products, so equal up to the fp32 sum's last bit
    # before the one rounding to bf16
    torch.testing.assert_close(cache.k.float(), want_k.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(cache.v, want_v)
    r32, rlow, _ = reference(q_rot, cache, cache.k, cache.v, [n + new for n in lens],
                             causal=causal)
    assert_fa_close("out", out, r32, rlow, atol=1e-3)


def test_bad_rotary_is_refused():
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    cos = torch.ones(48, 8, device=DEVICE)
    before = cache.k.clone()
    bad = [(dict(rotary_cos=cos), TypeError, "rotary_sin"),
           (dict(rotary_cos=cos, rotary_sin=torch.zeros(48, 4, device=DEVICE)), ValueError,
            "shapes"),
           (dict(rotary_cos=torch.ones(48, 17), rotary_sin=torch.ones(48, 17)), ValueError,
            "shapes"),
           (dict(rotary_cos=cos[:40], rotary_sin=cos[:40]), ValueError, "capacity 48"),
           (dict(rotary_cos=cos, rotary_sin=cos,
                 cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE)), ValueError,
            "cache_leftpad")]
    for kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            flash_attn_with_kvcache(q, cache.k, cache.v, k, k.clone(), cache_seqlens=3, **kw)
        assert torch.equal(cache.k, before)
    with pytest.raises(ValueError, match="without new k/v"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=3, rotary_cos=cos,
                                rotary_sin=cos)


def test_flash_attn_2_argument_names():
    """block_table and return_softmax_lse, flash-attn 2's names, mean page_table and
    return_lse."""
    cache = Cache("paged", 2, 1, 32, 32, capacity=32)
    q = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)
    want, want_lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens,
                                             page_table=cache.page_table, return_lse=True)
    got, got_lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens,
                                           block_table=cache.page_table,
                                           return_softmax_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    r32, rlow, _ = reference(q, cache, cache.k, cache.v, [5, 17])
    assert_fa_close("out", got, r32, rlow, atol=1e-3)
    with pytest.raises(ValueError, match="block_table was given with page_table"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens,
                                block_table=cache.page_table, page_table=cache.page_table)


@pytest.mark.parametrize("name", ["prefill-17", "prefill-window", "append-5-local"])
def test_long_queries_through_the_forward_kernels_match_reference(monkeypatch, name):
    """Long-query calls on a contiguous cache may run the varlen forward (sm90 on Hopper)
    over the cache's rows with the lengths as seqused_k: the same answer and the same append
    as the decode path. Checked here with the CPU forward standing in for sm90."""
    from asymflash.api import kvcache
    sq, hq, hkv, new, lens, kw = CASES[name]
    kw = dict(kw)
    monkeypatch.setattr(kvcache, "PREFILL_MIN_Q", 1)
    real = kvcache.prefill_on_forward_kernels
    taken = []

    def on_cpu_forward(*args, **kwargs):
        got = real(*args, backends=("cpu", "portable"), **kwargs)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(kvcache, "prefill_on_forward_kernels", on_cpu_forward)
    batch = len(lens)
    cache = Cache("contiguous", batch, hkv, 32, 32, capacity=128)
    q = torch.randn(batch, sq, hq, 32, dtype=torch.bfloat16, device=DEVICE)
    k_new = torch.randn(batch, new, hkv, 32, dtype=torch.bfloat16, device=DEVICE)
    v_new = torch.randn_like(k_new)
    sink = torch.randn(hq, device=DEVICE) if kw.pop("sink", False) else None
    want_k, want_v = cache.expected_after_append(lens, k_new, v_new)
    out, lse = flash_attn_with_kvcache(
        q, cache.k, cache.v, k_new, v_new,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        learnable_sink=sink, return_lse=True, **kw)
    assert taken == [True]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), "append"
    r32, rlow, rlse = reference(q, cache, want_k, want_v, [n + new for n in lens], sink, **kw)
    assert_fa_close("out", out, r32, rlow, atol=1e-3)
    assert_lse_close(lse, rlse)


def test_long_queries_keep_the_decode_kernel_off_hopper():
    """Without the sm90 forward (here: the CPU), prefill_on_forward_kernels declines and the
    decode path runs."""
    from asymflash.api import kvcache
    from asymflash.core.params import AttnParams, MaskSpec

    cache = Cache("contiguous", 2, 2, 32, 32, capacity=160)
    q = torch.randn(2, 130, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([3, 20], dtype=torch.int32, device=DEVICE)
    params = AttnParams(32 ** -0.5, MaskSpec(-1, 0), 0.0)
    assert kvcache.prefill_on_forward_kernels(q, cache.k, cache.v, None, None, lens, params,
                                              None) is None


@pytest.mark.parametrize("causal", [True, False])
def test_long_query_chunk_over_a_contiguous_cache(monkeypatch, causal):
    """A 130-row chunk appended to and attending over a contiguous cache, GQA 4:2, d=64:
    on an sm_90 GPU it runs the sm90 forward over the cache rows (asserted there), elsewhere
    the decode path; the reference either way."""
    from asymflash.api import kvcache
    taken = []
    real = kvcache.prefill_on_forward_kernels

    def recorded(*args, **kwargs):
        got = real(*args, **kwargs)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(kvcache, "prefill_on_forward_kernels", recorded)
    lens, sq = [0, 61, 200], 130
    cache = Cache("contiguous", 3, 2, 64, 64, capacity=336)
    q = torch.randn(3, sq, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    k_new = torch.randn(3, sq, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_new = torch.randn_like(k_new)
    want_k, want_v = cache.expected_after_append(lens, k_new, v_new)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, causal=causal,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE))
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), "append"
    r32, rlow, _ = reference(q, cache, want_k, want_v, [n + sq for n in lens], causal=causal)
    assert_fa_close("out", out, r32, rlow, atol=1e-3)
    on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    assert taken == [on_sm90]


def test_appending_to_full_caches_is_refused():
    """cache_seqlens None means every cache is full: new tokens have no room (refused on the
    host, the cache untouched)."""
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=16)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    before = cache.k.clone()
    with pytest.raises(ValueError, match="cache_seqlens is None"):
        flash_attn_with_kvcache(q, cache.k, cache.v, k, k.clone())
    with pytest.raises(ValueError, match="cache_seqlens is 16"):
        flash_attn_with_kvcache(q, cache.k, cache.v, k, k.clone(), cache_seqlens=16)
    assert torch.equal(cache.k, before)


def _planned_decode_case(layout="paged"):
    cache = Cache(layout, 3, 2, 32, 32, capacity=64)
    q = torch.randn(3, 1, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    return cache, q


@pytest.mark.parametrize("lengths", ["tensor", "int", "none"])
def test_call_plans_run_later_calls_and_match_the_reference(lengths, monkeypatch):
    """The second call of a signature runs its plan (the dispatcher is not asked again) and
    still appends and attends exactly: fresh k/v and q each call, checked against the
    reference after each."""
    from asymflash.api import kvcache
    if "portable" not in BACKENDS:
        pytest.skip("the portable kernels need a GPU or TRITON_INTERPRET=1")
    plans.clear()
    cache, _ = _planned_decode_case("contiguous" if lengths != "tensor" else "paged")
    lens = [9, 40, 0]
    if lengths == "tensor":
        arg, extra = torch.tensor(lens, dtype=torch.int32, device=DEVICE), \
            dict(check_values=False)
    elif lengths == "int":
        lens, extra = [33] * 3, {}
        arg = 33
    else:
        lens, arg, extra = [64] * 3, None, {}
    new = 0 if lengths == "none" else 1
    calls = []
    real_pick = kvcache._pick

    def counting_pick(*a):
        calls.append(1)
        return real_pick(*a)

    monkeypatch.setattr(kvcache, "_pick", counting_pick)
    for step in range(3):
        q = torch.randn(3, 1, 8, 32, dtype=torch.bfloat16, device=DEVICE)
        k_new = torch.randn(3, new, 2, 32, dtype=torch.bfloat16, device=DEVICE) if new else None
        v_new = torch.randn_like(k_new) if new else None
        want_k, want_v = (cache.expected_after_append(lens, k_new, v_new) if new
                          else (cache.k.clone(), cache.v.clone()))
        with forced("portable"):
            out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new,
                                               cache_seqlens=arg, causal=True, return_lse=True,
                                               **cache.kwargs(), **extra)
        assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), f"append {step}"
        r32, rlow, rlse = reference(q, cache, want_k, want_v, [n + new for n in lens],
                                    causal=True)
        assert_fa_close(f"out {step}", out, r32, rlow, atol=1e-3)
        assert_lse_close(lse, rlse)
    assert len(calls) == 1, "later calls of the signature should run its plan"
    assert _kv_plan_count() == 1


def _kv_plan_count():
    return sum(1 for key in plans._PLANS if key[0] == "kvcache")


def test_call_plans_never_skip_a_check(monkeypatch):
    """A plan exists only for its exact signature: a call that differs in any checked way (a
    length past the capacity, a wrong dtype, lengths whose values are checked) takes the
    full path and is refused there, the cache untouched."""
    plans.clear()
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn_like(k)
    flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=10)
    assert _kv_plan_count() == (1 if "cpu" not in BACKENDS[:1] else 0)
    before = cache.k.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=48)
    with pytest.raises((ValueError, TypeError)):
        flash_attn_with_kvcache(q, cache.k, cache.v, k.float(), v, cache_seqlens=10)
    bad = torch.tensor([10, 48], dtype=torch.int32, device=DEVICE)
    if DEVICE != "cuda":  # (CUDA checks tensor values on the device: a device-side assert)
        with pytest.raises(ValueError, match="cache_seqlens"):
            flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=bad)
    assert torch.equal(cache.k, before)
    # keys hold what the checks read: values checked on the host are never planned (on
    # CUDA the plan repeats the device's checks on every call)
    key = plans.kvcache_key(q, cache.k, cache.v, k, v, bad, None, None, None, False, (-1, -1),
                             0.0, None, 0, False, True, None)
    assert (key is None) == (DEVICE != "cuda"), "tensor lengths: planned on CUDA only"
    monkeypatch.setattr(plans, "ENABLED", False)
    assert plans.kvcache_key(q, cache.k, cache.v, k, v, 10, None, None, None, False, (-1, -1),
                              0.0, None, 0, False, True, None) is None


def test_uniform_lengths_are_made_once_and_the_table_is_bounded(monkeypatch):
    from asymflash.api import kvcache
    monkeypatch.setattr(kvcache, "_UNIFORM_LENGTHS", {})
    monkeypatch.setattr(kvcache, "_UNIFORM_LENGTHS_LIMIT", 3)
    dev = torch.device(DEVICE)
    a = kvcache._uniform_lengths(4, 17, dev)
    assert a.dtype == torch.int32 and a.tolist() == [17] * 4
    assert kvcache._uniform_lengths(4, 17, dev) is a
    assert kvcache._uniform_lengths(2, 17, dev).tolist() == [17, 17]
    kvcache._uniform_lengths(4, 18, dev)
    kvcache._uniform_lengths(4, 19, dev)  # past the limit: the table starts over
    assert len(kvcache._UNIFORM_LENGTHS) == 1
    assert kvcache._uniform_lengths(4, 17, dev) is not a and a.tolist() == [17] * 4


@pytest.mark.parametrize("lengths", ["tensor", "int", "none"])
def test_calls_without_new_keys_compile_fullgraph(lengths):
    """Under torch.compile a call without new keys is the custom op asymflash::kvcache_attend
    (the eager call inside): fullgraph compiles, the eager values, the cache untouched."""
    cache = Cache("paged", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    sink = torch.randn(8, device=DEVICE)
    arg = {"tensor": torch.tensor([17, 48], dtype=torch.int32, device=DEVICE), "int": 33,
           "none": None}[lengths]

    def step(q, k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=arg, causal=True,
                                       softcap=4.0, learnable_sink=sink, **cache.kwargs())

    before = cache.k.clone()
    want = step(q, cache.k, cache.v)
    got = torch.compile(step, fullgraph=True)(q, cache.k, cache.v)
    assert torch.equal(got, want) and torch.equal(cache.k, before)


def test_compiled_calls_are_checked():
    """The traced path checks its scalars while tracing and the rest in the op at run time:
    bad input raises ValueError as in eager mode."""
    cache = Cache("contiguous", 2, 2, 32, 32, capacity=48)
    q = torch.randn(2, 1, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(Exception, match="window_size"):
        torch.compile(lambda q: flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=5,
                                                        window_size=(3,)),
                      fullgraph=True)(q)
    with pytest.raises(Exception, match="cache_seqlens"):
        torch.compile(lambda q: flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=49),
                      fullgraph=True)(q)


def test_an_appending_call_under_fullgraph_names_the_append():
    """torch.compile(fullgraph=True) cannot trace an in-place append: the error says so in
    asymflash's words (a call without new k/v compiles to one op, tested above)."""
    q = torch.randn(2, 1, 4, 64)
    k_cache, v_cache = torch.randn(2, 32, 2, 64), torch.randn(2, 32, 2, 64)
    k, v = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)

    def step(q, k_cache, v_cache, k, v):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5)
    with pytest.raises(Exception, match="flash_attn_with_kvcache with new k/v"):
        torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k, v)
