"""exp2 computed on the FMA pipe: the bit-exact CPU model of what the kernels do.

Why: the softmax exponentials run on the MUFU unit (16 ex2/clk/SM), which did not get faster
while the tensor cores did, so for small head dims the forward pass waits on MUFU. FA4's answer
is to compute a share of the exponentials with ordinary fp32 FMAs instead, so both pipes work
at once. Split x = j + f with j = floor(x) and f in [0, 1); then

    2^x = 2^j * p(f),    p(f) = 1 + f*(c1 + f*(c2 + f*c3))  ~  2^f,

and multiplying by 2^j costs one integer add of j << 23 to the fp32 bit pattern of p(f) (it
adds j to the exponent field). That is 3 FMAs, a floor, a subtract and an int add per element.

Choices, and why:
* p(0) = 1 is pinned, so 2^integer is exact (f = 0 makes every Horner step exact) and the
  row maximum, where s - m = 0, gets exactly 1 as on MUFU. The other three coefficients are
  minimax in *relative* error on the closed interval [0, 1]: closed because f = x - floor(x)
  rounds to exactly 1.0 for tiny negative x (x = -1e-10 gives j = -1, f = 1.0f). Pinning costs
  little: max relative error 8.56e-5 pinned vs 7.48e-5 for the free degree-3 fit; both are far
  below bf16's half ulp (2^-9 = 1.95e-3), the precision P is rounded to for the P @ V MMA.
* Inputs are clamped to x >= -127 (one fmax): for -inf (masked scores) floor would give
  garbage, and j < -127 would borrow from the sign bit. After the clamp j >= -127 and the
  exponent field of the result is j + 127 + (0 or 1) >= 0, so the bit add never wraps:
  x <= -127 and -inf give exactly +0.0; x in (-127, -126) gives a value in [0, 2^-126]
  (a subnormal pattern, not 2^x). MUFU's ex2.approx.ftz returns 0 there, and either is
  2^-103 below the fp32 resolution of a softmax row sum (which is >= 1), so it never matters.
  The relative-error bound holds for -126 <= x < 128. There is no upper clamp: softmax only
  evaluates x = s - m <= threshold (8) with a stale max (see core/softmax.py).
* The model evaluates Horner without fused multiply-add (each product and sum rounded to
  fp32), which is what numpy and torch on CPU do. A kernel using fma (tl.fma / fma.rn.f32)
  differs by at most a few fp32 ulps, ~1e-7 relative, invisible next to 8.6e-5
  (tests/test_core_exp2.py checks both variants against the same bound).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

# p(f) = c0 + c1 f + c2 f^2 + c3 f^3 with c0 = 1 pinned; c1..c3 minimise max |p(f) 2^-f - 1| on
# [0, 1]. Fitted with the Remez exchange algorithm (float64, 2e5-point grid, writing
# p(f) = 1 + f q(f) and approximating (2^f - 1)/f by q with weight f 2^-f), then rounded to the
# nearest fp32. Equioscillation level 8.559e-5. tests/test_core_exp2.py refits and checks.
POLY_COEFFS: tuple[float, ...] = (1.0, 0.6951167583465576, 0.22764499485492706, 0.07706703990697861)

# Bound on |exp2_poly(x) / 2^x - 1| for -126 <= x < 128 as evaluated in fp32 (measured 8.6e-5:
# the fit's level plus fp32 rounding of the Horner steps and of x - floor(x)).
MAX_REL_ERR = 9.0e-5

# Below this the result may be subnormal or zero (see module docstring).
X_MIN = -127.0

_C32 = tuple(np.float32(c) for c in POLY_COEFFS)


def exp2_poly_numpy(x: np.ndarray) -> np.ndarray:
    """2^x in fp32 via floor, a degree-3 polynomial and an exponent-bit add, step for step.

    Every intermediate is np.float32 (Horner without fma); NaN inputs are not supported.
    """
    x = np.maximum(np.asarray(x, dtype=np.float32), np.float32(X_MIN))
    j = np.floor(x)
    f = x - j  # exact in fp32
    c0, c1, c2, c3 = _C32
    p = (c3 * f + c2) * f + c1
    p = p * f + c0
    bits = p.view(np.int32) + (j.astype(np.int32) << np.int32(23))
    return bits.view(np.float32)


def exp2_poly_torch(x: torch.Tensor) -> torch.Tensor:
    """Same as `exp2_poly_numpy` on an fp32 torch tensor (any device), bit for bit."""
    if x.dtype != torch.float32:
        raise TypeError(f"exp2_poly_torch: x must be float32, got {x.dtype}")
    x = torch.clamp(x, min=X_MIN)
    j = torch.floor(x)
    f = x - j
    c0, c1, c2, c3 = POLY_COEFFS  # fp32-representable, so scalar ops round like fp32 ones
    p = (f * c3 + c2) * f + c1
    p = p * f + c0
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
