"""sort and argsort on DistArrays against NumPy (and array_api_strict for descending order)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray
from disttensor.ops import sorting
from disttensor.testing import assert_equal, collective_assert, collective_outcome
from disttensor.testing.numpy_compare import check_like_numpy, layouts
from disttensor.testing.strategies import distributions, process_grids

parallel = pytest.mark.parallel([1, 2, 3, 4])


def _xp(x):
    return x.__array_namespace__()


def _bits(a):
    """The bytes of ``a``: equal only when every element (sign of zero, NaN) is the same."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))


def _strict_desc(g, axis, index):
    """The standard's stable descending order: array_api_strict's argsort (its sort flips
    NumPy's ascending sort, which reverses equal elements such as -0.0 and 0.0; the values
    here are those its argsort selects, so that sort and argsort agree)."""
    xps = pytest.importorskip("array_api_strict")
    idx = np.asarray(xps.argsort(xps.asarray(g), axis=axis, descending=True, stable=True))
    return idx if index else np.take_along_axis(g, idx, axis)


@parallel
@pytest.mark.parametrize("index", [False, True])
def test_like_numpy_every_layout(index):
    """Stable ascending sort/argsort along each axis, on every layout, with ties (ints)."""
    for axis in (0, -1):
        np_f = (lambda a, ax=axis: np.argsort(a, axis=ax, kind="stable")) if index else (
            lambda a, ax=axis: np.sort(a, axis=ax, kind="stable"))
        dt_f = (lambda x, ax=axis: _xp(x).argsort(x, axis=ax)) if index else (
            lambda x, ax=axis: _xp(x).sort(x, axis=ax))
        check_like_numpy(np_f, dt_f, shapes=[(0,), (1,), (23,), (7, 5), (3, 0)],
                         dtypes=[np.float64, np.int16, np.complex64, np.bool_],
                         name=f"{'arg' if index else ''}sort axis={axis}")


def _special(n, seed):
    """Floats with ties, NaNs and both signed zeros."""
    rng = np.random.default_rng(seed)
    g = rng.integers(-3, 4, n).astype(np.float64)
    g[rng.random(n) < 0.15] = np.nan
    g[rng.random(n) < 0.15] = -0.0
    return g


@parallel
@pytest.mark.parametrize("descending", [False, True])
def test_nan_and_signed_zeros_bitwise(descending):
    """NaN order and signed zeros exactly as NumPy's stable sort (array_api_strict: descending)."""
    for n in (1, 40, 301):
        g = _special(n, n)
        for d in layouts((n,)):
            x = DistArray.from_global(g, d)
            s = _xp(x).sort(x, descending=descending)
            a = _xp(x).argsort(x, descending=descending)
            want_s = _strict_desc(g, 0, False) if descending else np.sort(g, kind="stable")
            want_a = _strict_desc(g, 0, True) if descending else np.argsort(g, kind="stable")
            collective_assert(s.dist == d and a.dist == d, "not in the input's distribution")
            assert_equal(_bits(s.to_global()), _bits(want_s))
            assert_equal(a, want_a.astype(np.intp))


@parallel
def test_descending_nd_and_numpy_protocol():
    """Descending on a split axis of a 2-D array, and numpy.sort/argsort (axis=None too)."""
    g = np.random.default_rng(3).integers(0, 4, (9, 11)).astype(np.float32)
    for d in layouts(g.shape):
        x = DistArray.from_global(g, d)
        for axis in (0, 1):
            assert_equal(_xp(x).sort(x, axis=axis, descending=True), _strict_desc(g, axis, False))
            assert_equal(_xp(x).argsort(x, axis=axis, descending=True),
                         _strict_desc(g, axis, True).astype(np.intp))
        assert_equal(np.sort(x, axis=None), np.sort(g, axis=None))
        assert_equal(np.argsort(x, axis=0, kind="stable"), np.argsort(g, axis=0, kind="stable"))


