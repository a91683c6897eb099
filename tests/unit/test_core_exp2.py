"""The polynomial exp2: accuracy, exact corners, bf16 effect, the fit itself, and that the
sm90 kernel's PTX and the CPU model are one and the same."""

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


def _remez_pinned(n_grid=200_001, iters=30):
    """Refit: p(f) = 1 + f + f (f - 1)(a + b f), so p(0) = 1 and p(1) = 2, minimax relative
    error on [0, 1] (Remez). The error p 2^-f - 1 = w (h - (a + b f)) with w = f (1 - f) 2^-f
    and h = ((1 + f) 2^-f - 1) / w: a weighted linear approximation of h."""
    grid = np.linspace(0.0, 1.0, n_grid)[1:-1]  # w vanishes at both ends, where p is exact
    w = grid * (1 - grid) * np.exp2(-grid)
    h = ((1 + grid) * np.exp2(-grid) - 1) / w
    ref = 0.5 - 0.5 * np.cos(np.pi * np.arange(1, 4) / 4)  # 3 points: 2 coefficients + level
    for _ in range(iters):
        wr = ref * (1 - ref) * np.exp2(-ref)
        hr = ((1 + ref) * np.exp2(-ref) - 1) / wr
        a = np.stack([np.ones(3), ref, (-1.0) ** np.arange(3) / wr], axis=1)
        sol = np.linalg.solve(a, hr)
        err = w * (h - (sol[0] + sol[1] * grid))
        # one extremum per sign-constant run of the error; keep the 3 largest, alternating
        cuts = np.flatnonzero(np.sign(err[1:]) != np.sign(err[:-1])) + 1
        ext = [s[np.argmax(np.abs(err[s]))] for s in np.split(np.arange(grid.size), cuts)]
        while len(ext) > 3:
            ext = ext[1:] if abs(err[ext[0]]) < abs(err[ext[-1]]) else ext[:-1]
        ref = grid[ext]
    a, b = sol[:2]
    return (1.0, 1.0 - a, a - b, b), float(np.max(np.abs(err)))


def test_coeffs_are_fp32_and_pinned():
    assert POLY_COEFFS[0] == 1.0
    for c in POLY_COEFFS:
        assert float(np.float32(c)) == c
    # p(1) = 2: the fp32 Horner steps at f = 1 land on exactly 2.0 (continuity at integers)
    assert exp2_poly_numpy(np.float32([1.0]))[0] == 2.0
    assert abs(sum(POLY_COEFFS) - 2.0) < 1e-7


def test_refit_matches_stored_coefficients():
    coeffs, level = _remez_pinned()
    f = np.linspace(0.0, 1.0, 400_001)
    stored = _poly_max_rel_err(POLY_COEFFS, f)
    refit = _poly_max_rel_err(coeffs, f)
    assert 1.02e-4 < level < 1.04e-4
    # the stored (fp32-rounded) coefficients are as good as a fresh float64 fit, to 1e-7 abs
    assert stored <= refit + 1e-7
    np.testing.assert_allclose(POLY_COEFFS, coeffs, rtol=1e-6)
    # and better than an ordinary least-squares fit with the same pins (sanity of "minimax")
    a = (f * (f - 1) * np.exp2(-f))[:, None] * np.stack([np.ones_like(f), f], axis=1)
    ab = np.linalg.lstsq(a, 1.0 - (1 + f) * np.exp2(-f), rcond=None)[0]
    assert stored < _poly_max_rel_err((1.0, 1.0 - ab[0], ab[0] - ab[1], ab[1]), f)


def test_dense_sweep_rel_err():
    # -126 <= x < 128 covers every normal result; softmax uses x <= 8
    x = np.linspace(-126.0, 127.99, 1_000_001, dtype=np.float32)
    # plus fractions just below every integer, where f = x - floor(x) is close to 1
    ints = np.arange(-125, 128, dtype=np.float32)
    x = np.concatenate([x, np.nextafter(ints, np.float32(-np.inf)), -np.float32(1e-10)[None]])
    err = _rel_err(exp2_poly_numpy(x), x)
    assert err.max() <= MAX_REL_ERR
    assert err.max() > 1.0e-4  # the bound is tight, not vacuous


