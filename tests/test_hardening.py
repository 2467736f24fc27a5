"""Bad or unusual input to disttensor: a correct result, or the same clear error on every rank.

Each case runs at 2 and 3 ranks. ``collective_outcome`` makes every rank
compare how the call ended (returned, or raised which type with which
message), so an error on some ranks only fails the test instead of hanging it.
References are NumPy on the whole array.
"""

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert, collective_outcome

comm = MPI.COMM_WORLD
P = comm.Get_size()


def grid1():
    return dt.ProcessGrid(P)


def raises(exc_type, words, fn, *args, **kwargs):
    """Assert that every rank raises ``exc_type`` with one message containing ``words``."""
    _, err = collective_outcome(fn, *args, **kwargs)
    collective_assert(isinstance(err, exc_type), f"expected {exc_type.__name__}, got {err!r}")
    for w in words:
        collective_assert(w in str(err), f"{w!r} not in the message {str(err)!r}")
    return err


def uneven(n, grid):
    """A 1-D Distribution of n elements in which rank 0 holds nothing."""
    cuts = [0, *dt.block_boundaries(n, grid.size - 1)[1:-1]]
    return dt.Distribution((n,), grid, splits=[cuts])


# ------------------------------------------------------------------ dtypes
STRINGS = np.array(["ab", "f", "ghi", "", "xyz", "q", "mn"])


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("dtype", ["<U3", "S3", "<U1", "S7"])
def test_strings_scatter_gather_redistribute(dtype):
    g = grid1()
    a = STRINGS.astype(dtype)
    for dist in (dt.Distribution(a.shape, g), uneven(a.size, g)):
        x, err = collective_outcome(dt.DistArray.from_global, a if g.rank == 0 else None, dist,
                                    root=0)
        collective_assert(err is None, repr(err))
        assert_equal(x, a)
        root_view = x.to_global(root=P - 1)
        collective_assert((g.rank != P - 1) or np.array_equal(root_view, a), repr(root_view))
        y = dt.DistArray.from_global(a, dist).redistribute(dist.replicated())
        assert_equal(y.local, a)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("mode", ["constant", "wrap", "reflect", "symmetric", "edge"])
def test_string_halo_matches_numpy_pad(mode):
    g = grid1()
    a = STRINGS.astype("<U3")
    x = dt.DistArray.from_global(a, dt.Distribution(a.shape, g))
    kw = {"constant_values": "zz"} if mode == "constant" else {}
    ext = x.exchange_halo(2, mode, **kw)
    sl = x.dist.local_slices()[0]
    want = np.pad(a, 2, mode, **kw)[sl.start: sl.stop + 4]
    collective_assert(np.array_equal(ext, want), f"{ext} != {want}")


@pytest.mark.parallel([2, 3])
def test_records_and_datetimes_move_unchanged():
    g = grid1()
    rec = np.zeros(5, [("a", "i4"), ("b", "f8"), ("c", "U2")])
    rec["a"], rec["b"], rec["c"] = np.arange(5), np.linspace(0, 1, 5), list("vwxyz")
    when = np.arange("2026-01-01", "2026-01-06", dtype="datetime64[D]")
    for a in (rec, when, when - when[0]):
        for dist in (dt.Distribution((5,), g), uneven(5, g)):
            x = dt.DistArray.from_global(a if g.rank == 0 else None, dist, root=0)
            assert_equal(x, a)
            ext = dt.DistArray.from_global(a, dist).exchange_halo(1, "wrap")
            sl = dist.local_slices()[0]
            collective_assert(np.array_equal(ext, np.pad(a, 1, "wrap")[sl.start: sl.stop + 2]))


@pytest.mark.parallel([2, 3])
def test_object_dtypes_refused_on_every_rank():
    g = grid1()
    obj = np.array([1, "a", None], dtype=object)
    words = ("cannot hold dtype object",)
    for dist in (dt.Distribution((3,), g), uneven(3, g)):
        raises(TypeError, words, dt.DistArray.from_global, obj if g.rank == 0 else None, dist,
               root=0)
        raises(TypeError, words, dt.DistArray.from_global, obj, dist)
        raises(TypeError, words, dt.zeros, dist, object)
        raises(TypeError, words, dt.DistArray.from_local, obj[dist.local_slices()], dist)
    rec = np.zeros(3, [("a", "i4"), ("o", object)])
    raises(TypeError, ("cannot hold dtype",), dt.DistArray.from_global, rec,
           dt.Distribution((3,), g))


@pytest.mark.parallel([2, 3])
def test_root_side_error_reaches_every_rank():
    g = grid1()
    d = dt.Distribution((3,), g)
    raises(ValueError, ("does not match",), dt.DistArray.from_global,
           np.zeros(4) if g.rank == 0 else None, d, root=0)


