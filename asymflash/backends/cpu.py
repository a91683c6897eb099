"""CPU backend: tiled attention in torch, O(seqlen) extra memory.

The same algorithm as the GPU kernels, written with torch ops on tiles: an online softmax
over key blocks for the forward, and a backward that recomputes each tile's probabilities
from the saved lse. No (seqlen_q, seqlen_k) matrix is ever formed, only (BLOCK_Q, BLOCK_K)
tiles per head, so long sequences fit. All arithmetic is fp32; the loop order is fixed, so
the backward is deterministic.
"""

from __future__ import annotations

import torch

from ..core.masks import allowed, key_range, tile_is_full
from ..core.params import AttnParams, CacheSpec, SeqInfo
from ..core.softmax import sink_grad

NAME = "cpu"
BLOCK_Q = 256
BLOCK_K = 512


def unsupported(q, k, v, seq, params, sink):
    if k.dtype != q.dtype or v.dtype != q.dtype:  # fp8 k/v come cast by api/fp8.py
        return f"k/v in {k.dtype}/{v.dtype} beside {q.dtype} q (the forward needs one dtype)"
    return None if q.device.type == "cpu" else f"tensors are on {q.device}, not the CPU"


unsupported_backward = unsupported


def _sequences(seq: SeqInfo):
    """(q_start, seqlen_q, k_start, seqlen_k) for each sequence, from host copies."""
    cu_q, cu_k = seq.cu_seqlens_q.tolist(), seq.cu_seqlens_k.tolist()
    used = seq.seqused_k.tolist() if seq.seqused_k is not None else None
    for b in range(seq.batch):
        sk = used[b] if used is not None else cu_k[b + 1] - cu_k[b]
        yield cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], sk


def _tiles(seq: SeqInfo, params: AttnParams):
    """Every (sequence, query tile, key tile) that holds at least one allowed pair."""
    for q0, sq, k0, sk in _sequences(seq):
        for qs in range(0, sq, BLOCK_Q):
            qe = min(sq, qs + BLOCK_Q)
            k_lo, k_hi = key_range(qs, qe, sq, sk, params.mask)
            k_lo = max(k_lo, 0)
            keys = [(ks, min(ks + BLOCK_K, k_hi)) for ks in range(k_lo, k_hi, BLOCK_K)]
            yield (q0, sq, k0, sk), (qs, qe), keys


def _scores(qt, kt, params: AttnParams, sq, sk, q_span, k_span):
    """Scaled (and capped, masked) scores of one tile, (hkv, group, n_q, n_k); also tanh."""
    s = torch.einsum("nhgd,khd->hgnk", qt, kt) * params.softmax_scale
    t = None
    if params.softcap > 0:
        t = torch.tanh(s / params.softcap)
        s = params.softcap * t
    if not tile_is_full(*q_span, *k_span, sq, sk, params.mask):
        ok = allowed(sq, sk, params.mask, q_range=q_span, k_range=k_span)
        s = s.masked_fill(~ok, float("-inf"))
    return s, t


