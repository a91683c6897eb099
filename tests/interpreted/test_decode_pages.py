"""The decode kernel's three ways to find a key in a paged cache (`decode.key_pages`): pages
holding whole key tiles (one page read per tile), tiles holding whole pages (a key's row
fixed by its slot in the tile), and neither (each key divides). Each against the reference
over the same keys gathered from the pages, with and without new keys appended by the
kernel, ragged lengths (1, 17, 113 keys), GQA. Interpreted on the CPU, tiles set per case."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close

from asymflash.backends.portable import decode
from asymflash.core.masks import normalize_window
from asymflash.core.params import AttnParams, CacheSpec
from asymflash.reference import attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("page,block_n", [(32, 16), (16, 32), (48, 32)],
                         ids=["pages-hold-tiles", "tiles-hold-pages", "neither"])
@pytest.mark.parametrize("new", [0, 3])
def test_paged_keys_found_each_way(page, block_n, new):
    torch.manual_seed(page * 7 + block_n + new)
    batch, hq, hkv, d = 3, 4, 2, 32
    lens = torch.tensor([1, 17, 113], dtype=torch.int32, device=DEVICE)
    pages_per_seq = (113 + new + page - 1) // page
    num_pages = batch * pages_per_seq + 2
    k_cache = torch.randn(num_pages, page, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq]
    table = table.view(batch, pages_per_seq).to(torch.int32)
    q = torch.randn(batch, 1, hq, d, device=DEVICE, dtype=torch.bfloat16)
    k_new = torch.randn(batch, new, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    before = k_cache.clone(), v_cache.clone()
    spec = CacheSpec(k_cache, v_cache, lens, new, table, None, None, 1, 113 + new, batch,
                     k_new if new else None, v_new if new else None)
    params = AttnParams(d ** -0.5, normalize_window(True, (-1, -1)), 0.0)
    config = decode.DecodeConfig(16, block_n, True, 4, 1)
    out, _ = decode.decode(q, spec, params, None, 2, config)
    for b, n in enumerate(lens.tolist()):
        rows = torch.arange(n, device=DEVICE)
        k = before[0][table[b, rows // page].long(), rows % page]
        v = before[1][table[b, rows // page].long(), rows % page]
        k = torch.cat([k, k_new[b]])[None]
        v = torch.cat([v, v_new[b]])[None]
        ref, _ = attention_ref(q[b:b + 1], k, v, causal=True)
        low, _ = attention_ref(q[b:b + 1], k, v, causal=True, upcast=False)
        assert_fa_close(f"out[{b}]", out[b:b + 1], ref, low, atol=1e-3)
        if new:  # the new keys were written at positions n .. n + new - 1
            pos = torch.arange(n, n + new, device=DEVICE)
            assert torch.equal(k_cache[table[b, pos // page].long(), pos % page], k_new[b])
