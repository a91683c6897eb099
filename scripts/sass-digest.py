"""One SASS digest per representative sm90 kernel build: proves a refactor kept the code.

Compiles each build for sm_90a on the CPU through the library's own host code
(`compile_for_target`, configs from `select_config` / `launch_plan`), disassembles the
cubin (`cuobjdump -sass`, shipped with triton), keeps the instruction text only (no
addresses, encodings, line info or kernel names) and prints, per build:

    name  sha256[:16]  instructions  registers  local stores (STL)  local loads (LDL)

Usage (from the repository root; no GPU needed):

    python scripts/sass-digest.py > /tmp/sass-before.txt      # before a change
    python scripts/sass-digest.py > /tmp/sass-after.txt       # after it
    diff /tmp/sass-before.txt /tmp/sass-after.txt             # must be empty

--dump DIR writes each build's normalised SASS to DIR/<name>.sass (to diff a build that
changed); -k SUBSTR keeps the builds whose name contains SUBSTR, --names A,B the builds
named; -j N compiles N at once.
Each build runs in a fresh interpreter without TRITON_INTERPRET (under the interpreter a
Gluon compile cannot call Triton's standard library).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, direction, compile_for_target kwargs). "plan": a launch_plan call whose config the
# build takes (the path `forward` / `backward` take for such a call). "cfg": overrides of
# the default config. "dtype" by name.
FWD = [
    ("fwd-d64", {"head_dim": 64}),
    ("fwd-d128", {"head_dim": 128}),
    ("fwd-d256", {"head_dim": 256}),
    ("fwd-d128-fp16-causal", {"head_dim": 128, "dtype": "float16", "has_right": True}),
    ("fwd-d128-window-softcap-sink-varlen",
     {"head_dim": 128, "has_left": True, "has_right": True, "softcap": True, "has_sink": True,
      "uniform": False, "has_seqused": True}),
    ("fwd-d64-persistent", {"head_dim": 64, "cfg": {"persistent": True}}),
    ("fwd-d128-causal-persistent-lpt",
     {"head_dim": 128, "has_right": True, "cfg": {"persistent": True, "lpt": True}}),
    ("fwd-d256-persistent", {"head_dim": 256, "cfg": {"persistent": True}}),
    ("fwd-d128-persistent-qbuf2", {"head_dim": 128, "cfg": {"persistent": True,
                                                          "q_buffers": 2}}),
    ("fwd-d64-3wg-pingpong", {"head_dim": 64, "cfg": {"pingpong": True, "persistent": True,
                                                      "q_buffers": 1, "consumer_wgs": 3}}),
    ("fwd-d64-3wg-causal", {"head_dim": 64, "has_right": True,
                            "cfg": {"consumer_wgs": 3, "persistent": True, "lpt": True}}),
    ("fwd-d128-pingpong-causal", {"head_dim": 128, "has_right": True,
                                  "cfg": {"pingpong": True, "lpt": True}}),
    ("fwd-d128-heads-axis-causal", {"head_dim": 128, "heads_axis": True, "has_right": True}),
    ("fwd-d256-128-heads-axis", {"head_dim": 256, "head_dim_v": 128, "heads_axis": True,
                                 "has_right": True}),
    ("fwd-d128-masked-store", {"head_dim": 128, "tma_store": False}),
    ("fwd-d64-exp2-emu4", {"head_dim": 64, "cfg": {"exp2_emu_every": 4}}),
    ("fwd-d64-exp2-emu8-rescale8", {"head_dim": 64, "cfg": {"exp2_emu_every": 8,
                                                            "rescale_threshold": 8.0}}),
    ("fwd-d128-tail-skip", {"head_dim": 128, "has_right": True,
                            "cfg": {"tail_skip": True, "block_n": 64, "stages": 3,
                                    "persistent": True, "lpt": True}}),
    # d_qk 192 / d_v 128 (q and k in a 128- and a 64-wide piece), and the launch plans of
    # DeepSeek-V3's MLA prefill (128 heads, 2 x 4k, causal) and of a softcap call (64-key
    # blocks) with a window, a sink and packed sequences
    ("fwd-d192-128", {"head_dim": 192, "head_dim_v": 128}),
    ("fwd-d192-128-heads-axis-causal", {"head_dim": 192, "head_dim_v": 128, "heads_axis": True,
                                        "has_right": True}),
    ("fwd-plan-d192-128-causal-4k", {"head_dim": 192, "head_dim_v": 128, "has_right": True,
                                     "plan": dict(max_seqlen_q=4096, max_seqlen_k=4096,
                                                  batch=2, hq=128, hkv=128, window_right=0)}),
    ("fwd-plan-d192-128-softcap-window-sink-varlen", {
        "head_dim": 192, "head_dim_v": 128, "has_left": True, "has_right": True,
        "softcap": True, "has_sink": True, "uniform": False, "has_seqused": True,
        "plan": dict(max_seqlen_q=1000, max_seqlen_k=1000, batch=4, hq=16, hkv=16,
                     window_left=100, window_right=50)}),
    # launch plans of real calls: d=64 16k rows (three warpgroups, persistent), causal 512
    # rows (tail skip), and a pack-GQA decode-like call (32:4 heads, 16 rows x 8 = 128)
    ("fwd-plan-d64-16k", {"head_dim": 64, "plan": dict(
        max_seqlen_q=16384, max_seqlen_k=16384, batch=2, hq=16, hkv=16)}),
    ("fwd-plan-d128-causal-512", {"head_dim": 128, "has_right": True, "plan": dict(
        max_seqlen_q=512, max_seqlen_k=512, batch=8, hq=16, hkv=16, window_right=0)}),
    ("fwd-plan-d128-pack-gqa", {"head_dim": 128, "plan": dict(
        max_seqlen_q=128, max_seqlen_k=8192, batch=32, hq=4, hkv=4)}),
]
BWD = [
    ("bwd-d64", {"head_dim": 64}),
    ("bwd-d128", {"head_dim": 128}),
    ("bwd-d256-wide", {"head_dim": 256}),
    ("bwd-d64-det", {"head_dim": 64, "deterministic": True}),
    ("bwd-d128-det", {"head_dim": 128, "deterministic": True}),
    ("bwd-d256-wide-det", {"head_dim": 256, "deterministic": True}),
    ("bwd-d64-causal", {"head_dim": 64, "has_right": True}),
    ("bwd-d128-causal", {"head_dim": 128, "has_right": True}),
    ("bwd-d256-wide-causal", {"head_dim": 256, "has_right": True}),
    ("bwd-d128-window-softcap", {"head_dim": 128, "has_left": True, "has_right": True,
                                 "softcap": True}),
    ("bwd-d64-window-varlen", {"head_dim": 64, "has_left": True, "has_right": True,
                               "dtype": "float16", "uniform": False, "has_seqused": True}),
    ("bwd-d128-ws-persistent", {"head_dim": 128, "cfg": {"ws_persistent": True}}),
    ("bwd-d64-causal-det-ws-persistent", {"head_dim": 64, "has_right": True,
                                          "deterministic": True,
                                          "cfg": {"ws_persistent": True}}),
    ("bwd-d128-heads-axis", {"head_dim": 128, "heads_axis": True, "has_right": True}),
    # (No d=192 build: ptxas (CUDA 12.9) names a few of its registers differently from run
    # to run of the same PTX, so its digest changes with nothing changed. Compare its PTX
    # without line info instead: TRITON_DISABLE_LINE_INFO=1, `kernel.asm["ptx"]`.)
    ("bwd-plan-d64-causal-1k", {"head_dim": 64, "has_right": True, "plan": dict(
        max_seqlen_q=1024, max_seqlen_k=1024, batch=4, hq=16, hkv=16, window_right=0)}),
]
POST = [(f"dq-post-{w}-{c}", {"width": w, "cols": c}) for w, c in
        ((64, 64), (128, 64), (256, 128))]

# One build, run in a fresh interpreter: writes the cubin to argv[3].
_BUILD = r"""
import importlib, json, sys
import torch, triton