# ------------------------------------------------------------------ halo values
@pytest.mark.parallel([2, 3])
def test_constant_values_that_do_not_fit_raise_as_numpy_pad():
    g = grid1()
    x8 = dt.DistArray.from_global(np.arange(6, dtype=np.int8), dt.Distribution((6,), g))
    xi = dt.DistArray.from_global(np.arange(6), dt.Distribution((6,), g))
    for x, value in ((x8, 300), (x8, [[1, 300]]), (xi, np.nan), (x8, -129)):
        _, err = collective_outcome(x.exchange_halo, 1, constant_values=value)
        try:
            np.pad(x.local, 1, constant_values=value)
            want = None
        except Exception as exc:
            want = type(exc)
        collective_assert(want is not None and type(err) is want, f"{value}: {err!r} vs {want}")
    for x, value in ((xi, 1.5), (x8, 127), (xi, (3, -4))):  # what numpy.pad accepts
        ext = x.exchange_halo(1, constant_values=value)
        sl = x.dist.local_slices()[0]
        a = np.arange(6, dtype=x.dtype)
        collective_assert(np.array_equal(ext, np.pad(a, 1, constant_values=value)
                                         [sl.start: sl.stop + 2]), f"{value}: {ext}")


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("mode", ["reflect", "symmetric", "wrap", "edge", "constant"])
@pytest.mark.parametrize("n,width", [(3, 300), (1, 7), (5, (40, 3))])
def test_halos_far_wider_than_the_array(mode, n, width):
    g = grid1()
    a = np.arange(n, dtype=float) * 1.5 + 1
    x = dt.DistArray.from_global(a, dt.Distribution((n,), g))
    ext = x.exchange_halo(width, mode)
    lo, hi = (width, width) if isinstance(width, int) else width
    sl = x.dist.local_slices()[0]
    want = np.pad(a, (lo, hi), mode)[sl.start: sl.stop + lo + hi]
    collective_assert(np.array_equal(ext, want), f"{ext} != {want}")


# ------------------------------------------------------------------ arguments
@pytest.mark.parallel([2, 3])
def test_grid_arguments():
    g = dt.ProcessGrid((P, 1))
    raises(ValueError, ("subcomm: axis 5",), g.subcomm, 5)
    raises(TypeError, ("subcomm: axis",), g.subcomm, True)
    raises(TypeError, ("subcomm: axis",), g.subcomm, (0, 1.0))
    raises(TypeError, ("subcomm: axes",), g.subcomm, None)
    collective_assert(g.subcomm(-1).Get_size() == 1 and g.subcomm(-2).Get_size() == P)
    raises(ValueError, ("neighbor: axis 3",), g.neighbor, 3, 1)
    raises(TypeError, ("neighbor: offset",), g.neighbor, 0, 1.5)
    collective_assert(g.neighbor(-2, 1) == (g.rank + 1 if g.rank + 1 < P else None))
    raises(TypeError, ("comm must be an mpi4py intracommunicator",),
           lambda: dt.ProcessGrid(P, comm="x"))
    raises(ValueError, ("ProcessGrid.create: ndim must be >= 1",), dt.ProcessGrid.create, -1)
    raises(TypeError, ("ProcessGrid.create: ndim",), dt.ProcessGrid.create, 1.5)
    raises(TypeError, ("grid shape",), dt.ProcessGrid, (P, 1.0))


@pytest.mark.parallel([2, 3])
def test_distribution_arguments():
    g = grid1()
    raises(TypeError, ("a grid axis must be an integer, got True",), dt.Distribution, (4,), g,
           axes=[True])
    raises(TypeError, ("global_shape",), dt.Distribution, None, g)
    raises(TypeError, ("global shape entry",), dt.Distribution, (4.0,), g)
    raises(TypeError, ("axes must be a sequence",), dt.Distribution, (4,), g, axes=0)
    raises(TypeError, ("splits must be a sequence",), dt.Distribution, (4,), g, splits=1)
    raises(TypeError, ("splits[0]",), dt.Distribution, (4,), g, splits=[3])
    raises(ValueError, ("block_boundaries: n must be >= 0",), dt.block_boundaries, -10, 3)
    raises(ValueError, ("block_boundaries: p",), dt.block_boundaries, 10, 0)
    raises(TypeError, ("block_boundaries: p",), dt.block_boundaries, 10, 2.5)
    raises(TypeError, ("block_boundaries: n",), dt.block_boundaries, "10", 2)
    b = dt.block_boundaries(10, 3)
    collective_assert(b == (0, 4, 7, 10), str(b))


