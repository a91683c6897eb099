"""Where a decode call's time goes: %globaltimer stamps in the sm90 TMA decode kernel.

The kernel's TIMELINE build (`backends/sm90/decode.py`, a constexpr: the shipped build has no
stamps) records per program (one (sequence, kv head, split)), in ns on the GPU's global
clock, shared by all SMs:

    0 start   1 Q in shared memory (the ring's first loads already issued)
    2 the first K/V block has landed   3 the TMA blocks done   4 the tail done
    5 partial stored, ticket drawn (split calls)   6 output stored (merged, by the last split)

Cases: bf16, d=128, GQA 32:4, one query, no append, L2 flushed before each call (a 256 MB
write), batch 8 x 4k / 16k keys, contiguous and paged (page 64), heuristic splits and
others. Printed per case, medians over 5 calls (min-max in brackets), times from the first
program's start: when programs start, their first-byte wait, the streaming rate per program
and in all, when the last TMA block and the last output land, and how far apart the splits
of one tile finish (the merge waits for the last).

    PYTHONPATH=. python scripts/decode-timeline.py            # on an H200
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asymflash.api.kvcache import CacheSpec  # noqa: E402
from asymflash.backends.sm90 import decode  # noqa: E402
from asymflash.core.params import AttnParams  # noqa: E402

HQ, HKV, D, PAGE = 32, 4, 128, 64


def make(batch, seqlen, paged):
    dev = "cuda"
    q = torch.randn(batch, 1, HQ, D, dtype=torch.bfloat16, device=dev)
    if paged:
        pages = batch * seqlen // PAGE
        kc = torch.randn(pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
        table = torch.randperm(pages, device=dev).view(batch, -1).to(torch.int32)
    else:
        kc = torch.randn(batch, seqlen, HKV, D, dtype=torch.bfloat16, device=dev)
        table = None
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=dev)
    spec = CacheSpec(kc, vc, lens, 0, table, None, None, 1, seqlen, batch)
    return q, spec


def one_run(q, spec, splits, flush):
    params = AttnParams(softmax_scale=D ** -0.5)
    _, _, n_splits = decode.plan(q, spec, splits)
    progs = spec.batch * HKV * n_splits
    stamps = torch.zeros(progs * 8, dtype=torch.int64, device="cuda")
    if flush is not None:
        flush.fill_(1)
    torch.cuda.synchronize()
    decode.decode(q, spec, params, None, splits, stamps=stamps)
    torch.cuda.synchronize()
    return stamps.view(progs, 8).cpu(), n_splits


def summarise(st, n_splits, block_bytes):
    t0 = st[:, 0].min().item()
    rel = (st[:, :7] - t0).double() / 1e3  # us from the first start
    n_full = st[:, 7].double()
    loop = rel[:, 3] - rel[:, 2]
    per_block = (loop / (n_full - 1).clamp(min=1))
    done = rel[:, 6] if n_splits == 1 else rel[:, 5]
    tiles = st.shape[0] // n_splits
    spread = (rel[:, 5].view(tiles, n_splits).max(1).values
              - rel[:, 5].view(tiles, n_splits).min(1).values) if n_splits > 1 else None
    total_bytes = block_bytes * n_full.sum().item()
    return dict(
        start_last=rel[:, 0].max().item(),
        prologue=(rel[:, 1] - rel[:, 0]).median().item(),
        first_block=(rel[:, 2] - rel[:, 1]).median().item(),
        first_block_max=(rel[:, 2] - rel[:, 1]).max().item(),
        per_block_us=per_block.median().item(),
        gbs_per_prog=block_bytes / per_block.median().item() / 1e3,
        loop_end_min=rel[:, 3].min().item(), loop_end_med=rel[:, 3].median().item(),
        loop_end_max=rel[:, 3].max().item(),
        tail=(rel[:, 4] - rel[:, 3]).median().item(),
        partial_done_max=done.max().item(),
        merge=(rel[:, 6].max() - done.max()).item() if n_splits > 1 else 0.0,
        end=rel[:, 6].max().item(),
        split_spread=spread.median().item() if spread is not None else 0.0,
        split_spread_max=spread.max().item() if spread is not None else 0.0,
        tbs_stream=total_bytes / ((rel[:, 3].max() - rel[:, 2].min()).item() * 1e-6) / 1e12,
        tbs_call=total_bytes / (rel[:, 6].max().item() * 1e-6) / 1e12,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-flush", action="store_true",
                    help="no L2 flush between calls: the TLB (and, below 50 MB, L2) stays warm")
    ap.add_argument("--cases", default=None,
                    help="batch:seqlen:paged:splits,... (default: six cases at batch 8 and 32)")
    a = ap.parse_args()
    flush = None if a.no_flush else torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    cases = [(8, 4096, False, 0), (8, 4096, False, 2), (8, 4096, False, 8),
             (8, 4096, True, 0), (8, 16384, False, 0), (32, 4096, False, 0)]
    if a.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
        cases = [(b, n, bool(p), sp) for b, n, p, sp in cases]
    keys = ["start_last", "prologue", "first_block", "first_block_max", "per_block_us",
            "gbs_per_prog", "loop_end_min", "loop_end_med", "loop_end_max", "tail",
            "partial_done_max", "merge", "end", "split_spread", "split_spread_max",
            "tbs_stream", "tbs_call"]
    for batch, seqlen, paged, splits in cases:
        q, spec = make(batch, seqlen, paged)
        bn = decode.block_n(PAGE if paged else None)
        one_run(q, spec, splits, flush)  # compile, warm
        runs = []
        for _ in range(a.reps):
            st, n_splits = one_run(q, spec, splits, flush)
            runs.append(summarise(st, n_splits, 2 * bn * D * 2))
        name = (f"{'paged' if paged else 'contiguous'} b{batch} {seqlen // 1024}k "
                f"splits={n_splits} ({batch * HKV * n_splits} programs)")
        print(f"\n== {name}")
        for k in keys:
            vals = [r[k] for r in runs]
            print(f"  {k:18s} {statistics.median(vals):8.2f}  [{min(vals):.2f}-{max(vals):.2f}]")


if __name__ == "__main__":
    main()
