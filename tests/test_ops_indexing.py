"""Indexing DistArrays against NumPy: basic keys (Hypothesis), integer arrays, writes, masks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.ops import implicit_redistribution
from disttensor.testing import assert_equal, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy, layouts, sample
from disttensor.testing.strategies import distributions, process_grids

parallel = pytest.mark.parallel([1, 2, 3, 4])

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6)
dists = distributions(shape=shapes, grid=process_grids(max_ndim=2))


def _values(shape):
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 0.5


@st.composite
def dist_and_key(draw):
    d = draw(dists)
    key = draw(hnp.basic_indices(d.global_shape, min_dims=0, allow_newaxis=True,
                                 allow_ellipsis=True))
    return d, key


@parallel
@settings(max_examples=40)
@given(case=dist_and_key())
def test_getitem_matches_numpy(case):
    d, key = case
    g = _values(d.global_shape)
    x = DistArray.from_global(g, d)
    y = x[key]
    want = np.asarray(g[key])
    assert_equal(y, want)
    collective_assert(y.grid is x.grid and not np.shares_memory(y.local, x.local),
                      "not a new array on the same grid", x.comm)


@parallel
@settings(max_examples=40)
@given(case=dist_and_key(), kind=st.sampled_from(["scalar", "numpy", "dist", "broadcast"]),
       layout=st.integers(0, 4))
def test_setitem_matches_numpy(case, kind, layout):
    d, key = case
    g = _values(d.global_shape)
    x = DistArray.from_global(g, d)
    target = g[key]
    tshape = np.shape(target)
    if kind == "scalar":
        value = -1.25
    else:
        vshape = tshape[1:] if kind == "broadcast" and tshape else tshape
        value = -_values(vshape)
        if kind != "numpy" and vshape:
            lay = layouts(vshape, d.grid.comm)
            value = DistArray.from_global(value, lay[layout % len(lay)])
        elif kind != "numpy":
            value = DistArray.from_global(value, Distribution((), d.grid, ()))
    ref = g.copy()
    ref[key] = value.to_global() if isinstance(value, DistArray) else value
    x[key] = value
    assert_equal(x, ref)


@parallel
def test_index_errors_match_numpy():
    keys = [(0, 0, 0), (7,), (slice(None), -6), (Ellipsis, Ellipsis),
            (slice(None, None, 0),), (1.5,)]
    for key in keys:
        check_like_numpy(lambda x, key=key: x[key], shapes=[(5, 4)], max_layouts=3,
                         name=f"x[{key}]")

        def setter(x, key=key):
            x[key] = 1.0
            return x

        check_like_numpy(setter, shapes=[(5, 4)], max_layouts=3, name=f"x[{key}] = 1")
    # a value that does not broadcast into the target region
    check_like_numpy(lambda x: x.__setitem__(slice(0, 2), np.ones(3)), shapes=[(5, 4)],
                     max_layouts=3, name="bad broadcast")
    check_like_numpy(lambda x: x.__setitem__(0, 300), shapes=[(5, 4)], dtypes=[np.int8],
                     max_layouts=3, name="int8 overflow")
    # integer-array keys: out-of-range indices (also negative), arrays that do not broadcast,
    # a mask mixed with an integer array, too many indices
    for key in [(np.array([0, 5]),), (slice(None), np.array([-5, 0])),
                (np.array([0, 1]), np.array([0, 1, 2])), (np.array([0, 1]), 4),
                (sample((5, 4)) > 0, np.array([0])), (np.array([0]), 0, 0)]:
        check_like_numpy(lambda x, key=key: x[key], shapes=[(5, 4)], max_layouts=3,
                         name=f"x[{key}]")

        def fancy_setter(x, key=key):
            x[key] = 1.0
            return x

        check_like_numpy(fancy_setter, shapes=[(5, 4)], max_layouts=3, name=f"x[{key}] = 1")
    # a DistArray index out of range: IndexError on every rank, also those without it
    x = dt.zeros((5, 4))
    bad = DistArray.from_global(np.array([0, 1, 2, 7]), layouts((4,))[0])
    for op in (lambda: x[bad, 0], lambda: x.__setitem__((bad, 0), 1.0)):
        try:
            op()
            raised = False
        except IndexError:
            raised = True
        collective_assert(raised, "an out-of-range DistArray index did not raise", x.comm)


def _index_form(draw, arr, grid_comm):
    form = draw(st.sampled_from(["numpy", "list", "dist"]))
    if form == "list":
        return arr.tolist()
    if form == "dist" and arr.ndim:
        lay = layouts(arr.shape, grid_comm)
        return DistArray.from_global(arr, lay[draw(st.integers(0, len(lay) - 1))])
    return arr


@st.composite
def _advanced_case(draw):
    """A distribution and a key with one or two integer arrays (repeats and negative
    indices included), integers, slices and new axes elsewhere."""
    d = draw(dists)
    nd = d.ndim
    narr = draw(st.integers(1, min(2, nd)))
    adims = sorted(draw(st.lists(st.integers(0, nd - 1), min_size=narr, max_size=narr,
                                 unique=True)))
    bshape = draw(st.sampled_from([(2,), (3,), (2, 2), (0,), (1, 3)]))
    key = []
    for dim in range(nd):
        n = d.global_shape[dim]
        if dim in adims:
            shape = bshape if draw(st.booleans()) else bshape[-1:]
            if n == 0:
                shape = (0,)
            arr = np.asarray(draw(hnp.arrays(np.int64, shape, elements=st.integers(
                -n, max(n - 1, -n)))) if n else np.zeros(shape, np.int64))
            key.append(_index_form(draw, arr, d.grid.comm))
        elif n and draw(st.integers(0, 3)) == 0:
            key.append(draw(st.integers(-n, n - 1)))
        elif draw(st.booleans()):
            key.append(slice(*draw(st.tuples(st.integers(-n - 1, n + 1),
                                              st.integers(-n - 1, n + 1)))))
        else:
            key.append(slice(None))
    if draw(st.booleans()):
        key.insert(draw(st.integers(0, len(key))), None)
    return d, tuple(key)


def _numpy_key(key):
    return tuple(k.to_global() if isinstance(k, DistArray) else
                 (np.asarray(k, dtype=np.int64) if isinstance(k, list) else k) for k in key)


@parallel
@settings(max_examples=20)
@given(case=_advanced_case())
def test_integer_arrays_getitem_matches_numpy(case):
    """x[i, j], x[i, :, j], x[0, i], with slices and new axes: NumPy's advanced indexing."""
    d, key = case
    g = _values(d.global_shape)
    x = DistArray.from_global(g, d)
    nkey = _numpy_key(key)
    try:
        want = g[nkey]
    except IndexError:  # shapes that do not broadcast: the same error
        try:
            x[key]
            raised = False
        except IndexError:
            raised = True
        collective_assert(raised, f"x[{nkey}] did not raise IndexError", x.comm)
        return
    assert_equal(x[key], want)


