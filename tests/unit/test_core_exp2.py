"""The polynomial exp2 model: accuracy, exact corners, bf16 effect, and the fit itself."""

import numpy as np
import pytest
import torch

from asymflash.core.exp2 import (
    MAX_REL_ERR,
    POLY_COEFFS,
    emulated_mask,
    exp2_poly_numpy,
    exp2_poly_torch,
)


def _rel_err(y, x):
    ref = np.exp2(x.astype(np.float64))
    return np.abs(y.astype(np.float64) / ref - 1.0)


def _poly_max_rel_err(coeffs, f):
    """Max relative error of the polynomial itself on f (float64 arithmetic)."""
    p = np.polynomial.polynomial.polyval(f, np.asarray(coeffs, dtype=np.float64))
    return np.max(np.abs(p * np.exp2(-f) - 1.0))


def _remez_pinned(n_grid=200_001, iters=25):
    """Refit: p(f) = 1 + f q(f), q quadratic, minimax relative error on [0, 1] (Remez)."""
    grid = np.linspace(0.0, 1.0, n_grid)[1:]  # weight vanishes at 0, where p(0) = 1 is exact
    w = grid * np.exp2(-grid)
    g = np.expm1(grid * np.log(2.0)) / grid
    ref = 0.5 - 0.5 * np.cos(np.pi * np.arange(1, 5) / 4)  # 4 points: 3 coefficients + level
    for _ in range(iters):
        wr = ref * np.exp2(-ref)
        a = np.stack([np.ones(4), ref, ref**2, (-1.0) ** np.arange(4) / wr], axis=1)
        sol = np.linalg.solve(a, np.expm1(ref * np.log(2.0)) / ref)
        q = sol[:3]
        err = w * (g - (q[0] + q[1] * grid + q[2] * grid**2))
        # one extremum per sign-constant run of the error; keep the 4 largest, alternating
        cuts = np.flatnonzero(np.sign(err[1:]) != np.sign(err[:-1])) + 1
        ext = [s[np.argmax(np.abs(err[s]))] for s in np.split(np.arange(grid.size), cuts)]
        while len(ext) > 4:
            ext = ext[1:] if abs(err[ext[0]]) < abs(err[ext[-1]]) else ext[:-1]
        ref = grid[ext]
    return (1.0, *q), float(np.max(np.abs(err)))


def test_coeffs_are_fp32_and_pinned():
    assert POLY_COEFFS[0] == 1.0
    for c in POLY_COEFFS:
        assert float(np.float32(c)) == c


def test_refit_matches_stored_coefficients():
    coeffs, level = _remez_pinned()
    f = np.linspace(0.0, 1.0, 400_001)
    stored = _poly_max_rel_err(POLY_COEFFS, f)
    refit = _poly_max_rel_err(coeffs, f)
    assert 8.4e-5 < level < 8.7e-5
    # the stored (fp32-rounded) coefficients are as good as a fresh float64 fit, to 1e-7 abs
    assert stored <= refit + 1e-7
    np.testing.assert_allclose(POLY_COEFFS, coeffs, rtol=1e-6)
    # and better than an ordinary least-squares fit of the same form (sanity of "minimax")
    a = np.stack([f, f**2, f**3], axis=1) * np.exp2(-f)[:, None]
    ls = np.linalg.lstsq(a, 1.0 - np.exp2(-f), rcond=None)[0]
    assert stored < _poly_max_rel_err((1.0, *ls), f)


def test_dense_sweep_rel_err():
    # -126 <= x < 128 covers every normal result; softmax uses x <= 8
    x = np.linspace(-126.0, 127.99, 1_000_001, dtype=np.float32)
    # plus fractions just below every integer, where f = x - floor(x) is close to 1
    ints = np.arange(-125, 128, dtype=np.float32)
    x = np.concatenate([x, np.nextafter(ints, np.float32(-np.inf)), -np.float32(1e-10)[None]])
    err = _rel_err(exp2_poly_numpy(x), x)
    assert err.max() <= MAX_REL_ERR
    assert err.max() > 8.0e-5  # the bound is tight, not vacuous


