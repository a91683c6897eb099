"""Host time of one decode call as transformers makes it, and where it goes (cProfile).

A decode step of a small model is host-bound (scripts/hf-generate-bench.py: ~50 us more per
layer than SDPA on the H200's host): this times the Python of one attention call per path,
GPU work kept tiny (batch 8, 1k cached keys, 16 q / 4 kv heads x 128, bf16, the cache as
transformers holds it: (batch, heads, seq, dim) tensors seen transposed).

    asymattn   integrations.hf.attention_forward (-> flash_attn_with_kvcache)
    kvcache    flash_attn_with_kvcache on the same transposed tensors, no lengths
    sdpa       torch's scaled_dot_product_attention (enable_gqa) on the HF tensors

Prints us per call (median of 5 rounds of 300 calls, no synchronisation inside a round: the
GPU runs behind), then a cProfile of 300 asymattn calls by own time and by cumulative time.

    PYTHONPATH=. python scripts/decode-host.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asymflash import flash_attn_with_kvcache  # noqa: E402
from asymflash.integrations import hf  # noqa: E402


class _Layer(torch.nn.Module):
    is_causal = True


def per_call_us(fn, calls=300, rounds=5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def profile(fn, sort, calls=300, top=25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:start + top + 1])


def main():
    dev = "cuda"
    batch, hq, hkv, d, n = 8, 16, 4, 128, 1024
    query = torch.randn(batch, hq, 1, d, dtype=torch.bfloat16, device=dev)
    key = torch.randn(batch, hkv, n, d, dtype=torch.bfloat16, device=dev)
    value = torch.randn_like(key)
    layer = _Layer()
    scale = d ** -0.5
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))

    paths = {
        "asymattn": lambda: hf.attention_forward(layer, query, key, value, None,
                                                 scaling=scale),
        "kvcache": lambda: flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=True),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=scale, enable_gqa=True),
        "empty op (torch.empty)": lambda: torch.empty(batch, 1, hq, d, device=dev),
    }
    with torch.no_grad():
        for name, fn in paths.items():
            print(f"{name:24s} {per_call_us(fn):7.1f} us per call")
        print("\ncProfile, asymattn, by own time")
        print(profile(paths["asymattn"], "tottime"))
        print("\ncProfile, asymattn, by cumulative time")
        print(profile(paths["asymattn"], "cumulative"))


if __name__ == "__main__":
    main()
