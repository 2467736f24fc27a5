"""unique_*, searchsorted and take on DistArrays against NumPy on the gathered array."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from disttensor import DistArray
from disttensor.testing import assert_equal, collective_assert, collective_outcome
from disttensor.testing.numpy_compare import layouts
from disttensor.testing.strategies import distributions, process_grids

parallel = pytest.mark.parallel([1, 2, 3, 4])


def _xp(x):
    return x.__array_namespace__()


def _reference(g):
    """Sorted unique values and the rest from numpy.unique (NumPy's unique_values may come
    unsorted since 2.3; the standard leaves the order open, this library sorts)."""
    v, i, inv, c = np.unique(g, return_index=True, return_inverse=True, return_counts=True,
                             equal_nan=False)
    return v, i.astype(np.intp), inv.reshape(g.shape).astype(np.intp), c.astype(np.intp)


def _check_unique(x, g):
    xp = _xp(x)
    v, i, inv, c = _reference(g)
    assert_equal(xp.unique_values(x), v)
    got = xp.unique_counts(x)
    assert_equal(got.values, v)
    assert_equal(got.counts, c)
    got = xp.unique_all(x)
    for a, w in zip(got, (v, i, inv, c)):
        assert_equal(a, w)
    got = xp.unique_inverse(x)
    assert_equal(got.values, v)
    assert_equal(got.inverse_indices, inv)


@parallel
def test_unique_every_layout():
    rng = np.random.default_rng(0)
    for shape in [(0,), (1,), (29,), (4, 5), (2, 0, 3)]:
        for dtype in (np.float64, np.int8, np.bool_):
            g = rng.integers(-3, 4, shape).astype(dtype)
            for d in layouts(shape):
                _check_unique(DistArray.from_global(g, d), g)


@parallel
def test_unique_nan_distinct_and_signed_zero_one_value():
    """NaNs are all distinct (equal_nan=False), -0.0 and 0.0 one value; values[inverse] == x."""
    g = np.array([np.nan, 0.0, 1.0, -0.0, np.nan, 1.0, np.nan, 0.0, 2.0, -0.0, np.nan])
    for d in layouts(g.shape):
        x = DistArray.from_global(g, d)
        xp = _xp(x)
        v, _, _, c = _reference(g)
        assert_equal(xp.unique_values(x), v)
        assert_equal(xp.unique_counts(x).counts, c)
        inv = xp.unique_inverse(x)
        back = inv.values.to_global()[inv.inverse_indices.to_global()]
        collective_assert(np.array_equal(back, g, equal_nan=True), "values[inverse] != x")


@st.composite
def _dist_and_values(draw):
    d = draw(distributions(shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=7),
                           grid=process_grids(max_ndim=2)))
    g = draw(hnp.arrays(np.int16, d.global_shape, elements=st.integers(-3, 3)))
    return d, g


@parallel
@settings(max_examples=20)
@given(case=_dist_and_values())
def test_unique_hypothesis(case):
    d, g = case
    _check_unique(DistArray.from_global(g, d), g)


@parallel
def test_searchsorted_every_layout():
    rng = np.random.default_rng(1)
    for n in (0, 1, 25):
        s = np.sort(rng.integers(-4, 5, n).astype(np.float64))
        s[-2:] = np.nan if n > 2 else s[-2:]
        v = np.array([[-9.0, 0.0, 0.5], [4.0, np.nan, 9.0]])
        for d in layouts((n,)):
            x1 = DistArray.from_global(s, d)
            for dv in layouts(v.shape):
                x2 = DistArray.from_global(v, dv)
                for side in ("left", "right"):
                    got = _xp(x1).searchsorted(x1, x2, side=side)
                    assert_equal(got, np.searchsorted(s, v, side=side).astype(np.intp))
                    collective_assert(got.dist == dv, "not in x2's distribution")
            assert_equal(np.searchsorted(x1, v[0]), np.searchsorted(s, v[0]))
        unsorted = rng.permutation(s)
        x1 = DistArray.from_global(unsorted, layouts((n,))[-1])
        order = np.argsort(unsorted, kind="stable")
        assert_equal(_xp(x1).searchsorted(x1, v, sorter=order),
                     np.searchsorted(unsorted, v, sorter=order))


@st.composite
def _take_case(draw):
    d = draw(distributions(shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
                           grid=process_grids(max_ndim=2)))
    axis = draw(st.integers(0, d.ndim - 1))
    n = d.global_shape[axis]
    idx = draw(hnp.arrays(np.int64, draw(st.integers(0, 8)),
                          elements=st.integers(-n, n - 1) if n else st.nothing()))
    return d, axis, idx, draw(st.booleans())


@parallel
@settings(max_examples=25)
@given(case=_take_case())
def test_take_hypothesis(case):
    """take with NumPy or DistArray indices (negative ones too) against numpy.take."""
    d, axis, idx, as_dist = case
    g = np.arange(np.prod(d.global_shape), dtype=np.float32).reshape(d.global_shape)
    x = DistArray.from_global(g, d)
    ind = DistArray.from_global(idx, layouts(idx.shape)[-1]) if as_dist else idx
    got = _xp(x).take(x, ind, axis=axis)
    assert_equal(got, np.take(g, idx, axis=axis))
    collective_assert(got.dist.dim_axes == d.dim_axes, "take changed the grid axes")


@parallel
def test_bad_arguments_raise_alike():
    g = np.arange(12.0).reshape(3, 4)
    x = DistArray.from_global(g, layouts(g.shape)[0])
    xp = _xp(x)
    s = DistArray.from_global(np.arange(5.0), layouts((5,))[0])
    for call, exc in [(lambda: xp.take(x, np.array([0, 3]), axis=0), IndexError),
                      (lambda: xp.take(x, np.array([-4]), axis=0), IndexError),
                      (lambda: xp.take(x, DistArray.from_global(np.array([0, 9]),
                                                                layouts((2,))[0]), axis=1),
                       IndexError),
                      (lambda: xp.take(x, np.array([0.5]), axis=0), IndexError),
                      (lambda: xp.take(x, np.array([0])), ValueError),
                      (lambda: xp.take(x, np.array([[0]]), axis=0), ValueError),
                      (lambda: xp.searchsorted(x, 1.0), ValueError),
                      (lambda: xp.searchsorted(s, 1.0, side="middle"), ValueError),
                      (lambda: xp.unique_values(g), TypeError)]:
        _, err = collective_outcome(call)
        collective_assert(isinstance(err, exc), f"expected {exc.__name__}, got {err!r}")
