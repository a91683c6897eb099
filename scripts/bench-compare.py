"""Before/after: two `python -m asymflash bench` results, cell by cell.

    python scripts/bench-compare.py --old DIR... --new DIR... [--provider asymflash-sm90]

Each directory holds a results.json. A cell measured in several directories of one side (runs
repeated in alternating order) counts with its best time: noise only ever slows a run. For
every (case, mode) that both sides measured, prints new / old TFLOP/s and host time per call,
then the geometric mean and the slowest cell. Exit status 1 when a cell of the new run is
more than the tolerance slower, or its geometric mean lower, or a cell of it is WRONG.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def cells(directories: list, provider: str) -> dict:
    out = {}
    for directory in directories:
        record = json.loads((directory / "results.json").read_text())
        for r in record["results"]:
            if r["provider"] != provider:
                continue
            key = (r["hdim"], r["causal"], r["seqlen_q"], r["mode"])
            kept = out.get(key)
            if kept is None or r["status"] != "ok" or (
                    kept["status"] == "ok" and r["tflops"] > kept["tflops"]):
                out[key] = r  # a wrong or failed round is never hidden by a good one
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, nargs="+", required=True)
    ap.add_argument("--new", type=Path, nargs="+", required=True)
    ap.add_argument("--provider", default="asymflash-sm90")
    ap.add_argument("--tolerance", type=float, default=0.02)
    args = ap.parse_args(argv)
    old, new = cells(args.old, args.provider), cells(args.new, args.provider)
    wrong = [k for k, r in new.items() if r["status"] != "ok"]
    rows, ratios = [], []
    print("| hdim | causal | seqlen | mode | old TFLOP/s | new TFLOP/s | new / old | "
          "host us old / new |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(set(old) & set(new)):
        o, n = old[key], new[key]
        if o["status"] != "ok" or n["status"] != "ok":
            print(f"| {' | '.join(map(str, key))} | {o['status']} | {n['status']} | - | - |")
            continue
        ratio = n["tflops"] / o["tflops"]
        ratios.append(ratio)
        rows.append((ratio, key))
        host = f"{o.get('host_us') or 0:.0f} / {n.get('host_us') or 0:.0f}"
        print(f"| {' | '.join(map(str, key))} | {o['tflops']:.4g} | {n['tflops']:.4g} | "
              f"{ratio:.3f} | {host} |")
    if not ratios:
        print("no cell measured by both runs")
        return 1
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    worst, worst_key = min(rows)
    slow = [k for r, k in rows if r < 1 - args.tolerance]
    print(f"\n{len(ratios)} cells: geomean new/old {geomean:.3f}, slowest {worst:.3f} "
          f"({worst_key}); {len(slow)} beyond -{args.tolerance:.0%}; {len(wrong)} not ok in new")
    return 1 if slow or wrong or geomean < 1.0 else 0


if __name__ == "__main__":
    sys.exit(main())