@parallel
@pytest.mark.parametrize("descending", [False, True])
def test_batched_sample_sort_nd(descending, monkeypatch):
    """N-D sorts along a split axis through the batched sample sort (forced on every layout):
    NaNs and signed zeros bitwise, stable argsort, the input's distribution kept."""
    monkeypatch.setattr(sorting, "LINES_IMBALANCE", 0.0)
    for shape in [(31, 2), (3, 2, 13), (9, 1)]:
        g = _special(int(np.prod(shape)), 7).reshape(shape)
        for d in layouts(shape):
            x = DistArray.from_global(g, d)
            for axis in range(len(shape)):
                s = _xp(x).sort(x, axis=axis, descending=descending)
                a = _xp(x).argsort(x, axis=axis, descending=descending)
                want_s = (_strict_desc(g, axis, False) if descending
                          else np.sort(g, axis=axis, kind="stable"))
                want_a = (_strict_desc(g, axis, True) if descending
                          else np.argsort(g, axis=axis, kind="stable"))
                collective_assert(s.dist == d and a.dist == d, "not in the input's distribution")
                assert_equal(_bits(s.to_global()), _bits(want_s))
                assert_equal(a, want_a.astype(np.intp))


@parallel
def test_nd_split_axis_strategy_rule(monkeypatch):
    """Whole lines where the other dims spread them evenly, the batched sample sort where
    moving the split would pile the array up on a few ranks (an (n, 1) array)."""
    calls = []
    batched = sorting._batched_sample_sort

    def spy(*args):
        calls.append(args[1])
        return batched(*args)

    monkeypatch.setattr(sorting, "_batched_sample_sort", spy)
    p = MPI.COMM_WORLD.size
    grid = dt.ProcessGrid((p,))
    for shape, want in (((50, 1), p > 1), ((20, 4 * p), False)):
        g = np.random.default_rng(0).standard_normal(shape)
        x = DistArray.from_global(g, dt.Distribution(shape, grid, (0, None)))
        calls.clear()
        assert_equal(_xp(x).sort(x, axis=0), np.sort(g, axis=0))
        collective_assert(bool(calls) == want, f"{shape}: batched={bool(calls)}, want {want}")


@parallel
def test_large_and_skewed_inputs_balance():
    """Sorted, reversed, constant and heavily tied inputs; no rank receives much more than its
    block (the splitters sit at the target boundaries, ties are split by index)."""
    n = 4000
    rng = np.random.default_rng(1)
    cases = [np.arange(n, dtype=np.int64), np.arange(n, 0, -1).astype(np.int64),
             np.zeros(n, dtype=np.int64), rng.integers(0, 3, n), rng.standard_normal(n)]
    grid = dt.ProcessGrid((MPI.COMM_WORLD.size,))
    for g in cases:
        for d in (dt.Distribution((n,), grid), layouts((n,))[-1]):
            x = DistArray.from_global(g, d)
            assert_equal(_xp(x).argsort(x), np.argsort(g, kind="stable").astype(np.intp))
            assert_equal(_xp(x).sort(x), np.sort(g))


@st.composite
def _dist_and_values(draw):
    d = draw(distributions(shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=8),
                           grid=process_grids(max_ndim=2)))
    g = draw(hnp.arrays(np.int8, d.global_shape, elements=st.integers(-2, 2)))
    return d, g, draw(st.integers(0, d.ndim - 1)), draw(st.booleans())


@parallel
@settings(max_examples=25)
@given(case=_dist_and_values())
def test_argsort_stable_hypothesis(case):
    """Stability on drawn distributions (multi-axis splits, replicas, empty blocks) with ties."""
    d, g, axis, descending = case
    x = DistArray.from_global(g, d)
    got = _xp(x).argsort(x, axis=axis, descending=descending)
    want = (_strict_desc(g, axis, True) if descending
            else np.argsort(g, axis=axis, kind="stable"))
    assert_equal(got, want.astype(np.intp))
    collective_assert(got.dist == d, "argsort changed the distribution")


@parallel
def test_bad_arguments_raise_alike():
    x = dt.arange(6.0)
    xp = _xp(x)
    for call, exc in [(lambda: xp.sort(x, axis=1), np.exceptions.AxisError),
                      (lambda: xp.argsort(x, axis=1.0), TypeError),
                      (lambda: xp.sort(x, descending="yes"), TypeError),
                      (lambda: xp.sort(xp.asarray(1.0)), np.exceptions.AxisError),
                      (lambda: np.sort(x, order="a"), ValueError),
                      (lambda: xp.sort(np.arange(3)), TypeError)]:
        _, err = collective_outcome(call)
        collective_assert(isinstance(err, exc), f"expected {exc.__name__}, got {err!r}")