@parallel
@settings(max_examples=20)
@given(case=_advanced_case(),
       kind=st.sampled_from(["scalar", "numpy", "dist", "broadcast"]), layout=st.integers(0, 4))
def test_integer_arrays_setitem_matches_numpy(case, kind, layout):
    """x[idx] = v, x[..., idx] = v, x[i, j] = v, x[1:3, idx] = v on any distribution;
    repeated indices write the value at the last position, as NumPy does."""
    d, key = case
    g = _values(d.global_shape)
    x = DistArray.from_global(g, d)
    nkey = _numpy_key(key)
    try:
        tshape = g[nkey].shape
    except IndexError:
        return
    if kind == "scalar":
        value = -1.25
    else:
        vshape = tshape[1:] if kind == "broadcast" and tshape else tshape
        value = -_values(vshape)
        if kind == "dist":
            lay = layouts(vshape, d.grid.comm)
            value = DistArray.from_global(value, lay[layout % len(lay)])
    ref = g.copy()
    ref[nkey] = value.to_global() if isinstance(value, DistArray) else value
    x[key] = value
    assert_equal(x, ref)


@parallel
def test_mask_setitem_with_array_values():
    """x[mask] = v with one value per selected element (NumPy's row-major order)."""
    def np_assign(x):
        m = x > 0
        x[m] = -np.arange(np.count_nonzero(m), dtype=x.dtype)
        return x

    def dt_assign(x):
        m = x > 0
        n = int(np.count_nonzero(m.to_global()))
        v = DistArray.from_global(-np.arange(n, dtype=x.dtype), layouts((n,), x.comm)[-1])
        x[m] = v
        return x

    check_like_numpy(np_assign, shapes=[(7,), (5, 4), (0, 3)], name="x[x > 0] = numpy")
    check_like_numpy(np_assign, dt_assign, shapes=[(5, 4)], name="x[x > 0] = DistArray")


