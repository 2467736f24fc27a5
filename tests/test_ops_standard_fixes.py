"""Places where the namespace now follows the array API standard: dtypes, finfo, 0-d masks,
asarray of nested 0-d DistArrays."""

import array_api_strict as xs
import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_allclose, assert_equal, collective_assert, collective_outcome

parallel = pytest.mark.parallel([1, 2, 3])


def _xp():
    return dt.zeros((1,)).__array_namespace__()


@parallel
def test_vecdot_keeps_uint8_and_wraps_around():
    xp = _xp()
    a = np.array([[200, 100, 7], [255, 255, 1]], np.uint8)
    x = xp.asarray(a)
    got = xp.vecdot(x, x)
    want = (a.astype(np.int64) ** 2).sum(axis=-1) % 256
    assert_equal(got, want.astype(np.uint8))


@parallel
def test_finfo_python_scalars():
    xp = _xp()
    for dtype, ref in [(xp.float32, np.float32), (xp.float64, np.float64),
                       (xp.complex64, np.float32)]:
        f, r = xp.finfo(dtype), np.finfo(ref)
        ok = all(type(getattr(f, k)) is float for k in ("eps", "max", "min", "smallest_normal"))
        ok = ok and type(f.bits) is int and f.eps == float(r.eps) and f.max == float(r.max)
        ok = ok and f.smallest_normal == float(r.smallest_normal) and f.bits == r.bits
        collective_assert(ok, f"finfo({dtype}) = {f}")


@parallel
def test_zero_d_boolean_masks():
    xp = _xp()
    for value in (True, False):
        t = xp.asarray(value)
        assert_equal(t[t], np.asarray(value)[np.asarray(value)])
        e = xp.zeros((0,))
        assert_equal(e[t], np.zeros((0,))[np.asarray(value)])
        g = np.arange(6.0).reshape(2, 3)
        x = xp.asarray(g)
        assert_equal(x[t], g[np.asarray(value)])
        assert_equal(x[value], g[value])
        x[t] = -1.0
        g[np.asarray(value)] = -1.0
        assert_equal(x, g)


@parallel
def test_asarray_of_nested_zero_d_arrays():
    xp = _xp()
    s = xp.sum(xp.asarray([1.0, 2.0]))
    m = xp.max(xp.asarray([4, 9]))
    assert_equal(xp.asarray([[s, 1.0], [s, 2.0]]), np.array([[3.0, 1.0], [3.0, 2.0]]))
    assert_equal(xp.asarray([m, 1]), np.array([9, 1]))
    with pytest.raises(ValueError):
        xp.asarray([xp.asarray([1.0]), 2.0])


# ------------------------------------------------ linalg.pinv and matrix_rank: the standard's rtol
def _split_stack(a, axes=None):
    """``a`` as a DistArray split over its first dimension (its stack), or as ``axes`` says."""
    g = dt.ProcessGrid(MPI.COMM_WORLD.Get_size())
    axes = (0,) + (None,) * (a.ndim - 1) if axes is None else axes
    return dt.DistArray.from_global(a, dt.Distribution(a.shape, g, axes))


def _rank_deficient(rng, shape, dtype):
    """Stacks of matrices with a spread of singular values (some tiny, some zero)."""
    *stack, m, n = shape
    k = min(m, n)
    u = np.linalg.qr(rng.standard_normal((*stack, m, m)))[0][..., :k]
    v = np.linalg.qr(rng.standard_normal((*stack, n, n)))[0][..., :k]
    s = np.geomspace(1.0, 1e-12, k) * (np.arange(k) < k - 1)  # the last one exactly zero
    return ((u * s) @ np.swapaxes(v, -1, -2)).astype(dtype)


RTOLS = {
    "default": lambda stack: None,
    "float": lambda stack: 1e-6,
    "tiny": lambda stack: 1e-14,  # keeps the 1e-12 singular value, drops the zero one
    "per matrix": lambda stack: np.geomspace(1e-3, 1e-13, int(np.prod(stack))).reshape(stack),
    "broadcast": lambda stack: np.full((1,) * len(stack), 1e-9),
}