def test_fma_variant_same_bound():
    """The kernel may fuse Horner into fma; emulate fma in float64 and check the same bound."""
    x = np.linspace(-20.0, 8.0, 300_001, dtype=np.float32)
    j = np.floor(x)
    f = (x - j).astype(np.float64)
    c = [np.float64(np.float32(v)) for v in POLY_COEFFS]
    p = np.float32(c[3] * f + c[2]).astype(np.float64)  # a*b exact in float64, one rounding
    p = np.float32(p * f + c[1]).astype(np.float64)
    p = np.float32(p * f + c[0])
    y = (p.view(np.int32) + (j.astype(np.int32) << 23)).view(np.float32)
    assert _rel_err(y, x).max() <= MAX_REL_ERR
    ulp = np.abs(y.view(np.int32) - exp2_poly_numpy(x).view(np.int32))
    assert ulp.max() <= 2


def test_exact_at_integers():
    x = np.arange(-126, 128, dtype=np.float32)
    # ldexp is exact; np.exp2 itself is 1 ulp off at 127 in some numpy builds (seen on 2.5)
    exact = np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32)
    np.testing.assert_array_equal(exp2_poly_numpy(x), exact)


def test_low_end_and_minus_inf():
    x = np.array([-np.inf, -1e30, -1000.0, -127.5, -127.0], dtype=np.float32)
    y = exp2_poly_numpy(x)
    assert np.all(y == 0.0) and not np.any(np.signbit(y))
    # between -127 and -126: never garbage, never above the smallest normal
    x = np.linspace(-127.0, -126.0, 10_001, dtype=np.float32)
    y = exp2_poly_numpy(x)
    assert np.all(np.isfinite(y)) and np.all(y >= 0.0)
    assert np.all(y <= np.float32(2.0**-126))


def test_torch_matches_numpy_bitwise():
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(200_000, generator=g) * 140.0 - 130.0,
            torch.tensor([-float("inf"), -127.0, -126.0, 0.0, 8.0, -1e-10]),
        ]
    ).to(torch.float32)
    y_t = exp2_poly_torch(x).numpy()
    y_n = exp2_poly_numpy(x.numpy())
    np.testing.assert_array_equal(y_t.view(np.int32), y_n.view(np.int32))
    with pytest.raises(TypeError, match="float32"):
        exp2_poly_torch(x.double())


def test_bf16_within_one_ulp_of_mufu_standin():
    # softmax arguments s - m lie in [-inf, 8] with a stale max; P is rounded to bf16 for P @ V
    x = torch.linspace(-126.0, 8.0, 1_000_001, dtype=torch.float32)
    a = exp2_poly_torch(x).to(torch.bfloat16)
    b = torch.exp2(x).to(torch.bfloat16)
    ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1
    # and almost always identical: 8.6e-5 is 4.4% of a bf16 ulp
    assert (ulps != 0).float().mean().item() < 0.05


def test_emulated_mask_rule():
    assert not emulated_mask(128, 0.0).any()
    assert emulated_mask(128, 1.0).all()
    for n, share in [(128, 0.25), (128, 0.5), (64, 0.3), (16, 1 / 3), (7, 0.5)]:
        m = emulated_mask(n, share)
        assert m.shape == (n,) and m.dtype == bool
        assert m.sum() == int(n * share + 1e-9)
        # evenly spread: in any window of w columns the count is within 1 of w * share
        for w in (4, 8):
            counts = np.convolve(m, np.ones(w, dtype=int), mode="valid")
            assert np.all(np.abs(counts - w * share) <= 1.0 + 1e-9)
    np.testing.assert_array_equal(emulated_mask(8, 0.5), [0, 1, 0, 1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="share"):
        emulated_mask(8, 1.5)
