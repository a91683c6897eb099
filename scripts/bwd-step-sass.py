"""What one sm90 backward build's step loop holds, from its sm_90a SASS (no GPU needed).

Compiles the backward the way `host.launch_plan` picks it for a call (head dims, lengths,
batch, heads, causal) and prints the chosen BwdConfig and KIND, then per step loop (a loop
whose body issues HGMMA and holds no inner such loop): its instruction count, its HGMMA
instructions by shape, CTA barriers (BAR.SYNC), mbarrier waits/arrives, local-memory
instructions; and for the kernel: registers, shared memory, threads per CTA.

    python scripts/bwd-step-sass.py --d 256 --dv 128 --seqlen 4096 --batch 2 --heads 128 \
        --causal --heads-axis
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from sass_loops import step_loops  # noqa: E402  (the compile tests' loop finder)

_LOCAL = re.compile(r"\b(LDL|STL)\b")

_BUILD = r"""
import json, sys
from asymflash.backends.sm90.bwd import host
a = json.loads(sys.argv[1])
plan = host.launch_plan(a["d"], a["dv"], a["seqlen"], a["seqlen"], True, False, -1,
                        0 if a["causal"] else -1, False, a["det"], a["batch"], a["heads"],
                        132, None, hq=a["heads"])
print("CONFIG", plan.cfg, file=sys.stderr)
print("KIND", plan.constexprs["KIND"], "num_warps", plan.constexprs["num_warps"],
      "grid", plan.grid, file=sys.stderr)
k = host.compile_for_target(a["d"], a["dv"], cfg=plan.cfg, heads_axis=a["heads_axis"],
                            has_right=a["causal"], deterministic=a["det"])
open(sys.argv[2], "wb").write(k.asm["cubin"])
print("SHARED", k.metadata.shared, file=sys.stderr)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dv", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--det", action="store_true")
    ap.add_argument("--dump", default=None, help="write the step loops' SASS to this file")
    ap.add_argument("--heads-axis", action="store_true",
                    help="(rows, heads, dim) descriptors, as head dims between the widths")
    args = ap.parse_args()
    a = dict(d=args.d, dv=args.dv or args.d, seqlen=args.seqlen, batch=args.batch,
             heads=args.heads, causal=args.causal, det=args.det, heads_axis=args.heads_axis)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        res = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(a), cubin], env=env,
                             cwd=ROOT, capture_output=True, text=True)
        print(res.stderr.strip()[-3000:])
        if res.returncode:
            return 1
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    print("REGS", re.findall(r"REG:(\d+)", usage)[0],
          "local (kernel)", len(re.findall(r"\b(LDL|STL)\b", sass)),
          "HGMMA (kernel)", sass.count("HGMMA"))
    loops = step_loops(sass)
    if args.dump:
        Path(args.dump).write_text("\n\n".join("\n".join(body) for body in loops) + "\n")
    for i, body in enumerate(loops):
        shapes = collections.Counter(re.search(r"HGMMA\.(\S+)", t).group(1).split(".")[0]
                                     for t in body if "HGMMA" in t)
        print(f"step loop {i}: {len(body)} instructions, HGMMA {sum(shapes.values())} "
              f"{dict(shapes)}, BAR.SYNC {sum('BAR.SYNC' in t for t in body)}, "
              f"SYNCS {sum('SYNCS' in t for t in body)}, "
              f"local {sum(bool(_LOCAL.search(t)) for t in body)}, "
              f"MUFU.EX2 {sum('MUFU.EX2' in t for t in body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