@parallel
@pytest.mark.parametrize("rtol", sorted(RTOLS))
@pytest.mark.parametrize("shape", [(6, 5, 4), (3, 4, 7), (2, 3, 5, 5), (9, 3)])
def test_pinv_and_matrix_rank_rtol_as_array_api_strict(rtol, shape):
    # array_api_strict (NumPy's SVD with the standard's rtol) is the reference: singular
    # values up to rtol times the largest are dropped, default max(M, N) * eps
    xp = _xp()
    rng = np.random.default_rng(len(shape) + 10 * shape[-1])
    a = _rank_deficient(rng, shape, np.float64)
    r = RTOLS[rtol](shape[:-2])
    x = _split_stack(a) if len(shape) > 2 else _split_stack(a, (0, None))
    ra = r if r is None or np.ndim(r) == 0 else xs.asarray(r)
    want_pinv = np.asarray(xs.linalg.pinv(xs.asarray(a), rtol=ra))
    want_rank = np.asarray(xs.linalg.matrix_rank(xs.asarray(a), rtol=ra))
    for given in ([r] if r is None or np.ndim(r) == 0 else [r, xp.asarray(r)]):
        assert_allclose(xp.linalg.pinv(x, rtol=given), want_pinv, rtol=1e-6, atol=1e-9)
        assert_equal(xp.linalg.matrix_rank(x, rtol=given), want_rank)


@parallel
def test_pinv_rtol_decides_which_singular_values_count():
    # diag(1, 1e-4, 0): rtol 1e-3 drops 1e-4, rtol 1e-5 keeps it (independent of any library)
    xp = _xp()
    a = np.diag([1.0, 1e-4, 0.0])[None].repeat(4, axis=0)
    x = _split_stack(a)
    assert_allclose(xp.linalg.pinv(x, rtol=1e-3), np.diag([1.0, 0.0, 0.0])[None].repeat(4, 0))
    assert_allclose(xp.linalg.pinv(x, rtol=1e-5), np.diag([1.0, 1e4, 0.0])[None].repeat(4, 0))
    per = xp.asarray(np.array([1e-3, 1e-5, 1e-3, 1e-5]))
    want = np.stack([np.diag([1.0, 0.0 if i % 2 == 0 else 1e4, 0.0]) for i in range(4)])
    assert_allclose(xp.linalg.pinv(x, rtol=per), want)
    assert_equal(xp.linalg.matrix_rank(x, rtol=per), np.array([1, 2, 1, 2]))
    _, err = collective_outcome(lambda: xp.linalg.pinv(x, rtol=np.ones(3)))
    collective_assert(isinstance(err, ValueError) and "does not broadcast" in str(err), repr(err))


# ------------------------------------------------ linalg.vecdot
VECDOT = [((3,), (3,), -1), ((4, 3), (3,), -1), ((2, 3), (4, 2, 3), -1), ((4, 3, 2), (3, 2), -2),
          ((1, 3), (4, 3), -1), ((5, 1, 3), (1, 2, 3), -1), ((2, 5, 3), (5, 3), -2),
          ((4, 3), (4, 3), 0), ((4, 3), (4, 3), 1), ((4, 3), (4, 3), -2), ((6, 2), (2,), -1)]


@parallel
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.float32, np.float64,
                                   np.complex64, np.complex128])
@pytest.mark.parametrize("case", range(len(VECDOT)))
def test_linalg_vecdot_as_array_api_strict(dtype, case):
    # conj(x1) * x2 summed over axis (each operand's own, counted from the end when negative),
    # the other dimensions broadcast, in the operands' dtype: array_api_strict for negative
    # axes (it refuses others, as the 2023.12 standard allows), NumPy's vecdot for all
    s1, s2, axis = VECDOT[case]
    xp = _xp()
    rng = np.random.default_rng(case)
    def draw(shape):
        v = rng.integers(-9, 10, shape)
        if np.dtype(dtype).kind == "c":
            v = v + 1j * rng.integers(-9, 10, shape)
        return np.asarray(v).astype(dtype) if np.dtype(dtype).kind != "u" else \
            np.abs(v).astype(dtype)
    a, b = draw(s1), draw(s2)
    want = np.vecdot(a, b, axis=axis)
    if axis < 0:
        strict = np.asarray(xs.linalg.vecdot(xs.asarray(a), xs.asarray(b), axis=axis))
        collective_assert(strict.dtype == want.dtype and np.allclose(strict, want))
    x1 = _split_stack(a, (0,) + (None,) * (a.ndim - 1))
    x2 = _split_stack(b, (None,) * (b.ndim - 1) + (0,))
    for got in (xp.linalg.vecdot(x1, x2, axis=axis), xp.vecdot(x1, x2, axis=axis),
                np.vecdot(x1, x2, axis=axis)):
        collective_assert(got.dtype == want.dtype and got.shape == want.shape,
                          f"{got.dtype} {got.shape} != {want.dtype} {want.shape}")
        assert_allclose(got, want, rtol=1e-5)


