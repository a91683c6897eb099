"""The portable kernels' fixed tile choices build for sm_90a without register spills.

Compiled through triton.compile with a GPUTarget (tests/sass_report.py): no GPU needed.
"""

from __future__ import annotations

import pytest
from sass_report import sass_report, within_budget

# Imports and the argument types of a portable kernel: names in capitals are pointers (bf16
# unless listed), the rest i32 scalars (softmax_scale and softcap fp32), constexprs as given.
_PRELUDE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


from kernel_signature import kernel_signature


def signature(fn, cons, i32_pointers, fp32_pointers):
    pointers = {**dict.fromkeys(i32_pointers, "*i32"), **dict.fromkeys(fp32_pointers, "*fp32")}
    return kernel_signature(fn, cons, pointers, ("softmax_scale", "softcap"))
"""

_BUILD = _PRELUDE + r"""
from asymflash.backends.portable import candidates
from asymflash.backends.portable.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from asymflash.backends.portable.fwd import attn_fwd_kernel

name, d, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
fn = {"fwd": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel, "dq": attn_bwd_dq_kernel}[name]
c = candidates(name, d, d)[0]
cons = dict(D=d, DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            SOFTCAP=False, HAS_USED_K=False, LEFT=False, RIGHT=causal)
if "HAS_SINK" in fn.arg_names:
    cons["HAS_SINK"] = False
sig = signature(fn, cons, ("CU_Q", "CU_K", "USED_K"), ("LSE", "SINK", "DELTA"))
kernel = triton.compile(ASTSource(fn, sig, cons), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": c.num_warps, "num_stages": c.num_stages})
"""


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_fixed_tiles_build_for_sm90_without_spills(kernel, d, causal):
    report = sass_report(_BUILD, kernel, str(d), str(int(causal)))
    assert report["mma"] > 0, "no tensor-core instructions"
    if kernel == "dkdv" or (kernel == "fwd" and d == 64):
        # dK/dV, and the forward at d <= 64, keep the tiles the GPU suite passed with, which
        # spill (portable/bwd.py and portable/__init__.py say why); this records the count
        # so a change is visible, it is not a target.
        within_budget(report, report["local"], 199)
        return
    within_budget(report, report["local"], 0)


@pytest.mark.parametrize("d,dv,want", [(40, 24, (64, 64)), (24, 40, (64, 64)), (32, 24, (32, 32)),
                                       (64, 64, (64, 64)), (192, 128, (256, 128)),
                                       (96, 128, (128, 128)), (8, 8, (16, 16))])
def test_head_blocks_pad_small_widths_together(d, dv, want):
    # 64/32 widths in one kernel failed on the H200 (see portable.head_blocks); wider ones
    # keep their own width (a 256-wide O accumulator would not fit the registers).
    from asymflash.backends.portable import head_blocks

    assert head_blocks(d, dv) == want


_DECODE_BUILD = _PRELUDE + r"""
from asymflash.backends.portable.decode import decode_kernel as fn

paged, leftpad = sys.argv[1] == "1", sys.argv[2] == "1"
fp8 = len(sys.argv) > 3 and sys.argv[3] == "fp8"  # an e4m3 cache beside bf16 q
ARCH = int(sys.argv[4]) if len(sys.argv) > 4 else 90
STAGES = int(sys.argv[5]) if len(sys.argv) > 5 else 3
# the H200 decode shape: bf16, d 128, GQA 8:1 packed, 128-key tiles, 4 warps, 3 stages
cons = dict(D=128, DV=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=16, BLOCK_N=128,
            VARLEN_Q=False, PAGED=paged, PAGE_SIZE=64 if paged else 0, HAS_BATCH_IDX=False,
            HAS_LEFTPAD=leftpad,
            HAS_NEW=True, SPLIT=True, SOFTCAP=False, HAS_SINK=False, WRITE_LSE=True,
            LEFT=False, RIGHT=True, DESCALE_K=fp8, DESCALE_V=fp8)
sig = signature(fn, cons, ("CU_Q", "SEQLENS_K", "PAGE_TABLE", "BATCH_IDX", "LEFTPAD", "COUNTERS"),
                ("LSE", "SINK", "WORK", "K_DESCALE", "V_DESCALE"))
if fp8:
    sig.update({arg: "*fp8e4nv" for arg in ("K", "V", "K_NEW", "V_NEW")})
# what the JIT specialises in a real call: 16-byte aligned pointers, strides multiples of 16
aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
           if sig[arg].startswith("*") or arg.startswith("stride")}
kernel = triton.compile(ASTSource(fn, sig, cons, attrs=aligned),
                        target=GPUTarget("cuda", ARCH, 32), options={"num_warps": 4,
                                                                   "num_stages": STAGES})
