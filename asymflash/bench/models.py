"""The models suite of `python -m asymflash bench --suite models`: named workloads shaped like
the models people run, beside the FlashAttention papers' grid.

The grid is MHA with one length per batch; models run GQA, packed documents of mixed lengths,
sliding windows, softcaps, d_qk != d_v, 100k-token contexts, non-causal vision transformers,
hybrid local/global stacks and decode over (paged) caches. Each case names the model whose
published config gives its head counts and head dims. Every case also has a "smoke" scaling
(`ModelCase.smoke`): the same kind at a size the CPU computes in a moment, so tests run the
whole suite's machinery (inputs, reference, the providers' calls, the check).

Document lengths (varlen cases) are log-normal -- document lengths of pretraining corpora are
heavy-tailed, roughly log-normal -- with the case's median and sigma, drawn by Python's
`random.Random(seed)` (the same lengths on every machine), each capped at the model's context,
packed until the case's token count is reached (the last document cut to fit).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import torch

from .core import Case, Inputs, Reference, Runner, chunked_attention, visible_pairs

KINDS = ("dense", "varlen", "hybrid", "decode")


def doc_lengths(total: int, cap: int, median: float, sigma: float, seed: int) -> tuple:
    """Log-normal document lengths (median `median`, log-space sigma `sigma`), each in
    [1, cap], packed until they sum to `total` exactly."""
    rng = random.Random(seed)
    lens, left = [], total
    while left > 0:
        n = min(cap, left, max(1, round(rng.lognormvariate(math.log(median), sigma))))
        lens.append(n)
        left -= n
    return tuple(lens)


def window_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> float:
    """(query, key) pairs a (left, right) window lets through, bottom-right aligned (-1:
    unbounded), counted exactly: sum over queries of the keys in [pos - left, pos + right]."""
    shift, total = seqlen_k - seqlen_q, 0
    for i in range(seqlen_q):
        pos = i + shift
        lo = 0 if left < 0 else max(0, pos - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, pos + right)
        total += max(0, hi - lo + 1)
    return float(total)


@dataclass(frozen=True)
class ModelCase(Case):
    """One named workload. Beyond Case's shape:

    kind: dense (q/k/v (batch, seqlen, heads, d)), varlen (batch 1: doc_lens packed into
    seqlen_q tokens, each document its own sequence), hybrid (the same q/k/v through
    `local_per_global` sliding-window layers and one global layer: the output stacks the
    layers), decode (one query per sequence over a cache of seqlen_k slots holding
    cache_lens[b] keys; page_size > 0: paged, pages shuffled).
    window: flash-attn's (left, right), -1 unbounded; with causal, right is 0.
    """

    name: str = ""
    model: str = ""
    kind: str = "dense"
    window: tuple = (-1, -1)
    softcap: float = 0.0
    doc_lens: tuple = ()
    cache_lens: tuple = ()
    page_size: int = 0
    local_per_global: int = 0
    # How the smoke scaling draws doc_lens again (median, sigma, cap, seed); () otherwise.
    doc_dist: tuple = ()

    @property
    def label(self) -> str:
        return self.name

    @property
    def modes(self) -> tuple:
        return ("fwd",) if self.kind == "decode" else ("fwd", "bwd", "fwdbwd")

    @property
    def layer_windows(self) -> tuple:
        """The window of each layer a call computes (one, except hybrid)."""
        if self.kind == "hybrid":
            return (self.window,) * self.local_per_global + ((-1, -1),)
        return (self.window,)

    @property
    def out_shape(self) -> tuple:
        if self.kind == "varlen":
            return (self.seqlen_q, self.nheads, self.hdim_v)
        base = (self.batch, self.seqlen_q, self.nheads, self.hdim_v)
        return (len(self.layer_windows),) + base if self.kind == "hybrid" else base

    def pairs(self) -> float:
        if self.kind == "varlen":
            return float(sum(visible_pairs(n, n, self.causal) for n in self.doc_lens))
        if self.kind == "decode":  # per sequence, as attention_flops multiplies by batch
            return sum(self.cache_lens) / self.batch
        total = 0.0
        for left, right in self.layer_windows:
            right = 0 if self.causal else right
            if left < 0 and right in (-1, 0):  # the grid's convention (causal square: half)
                total += visible_pairs(self.seqlen_q, self.seqlen_k, right == 0)
            else:
                total += window_pairs(self.seqlen_q, self.seqlen_k, left, right)
        return total

    def kv_bytes(self) -> float | None:
        """Bytes of K and V a decode call must read (the keys each sequence holds), or None
        for the other kinds (compute-bound: TFLOP/s is their measure)."""
        if self.kind != "decode":
            return None
        per_key = self.nheads_kv * (self.hdim + self.hdim_v) * self.torch_dtype.itemsize
        return float(sum(self.cache_lens) * per_key)

    def smoke(self) -> "ModelCase":
        """The same kind at CPU size: a few dozen tokens, two kv heads at most (the GQA ratio
        capped at 4), the head dims, softcap and the window's share of the context kept."""
        ratio = min(4, self.nheads // self.nheads_kv)
        kv = 1 if ratio > 1 else 2
        seq = 96 if self.kind in ("varlen", "hybrid") or self.window != (-1, -1) else 40
        scale = seq / max(self.seqlen_k, 1)
        left, right = self.window
        window = (max(1, round(left * scale)) if left > 0 else left,
                  max(1, round(right * scale)) if right > 0 else right)
        kw = dict(batch=min(self.batch, 2), seqlen_q=min(self.seqlen_q, seq), seqlen_k=seq,
                  nheads=kv * ratio, nheads_kv=kv, window=window, dtype="fp32")
        if self.kind == "varlen":
            median, sigma, cap, seed = self.doc_dist
            small_cap = max(8, round(cap * scale))
            kw.update(batch=1, seqlen_q=seq, doc_lens=doc_lengths(
                seq, small_cap, max(6.0, median * scale), sigma, seed))
        if self.kind == "decode":
            b = 3 if self.batch <= 8 else 4
            kw.update(batch=b, seqlen_q=1, seqlen_k=48, page_size=16 if self.page_size else 0,
                      cache_lens=(48, 17, 1, 33)[:b])
        return dataclasses.replace(self, name=self.name + "-smoke", **kw)


def _varlen(name, model, total, cap, median, sigma, heads, kv, d, seed=0) -> ModelCase:
    lens = doc_lengths(total, cap, median, sigma, seed)
    return ModelCase(1, total, total, heads, kv, d, d, True, name=name, model=model,
                     kind="varlen", doc_lens=lens, doc_dist=(median, sigma, cap, seed))


def _decode(name, model, batch, context, paged, seed=0) -> ModelCase:
    # Serving batches hold sequences at different points of their generation: lengths
    # uniform in [context / 4, context], the longest always present.
    rng = random.Random(seed)
    lens = (context,) + tuple(rng.randint(context // 4, context) for _ in range(batch - 1))
    return ModelCase(batch, 1, context, 32, 8, 128, 128, True, name=name, model=model,
                     kind="decode", cache_lens=lens, page_size=64 if paged else 0)


def models_suite() -> list:
    """The suite at full size, in table order."""
    return [
        _varlen("varlen-docs-llama3-8b", "Llama-3-8B (32:8, d128), 64k tokens packed, "
                "log-normal docs median 1k sigma 1.2, cap 8k", 65536, 8192, 1024, 1.2, 32, 8,
                128),
        ModelCase(2, 4096, 4096, 128, 128, 192, 128, True, name="mla-prefill-deepseek-v3",
                  model="DeepSeek-V3 MLA prefill (128 heads, d_qk 192 = 128 + 64 rope, "
                  "d_v 128)"),
        ModelCase(1, 131072, 131072, 32, 8, 128, 128, True, name="long-128k-llama3-8b",
                  model="Llama-3-8B (32:8, d128) at 128k tokens"),
        ModelCase(4, 4096, 4096, 16, 16, 64, 64, False, name="vit-l16-4k",
                  model="ViT-L/16 (16 heads, d64) at 1024x1024: 4096 patches, non-causal"),
        ModelCase(2, 8192, 8192, 64, 8, 128, 128, True, name="train-8k-llama3-70b",
                  model="Llama-3-70B (64:8, d128) training step at 8k"),
        ModelCase(1, 16384, 16384, 32, 8, 128, 128, True, name="swa-4k-mistral-7b",
                  model="Mistral-7B (32:8, d128), 4k sliding window over 16k",
                  window=(4095, 0)),
        ModelCase(2, 8192, 8192, 16, 8, 256, 256, True, name="softcap-gemma2-9b",
                  model="Gemma-2-9B global layer (16:8, d256, softcap 50)", softcap=50.0),
        ModelCase(1, 16384, 16384, 16, 8, 256, 256, True, name="hybrid-gemma3-12b",
                  model="Gemma-3-12B (16:8, d256): 5 sliding-window (1k) layers + 1 global, "
                  "16k", kind="hybrid", window=(1023, 0), local_per_global=5),
        _decode("decode-b8-4k-llama3-8b", "Llama-3-8B decode (32:8, d128), batch 8, "
                "contiguous cache 4k", 8, 4096, False),
        _decode("decode-paged-b8-4k-llama3-8b", "Llama-3-8B decode, batch 8, paged cache 4k "
                "(page 64, shuffled)", 8, 4096, True),
        _decode("decode-b32-4k-llama3-8b", "Llama-3-8B decode, batch 32, contiguous cache 4k",
                32, 4096, False),
        _decode("decode-paged-b32-4k-llama3-8b", "Llama-3-8B decode, batch 32, paged cache "
                "4k (page 64, shuffled)", 32, 4096, True),
    ]


def select_cases(cases: list, names) -> list:
    """The cases named (a name or a unique prefix each); ValueError lists the known ones."""
    if not names:
        return list(cases)
    keep = []
    for name in names:
        hits = [c for c in cases if c.name == name] or \
            [c for c in cases if c.name.startswith(name)]
        if not hits:
            known = ", ".join(c.name for c in cases)
            raise ValueError(f"unknown case {name!r}; the suite has: {known}")
        keep += [c for c in hits if c not in keep]
    return [c for c in cases if c in keep]


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass
class ModelInputs(Inputs):
    """q, k, v, dout as the case's kind lays them out (varlen: packed (tokens, heads, d);
    decode: k/v the contiguous cache), and the kind's index tensors in `aux`: cu_seqlens
    (int32), cache_seqlens (int32), page_table, k_paged, v_paged."""

    aux: dict = field(default_factory=dict)


def make_model_inputs(case: ModelCase, device, seed: int = 0) -> ModelInputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=case.torch_dtype)

    b, sq, sk, h, hk = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_kv
    aux = {}
    if case.kind == "varlen":
        q, k, v = randn(sq, h, case.hdim), randn(sq, hk, case.hdim), randn(sq, hk, case.hdim_v)
        offsets = [0]
        for n in case.doc_lens:
            offsets.append(offsets[-1] + n)
        aux["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32, device=device)
        aux["max_seqlen"] = max(case.doc_lens)
    else:
        q = randn(b, sq, h, case.hdim)
        k, v = randn(b, sk, hk, case.hdim), randn(b, sk, hk, case.hdim_v)
    if case.kind == "decode":
        aux["cache_seqlens"] = torch.tensor(case.cache_lens, dtype=torch.int32, device=device)
        if case.page_size:
            aux.update(_paged(k, v, case.page_size, seed, device))
    return ModelInputs(q, k, v, randn(*case.out_shape), aux)


def _paged(k, v, page_size: int, seed: int, device) -> dict:
    """The contiguous cache cut into pages stored in a shuffled order (as a serving engine's
    allocator leaves them), with the page table that finds them: same keys, same values."""
    b, cap, hk = k.shape[:3]
    per_seq = cap // page_size
    perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(seed + 1))
    table = perm.view(b, per_seq).to(torch.int32)
    pages_k = torch.empty(b * per_seq, page_size, hk, k.shape[3], dtype=k.dtype, device=device)
    pages_v = torch.empty(b * per_seq, page_size, hk, v.shape[3], dtype=v.dtype, device=device)
    pages_k[perm.to(device)] = k.reshape(b * per_seq, page_size, hk, -1)
    pages_v[perm.to(device)] = v.reshape(b * per_seq, page_size, hk, -1)
    return {"page_table": table.to(device), "k_paged": pages_k, "v_paged": pages_v}


# --------------------------------------------------------------------------------------------
# The reference


def chunk_elems(device) -> int:
    """Score elements per chunk of the reference: the grid's 2^26 on the CPU; on CUDA a share
    of the free memory (about 100 bytes per element covers the fp32 scores, the softmax's
    temporaries and what autograd keeps), so the 128k case runs a few hundred chunks, not
    thousands of 16-row ones."""
    device = torch.device(device)
    if device.type != "cuda":
        return 2**26
    free, _ = torch.cuda.mem_get_info(device)
    return max(2**26, min(2**31, free // 100))


def _layers(ref_fn, case: ModelCase, q, k, v, upcast, dout):
    """The reference output of `case` on (upcast or plain) q/k/v; grads accumulate in the
    leaves when dout is given. Every document, layer and sequence is its own chunked call."""
    kw = dict(softcap=case.softcap, max_elems=chunk_elems(q.device))

    def attend(qs, ks, vs, window, d):
        return chunked_attention(ref_fn, qs, ks, vs, case.causal, upcast, dout=d,
                                 window_size=window, **kw)

    if case.kind == "varlen":
        outs, start = [], 0
        for n in case.doc_lens:
            sl = slice(start, start + n)
            d = None if dout is None else dout[sl][None]
            outs.append(attend(q[sl][None], k[sl][None], v[sl][None], case.window, d)[0])
            start += n
        return torch.cat(outs)
    if case.kind == "decode":
        return torch.cat([attend(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], case.window, None)
                          for i, n in enumerate(case.cache_lens)])
    if case.kind != "hybrid":
        return attend(q, k, v, case.window, dout)
    return torch.stack([attend(q, k, v, w, None if dout is None else dout[i])
                        for i, w in enumerate(case.layer_windows)])


def _model_reference_run(ref_fn, inputs: ModelInputs, case: ModelCase, upcast, with_grads):
    dtype = torch.float32 if upcast else case.torch_dtype
    q, k, v = (t.to(dtype) for t in (inputs.q, inputs.k, inputs.v))
    if not with_grads:
        with torch.no_grad():
            return _layers(ref_fn, case, q, k, v, upcast, None), None
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = _layers(ref_fn, case, q, k, v, upcast, inputs.dout.to(dtype))
    return out, tuple(t.grad.detach() for t in (q, k, v))


def model_reference(ref_fn, inputs: ModelInputs, case: ModelCase, with_grads: bool) -> Reference:
    """fp32 and same-dtype references of every document, layer and sequence of the case."""
    with_grads = with_grads and case.kind != "decode"
    out, grads = _model_reference_run(ref_fn, inputs, case, True, with_grads)
    plain, grads_plain = _model_reference_run(ref_fn, inputs, case, False, with_grads)
    return Reference(out, plain, grads, grads_plain)


class ModelRunner(Runner):
    """The grid's Runner (check before timing, statuses, timing) over ModelCases."""

    def make_inputs(self, case: ModelCase) -> ModelInputs:
        return make_model_inputs(case, self.device, self.seed)

    def reference(self, inputs: ModelInputs, case: ModelCase, with_grads: bool) -> Reference:
        return model_reference(self.reference_fn, inputs, case, with_grads)

    def make_call(self, provider, case: ModelCase, inputs: ModelInputs, q, k, v):
        if provider.make_model is None:
            raise NotImplementedError("not in the models suite")
        return provider.make_model(case, inputs, q, k, v)
