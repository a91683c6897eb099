"""Compile a kernel for sm_90a on a machine without a GPU and report what its SASS holds.

The compiles run in a worker interpreter without TRITON_INTERPRET (conftest turns the
interpreter on for CPU machines, and under it Triton cannot compile for a GPU target). One
worker per test process serves every report of that process (one set of imports instead of
one per report), and a report asked for twice is compiled once. The caller's script must
leave the CompiledKernel in `kernel`; REPORT_TAIL prints one JSON line.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

REPORT_TAIL = r"""
import json as _json, os as _os, re as _re, subprocess as _sp, tempfile as _tf
_bin = _os.path.join(_os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with _tf.NamedTemporaryFile(suffix=".cubin", delete=False) as _f:
    _f.write(kernel.asm["cubin"])
_sass = _sp.run([_os.path.join(_bin, "nvdisasm"), "-c", _f.name], capture_output=True,
                text=True, check=True).stdout
_res = _sp.run([_os.path.join(_bin, "cuobjdump"), "-res-usage", _f.name],
               capture_output=True, text=True, check=True).stdout
_os.unlink(_f.name)
# ptxas's own verdict on the wgmma pipeline (C7511: it serialised every wgmma of the kernel);
# a second ptxas run, so only when asked (ASYM_PTXAS_VERDICT=1: `sass_report(ptxas=True)`)
_serialized = None
if _os.environ.get("ASYM_PTXAS_VERDICT") == "1":
    with _tf.NamedTemporaryFile(suffix=".ptx", delete=False, mode="w") as _p:
        _p.write(kernel.asm["ptx"])
    _ptxas = _sp.run([_os.path.join(_bin, "ptxas"), "-arch=sm_90a", "-v", _p.name, "-o",
                      _p.name + ".cubin"], capture_output=True, text=True)
    for _name in (_p.name, _p.name + ".cubin"):
        if _os.path.exists(_name):
            _os.unlink(_name)
    _serialized = "wgmma.mma_async instructions are serialized" in _ptxas.stdout + _ptxas.stderr
# The step loops (`sass_loops`). A persistent kernel's tile loop spans prologue and
# epilogue, which local_in_loop below counts; this counts the steps' own local-memory
# instructions.
from sass_loops import step_loops as _step_loops_of
_step_loops = _step_loops_of(_sass)
_local_in_steps = sum(1 for _body in _step_loops for t in _body
                      if _re.search(r"\b(LDL|STL)\b", t))
# instructions of the step loops (all of them together) by opcode, predicates dropped
_step_ops = {}
for _body in _step_loops:
    for _t in _body:
        _op = _re.sub(r"^@!?U?P\w+\s+", "", _t).split()[0]
        _step_ops[_op] = _step_ops.get(_op, 0) + 1
print(_json.dumps(dict(
    wgmma_serialized=_serialized, step_loops=len(_step_loops),
    local_in_step_loops=_local_in_steps, step_ops=_step_ops,
    # fp8 wgmmas (SASS names them QGMMA; PTX wgmma...e4m3.e4m3)
    qgmma_e4m3=len(_re.findall(r"\bQGMMA\.\S+\.E4M3\.E4M3\b", _sass)),
    hgmma=_sass.count("HGMMA"), mma=_sass.count("HGMMA") + _sass.count("HMMA"),
    # HGMMA instructions by shape (M x N x K), e.g. {"64x32x16": 28}
    hgmma_shapes={_k: _v for _k, _v in __import__("collections").Counter(
        _re.findall(r"HGMMA\.(\d+x\d+x\d+)", _sass)).items()},
    local=len(_re.findall(r"\b(LDL|STL)\b", _sass)), mufu_ex2=_sass.count("MUFU.EX2"),
    f2f=len(_re.findall(r"\bF2F\.", _sass)),  # conversion-pipe conversions
    lds_u8=len(_re.findall(r"\bLDS\.U8\b", _sass)),  # shared memory read byte by byte
    # local-memory instructions between the first and the last HGMMA: the main loop's body
    # (spills around the loop, in the prologue or the epilogue, cost once per CTA)
    local_in_loop=len(_re.findall(r"\b(LDL|STL)\b", _sass[_sass.find("HGMMA"):
                                                            _sass.rfind("HGMMA")])),
    red=len(_re.findall(r"\bREDG?\.E\.ADD\.F32", _sass)),
    tma_reduce=_sass.count("UTMAREDG"), tma_store=_sass.count("UTMASTG"),
    tma_load_3d=kernel.asm["ptx"].count("cp.async.bulk.tensor.3d.shared"),
    # deterministic backward: each release of a dQ turn waits for the TMA reduce to *write*
    # (wait_group without .read) and fences the async proxy first
    release_after_bulk_write=bool(_re.search(
        r"cp\.async\.bulk\.wait_group 0;\s*fence\.proxy\.async\.global;"
        r"(?:(?!(?:atom|red)\.)[\s\S])*"
        # (a release add whose result is unused: `atom` up to triton 3.8, `red` on 3.9)
        r"(?:atom|red)\.global\.gpu\.release",
        _re.sub(r"(?m)^\s*\.loc\b.*\n", "", kernel.asm["ptx"]))),  # (line info from 3.9)
    syncs=len(_re.findall(r"\bSYNCS\.(?:PHASECHK|ARRIVE)", _sass)),
    bars=_sass.count("BAR.SYNC"),
    vote_any=_sass.count("VOTE.ANY"),
    sts128=len(_re.findall(r"\bSTS\.128\b", _sass)),
    ldg128=len(_re.findall(r"\bLDG\.E\.128\b", _sass)),
    ldg32=len(_re.findall(r"\bLDG\.E\s", _sass)),
    # 64-bit stores right before a fence of the async proxy: a row-major dQ staging tile
    sts64_fp32_staging=len(_re.findall(r"STS\.64[^\n]*\n[^\n]*MEMBAR\.ALL\.CTA", _sass)),
    # TMA boxes of the fp32 descriptors (the backward's dQ staging tile): [rows, columns]
    fp32_boxes=[m["block_size"] for m in (getattr(kernel.metadata, "tensordesc_meta", None)
                                          or []) if m["elem_size"] == 4],
    regs=int(_re.findall(r"REG:(\d+)", _res)[0]), shared=kernel.metadata.shared,
    maxnreg=sorted({int(x) for x in _re.findall(
        r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])}))))
