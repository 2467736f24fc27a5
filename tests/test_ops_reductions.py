"""Reductions on DistArrays against NumPy, and where their messages go."""

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.testing import assert_equal, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy, sample

parallel = pytest.mark.parallel([1, 2, 3, 4])

SHAPES = [(), (0,), (7,), (5, 4), (3, 0, 2), (3, 4, 5)]
AXES = [None, 0, -1, (0, 2), (1,)]


def _fits(shape, axis):
    if axis is None:
        return True
    axes = axis if isinstance(axis, tuple) else (axis,)
    return all(-len(shape) <= a < len(shape) for a in axes)


@parallel
@pytest.mark.parametrize("name", ["sum", "prod", "mean", "var", "std", "all", "any",
                                  "count_nonzero"])
def test_reductions_over_any_axes(name):
    f = getattr(np, name)
    others = [np.int32, np.bool_, np.complex128]
    for i, axis in enumerate(AXES):
        for keepdims in (False, True):
            kw = {"axis": axis, "keepdims": keepdims}
            shapes = [s for s in SHAPES if _fits(s, axis)]
            dtypes = [np.float64, others[(2 * i + keepdims) % 3]]  # every dtype, in turn
            check_like_numpy(lambda x, kw=kw: f(x, **kw), shapes=shapes, dtypes=dtypes,
                             max_layouts=4, name=f"{name}({kw})")
    # out of range axes raise numpy's AxisError on every rank
    check_like_numpy(lambda x: f(x, axis=3), shapes=[(5, 4)], name=f"{name}(axis=3)")


@parallel
@pytest.mark.parametrize("name", ["min", "max", "argmin", "argmax"])
def test_extrema(name):
    f = getattr(np, name)
    others = [np.int16, np.bool_, np.complex128]
    axes = [None, 0, -1] if name.startswith("arg") else AXES
    for i, axis in enumerate(axes):
        for keepdims in (False, True):
            kw = {"axis": axis, "keepdims": keepdims}
            shapes = [s for s in SHAPES if _fits(s, axis)]  # empty ones must raise
            dtypes = [np.float64, others[(2 * i + keepdims) % 3]]
            check_like_numpy(lambda x, kw=kw: f(x, **kw), shapes=shapes, dtypes=dtypes,
                             max_layouts=4, name=f"{name}({kw})")


@parallel
def test_nan_propagation_and_ties():
    g = sample((6, 5))
    g[2, 3] = np.nan
    g[4, 0] = np.nan
    ints = np.zeros((6, 5), np.int64)
    ints[1, 2] = ints[4, 4] = 7  # ties: the first one wins
    ints[5, 1] = ints[0, 3] = -3
    for arr, name in ((g, "nan"), (ints, "ties")):
        for f in (np.min, np.max, np.argmin, np.argmax, np.sum):
            for axis in (None, 0, 1):
                check_like_numpy(lambda x, f=f, axis=axis, arr=arr: f(x * 0 + arr, axis=axis),
                                 shapes=[(6, 5)], dtypes=[arr.dtype],
                                 name=f"{f.__name__} {name} axis={axis}")


@parallel
def test_dtype_initial_ddof_and_methods():
    cases = [
        (lambda x: np.sum(x, dtype=np.float32), "sum dtype"),
        (lambda x: np.prod(x, axis=0, dtype=np.int64), "prod dtype"),
        (lambda x: np.mean(x, axis=1, dtype=np.float32), "mean dtype"),
        (lambda x: np.sum(x, axis=1, initial=10), "sum initial"),
        (lambda x: np.max(x, axis=0, initial=-100), "max initial"),
        (lambda x: np.var(x, axis=0, ddof=1), "var ddof"),
        (lambda x: np.std(x, ddof=2), "std ddof"),
        (lambda x: x.sum(axis=(0, 1)), "x.sum"), (lambda x: x.mean(), "x.mean"),
        (lambda x: x.max(axis=1, keepdims=True), "x.max"), (lambda x: x.argmin(), "x.argmin"),
        (lambda x: np.add.reduce(x), "add.reduce"),
        (lambda x: np.maximum.reduce(x, axis=1), "maximum.reduce"),
        (lambda x: np.logical_or.reduce(x > 0, axis=None), "logical_or.reduce"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(5, 4), (3, 0)], dtypes=[np.float64, np.int32], name=name)


@parallel
def test_cumulative():
    for f in (np.cumsum, np.cumprod):
        for axis in (None, 0, -1):
            check_like_numpy(lambda x, f=f, axis=axis: f(x, axis=axis),
                             shapes=[(7,), (5, 4), (3, 0, 2), (3, 4, 2)],
                             dtypes=[np.float64, np.int32], name=f"{f.__name__} axis={axis}")
    check_like_numpy(lambda x: np.add.accumulate(x, axis=1), shapes=[(5, 4)])


