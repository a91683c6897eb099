"""exp2 computed on the FMA pipe: the coefficients the kernels use, and a bit-exact CPU model.

Why: the softmax exponentials run on the MUFU unit (16 ex2/clk/SM), which did not get faster
while the tensor cores did, so for small head dims the forward pass waits on MUFU. FA4's answer
is to compute a share of the exponentials with ordinary fp32 FMAs instead, so both pipes work
at once. Split x = j + f with j = floor(x) and f in [0, 1]; then

    2^x = 2^j * p(f),    p(f) = 1 + f*(c1 + f*(c2 + f*c3))  ~  2^f,

and multiplying by 2^j costs one integer add of j << 23 to the fp32 bit pattern of p(f) (it
adds j to the exponent field).

This module is the source of truth: the sm90 forward's PTX (`fwd/kernel.py`, `_emu_asm`) takes
its constants from `ptx_f32` of the values here, and `exp2_poly_numpy` / `exp2_poly_torch`
evaluate the kernel's instruction sequence step for step, bit for bit:

    ef = max.ftz(x, -127)                 clamp (inputs below 2^-126 in magnitude flush to 0)
    et = add.rm.ftz(ef, 1.5 * 2^23)       = floor(ef) + 1.5 * 2^23 exactly (its ulp is 1)
    ef = ef - (et - 1.5 * 2^23)           f = ef - floor(ef), exact
    p  = fma.rn(fma.rn(fma.rn(f, c3, c2), f, c1), f, 1)      Horner
    y  = bits(p) + (bits(et) << 23)       the low bits of et hold floor(ef); the shift drops
                                          the constant's own bits and leaves floor(ef) << 23

Choices, and why:
* p(0) = 1 and p(1) = 2 are pinned (c1 + c2 + c3 = 1): 2^integer is exact (f = 0 makes every
  Horner step exact, so the row maximum, where s - m = 0, gets exactly 1 as on MUFU), and the
  result is continuous across integer steps (f rounds to exactly 1.0 for tiny negative x:
  x = -1e-10 gives j = -1, f = 1.0, and p(1) * 2^-1 = 1). The two free coefficients are
  minimax in relative error on [0, 1]: max relative error 1.0e-4, far below bf16's half ulp
  (2^-9 = 1.95e-3), the precision P is rounded to for the P @ V MMA.
* Inputs are clamped to x >= -127 (one fmax): for -inf (masked scores) floor would give
  garbage, and j < -127 would borrow from the sign bit. After the clamp j >= -127 and the
  exponent field of the result is j + 127 + (0 or 1) >= 0, so the bit add never wraps:
  x <= -127 and -inf give exactly +0.0; x in (-127, -126) gives a value in [0, 2^-126]
  (a subnormal pattern, not 2^x). MUFU's ex2.approx.ftz returns 0 there, and either is
  2^-103 below the fp32 resolution of a softmax row sum (which is >= 1), so it never matters.
  The relative-error bound holds for -126 <= x < 128. There is no upper clamp: softmax only
  evaluates x = s - m <= threshold (8) with a stale max (see core/softmax.py).
* fma in the model: an fp32 product is exact in float64 (24 + 24 bits <= 53), so a*b + c
  rounded once to fp32 is fma.rn. Rounding the float64 sum to fp32 would round twice, and the
  sum is not always exact in float64 (f can be tiny next to c2): the model rounds the float64
  sum to odd first (the exact remainder from TwoSum picks the neighbour with an odd last bit),
  and round-to-odd in a format with >= 2 more bits than fp32 followed by round-to-nearest-even
  to fp32 is the correctly rounded result.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import torch

# p(f) = c0 + c1 f + c2 f^2 + c3 f^3, fp32 values: c0 = 1 and c1 + c2 + c3 = 1 (p(1) = 2)
# pinned; the two free coefficients minimise max |p(f) 2^-f - 1| on [0, 1] (Remez, then
# rounded to fp32). tests/test_core_exp2.py refits and checks.
POLY_COEFFS: tuple[float, ...] = (1.0, 0.6954243779182434, 0.226307675242424,
                                  0.07826796919107437)

# Bound on |exp2_poly(x) / 2^x - 1| for -126 <= x < 128 as evaluated in fp32.
MAX_REL_ERR = 1.1e-4

# Below this the result may be subnormal or zero (see module docstring).
X_MIN = -127.0
# Adding this rounding down leaves floor(x) in the low mantissa bits (ulp 1 in [2^23, 2^24)).
FLOOR_MAGIC = 1.5 * 2**23


def ptx_f32(c: float) -> str:
    """The PTX literal of fp32 value c (`0f` and its 8 hex digits), as the kernels write it."""
    return "0f" + struct.pack(">f", c).hex().upper()


_C32 = tuple(np.float32(c) for c in POLY_COEFFS)
_TINY = np.float32(2.0**-126)


def _fma32_numpy(a: np.ndarray, b, c) -> np.ndarray:
    """fma.rn.f32(a, b, c) on fp32 arrays: exact product in float64, sum rounded to odd in
    float64, then to nearest-even fp32 (see the module docstring)."""
    p = a.astype(np.float64) * np.asarray(b, dtype=np.float64)
    c64 = np.asarray(c, dtype=np.float64)
    s = p + c64
    bv = s - p  # TwoSum: s + e == p + c exactly
    e = (p - (s - bv)) + (c64 - bv)
    inexact = (e != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def exp2_poly_numpy(x: np.ndarray) -> np.ndarray:
    """2^x in fp32 by the kernel's instruction sequence (module docstring), bit for bit.

    NaN inputs are not supported.
    """
    x = np.asarray(x, dtype=np.float32)
    x = np.where(np.abs(x) < _TINY, np.float32(0.0), x)  # .ftz
    ef = np.maximum(x, np.float32(X_MIN))
    j = np.floor(ef)  # add.rm then sub: exact
    f = ef - j  # exact in fp32
    c0, c1, c2, c3 = _C32
    p = _fma32_numpy(f, c3, c2)
    p = _fma32_numpy(p, f, c1)
    p = _fma32_numpy(p, f, c0)
    bits = p.view(np.int32) + (j.astype(np.int32) << np.int32(23))
    return bits.view(np.float32)


def _fma32_torch(a: torch.Tensor, b, c) -> torch.Tensor:
    p = a.double() * b
    s = p + c
    bv = s - p
    e = (p - (s - bv)) + (c - bv)
    inexact = (e != 0) & ((s.view(torch.int64) & 1) == 0)
    away = torch.where(e > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf")))
    s = torch.where(inexact, torch.nextafter(s, away), s)
    return s.float()


def exp2_poly_torch(x: torch.Tensor) -> torch.Tensor:
    """Same as `exp2_poly_numpy` on an fp32 torch tensor (any device), bit for bit."""
    if x.dtype != torch.float32:
        raise TypeError(f"exp2_poly_torch: x must be float32, got {x.dtype}")
    x = torch.where(x.abs() < 2.0**-126, torch.zeros_like(x), x)
    ef = torch.clamp(x, min=X_MIN)
    j = torch.floor(ef)
    f = ef - j
    c0, c1, c2, c3 = POLY_COEFFS  # fp32 values, exact in float64
    p = _fma32_torch(f, c3, c2)
    p = _fma32_torch(p, f, c1)
    p = _fma32_torch(p, f, c0)
    bits = p.view(torch.int32) + (j.to(torch.int32) << 23)
    return bits.view(torch.float32)


def emulated_mask(n: int, share: float) -> np.ndarray:
    """Which of n columns of a score block use the polynomial (True) instead of MUFU ex2.

    Rule: with share = a/b as a fraction (denominator <= 1024), column c is emulated iff
    floor((c + 1) a / b) > floor(c a / b). That selects floor(n a / b) columns spread evenly
    (a Bresenham line), so in each thread's row fragment the FMA and MUFU work interleave
    instead of one pipe idling while the other finishes a run. share = 0 gives no columns,
    share = 1 all of them; the same rule, evaluated at compile time, picks the registers in
    the kernels.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"emulated_mask: share must be in [0, 1], got {share}")
    fr = Fraction(share).limit_denominator(1024)
    c = np.arange(n + 1, dtype=np.int64) * fr.numerator // fr.denominator
    return c[1:] > c[:-1]