"""


def sm90_build(module: str) -> str:
    """Script compiling `asymflash.backends.sm90.<module>.compile_for_target(**argv[1])`
    (JSON; "dtype" by name, "cfg" as overrides of the config the host picks for these
    features)."""
    return f"""
import json, sys
import torch, triton
from asymflash.backends.sm90.{module} import host as mod
kw = json.loads(sys.argv[1])
if "dtype" in kw:
    kw["dtype"] = getattr(torch, kw["dtype"])
kernel = mod.compile_for_target(**kw)
"""


# The worker: reads one JSON request a line ({"script", "args", "ptxas"}), runs the script in
# a fresh namespace with sys.argv set as a command line would, and answers one JSON line on
# its own descriptor (compilers' native output to fd 1 goes to stderr instead). Between
# requests it takes back what a script may have installed in the process: Triton's stage
# hook (the arrive_all pass) and the environment.
_WORKER = r"""
import contextlib, io, json, os, sys, traceback
_reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
import torch, triton
from triton import knobs
_hook = knobs.runtime.add_stages_inspection_hook
_env = dict(os.environ)
for _line in sys.stdin:
    _req = json.loads(_line)
    os.environ["ASYM_PTXAS_VERDICT"] = "1" if _req["ptxas"] else "0"
    sys.argv = ["-c", *_req["args"]]
    _buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(_buf):
            exec(compile(_req["script"], "<sass_report>", "exec"), {"__name__": "__main__"})
        _ans = {"ok": True, "stdout": _buf.getvalue()}
    except BaseException:
        _ans = {"ok": False, "error": _buf.getvalue()[-2000:] + traceback.format_exc()}
    knobs.runtime.add_stages_inspection_hook = _hook
    for _mod in list(sys.modules.values()):
        if getattr(_mod, "__name__", "").endswith(".arrive_all") and \
                isinstance(getattr(_mod, "_installed", None), list):
            _mod._installed.clear()
    os.environ.clear()
    os.environ.update(_env)
    _reply.write(json.dumps(_ans) + "\n")
    _reply.flush()
"""

TIMEOUT = 600  # seconds per report

# The budgets of the compile tests (local-memory instructions: register spills) were read off
# the SASS of triton 3.6, the release the GPU suite verifies. Other releases' LLVM and ptxas
# allocate registers differently (a few spills more or less), and the GPU has not measured
# what that costs there. So on another release an overrun skips with the numbers, and only
# the structural checks (HGMMA, setmaxnreg budgets, shared memory, TMA) fail a test.
REFERENCE_TRITON = "3.6."


def reference_codegen() -> bool:
    """Whether this Triton is the one the compile tests' budgets were measured with."""
    return triton.__version__.startswith(REFERENCE_TRITON)


class Budgets:
    """A report's budgets, checked together by `verdict` after its structural asserts: over
    budget fails on the reference Triton and skips, saying by how much, on another."""

    def __init__(self, rep: dict):
        self.rep, self.over = rep, []

    def check(self, value: int, budget: int, what: str = "local-memory instructions"):
        if value > budget:
            self.over.append(f"{what} {value} > {budget}")
        return self

    def verdict(self):
        if not self.over:
            return
        over = "; ".join(self.over)
        if reference_codegen():
            raise AssertionError(f"over budget: {over}: {self.rep}")
        pytest.skip(f"over a budget measured on the SASS of triton {REFERENCE_TRITON}x: {over} on "
                    f"triton {triton.__version__}, whose register allocation differs "
                    f"(structural checks passed)")


def within_budget(rep: dict, value: int, budget: int, what: str = "local-memory instructions"):
    """One budget as the report's last check (`Budgets`)."""
    Budgets(rep).check(value, budget, what).verdict()


class _Worker:
    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                             env.get("PYTHONPATH", "")])
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # timed out or died: its stderr says why
            self.close()
            self.log.seek(0)
            raise AssertionError(f"compile worker {'timed out' if not ready else 'died'}: "
                                 + self.log.read()[-3000:])
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_worker: _Worker | None = None
_reports: dict = {}  # (script, args, ptxas) -> the report's JSON line


def _close_worker():
    if _worker is not None:
        _worker.close()


atexit.register(_close_worker)


def sass_report(script: str, *args: str, ptxas: bool = False) -> dict:
    """Run `script` (which compiles `kernel`, with `triton` imported) + REPORT_TAIL; ptxas:
    also report whether ptxas serialised the kernel's wgmmas (None otherwise)."""
    global _worker
    if not (BIN / "nvdisasm").exists():
        pytest.skip("nvdisasm not shipped with this triton")
    key = (script, args, ptxas)
    if key not in _reports:
        if _worker is None or _worker.proc.poll() is not None:
            _worker = _Worker()
        try:
            answer = _worker.ask({"script": script + REPORT_TAIL, "args": list(args),
                                  "ptxas": ptxas})
        except AssertionError:
            _worker = None
            raise
        assert answer["ok"], answer["error"][-3000:]
        _reports[key] = answer["stdout"].strip().splitlines()[-1]
    return json.loads(_reports[key])  # a fresh copy for each caller
