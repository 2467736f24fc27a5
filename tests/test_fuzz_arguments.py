"""Random, mostly invalid, arguments to public disttensor calls (property-based).

For every drawn call the ranks must end alike (``collective_outcome``: all
return, or all raise the same exception type with the same message), and a
call that returns must agree with NumPy on the whole array. Every rank draws
the same examples (the ``"mpi"`` Hypothesis profile is derandomised).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert, collective_outcome

P = MPI.COMM_WORLD.Get_size()

junk = st.one_of(
    st.none(), st.booleans(), st.floats(-3, 30), st.just(float("nan")), st.text(max_size=2),
    st.just(2.0), st.just([1]), st.just(np.int64(3)),
)
ints = st.integers(-4, 13)
maybe_int = st.one_of(ints, ints, ints, junk)
shapes = st.one_of(maybe_int, st.lists(maybe_int, max_size=3), st.tuples(maybe_int, maybe_int))


def numpy_outcome(fn):
    try:
        return fn(), None
    except Exception as exc:  # any NumPy error means the call is invalid
        return None, exc


def agree(ours, ref, compare=np.array_equal):
    """Our call ended alike everywhere; if it returned, NumPy returned the same thing."""
    result, err = ours
    if err is not None:
        collective_assert(isinstance(err, (TypeError, ValueError, IndexError, OverflowError)),
                          f"unexpected {type(err).__name__}: {err}")
        return
    want, ref_err = numpy_outcome(ref)
    collective_assert(ref_err is None, f"disttensor returned {result!r} where NumPy raised "
                                       f"{ref_err!r}")
    collective_assert(compare(result, want), f"{result!r} != {want!r}")


@pytest.mark.parallel([2, 3])
@given(n=maybe_int, p=maybe_int)
def test_block_boundaries(n, p):
    def ref():
        if isinstance(n, bool) or isinstance(p, bool):
            raise TypeError("bool")
        parts = np.array_split(np.arange(n), p)
        return tuple(np.cumsum([0] + [len(c) for c in parts]).tolist())
    agree(collective_outcome(dt.block_boundaries, n, p), ref,
          compare=lambda a, b: tuple(a) == tuple(b))


@pytest.mark.parallel([2, 3])
@given(shape=shapes, axes=st.one_of(st.none(), st.lists(st.one_of(st.none(), maybe_int),
                                                         max_size=3), junk))
def test_distribution(shape, axes):
    g = dt.ProcessGrid(P)
    d, err = collective_outcome(dt.Distribution, shape, g, axes)
    if err is None:  # every element is held by nreplicas ranks
        count = MPI.COMM_WORLD.allreduce(int(np.prod(d.local_shape())))
        collective_assert(count == d.size * d.nreplicas, f"{d}: {count} elements held")


@pytest.mark.parallel([2, 3])
@given(newshape=shapes)
def test_reshape(newshape):
    a = np.arange(12.0)
    x = dt.DistArray.from_global(a, dt.Distribution((12,), dt.ProcessGrid(P)))

    def ref():
        if isinstance(newshape, bool) or isinstance(newshape, (list, tuple)) and any(
                isinstance(s, bool) for s in newshape):
            raise TypeError("bool")
        return np.reshape(a, newshape)
    agree(collective_outcome(lambda: x.reshape(newshape).to_global()), ref)


axis_arg = st.one_of(st.none(), st.integers(-3, 3), st.tuples(st.integers(-3, 3)),
                     st.lists(st.integers(-2, 2), max_size=2).map(tuple), junk)


@pytest.mark.parallel([2, 3])
@given(axis=axis_arg, keepdims=st.booleans())
def test_sum_axis(axis, keepdims):
    a = np.arange(12.0).reshape(3, 4)
    x = dt.DistArray.from_global(a, dt.Distribution((3, 4), dt.ProcessGrid(P)))

    def ref():
        if isinstance(axis, (bool, float, str, list)) or axis is not None and not isinstance(
                axis, (int, tuple, np.integer)):
            raise TypeError("axis")
        return np.sum(a, axis=axis, keepdims=keepdims)
    agree(collective_outcome(lambda: x.sum(axis=axis, keepdims=keepdims).to_global()), ref,
          compare=np.allclose)


widths = st.one_of(st.integers(-1, 9), st.tuples(st.integers(-1, 9), st.integers(0, 9)),
                   st.just([[1, 2]]), st.just([[1, 1], [0, 0]]), junk)
modes = st.sampled_from(["constant", "wrap", "reflect", "symmetric", "edge", "mirror"])
fills = st.one_of(st.just(0), st.integers(-200, 300), st.floats(allow_nan=True, width=32),
                  st.just((1, 2)), st.just("a"))


@pytest.mark.parallel([2, 3])
@given(w=widths, mode=modes, cv=fills, dtype=st.sampled_from(["int8", "float64", "<U2"]))
def test_exchange_halo(w, mode, cv, dtype):
    a = (np.arange(5) * 3 - 5).astype(dtype)
    x = dt.DistArray.from_global(a, dt.Distribution((5,), dt.ProcessGrid(P)))
    kw = {"constant_values": cv} if mode == "constant" else {}
    result, err = collective_outcome(lambda: x.exchange_halo(w, mode, **kw).copy())
    if err is not None:
        return
    lo, hi = np.broadcast_to(np.asarray(w), (1, 2))[0]
    sl = x.dist.local_slices()[0]
    want = np.pad(a, ((lo, hi),), mode, **kw)[sl.start: sl.stop + lo + hi]
    collective_assert(np.array_equal(result, want, equal_nan=dtype == "float64"),
                      f"{result!r} != {want!r}")


keys = st.one_of(
    st.integers(-9, 9), st.slices(8), st.tuples(st.integers(-4, 4), st.integers(-5, 5)),
    st.tuples(st.slices(4), st.integers(-5, 5)), st.just(Ellipsis), st.just(None), junk,
)


@pytest.mark.parallel([2, 3])
@given(key=keys)
def test_getitem(key):
    a = np.arange(24.0).reshape(4, 6)
    x = dt.DistArray.from_global(a, dt.Distribution((4, 6), dt.ProcessGrid(P)))

    def get():
        out = x[key]
        return out.to_global() if isinstance(out, dt.DistArray) else out
    agree(collective_outcome(get), lambda: a[key])


@pytest.mark.parallel([2, 3])
@given(axis=maybe_int, offset=maybe_int, periodic=st.booleans())
def test_grid_neighbor(axis, offset, periodic):
    g = dt.ProcessGrid((P, 1))
    result, err = collective_outcome(g.neighbor, axis, offset, periodic)
    if err is None:
        coords = list(g.coords)
        coords[axis] += offset
        if periodic:
            coords[axis] %= g.shape[axis]
        inside = all(0 <= c < s for c, s in zip(coords, g.shape))
        want = coords[0] * 1 + coords[1] if inside else None
        collective_assert(result == want, f"{result} != {want}")
