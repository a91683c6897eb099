"""The e4m3 -> bf16 widening of the decode kernel (`portable.decode.widen`) on the CPU: its
PTX (`WIDEN_E4M3_PTX`) run instruction by instruction on a small model of the PTX
instructions it uses, and its tensor-op form (the interpreter's) in torch, each on every
byte value in every position of a 32-bit register, against torch's e4m3 -> bf16 cast. The
GPU runs the PTX itself (tests/gpu/test_fp8_gpu.py's cache decode values)."""

from __future__ import annotations

import re

import pytest
import torch

from asymflash.backends.portable import decode

MASK = 0xFFFFFFFF


def _bf16_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


def _bf16(bits: int) -> float:
    return float(torch.tensor(bits if bits < 0x8000 else bits - 0x10000,
                              dtype=torch.int16).view(torch.bfloat16))


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte sel[i] of {b, a} (a: 0-3),
    its sign replicated where the selector's bit 3 is set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> 4 * i) & 0xF
        byte = src[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _mul_bf16x2(a: int, b: int) -> int:
    """mul.rn.bf16x2: each 16-bit lane, rounded to bf16 (exact here: times a power of 2)."""
    out = 0
    for lane in range(2):
        x, y = (a >> 16 * lane) & 0xFFFF, (b >> 16 * lane) & 0xFFFF
        out |= _bf16_bits(_bf16(x) * _bf16(y)) << 16 * lane
    return out


def run_ptx(src: str, operands: dict) -> dict:
    """Run the asm's instructions (mov, prmt, shr, and, lop3, mul.rn.bf16x2) on `operands` ({"$2": value, ...}); returns the registers."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in src.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        d = args[0]
        if op == "and.b32":
            regs[d] = val(args[1]) & val(args[2]) & MASK
        elif op == "mov.b32":
            regs[d] = val(args[1]) & MASK
        elif op == "prmt.b32":
            regs[d] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "shr.b32":
            regs[d] = (val(args[1]) & MASK) >> val(args[2])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(args[1]), val(args[2]), val(args[3]), val(args[4]))
        elif op == "mul.rn.bf16x2":
            regs[d] = _mul_bf16x2(val(args[1]), val(args[2]))
        else:
            raise AssertionError(f"no model of {op}")
    return regs


def _expected(byte_values) -> list:
    """torch's e4m3 -> bf16 of the bytes, as bf16 bit patterns."""
    x = torch.tensor(byte_values, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return (x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


NAN_BYTES = (0x7F, 0xFF)  # e4m3fn's NaN encodings (it has no infinity)


def test_ptx_widens_every_byte_in_every_position():
    src = decode.WIDEN_E4M3_PTX.value
    assert re.findall(r"^\s*(\w[\w.]*)", src, re.M).count("mul.rn.bf16x2") == 2
    for byte in range(256):
        for pos in range(4):
            others = [(byte * 7 + 13 * i) & 0xFF for i in range(4)]
            others[pos] = byte
            word = sum(b << 8 * i for i, b in enumerate(others))
            regs = run_ptx(src, {"$2": word})
            got = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            want = _expected(others)
            for b, g, w in zip(others, got, want):
                if b in NAN_BYTES:  # read as +-480 (documented: docs/api.md, fp8)
                    assert _bf16(g) == (480.0 if b == 0x7F else -480.0)
                else:
                    assert g == w, (hex(word), hex(b), hex(g), hex(w))


def test_tensor_form_matches_torch_on_every_byte():
    """The interpreter's form of the same steps (torch here, as the interpreter computes)."""
    b = torch.arange(256, dtype=torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    got = (bits.to(torch.int16).view(torch.bfloat16).float() * 2.0**120).to(torch.bfloat16)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert got[0x7F].item() == 480.0 and got[0xFF].item() == -480.0


@pytest.mark.parametrize("lut,a,b,c,want", [(0xE4, 0xF0F0, 0x0F0F, 0xFF00, 0xF00F)])
def test_lop3_model(lut, a, b, c, want):
    """The model's own check: 0xE4 selects a where c is set, else b."""
    assert _lop3(a, b, c, lut) == want
