"""The sm90 Gluon backward compiles for sm_90a without a GPU: HGMMA and fp32 reductions in
SASS, register and shared-memory budgets, (almost) no local memory.

Each compile runs in a fresh interpreter without TRITON_INTERPRET (see test_sm90_compile.py:
under the interpreter a Gluon compile cannot call Triton's standard library).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asymflash.backends.sm90 import bwd

pytestmark = pytest.mark.skipif(bwd._GLUON_ERROR is not None, reason=str(bwd._GLUON_ERROR))

ROOT = Path(__file__).resolve().parents[1]

_REPORT = r"""
import json, os, re, subprocess, sys, tempfile
from dataclasses import replace
import torch, triton
from asymflash.backends.sm90 import bwd
kw = json.loads(sys.argv[1])
cfg_kw = kw.pop("cfg", None)
if "dtype" in kw:
    kw["dtype"] = getattr(torch, kw["dtype"])
if cfg_kw:
    kw["cfg"] = replace(bwd._DEFAULT_CONFIGS[kw.get("head_dim", 128)], **cfg_kw)
kernel = bwd.compile_for_target(**kw)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(kernel.asm["cubin"])
sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True,
                      text=True, check=True).stdout
res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                     capture_output=True, text=True, check=True).stdout
os.unlink(f.name)
print(json.dumps(dict(
    hgmma=sass.count("HGMMA"), local=len(re.findall(r"\b(LDL|STL)\b", sass)),
    red=len(re.findall(r"\bREDG?\.E\.ADD\.F32", sass)), regs=int(re.findall(r"REG:(\d+)", res)[0]),
    shared=kernel.metadata.shared)))
"""


def compile_report(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    bindir = os.path.join(os.path.dirname(bwd.triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bindir, "nvdisasm")):
        pytest.skip("nvdisasm not shipped with this triton")
    res = subprocess.run([sys.executable, "-c", _REPORT, json.dumps(kw)], capture_output=True,
                         text=True, env=env, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# (features, most local-memory instructions allowed). Unmasked steps never touch local
# memory. d=128 runs at the 255-register limit: on the masked path (boundary blocks of
# causal/local/ragged tiles, a few per CTA) ptxas spills up to 7 scalars around the mask
# (7 stores + 7 reloads); the bound still catches any tile-sized spill (100+ instructions).
CONFIGS = [
    ({"head_dim": 64}, 0),
    ({"head_dim": 64, "dtype": "float16", "has_right": True}, 0),
    ({"head_dim": 64, "has_left": True, "has_right": True, "softcap": True, "uniform": False,
      "has_seqused": True}, 0),
    ({"head_dim": 128}, 0),
    ({"head_dim": 128, "softcap": True}, 0),
    ({"head_dim": 128, "has_right": True}, 16),
    ({"head_dim": 128, "dtype": "float16", "has_left": True, "has_right": True,
      "uniform": False, "has_seqused": True}, 16),
    ({"head_dim": 128, "has_right": True, "softcap": True}, 16),
]


@pytest.mark.parametrize("kw,max_local", CONFIGS,
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_bwd_compiles_with_hgmma_and_budgets(kw, max_local):
    rep = compile_report(**kw)
    # Five MMAs per step (Sᵀ, dPᵀ, dV, dK, dQ), each several HGMMA instructions.
    assert rep["hgmma"] >= 20
    assert rep["red"] > 0, "dQ must be accumulated with fp32 reductions"
    assert rep["local"] <= max_local, f"register spills: {rep}"
    assert rep["regs"] <= 255
    assert rep["shared"] <= 227 * 1024


def test_config_outside_the_hardwired_layouts_refused():
    with pytest.raises(ValueError):
        bwd.select_config(128, bwd.BwdConfig(block_m=128))


def test_unsupported_backward_reports_reason_on_cpu():
    import torch

    from asymflash.core.params import AttnParams, SeqInfo

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, 8, 8, "cpu")
    why = bwd.unsupported_backward(q, q, q, seq, AttnParams(0.125), None)
    assert isinstance(why, str) and why
    why = bwd.unsupported_backward(q, q, q, seq, AttnParams(0.125, deterministic=True), None)
    assert isinstance(why, str) and why
