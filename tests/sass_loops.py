"""The step loops of a kernel's SASS (nvdisasm -c text): loops (a backward branch to a label)
whose body holds HGMMA (QGMMA: fp8) and no inner loop that does. Shared by the compile tests'
`sass_report` and `scripts/bwd-step-sass.py`."""

from __future__ import annotations

import re


def step_loops(sass: str) -> list[list[str]]:
    """The instructions of each step loop, in address order."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
            for name in pending:
                labels[name] = ins[-1][0]
            pending = []
    # (the mbarrier waits' retry stubs sit after the last EXIT and branch back: not loops)
    end = max((x for x, t in ins if re.match(r"(@!?U?P\d+\s+)?EXIT\b", t)), default=0)
    loops = set()
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?\(?\.(L_x_\d+)\)?", text)
        if m and addr < end and labels.get(m.group(1), addr + 1) <= addr:
            loops.add((labels[m.group(1)], addr))
    # (HGMMA, or QGMMA for fp8 operands)
    mma = [(a, b) for a, b in loops if any(a <= x <= b and "GMMA" in t for x, t in ins)]
    inner = [(a, b) for a, b in mma
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in mma)]
    return [[t for x, t in ins if a <= x <= b] for a, b in sorted(inner)]