"""


@pytest.mark.parametrize("paged,leftpad", [(True, False), (False, False), (False, True)])
def test_decode_kernel_builds_for_sm90(paged, leftpad):
    """The split-KV decode kernel, paged or contiguous, with a per-sequence start
    (cache_leftpad) or without, builds with tensor-core instructions. It runs at 255
    registers with ~150 local-memory instructions (sm_90a: paged 148, contiguous
    155, with cache_leftpad 153): the bound records that, so a change shows; not a target."""
    report = sass_report(_DECODE_BUILD, str(int(paged)), str(int(leftpad)))
    assert report["mma"] > 0, "no tensor-core instructions"
    within_budget(report, report["local"], 199)


@pytest.mark.parametrize("paged", [True, False])
def test_decode_kernel_builds_for_sm90_over_an_e4m3_cache(paged):
    """The same kernel reading an e4m3 cache, with its descales: q's rows scaled into fp16,
    key tiles cast to fp16 where the MMA reads them, value tiles converted before their trip
    to the MMA layout (`decode.value_operand`), fp16 MMAs. It builds with tensor-core instructions, no
    conversion-pipe instruction (`F2F`) and no byte-by-byte shared-memory read (`LDS.U8`:
    128 a thread per key tile when the values were cast after the trip; sm_90a, triton 3.6,
    the paged split-KV key loop 947 instructions against the bf16 cache's 1145, 2063
    before). Local memory: the bf16 build's bound. An sm_80 build fails (no e4m3 type
    before Ada): api/fp8.reads_e4m3 keeps such GPUs off it."""
    report = sass_report(_DECODE_BUILD, str(int(paged)), "0", "fp8")
    assert report["mma"] > 0, "no tensor-core instructions"
    assert report["f2f"] == 0, report["f2f"]
    assert report["lds_u8"] == 0, report["lds_u8"]
    within_budget(report, report["local"], 199)


def test_decode_fits_a_99_kb_gpu_with_a_stage_less():
    """sm_86 / sm_89 (RTX 30xx / 40xx, A10, L4) give a block 99 KB of shared memory (101376
    bytes). The contiguous decode at d=128 asks more at its 3 stages, and the GPU would
    refuse the launch; runtime.launch.launch_fitting repeats it with 2, which fit."""
    limit = 101376
    three = sass_report(_DECODE_BUILD, "0", "0", "bf16", "86", "3")
    two = sass_report(_DECODE_BUILD, "0", "0", "bf16", "86", "2")
    assert three["shared"] > limit >= two["shared"], (three["shared"], two["shared"])


_CONVERT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from asymflash.backends.sm90.bwd.dq_fragments import _dq_from_fragments_kernel as fn

width, cols = int(sys.argv[1]), int(sys.argv[2])
sig = {"acc_ptr": "*fp32", "dq_ptr": "*bf16", "cu_q_ptr": "*i32", "stride_row": "i32",
       "stride_head": "i32", "n_heads": "i32", "D": "constexpr", "WIDTH": "constexpr",
       "COLS": "constexpr"}
# aligned pointers and strides divisible by 16, as Triton's launch specialises them
attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
kernel = triton.compile(ASTSource(fn, sig, {"D": width, "WIDTH": width, "COLS": cols}, attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
"""


@pytest.mark.parametrize("width,cols", [(64, 64), (128, 64), (256, 128)])
def test_dq_from_fragments_reads_whole_rows(width, cols):
    # The fragment buffer read in memory order: 128-bit loads of whole 128-byte rows, no
    # spills (the earlier per-element gather issued 32-bit loads and spilled 137 values at
    # d=256).
    rep = sass_report(_CONVERT, str(width), str(cols))
    assert rep["ldg128"] == width // 8 and rep["ldg32"] <= 2, rep  # (+2: the sequence bounds)
    within_budget(rep, rep["local"], 0)


_INDEX_CHECKS = _PRELUDE + r"""
from asymflash.backends.portable.cache_checks import BLOCK, _check_kernel as fn

pages, rows, pad, repeats = (a == "1" for a in sys.argv[1:5])
cons = dict(HAS_PAGES=pages, HAS_ROWS=rows, HAS_PAD=pad, NO_REPEATS=repeats, BLOCK=BLOCK)
sig = signature(fn, cons, [a for a in fn.arg_names if a.endswith(("_in", "_out")) or a == "ok"],
                ())
kernel = triton.compile(ASTSource(fn, sig, cons), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 2})
"""


@pytest.mark.parametrize("pages,rows,pad,repeats", [(1, 0, 0, 0), (1, 0, 1, 0), (0, 1, 1, 1),
                                                    (1, 1, 1, 1)])
def test_index_checks_build_for_sm90(pages, rows, pad, repeats):
    """kvcache's one-launch index checks (backends/portable/cache_checks.py): a small kernel,
    builds for sm_90a without local memory."""
    rep = sass_report(_INDEX_CHECKS, str(pages), str(rows), str(pad), str(repeats))
    within_budget(rep, rep["local"], 0)
