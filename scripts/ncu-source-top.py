"""Where the warps of one kernel stall, per SASS instruction (scripts/ncu-source.sh's CSV).

    python3 scripts/ncu-source-top.py FILE.csv.gz [--top 20] [--reason barrier]

Prints (1) the stall reasons over all samples and over the samples of warps that are not
parked: a warp that waits out the kernel at a join (the load warp after its last TMA issue,
Gluon's worker partitions at the end of `warp_specialize`) sits at a NOP executed once per
warp and fills ncu's "barrier" stall without costing time (19 % of all
forward d=64 samples, 25 % of the backward's); (2) the hot loops (instructions executed at
least 30 % as often as the most executed one), each with its reasons; (3) the instructions
with the most samples of one reason."""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import Counter

ALL = "Warp Stall Sampling (All Samples)"
EXEC = "Instructions Executed"


def read(path: str) -> list[dict]:
    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def num(x) -> int:
    try:
        return int(str(x).replace(",", ""))
    except ValueError:
        return 0


def shares(rows: list[dict], reasons: list[str]) -> str:
    tot = Counter()
    for r in rows:
        for k in reasons:
            tot[k] += num(r[k])
    s = max(sum(tot.values()), 1)
    return f"{s} samples: " + ", ".join(f"{k[6:]} {v / s:.0%}" for k, v in tot.most_common(7))


def hot_loops(rows: list[dict]) -> list[tuple[int, int]]:
    peak = max(num(r[EXEC]) for r in rows)
    hot = [i for i, r in enumerate(rows) if num(r[EXEC]) >= 0.3 * peak]
    loops, start, prev = [], hot[0], hot[0]
    for i in hot[1:] + [None]:
        if i is None or i > prev + 3:
            if prev - start >= 10:
                loops.append((start, prev))
            if i is not None:
                start = i
        if i is not None:
            prev = i
    return loops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--reason", default="barrier")
    a = ap.parse_args()
    rows = read(a.path)
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    # Parked: a NOP whose samples are all one reason and that each warp runs about once.
    peak = max(num(r[EXEC]) for r in rows)
    parked = [r for r in rows if r["Source"].strip() == "NOP" and num(r[EXEC]) < peak * 0.01
              and num(r[ALL]) > 0]
    active = [r for r in rows if not any(r is p for p in parked)]
    print(f"{len(rows)} instructions")
    print("all:          ", shares(rows, reasons))
    print("not parked:   ", shares(active, reasons))
    waves = sum(num(r.get("L1 Wavefronts Shared", 0)) for r in rows)
    ideal = sum(num(r.get("L1 Wavefronts Shared Ideal", 0)) for r in rows)
    if waves:  # bank conflicts: wavefronts beyond the ideal (the dQ staging's)
        print(f"shared-memory wavefronts {waves}, ideal {ideal} "
              f"(excess {(waves - ideal) / waves:.1%})")
    for lo, hi in hot_loops(rows):
        print(f"loop [{lo},{hi}] x{num(rows[lo][EXEC])}:", shares(rows[lo:hi + 1], reasons))
    key = f"stall_{a.reason}"
    print(f"-- top by {key}")
    for i in sorted(range(len(rows)), key=lambda i: -num(rows[i][key]))[: a.top]:
        r = rows[i]
        top3 = sorted(reasons, key=lambda k: -num(r[k]))[:3]
        why = " ".join(f"{k[6:]}={num(r[k])}" for k in top3 if num(r[k]))
        print(f"{i:5d} {num(r[key]):6d} {num(r[ALL]):6d} exec={num(r[EXEC]):9d} "
              f"{r['Source'].strip()[:60]:60s} {why}")


if __name__ == "__main__":
    main()
