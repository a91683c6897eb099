"""Small calls through every kernel family, for compute-sanitizer (memcheck, racecheck).

Forward and backward at head dims 64, 128 and 256 (causal and not, GQA, deterministic, a
sliding window), varlen with ragged lengths, and a paged decode that appends. Each result is
checked against the reference, so a run is also a correctness check. Small shapes: the
sanitizer slows kernels by orders of magnitude. Run it once plainly first (kernels compile
into Triton's cache), then under the tool:

    python scripts/sanitize.py && compute-sanitizer --tool memcheck python scripts/sanitize.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asymflash import (  # noqa: E402
    attention_ref,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

DT = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script
failures = []


def close(name, got, want, tol=3e-2):
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    status = "ok" if err <= tol * scale else "WRONG"
    print(f"{name:48s} max err {err:.3g}  {status}", flush=True)
    if status != "ok":
        failures.append(name)


def dense(d, causal, hq=4, hkv=2, s=300, deterministic=False, window=(-1, -1)):
    q = torch.randn(2, s, hq, d, device=DEVICE, dtype=DT, requires_grad=True)
    k = torch.randn(2, s + 17, hkv, d, device=DEVICE, dtype=DT, requires_grad=True)
    v = torch.randn(2, s + 17, hkv, d, device=DEVICE, dtype=DT, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window,
                          deterministic=deterministic)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=causal, window_size=window)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    tag = f"d={d} causal={int(causal)} det={int(deterministic)} window={window}"
    close(f"fwd {tag}", out, ref)
    for n, g, r in zip("qkv", grads, ref_grads):
        close(f"d{n} {tag}", g, r)


def varlen(d=128):
    lens = [1, 113, 203, 17]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, d, device=DEVICE, dtype=DT, requires_grad=True)
               for h in (4, 2, 2))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    out.sum().backward()
    for b, n in enumerate(lens):
        a = int(cu[b])
        ref, _ = attention_ref(*(t[a:a + n].detach().float().unsqueeze(0) for t in (q, k, v)),
                               causal=True)
        close(f"varlen d={d} sequence {b} ({n} rows)", out[a:a + n], ref[0])


def paged_decode(d=128, page=64):
    batch, pages_per_seq, hkv, hq = 3, 4, 2, 8
    k_cache = torch.randn(batch * pages_per_seq, page, hkv, d, device=DEVICE, dtype=DT)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * pages_per_seq, device=DEVICE, dtype=torch.int32)
    table = table.view(batch, pages_per_seq)
    lens = torch.tensor([5, 130, 200], device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, 1, hq, d, device=DEVICE, dtype=DT)
    k_new, v_new = (torch.randn(batch, 1, hkv, d, device=DEVICE, dtype=DT) for _ in "kv")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                  page_table=table, causal=True)
    for b in range(batch):
        n = int(lens[b]) + 1
        keys, values = (c[table[b].long()].flatten(0, 1)[:n][None].float()
                        for c in (k_cache, v_cache))
        ref, _ = attention_ref(q[b:b + 1].float(), keys, values, causal=True)
        close(f"paged decode sequence {b} ({n} keys)", out[b], ref[0])


def main() -> int:
    torch.manual_seed(0)
    for d in (64, 128, 256):
        dense(d, causal=False)
        dense(d, causal=True)
    dense(128, causal=True, deterministic=True)
    dense(128, causal=False, window=(64, 0))
    if DEVICE == "cuda":
        dense(128, causal=False, hq=2, hkv=2, s=4096)  # long enough for persistent kernels
    varlen()
    paged_decode()
    print(f"sanitize: {len(failures)} wrong" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