def _grouped(x, hkv):
    """(n, hq, d) -> (n, hkv, group, d) in fp32: q heads of one kv head side by side."""
    return x.float().view(x.shape[0], hkv, x.shape[1] // hkv, x.shape[2])


def forward(q, k, v, seq: SeqInfo, params: AttnParams, sink):
    total_q, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = torch.zeros(total_q, hq, dv, dtype=q.dtype)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32)
    sink_g = None if sink is None else sink.float().view(hkv, hq // hkv, 1)
    k, v = k.float(), v.float()  # once, not per tile: O(seqlen) memory
    for (q0, sq, k0, sk), (qs, qe), keys in _tiles(seq, params):
        qt = _grouped(q[q0 + qs:q0 + qe], hkv)
        n = qe - qs
        m = torch.full((hkv, hq // hkv, n), float("-inf"))
        denom = torch.zeros(hkv, hq // hkv, n)
        acc = torch.zeros(hkv, hq // hkv, n, dv)
        for ks, ke in keys:
            s, _ = _scores(qt, k[k0 + ks:k0 + ke], params, sq, sk, (qs, qe), (ks, ke))
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - base.unsqueeze(-1))
            rescale = torch.exp(m - base)
            denom = denom * rescale + p.sum(-1)
            acc = acc * rescale.unsqueeze(-1) + torch.einsum(
                "hgnk,khd->hgnd", p, v[k0 + ks:k0 + ke])
            m = m_new
        if sink_g is not None:
            m_new = torch.maximum(m, sink_g)
            rescale = torch.exp(m - m_new)
            denom = denom * rescale + torch.exp(sink_g - m_new)
            acc = acc * rescale.unsqueeze(-1)
            m = m_new
        base = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = acc / safe.unsqueeze(-1)
        out[q0 + qs:q0 + qe] = o.permute(2, 0, 1, 3).reshape(n, hq, dv).to(q.dtype)
        lse[:, q0 + qs:q0 + qe] = (base + torch.log(denom)).reshape(hq, n)
    return out, lse


def row_terms(dout, out, dlse):
    """D = rowsum(dO * O) - dlse, (hq, total_q) fp32: the softmax-Jacobian term per row.

    A gradient flowing into lse adds p * dlse to dS, which is the same as lowering D by dlse.
    """
    d = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    return d if dlse is None else d - dlse.float()


def backward(dout, q, k, v, out, lse, dlse, seq: SeqInfo, params: AttnParams, sink):
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    d_rows = row_terms(dout, out, dlse)
    k, v = k.float(), v.float()
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for (q0, sq, k0, sk), (qs, qe), keys in _tiles(seq, params):
        rows = slice(q0 + qs, q0 + qe)
        n = qe - qs
        qt, dot = _grouped(q[rows], hkv), _grouped(dout[rows], hkv)
        lse_t = lse[:, rows].view(hkv, g, n, 1)
        lse_t = torch.where(torch.isinf(lse_t), torch.full_like(lse_t, float("inf")), lse_t)
        d_t = d_rows[:, rows].reshape(hkv, g, n, 1)
        dq_t = torch.zeros(n, hkv, g, q.shape[2])
        for ks, ke in keys:
            kt, vt = k[k0 + ks:k0 + ke], v[k0 + ks:k0 + ke]
            s, t = _scores(qt, kt, params, sq, sk, (qs, qe), (ks, ke))
            p = torch.exp(s - lse_t)
            dv[k0 + ks:k0 + ke] += torch.einsum("hgnk,nhgd->khd", p, dot)
            ds = p * (torch.einsum("nhgd,khd->hgnk", dot, vt) - d_t)
            if t is not None:  # d/ds of softcap * tanh(s / softcap)
                ds = ds * (1 - t * t)
            dq_t += torch.einsum("hgnk,khd->nhgd", ds, kt)
            dk[k0 + ks:k0 + ke] += torch.einsum("hgnk,nhgd->khd", ds, qt)
        dq[rows] = dq_t.reshape(n, hq, q.shape[2])
    scale = params.softmax_scale
    dsink = sink_grad(sink, lse, d_rows)
    return (dq * scale).to(q.dtype), (dk * scale).to(q.dtype), dv.to(q.dtype), dsink


# ---- Decode over a KV cache (flash_attn_with_kvcache, paged varlen): gather, then forward --

def unsupported_decode(q, cache, params, sink):
    if cache.k.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"a {cache.k.dtype} cache beside {q.dtype} q (needs q's dtype or e4m3)"
    return None if q.device.type == "cpu" else f"tensors are on {q.device}, not the CPU"


def _descaled(x, descale, seq_of_key, dtype):
    """Packed keys or values x (total_k, nheads_kv, d) times their sequence's descale."""
    if descale is None:
        return x.to(dtype)
    return x.float() * descale.float()[seq_of_key][:, :, None]


def gather(cache: CacheSpec):
    """Each sequence's keys and values, packed: (k, v, cu_seqlens_k) as in core.params."""
    lens = (cache.seqlens_k.to(torch.int64) + cache.k_extra).tolist()
    ks, vs = [], []
    for b, n in enumerate(lens):
        if cache.page_table is not None:
            page_size = cache.k.shape[1]
            pages = cache.page_table[b, :-(-n // page_size)].to(torch.int64)
            ks.append(cache.k[pages].flatten(0, 1)[:n])
            vs.append(cache.v[pages].flatten(0, 1)[:n])
        else:
            row = int(cache.batch_idx[b]) if cache.batch_idx is not None else b
            start = int(cache.leftpad[b]) if cache.leftpad is not None else 0
            ks.append(cache.k[row, start:n])
            vs.append(cache.v[row, start:n])
            lens[b] = max(n - start, 0)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    empty_k = cache.k.new_empty(0, *cache.k.shape[2:])
    empty_v = cache.v.new_empty(0, *cache.v.shape[2:])
    return (torch.cat(ks) if ks else empty_k, torch.cat(vs) if vs else empty_v,
            cu.to(cache.k.device), max(lens, default=0))


def decode(q, cache: CacheSpec, params: AttnParams, sink, num_splits: int = 0):
    """The CPU path; num_splits does not apply (the tiled loop has no occupancy to fill)."""
    total_q, nheads_q = q.shape[0], q.shape[1]
    dv = cache.v.shape[-1]
    if total_q == 0:
        return (q.new_empty(0, nheads_q, dv),
                torch.empty(nheads_q, 0, dtype=torch.float32, device=q.device))
    k, v, cu_k, max_k = gather(cache)
    # An e4m3 cache (api/kvcache_fp8.py) widens exactly to q's 16 bits; a no-op otherwise.
    # With descales, the values the cache stands for, in fp32 (forward computes in fp32).
    seq_of_key = None
    if cache.k_descale is not None or cache.v_descale is not None:
        seq_of_key = torch.repeat_interleave(torch.arange(cache.batch, device=k.device),
                                             cu_k.diff().long())
    k = _descaled(k, cache.k_descale, seq_of_key, q.dtype)
    v = _descaled(v, cache.v_descale, seq_of_key, q.dtype)
    if cache.cu_seqlens_q is not None:
        cu_q = cache.cu_seqlens_q
    else:
        cu_q = torch.arange(cache.batch + 1, dtype=torch.int32) * cache.max_seqlen_q
    seq = SeqInfo(cu_q, cu_k, cache.max_seqlen_q, max_k, None, False)
    return forward(q, k, v, seq, params, sink)
