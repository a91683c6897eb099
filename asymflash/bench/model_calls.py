"""How each provider runs a case of the models suite (bench/models.py).

A builder returns make_model(case, inputs, q, k, v) -> a no-argument call returning the
output laid out as `case.out_shape`; everything else (masks, index tensors, imports) is
built here, outside the timed region. A provider that cannot express a case raises
NotImplementedError with the reason: the cell is listed n/a, never run half-right.
"""

from __future__ import annotations

import functools
import importlib

import torch


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _layers_call(case, one_layer):
    """One call per layer window; hybrid cases stack the layers' outputs."""
    windows = case.layer_windows
    if case.kind != "hybrid":
        w = windows[0]
        return lambda: one_layer(w)
    return lambda: torch.stack([one_layer(w) for w in windows])


def flash_api(module: str, paged_arg: str = "page_table"):
    """flash-attn's API (asymflash, flash-attn 2, FA3): flash_attn_func, the varlen entry and
    flash_attn_with_kvcache; paged_arg names the page table (flash-attn 2: block_table)."""

    def make_model(case, inputs, q, k, v):
        mod = importlib.import_module(module)
        common = dict(causal=case.causal, softcap=case.softcap)
        aux = inputs.aux
        if case.kind == "varlen":
            cu, n = aux["cu_seqlens"], aux["max_seqlen"]
            return lambda: _first(mod.flash_attn_varlen_func(
                q, k, v, cu, cu, n, n, window_size=case.window, **common))
        if case.kind == "decode":
            kw = {"cache_seqlens": aux["cache_seqlens"], "window_size": case.window, **common}
            if case.page_size:
                kc, vc = aux["k_paged"], aux["v_paged"]
                kw[paged_arg] = aux["page_table"]
            else:
                kc, vc = k, v
            return lambda: _first(mod.flash_attn_with_kvcache(q, kc, vc, **kw))
        return _layers_call(case, lambda w: _first(mod.flash_attn_func(
            q, k, v, window_size=w, **common)))

    return make_model


def _fa4_window(window):
    return tuple(None if w < 0 else w for w in window)


def fa4(case, inputs, q, k, v):
    """flash_attn.cute (FA4): windows as (None | int, None | int); decode through its varlen
    entry over the cache with seqused_k (one split: sm90 refuses split-KV)."""
    mod = importlib.import_module("flash_attn.cute")
    common = dict(causal=case.causal, softcap=case.softcap)
    aux = inputs.aux
    if case.kind == "varlen":
        cu, n = aux["cu_seqlens"], aux["max_seqlen"]
        return lambda: _first(mod.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
            window_size=_fa4_window(case.window), **common))
    if case.kind == "decode":
        paged = bool(case.page_size)
        kc, vc = (aux["k_paged"], aux["v_paged"]) if paged else (k, v)
        return lambda: _first(mod.flash_attn_varlen_func(
            q, kc, vc, seqused_k=aux["cache_seqlens"], max_seqlen_q=1,
            max_seqlen_k=case.seqlen_k, page_table=aux["page_table"] if paged else None,
            num_splits=1, **common))
    return _layers_call(case, lambda w: _first(mod.flash_attn_func(
        q, k, v, window_size=_fa4_window(w), **common)))


def sdpa(make_fwd):
    """torch SDPA: dense causal / non-causal only (no windows, softcap, packing or caches)."""

    def make_model(case, inputs, q, k, v):
        if case.kind != "dense" or case.window != (-1, -1) or case.softcap:
            raise NotImplementedError("SDPA has no sliding window, softcap, varlen or kv cache")
        return make_fwd(q, k, v, case.causal)

    return make_model


# --------------------------------------------------------------------------------------------
# FlexAttention


def _mask_mod(case, window, doc_ids=None, lens=None):
    """flash-attn's mask as a mask_mod: bottom-right aligned causal / window, documents of a
    packed sequence (doc_ids), cache lengths (lens) of decode."""
    left, right = window
    right = 0 if case.causal else right
    shift = case.seqlen_k - case.seqlen_q if case.kind != "decode" else None

    def mask(b, h, q_idx, kv_idx):
        # decode: the query sits on the sequence's last key
        pos = q_idx + shift if lens is None else lens[b] - 1 + q_idx
        ok = kv_idx >= 0
        if right >= 0:
            ok = ok & (kv_idx <= pos + right)
        if left >= 0:
            ok = ok & (kv_idx >= pos - left)
        if doc_ids is not None:
            ok = ok & (doc_ids[q_idx] == doc_ids[kv_idx])
        if lens is not None:
            ok = ok & (kv_idx < lens[b])
        return ok

    return mask


def _doc_ids(case, device):
    sizes = torch.tensor(case.doc_lens, device=device)
    return torch.repeat_interleave(torch.arange(len(case.doc_lens), device=device), sizes)


def flex(compiled):
    """compiled() -> the flex_attention to call (the harness's one torch.compile)."""

    def make_model(case, inputs, q, k, v):
        if case.kind == "decode" and case.page_size:
            raise NotImplementedError("Flex has no paged kv cache here")
        from torch.nn.attention.flex_attention import create_block_mask

        fn = compiled()
        score_mod = None
        if case.softcap:
            cap = case.softcap

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        packed = case.kind == "varlen"
        qt, kt, vt = ((t.unsqueeze(0) if packed else t).transpose(1, 2) for t in (q, k, v))
        doc = _doc_ids(case, q.device) if packed else None
        lens = inputs.aux.get("cache_seqlens")
        b = 1 if packed else case.batch

        @functools.lru_cache(maxsize=None)
        def block_mask(window):
            return create_block_mask(_mask_mod(case, window, doc, lens), B=b, H=None,
                                     Q_LEN=qt.shape[2], KV_LEN=kt.shape[2], device=q.device)

        gqa = case.nheads != case.nheads_kv

        def one_layer(w):
            out = fn(qt, kt, vt, score_mod=score_mod, block_mask=block_mask(w),
                     enable_gqa=gqa).transpose(1, 2)
            return out[0] if packed else out

        for w in case.layer_windows:
            block_mask(w)  # built now, outside the timed region
        return _layers_call(case, one_layer)

    return make_model