@st.composite
def _fancy_case(draw):
    d = draw(dists)
    axis = draw(st.integers(0, d.ndim - 1))
    n = d.global_shape[axis]
    idx = draw(st.lists(st.integers(-n, n - 1), max_size=6)) if n else []
    form = draw(st.sampled_from(["numpy", "list", "dist"]))
    ell = draw(st.booleans())
    return d, axis, idx, form, ell


@parallel
@settings(max_examples=25)
@given(case=_fancy_case())
def test_integer_array_index_along_one_axis(case):
    """x[..., idx, ...] with one 1-D integer array (NumPy, list or DistArray) = numpy.take."""
    d, axis, idx, form, ell = case
    g = _values(d.global_shape)
    x = DistArray.from_global(g, d)
    arr = np.asarray(idx, dtype=np.int64)
    ind = {"numpy": arr, "list": list(idx),
           "dist": DistArray.from_global(arr, layouts(arr.shape)[-1])}[form]
    if ell and axis == d.ndim - 1:
        key = (Ellipsis, ind)
    else:
        key = (slice(None),) * axis + (ind,)
    assert_equal(x[key], g[(slice(None),) * axis + (arr,)])


@parallel
def test_boolean_masks():
    check_like_numpy(lambda x: x[x > 0], shapes=[(7,), (5, 4), (2, 3, 4), (0, 3)],
                     name="x[x > 0]")
    check_like_numpy(lambda x, y: x[y > 0], shapes=[((5, 4), (5, 4))], mixed=True,
                     name="x[y > 0]")

    def masked_set(x):
        x[x < 0] = 0.0
        return x

    check_like_numpy(masked_set, shapes=[(7,), (5, 4)], name="x[x < 0] = 0")
    m = sample((5, 4)) > 0
    check_like_numpy(lambda x: x[m], shapes=[(5, 4)], name="x[numpy mask]")


@parallel
def test_slicing_needs_no_messages_and_keeps_grid_axes():
    """Positive-step slices: new splits keep every element on the rank that held it."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(sorted(MPI.Compute_dims(comm.size, 2)))
    g = _values((9, 8))
    x = DistArray.from_global(g, Distribution((9, 8), grid))
    y = x[1:8:2, ::3]
    owned = g[x.dist.local_slices()]
    ok = y.dist.dim_axes == x.dist.dim_axes and np.isin(y.local, owned).all()
    z = x[3]  # integer index: the dim's grid axes become replicas
    ok = ok and z.dist.replica_axes == (0,)
    collective_assert(ok, f"{y.dist} / {z.dist}", comm)
    assert_equal(z, g[3])


@parallel
def test_iteration_scalars_and_newaxis():
    comm = MPI.COMM_WORLD
    x = dt.arange(6.0)
    rows = [float(v) for v in x]
    ok = rows == list(np.arange(6.0)) and x[2].item() == 2.0 and int(x[4]) == 4
    ok = ok and x[None, :, None].shape == (1, 6, 1) and bool(x[3] > 2)
    ok = ok and x[np.argmax(x)].item() == 5.0  # a 0-d integer DistArray as an index
    collective_assert(ok, f"{rows}", comm)


@parallel
def test_setitem_with_disabled_redistribution():
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    x = dt.zeros((8, 6), grid=grid, axes=(0, None))
    same = dt.ones((8, 6), grid=grid, axes=(0, None))
    other = dt.ones((8, 6), grid=grid, axes=(None, 0))
    with implicit_redistribution(False):
        x[...] = same  # already lined up
        try:
            x[...] = other
            raised = comm.size == 1
        except ValueError:
            raised = True
    collective_assert(raised, "moving the value was not refused", comm)
    assert_equal(x, np.ones((8, 6)))