@pytest.mark.parallel([2, 3])
def test_array_call_arguments():
    g = grid1()
    x = dt.zeros((24,), grid=g)
    raises(TypeError, ("reshape: shape",), x.reshape, 4.0, 6.0)
    raises(TypeError, ("reshape: shape",), x.reshape, 24.9)
    raises(TypeError, ("reshape: shape",), x.reshape, (4, 6.0))
    collective_assert(x.reshape(4, 6).shape == (4, 6) and x.reshape(24).shape == (24,))
    y = dt.arange(16, grid=g).reshape(4, 4)
    raises(TypeError, ("axis must be an int or a tuple of ints, got 1.0",), y.sum, axis=1.0)
    raises(TypeError, ("axis",), y.sum, axis=True)
    raises(TypeError, ("axis",), np.sum, y, axis=(0, 1.0))
    assert_equal(y.sum(axis=np.int64(1)), np.arange(16).reshape(4, 4).sum(axis=1))


@pytest.mark.parallel([2, 3])
def test_halo_plan_arguments():
    g = grid1()
    d1 = dt.Distribution((6,), g)
    d2 = dt.Distribution((6, 4), g)
    for d, w in ((d1, 1), (d1, (1, 2)), (d2, 1), (d2, [[1, 1], [0, 0]])):
        plan, err = collective_outcome(dt.halo_plan, d, w)
        collective_assert(err is None, repr(err))
        x = dt.DistArray.from_global(np.arange(d.size, dtype=float).reshape(d.shape), d)
        ext = plan.exchange(x)
        pairs = np.broadcast_to(np.asarray(w), (d.ndim, 2))
        sl = d.local_slices()
        want = np.pad(np.arange(d.size, dtype=float).reshape(d.shape), pairs)[
            tuple(slice(s.start, s.stop + lo + hi) for s, (lo, hi) in zip(sl, pairs))]
        collective_assert(np.array_equal(ext, want))
    raises(ValueError, ("halo widths", "one pair per dimension of 1"), dt.halo_plan, d1,
           [[1, 1], [0, 0]])
    raises(ValueError, ("halo widths",), dt.halo_plan, d1, 1.5)
    raises(ValueError, ("non-negative",), dt.halo_plan, d1, -1)
    raises(TypeError, ("halo mode must be a string",), dt.halo_plan, d1, 1, ["wrap"])
    raises(ValueError, ("unknown halo mode",), dt.halo_plan, d1, 1, "mirror")
    raises(TypeError, ("halo_plan: dist",), dt.halo_plan, (6,), 1)


@pytest.mark.parallel([2, 3])
def test_random_sizes():
    g = grid1()
    rng = dt.random.default_rng(1)
    raises(ValueError, ("global shape entries must be >= 0",), rng.standard_normal, (-2, 3),
           grid=g)
    raises(ValueError, ("global shape entries must be >= 0",), rng.integers, 0, 5, (-1,), grid=g)
    raises(TypeError, ("global shape entry",), rng.random, (2.5,), grid=g)
    raises(ValueError, ("integers needs",), rng.integers, 5, 5, (3,), grid=g)


@pytest.mark.parallel([2, 3])
def test_roots_ranks_and_plans():
    g = grid1()
    x = dt.arange(6.0, grid=g)
    for root in (True, 0.5, "0"):
        raises(ValueError, ("root must be an int",), x.to_global, root=root)
        raises(ValueError, ("root must be an int",), dt.DistArray.from_global, np.arange(6.0),
               x.dist, root=root)
        raises(ValueError, ("root must be an int",), dt.asarray, np.arange(6.0), root=root,
               grid=g)
    raises(ValueError, ("root must be a rank",), x.to_global, root=P)
    raises(ValueError, ("root must be a rank",), x.to_global, root=-1)
    got = x.to_global(root=np.int32(P - 1))
    collective_assert(np.array_equal(got, np.arange(6.0)) if g.rank == P - 1 else got is None)
    raises(TypeError, ("coords_of: rank",), g.coords_of, 0.5)
    raises(TypeError, ("rank_of: coordinates",), g.rank_of, (0.5,))
    raises(ValueError, ("tag_block: span",), g.tag_block, 0)
    raises(TypeError, ("shape must be an int or a sequence",), dt.zeros, 2.5, grid=g)
    raises(TypeError, ("dst must be a Distribution",), dt.redistribution_plan, x.dist, "y")
    raises(TypeError, ("expected a Distribution",), x.redistribute, (6,))


@pytest.mark.parallel([2, 3])
def test_string_operations_match_numpy():
    g = grid1()
    a = STRINGS.astype("<U3")
    x = dt.DistArray.from_global(a, dt.Distribution(a.shape, g))
    item, err = collective_outcome(lambda: x[2].item())
    collective_assert(err is None and item == a[2], f"{item!r} {err!r}")
    assert_equal(x[1:6:2], a[1:6:2])
    assert_equal(x[::-1], a[::-1])
    assert_equal(np.concatenate([x, x]), np.concatenate([a, a]))
    assert_equal(x == "ab", a == "ab")
    x[0:2] = "zz"
    b = a.copy()
    b[0:2] = "zz"
    assert_equal(x, b)
    _, err = collective_outcome(x.sum)  # NumPy has no sum of strings either
    collective_assert(isinstance(err, TypeError), repr(err))