@parallel
def test_linalg_vecdot_refuses_a_broadcast_contracted_axis():
    xp = _xp()
    x1 = _split_stack(np.ones((4, 1)))
    x2 = _split_stack(np.ones((4, 3)))
    for bad in (lambda: xp.linalg.vecdot(x1, x2), lambda: xp.linalg.vecdot(x1, x2, axis=-3)):
        _, err = collective_outcome(bad)
        collective_assert(isinstance(err, ValueError), repr(err))
    with pytest.raises(ValueError):
        np.vecdot(np.ones((4, 1)), np.ones((4, 3)))  # NumPy refuses it too


# ------------------------------------------------ expm1 on complex special values
_INF, _NAN = np.inf, np.nan
# (a, b) -> expm1(a + bj) as the standard's table has it (after C99 Annex G); None where the
# sign of a zero or of an infinity is unspecified. NumPy differs in the 12 cases marked *
# (the standard's 7 rows with a +0 or an infinite or NaN imaginary part, and their conjugates).
EXPM1 = [
    ((0.0, 0.0), (0.0, 0.0)), ((-0.0, 0.0), (0.0, 0.0)),                        # *(-0 + 0j)
    ((0.0, -0.0), (0.0, -0.0)), ((-0.0, -0.0), (0.0, -0.0)),                    # *(-0 - 0j)
    ((1.0, _INF), (_NAN, _NAN)), ((1.0, _NAN), (_NAN, _NAN)),
    ((_INF, 0.0), (_INF, 0.0)), ((_INF, -0.0), (_INF, -0.0)),                   # *
    ((-_INF, 1.0), (-1.0, 0.0)), ((-_INF, -1.0), (-1.0, -0.0)), ((-_INF, 0.0), (-1.0, 0.0)),
    ((-_INF, _INF), (-1.0, None)), ((-_INF, -_INF), (-1.0, None)),             # *
    ((_INF, _INF), (None, _NAN)), ((_INF, -_INF), (None, _NAN)),               # *
    ((-_INF, _NAN), (-1.0, None)),                                              # *
    ((_INF, _NAN), (None, _NAN)),                                               # *
    ((_NAN, 0.0), (_NAN, 0.0)), ((_NAN, -0.0), (_NAN, -0.0)),                   # *
    ((_NAN, 1.0), (_NAN, _NAN)), ((_NAN, _NAN), (_NAN, _NAN)),
]


def _same(got, want):
    """``want`` exactly, zeros by sign; None: a zero or infinity of either sign."""
    if want is None:
        return got == 0 or np.isinf(got)
    if np.isnan(want):
        return bool(np.isnan(got))
    return got == want and np.signbit(got) == np.signbit(want)


@parallel
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_expm1_complex_special_cases_as_the_standard(dtype):
    xp = _xp()
    z = np.empty(len(EXPM1) * 3, dtype)  # repeated so that every rank holds some
    for i, ((a, b), _) in enumerate(EXPM1 * 3):
        z.real[i], z.imag[i] = a, b
    got = xp.expm1(_split_stack(z)).to_global()
    collective_assert(got.dtype == dtype)
    bad = [(EXPM1[i % len(EXPM1)], (got[i].real, got[i].imag)) for i in range(z.size)
           if not (_same(got[i].real, EXPM1[i % len(EXPM1)][1][0])
                   and _same(got[i].imag, EXPM1[i % len(EXPM1)][1][1]))]
    collective_assert(not bad, f"expm1 differs from the standard: {bad}")
    # NumPy itself (and np.expm1 on DistArrays, which follows NumPy) agrees where it is right
    with np.errstate(all="ignore"):
        ref = np.expm1(z)
    agree = [i for i, ((a, b), w) in enumerate(EXPM1 * 3)
             if _same(ref[i].real, w[0]) and _same(ref[i].imag, w[1])]
    collective_assert(len(agree) == 3 * (len(EXPM1) - 12), f"{len(agree)}")
    collective_assert(np.array_equal(got[agree], ref[agree], equal_nan=True))
    assert_equal(np.expm1(_split_stack(z)), ref)


@parallel
def test_expm1_complex_finite_values_as_numpy():
    xp = _xp()
    rng = np.random.default_rng(5)
    z = (rng.standard_normal(64) * 3 + 1j * rng.standard_normal(64) * 3).astype(np.complex128)
    z[:8] *= 1e-9  # near zero, where expm1 is more than exp - 1
    z[8:12] = z[8:12].real  # zero imaginary parts: a real expm1
    assert_allclose(xp.expm1(_split_stack(z)), np.expm1(z), rtol=1e-13)
    r = rng.standard_normal(10)
    assert_equal(xp.expm1(_split_stack(r)), np.expm1(r))