direction, kw, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if direction == "post":
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from asymflash.backends.sm90.bwd.dq_fragments import _dq_from_fragments_kernel as fn
    sig = {"acc_ptr": "*fp32", "dq_ptr": "*bf16", "cu_q_ptr": "*i32", "stride_row": "i32",
           "stride_head": "i32", "n_heads": "i32", "D": "constexpr", "WIDTH": "constexpr",
           "COLS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    cons = {"D": kw["width"], "WIDTH": kw["width"], "COLS": kw["cols"]}
    kernel = triton.compile(ASTSource(fn, sig, cons, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
else:
    mod = importlib.import_module(f"asymflash.backends.sm90.{direction}.host")
    plan = kw.pop("plan", None)
    if "dtype" in kw:
        kw["dtype"] = getattr(torch, kw["dtype"])
    d = kw["head_dim"]
    if plan is not None:  # the config the launch plan of such a call takes
        wl, wr = plan.get("window_left", -1), plan.get("window_right", -1)
        uniform = kw.get("uniform", True)
        seqused = kw.get("has_seqused", False)
        if direction == "fwd":
            p = mod.launch_plan(d, kw.get("head_dim_v", d), plan["max_seqlen_q"],
                                plan["max_seqlen_k"], uniform, seqused, wl, wr,
                                kw.get("softcap", False), kw.get("has_sink", False),
                                plan["batch"], plan["hq"], plan["hkv"], 132, None)
        else:
            p = mod.launch_plan(d, kw.get("head_dim_v", d), plan["max_seqlen_q"],
                                plan["max_seqlen_k"], uniform, seqused, wl, wr,
                                kw.get("softcap", False), kw.get("deterministic", False),
                                plan["batch"], plan["hkv"], 132, None, hq=plan["hq"])
        kw["cfg"] = p.cfg
    kernel = mod.compile_for_target(**kw)  # "cfg": overrides of the host's choice
with open(out, "wb") as f:
    f.write(kernel.asm["cubin"])
"""


def _bin() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def normalise(sass: str) -> list[str]:
    """The instruction text of every function, in order, with function names replaced."""
    names = re.findall(r"Function\s*:\s*(\S+)", sass)
    out = []
    for line in sass.splitlines():
        m = re.search(r"Function\s*:\s*(\S+)", line)
        if m:
            out.append("FUNCTION")
            continue
        m = _INSTR.search(line)
        if m:
            text = m.group(1)
            for i, name in enumerate(names):
                text = text.replace(name, f"FN{i}")
            out.append(re.sub(r"\s+", " ", text))
    return out


def build(item) -> dict:
    name, direction, kw = item
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        res = subprocess.run([sys.executable, "-c", _BUILD, direction, json.dumps(kw), cubin],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
        if res.returncode != 0:
            return {"name": name, "error": res.stderr.strip().splitlines()[-1:]}
        sass = subprocess.run([str(_bin() / "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
        res_usage = subprocess.run([str(_bin() / "cuobjdump"), "-res-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
    ins = normalise(sass)
    text = "\n".join(ins) + "\n"
    return {"name": name, "digest": hashlib.sha256(text.encode()).hexdigest()[:16],
            "n": sum(1 for x in ins if x != "FUNCTION"),
            "regs": int(re.findall(r"REG:(\d+)", res_usage)[0]),
            "stl": sum(1 for x in ins if re.search(r"\bSTL\b", x)),
            "ldl": sum(1 for x in ins if re.search(r"\bLDL\b", x)), "text": text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only builds whose name contains this")
    ap.add_argument("--names", default="", help="only these builds (comma-separated names)")
    ap.add_argument("-j", type=int, default=2, help="builds compiled at once")
    ap.add_argument("--dump", default=None, help="directory for the normalised SASS")
    args = ap.parse_args()
    items = ([(n, "fwd", kw) for n, kw in FWD] + [(n, "bwd", kw) for n, kw in BWD]
             + [(n, "post", kw) for n, kw in POST])
    items = [it for it in items if args.k in it[0]]
    if args.names:
        names = args.names.split(",")
        unknown = set(names) - {it[0] for it in items}
        if unknown:
            ap.error(f"no such builds: {sorted(unknown)}")
        items = [it for it in items if it[0] in names]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        for rep in pool.map(build, items):
            if "error" in rep:
                failed += 1
                print(f"{rep['name']:40s} ERROR {rep['error']}", flush=True)
                continue
            print(f"{rep['name']:40s} {rep['digest']} ins={rep['n']:6d} regs={rep['regs']:3d} "
                  f"stl={rep['stl']:3d} ldl={rep['ldl']:3d}", flush=True)
            if args.dump:
                Path(args.dump, rep["name"] + ".sass").write_text(rep["text"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