def test_fma_model_is_correctly_rounded():
    """The model's fma (float64 product, sum rounded to odd, then to fp32) against exact
    rational arithmetic, on random and on tie-prone operands."""
    from fractions import Fraction

    from asymflash.core.exp2 import _fma32_numpy, _fma32_torch

    rng = np.random.default_rng(0)
    a = np.concatenate([rng.random(2000, dtype=np.float32),
                        np.float32(2.0) ** -rng.integers(20, 60, 2000).astype(np.float32)])
    for b, c in ((POLY_COEFFS[3], POLY_COEFFS[2]), (0.5, 1.0), (1.0, np.float32(2.0**-24))):
        got = _fma32_numpy(a, b, c)
        assert np.array_equal(_fma32_torch(torch.from_numpy(a), float(b), float(c)).numpy(), got)
        for ai, gi in zip(a[::7], got[::7]):
            exact = Fraction(float(ai)) * Fraction(float(b)) + Fraction(float(c))
            lo = np.float32(float(exact))
            down, up = (np.nextafter(lo, np.float32(t)) for t in (-np.inf, np.inf))
            cands = [down, lo, up]
            errs = [abs(Fraction(float(v)) - exact) for v in cands]
            best = min(errs)
            ties = [v for v, e in zip(cands, errs) if e == best]
            want = ties[0] if len(ties) == 1 else next(v for v in ties if not v.view(np.int32) & 1)
            assert gi == want, (ai, b, c)


def test_kernel_ptx_uses_these_coefficients():
    """The PTX the sm90 forward emits (`emu_asm`) carries exactly core.exp2's constants."""
    import re

    kernel = pytest.importorskip("asymflash.backends.sm90.fwd.softmax")
    if kernel.GLUON_ERROR is not None:
        pytest.skip(kernel.GLUON_ERROR)
    from asymflash.core.exp2 import FLOOR_MAGIC, X_MIN, ptx_f32

    for every in (1, 2, 4, 8):
        asm = kernel.emu_asm(every)  # the PTX the Gluon kernel places
        fmas = re.findall(r"fma\.rn\.ftz\.f32 ep, (\w+), (\w+), (\w+);", asm)
        assert fmas == [("ef", ptx_f32(POLY_COEFFS[3]), ptx_f32(POLY_COEFFS[2])),
                        ("ep", "ef", ptx_f32(POLY_COEFFS[1])),
                        ("ep", "ef", ptx_f32(POLY_COEFFS[0]))]
        assert f"max.ftz.f32 ef, ${2 * every - 1}, {ptx_f32(X_MIN)};" in asm
        assert asm.count(ptx_f32(FLOOR_MAGIC)) == 2 and "add.rm.ftz.f32" in asm
        assert asm.count("ex2.approx.ftz.f32") == every - 1
    # the literals decode to the model's values
    for c in POLY_COEFFS:
        assert np.frombuffer(bytes.fromhex(ptx_f32(c)[2:])[::-1], np.float32)[0] == c


@pytest.mark.gpu
def test_kernel_sequence_matches_the_model_bitwise_on_gpu():
    """The kernel's inline PTX (every element emulated) run on the GPU equals the CPU model
    bit for bit, over every range the softmax sees and the corners."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import triton
    import triton.language as tl

    kernel = pytest.importorskip("asymflash.backends.sm90.fwd.softmax")

    @triton.jit
    def _apply(x_ptr, y_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        y = tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    g = torch.Generator().manual_seed(0)
    ints = torch.arange(-126, 128, dtype=torch.float32)
    x = torch.cat([torch.rand(1_000_000, generator=g) * 140.0 - 131.0,
                   torch.linspace(-30.0, 8.0, 1_000_001), ints,
                   torch.nextafter(ints, torch.tensor(-float("inf"))),
                   torch.tensor([-float("inf"), -1e30, -127.0, -126.5, 0.0, -0.0, -1e-10,
                                 1e-10, 1e-40, -1e-40, 8.0])]).float()
    y = torch.empty_like(x, device="cuda")
    n = x.numel()
    _apply[(triton.cdiv(n, 1024),)](x.cuda(), y, n, ASM=kernel.emu_asm(1), BLOCK=1024)
    want = exp2_poly_numpy(x.numpy())
    got = y.cpu().numpy()
    bad = np.flatnonzero(got.view(np.int32) != want.view(np.int32))
    assert bad.size == 0, (x.numpy()[bad[:5]], got[bad[:5]], want[bad[:5]])


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