@parallel
def test_result_distribution():
    """Reduced dims are dropped (or size-1, unsplit); their grid axes become replicas."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(sorted(MPI.Compute_dims(comm.size, 2)))
    x = dt.ones((6, 5, 4), grid=grid, axes=(1, None, 0))
    s = x.sum(axis=0)
    k = x.sum(axis=(0, 2), keepdims=True)
    ok = (s.dist.dim_axes == ((), (0,)) and set(s.dist.replica_axes) == {1}
          and k.dist.dim_axes == ((), (), ()) and k.shape == (1, 5, 1)
          and k.dist.nreplicas == comm.size)
    collective_assert(ok, f"{s.dist} / {k.dist}", comm)
    assert_equal(k, np.full((1, 5, 1), 24.0))


class _Spy:
    """Wraps ``grid.subcomm`` to record which grid axes a reduction talks along."""

    def __init__(self, grid):
        self.grid, self.calls = grid, []
        self.orig = grid.subcomm

    def __enter__(self):
        def spy(axes):
            self.calls.append(tuple(sorted((axes,) if isinstance(axes, int) else axes)))
            return self.orig(axes)

        self.grid.subcomm = spy
        return self

    def __exit__(self, *exc):
        del self.grid.subcomm


@parallel
def test_communication_only_along_splitting_grid_axes():
    comm = MPI.COMM_WORLD
    gshape = sorted(MPI.Compute_dims(comm.size, 2))
    grid = ProcessGrid(gshape)
    g = sample((6, 5, 4))
    x = DistArray.from_global(g, Distribution((6, 5, 4), grid, (1, None, 0)))
    split = [a for a in (0, 1) if gshape[a] > 1]
    checks = [((1,), ()), ((0,), (1,)), ((2,), (0,)), ((0, 1), (1,)), ((0, 2), (0, 1)),
              (None, (0, 1))]
    ok, msgs = True, []
    for axis, axes in checks:
        for f in (np.sum, np.max, np.argmax if axis is None or len(axis) == 1 else np.min):
            with _Spy(grid) as spy:
                r = f(x, axis=axis if axis is None or len(axis) > 1 else axis[0])
            want = tuple(a for a in axes if a in split)
            got = set(spy.calls)
            if got != ({want} if want else set()):
                ok = False
                msgs.append(f"{f.__name__} axis={axis}: subcomms {got}, expected {want}")
            ref = f(g, axis=axis if axis is None or len(axis) > 1 else axis[0])
            ok = ok and np.allclose(r.local, np.asarray(ref)[r.dist.local_slices()])
    collective_assert(ok, "\n".join(msgs) or "wrong values", comm)


@parallel
def test_derived_reductions():
    g = sample((6, 5))
    g[1, 2] = g[3, 3] = np.nan
    g[:, 4] = np.nan  # an all-NaN column
    cases = [
        (lambda x: np.ptp(x, axis=0), "ptp"), (lambda x: np.trace(x), "trace"),
        (lambda x: np.trace(x, offset=-1, dtype=np.float32), "trace offset"),
        (lambda x: np.cumulative_sum(x, axis=1, include_initial=True), "cumulative_sum"),
        (lambda x: np.cumulative_prod(x, axis=0), "cumulative_prod"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(6, 5), (3, 0)], dtypes=[np.float64, np.int32],
                         max_layouts=4, name=name)
    for name in ("nansum", "nanprod", "nanmin", "nanmax", "nanmean", "nanvar", "nanstd"):
        f = getattr(np, name)
        for axis in (None, 0, 1):
            check_like_numpy(lambda x, f=f, axis=axis: f(x * 0 + g, axis=axis),
                             shapes=[(6, 5)], max_layouts=4, name=f"{name} axis={axis}")


@parallel
def test_empty_blocks_on_fresh_grids():
    """Ranks whose block is empty still take part in creating sub-communicators."""
    comm = MPI.COMM_WORLD
    gshape = sorted(MPI.Compute_dims(comm.size, 2))
    g = sample((5, 3))
    for f in (np.argmax, np.argmin, np.sum, np.max, np.cumsum, np.mean):
        grid = ProcessGrid(gshape)  # a new grid: no sub-communicator exists yet
        cuts = [[0] * (gshape[0] - 1), [3] * (gshape[1] - 1)]  # one rank row/column holds all
        x = DistArray.from_global(g, Distribution((5, 3), grid, (0, 1), cuts))
        r = f(x, axis=0)
        collective_assert(np.allclose(r.local, f(g, axis=0)[r.dist.local_slices()]),
                          f.__name__, comm)
