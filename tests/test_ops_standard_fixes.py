"""Places where the namespace now follows the array API standard: dtypes, finfo, 0-d masks,
asarray of nested 0-d DistArrays."""

import numpy as np
import pytest

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert

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
