"""The sm90 Gluon forward compiles for sm_90a without a GPU: HGMMA in SASS, no local memory.

Each compile runs in a fresh interpreter without TRITON_INTERPRET: conftest.py turns the
interpreter on for CPU machines, and under it Triton's standard library functions become
interpreted objects that a Gluon compile cannot call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asymflash.backends.sm90 import fwd

pytestmark = pytest.mark.skipif(fwd._GLUON_ERROR is not None, reason=str(fwd._GLUON_ERROR))

ROOT = Path(__file__).resolve().parents[1]

_REPORT = r"""
import json, os, re, subprocess, sys, tempfile
from dataclasses import replace
import torch, triton
from asymflash.backends.sm90 import fwd
kw = json.loads(sys.argv[1])
cfg_kw = kw.pop("cfg", None)
if "dtype" in kw:
    kw["dtype"] = getattr(torch, kw["dtype"])
if cfg_kw:
    kw["cfg"] = replace(fwd._DEFAULT_CONFIGS[kw.get("head_dim", 128)], **cfg_kw)
kernel = fwd.compile_for_target(**kw)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(kernel.asm["cubin"])
sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True,
                      text=True, check=True).stdout
os.unlink(f.name)
print(json.dumps(dict(
    hgmma=sass.count("HGMMA"), local=len(re.findall(r"\b(LDL|STL)\b", sass)),
    mufu_ex2=sass.count("MUFU.EX2"), shared=kernel.metadata.shared,
    maxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                kernel.asm["ptx"])}))))
"""


def compile_report(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not os.path.exists(os.path.join(os.path.dirname(fwd.triton.__file__), "backends",
                                       "nvidia", "bin", "nvdisasm")):
        pytest.skip("nvdisasm not shipped with this triton")
    res = subprocess.run([sys.executable, "-c", _REPORT, json.dumps(kw)], capture_output=True,
                         text=True, env=env, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


CONFIGS = [
    {"head_dim": 64},
    {"head_dim": 128},
    {"head_dim": 256},
    {"head_dim": 128, "dtype": "float16", "has_right": True},
    {"head_dim": 128, "has_left": True, "has_right": True, "softcap": True, "has_sink": True,
         "uniform": False, "has_seqused": True},
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_compiles_with_hgmma_and_no_spills(kw):
    rep = compile_report(**kw)
    assert rep["hgmma"] > 0
    assert rep["local"] == 0, "local memory traffic (register spills)"
    # warp_specialize budgets: consumers at 240 registers, the TMA warp at 24.
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"]
    assert rep["shared"] <= 227 * 1024


@pytest.mark.parametrize("emu,thr", [(4, 0.0), (8, 8.0)])
def test_fa4_switches_compile(emu, thr):
    rep = compile_report(head_dim=64, cfg={"exp2_emu_every": emu, "rescale_threshold": thr})
    assert rep["hgmma"] > 0 and rep["local"] == 0
    # Part of the exponentials left MUFU for the FMA pipe.
    assert rep["mufu_ex2"] < compile_report(head_dim=64)["mufu_ex2"]


def test_unsupported_reports_reason_on_cpu():
    import torch

    from asymflash.core.params import AttnParams, SeqInfo

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, 8, 8, "cpu")
    why = fwd.unsupported(q, q, q, seq, AttnParams(0.125), None)
    assert isinstance(why, str) and why
