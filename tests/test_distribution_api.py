"""The derivation API (``Distribution.splits``/``replace``, ``ProcessGrid.same_processes``,
``factorizations``) and DistArray's storage API (``buffer``, ``reserve_halo``, ``extended``,
``halo_token``).

References are independent of the code under test: brute-force enumeration for
``factorizations``, boundaries written out by hand or rebuilt with NumPy's
``array_split`` for ``splits``, and ``numpy.pad`` of the global array for the
extended views.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD


def grid_shapes(p):
    """Every 1-D and 2-D grid shape of ``p`` ranks (brute force)."""
    return [(p,)] + [(a, p // a) for a in range(1, p + 1) if p % a == 0]


def cut_patterns(n, p):
    """Some cut lists of ``n`` elements into ``p`` blocks: even, empty first/last, all-in-one."""
    pats = [None, list(np.cumsum([len(c) for c in np.array_split(np.arange(n), p)])[:-1])]
    if p > 1:
        pats += [[0] * (p - 1), [n] * (p - 1), [0] + [n] * (p - 2)]
    return pats


# --------------------------------------------------------------------------- factorizations
@pytest.mark.parametrize("p", range(1, 13))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_factorizations_brute_force(p, k):
    want = sorted(t for t in itertools.product(range(1, p + 1), repeat=k) if math.prod(t) == p)
    got = dt.factorizations(p, k)
    assert sorted(got) == want
    assert got == want  # lexicographic order
    assert dt.grid.factorizations is dt.factorizations


@pytest.mark.parametrize("p, k", [(0, 1), (2, 0), (-1, 2)])
def test_factorizations_rejects_non_positive(p, k):
    with pytest.raises(ValueError, match="p >= 1 and k >= 1"):
        dt.factorizations(p, k)


# --------------------------------------------------------------------------- splits
@pytest.mark.parallel(nprocs=SIZES)
def test_splits_round_trip_uneven_and_empty_blocks():
    p = comm.Get_size()
    for gshape in grid_shapes(p):
        grid = dt.ProcessGrid(gshape, comm)
        for shape in [(7, 5), (2, 9), (0, 4)]:
            q = gshape[-1]
            for cuts in cut_patterns(shape[1], q):
                d = dt.Distribution(shape, grid, (None, len(gshape) - 1), [None, cuts])
                again = dt.Distribution(shape, grid, d.axes, d.splits)
                collective_assert(again == d, f"{d}: round trip gave {again}")
                # the cuts come back as given, except where they are the block rule
                even = list(np.cumsum([len(c) for c in
                                       np.array_split(np.arange(shape[1]), q)])[:-1])
                want = None if cuts is None or list(cuts) == even else tuple(cuts)
                collective_assert(d.splits == (None, want), f"{d.splits} != {(None, want)}")


def test_splits_by_hand_on_a_grid_shape():
    d = dt.Distribution((10, 7), (2, 3), splits=[[0], [1, 1]])
    assert d.splits == ((0,), (1, 1))
    assert d.boundaries == ((0, 0, 10), (0, 1, 1, 7))
    assert dt.Distribution((10, 7), (2, 3)).splits == (None, None)
    assert dt.Distribution((10, 7), (2, 3), splits=[[5], [3, 5]]).splits == (None, None)
    assert dt.Distribution((), (2,), ()).splits == ()


# --------------------------------------------------------------------------- replace
def test_replace_each_keyword():
    d = dt.Distribution((10, 7), (2, 3), splits=[[4], None])
    assert d.replace() == d
    s = d.replace(splits=[None, [0, 7]])
    assert s.global_shape == (10, 7) and s.dim_axes == d.dim_axes
    assert s.boundaries == ((0, 5, 10), (0, 0, 7, 7))
    g = d.replace(global_shape=(4, 5))  # a new shape: the block rule unless splits are given
    assert g.boundaries == ((0, 2, 4), (0, 2, 4, 5)) and g.grid_shape == (2, 3)
    g2 = d.replace(global_shape=(4, 5), splits=[[1], None])
    assert g2.boundaries == ((0, 1, 4), (0, 2, 4, 5))
    a = d.replace(axes=(1, 0))
    assert a.dim_axes == ((1,), (0,)) and a.boundaries == ((0, 4, 7, 10), (0, 4, 7))
    r = d.replace(global_shape=(3,), axes=(None,))
    assert r.boundaries == ((0, 3),) and r.grid_shape == (2, 3)


@pytest.mark.parametrize("kw, exc, match", [
    ({"splits": [[11], None]}, ValueError, "non-decreasing"),
    ({"splits": [[1, 2], None]}, ValueError, "needs 1 cut"),
    ({"splits": [None]}, ValueError, "splits has 1 entries"),
    ({"global_shape": (4,)}, ValueError, "axes has 2 entries"),
    ({"global_shape": (-1, 2)}, ValueError, ">= 0"),
    ({"axes": (0, 0)}, ValueError, "at most one dimension"),
    ({"axes": (0, 2)}, ValueError, "does not exist"),
    ({"splits": [["a"], None]}, TypeError, "integer"),
])
def test_replace_validates_like_the_constructor(kw, exc, match):
    d = dt.Distribution((10, 7), (2, 3))
    with pytest.raises(exc, match=match):
        d.replace(**kw)


@pytest.mark.parallel(nprocs=SIZES)
def test_replace_keeps_the_process_grid():
    grid = dt.ProcessGrid((comm.Get_size(),), comm)
    d = dt.Distribution((5, 3), grid)
    for e in (d.replace(global_shape=(8, 2)), d.replace(axes=(None, 0)),
              d.replace(splits=[[0] * (grid.size - 1), None])):
        collective_assert(e.grid is grid, f"{e} lost the grid")
    p = comm.Get_size()
    e = d.replace(splits=[[0] * (p - 1), None])
    want = (5 if comm.Get_rank() == p - 1 else 0, 3)
    collective_assert(e.local_shape() == want, f"{e.local_shape()} != {want}")


# --------------------------------------------------------------------------- same_processes
@pytest.mark.parallel(nprocs=SIZES)
def test_same_processes():
    p, rank = comm.Get_size(), comm.Get_rank()
    grid = dt.ProcessGrid((p,), comm)
    dup = comm.Dup()
    try:
        other_shape = dt.ProcessGrid((1, p), dup)
        collective_assert(grid.same_processes(grid), "itself")
        collective_assert(grid.same_processes(other_shape), "a congruent Dup, another shape")
        collective_assert(grid.same_processes(dup), "a congruent communicator")
        collective_assert(grid.same_processes(comm), "its own communicator")
        sub = comm.Split(rank % 2, rank)  # all ranks on one rank, two halves on more
        try:
            want = p == 1
            half = dt.ProcessGrid((sub.Get_size(),), sub)
            collective_assert(grid.same_processes(half) == want, "a split communicator")
            collective_assert(half.same_processes(grid) == want, "a split communicator")
        finally:
            sub.Free()
        reversed_ranks = comm.Split(0, p - 1 - rank)  # same group, other order
        try:
            want = p == 1
            got = grid.same_processes(dt.ProcessGrid((p,), reversed_ranks))
            collective_assert(got == want, "ranks in another order")
        finally:
            reversed_ranks.Free()
        self_grid = dt.ProcessGrid((1,), MPI.COMM_SELF)
        collective_assert(grid.same_processes(self_grid) == (p == 1), "a different size")
    finally:
        dup.Free()


def test_same_processes_rejects_other_types():
    grid = dt.ProcessGrid((1,), MPI.COMM_SELF)
    with pytest.raises(TypeError, match="ProcessGrid or an MPI communicator"):
        grid.same_processes((1,))


# --------------------------------------------------------------------------- storage API
def _global(shape):
    return np.arange(math.prod(shape), dtype=np.float64).reshape(shape) * 0.5 - 3


@pytest.mark.parallel(nprocs=SIZES)
def test_extended_equals_numpy_pad_after_exchange():
    p = comm.Get_size()
    for gshape in grid_shapes(p):
        grid = dt.ProcessGrid(gshape, comm)
        shape = (7, 6)
        axes = (0, 1) if len(gshape) == 2 else (0, None)
        for cuts in cut_patterns(shape[0], gshape[0]):
            dist = dt.Distribution(shape, grid, axes, [cuts, None])
            a = _global(shape)
            x = dt.DistArray.from_global(a, dist)
            widths = ((2, 1), (1, 3))
            x.exchange_halo(widths, "reflect")
            sl = dist.local_slices()
            padded = np.pad(a, widths, mode="reflect")
            for w in (widths, ((1, 0), (0, 2)), 0):
                ww = ((w, w), (w, w)) if isinstance(w, int) else w
                ext = x.extended(w)
                want = padded[tuple(slice(s.start + w0 - lo, s.stop + w0 + hi)
                                    for s, (w0, _), (lo, hi) in zip(sl, widths, ww))]
                collective_assert(ext.shape == want.shape and np.array_equal(ext, want),
                                  f"extended({w}) on {dist}")
            collective_assert(np.shares_memory(x.extended(widths), x.buffer), "not a view")
            collective_assert(x.buffer.shape == tuple(n + lo + hi for n, (lo, hi) in
                                                      zip(x.local_shape, x.margins)),
                              "buffer shape")


@pytest.mark.parallel(nprocs=SIZES)
def test_halo_token_changes_on_every_fill():
    grid = dt.ProcessGrid((comm.Get_size(),), comm)
    x = dt.DistArray.from_global(_global((9, 4)), dt.Distribution((9, 4), grid))
    collective_assert(x.halo_token is None, "a fresh array has no fill")
    x.exchange_halo(1)
    first = x.halo_token
    collective_assert(first is not None, "no token after a fill")
    x.exchange_halo(1, "wrap")
    second = x.halo_token
    collective_assert(second is not None and second is not first, "same token twice")
    plan = dt.halo_plan(x.dist, ((1, 1), (0, 0)), "edge")
    request = plan.start(x)
    request.finish()
    collective_assert(x.halo_token is not second, "a plan's fill changes the token too")
    x.reserve_halo(3)  # growth: the margins no longer hold a fill
    collective_assert(x.halo_token is None, "growing keeps a stale token")
    token = x.mark_halo_filled()
    collective_assert(x.halo_token is token and token is not None, "mark_halo_filled")


@pytest.mark.parallel(nprocs=SIZES)
def test_reserve_halo():
    grid = dt.ProcessGrid((comm.Get_size(),), comm)
    a = _global((6, 5))
    x = dt.DistArray.from_global(a, dt.Distribution((6, 5), grid))
    block = a[x.dist.local_slices()]
    x.reserve_halo(((1, 2), (0, 1)))
    collective_assert(x.margins == ((1, 2), (0, 1)), f"margins {x.margins}")
    collective_assert(np.array_equal(x.local, block), "the block changed")
    buf = x.buffer
    x.reserve_halo(((1, 1), (0, 0)))  # within the margins: nothing moves
    collective_assert(x.buffer is buf and x.margins == ((1, 2), (0, 1)), "needless growth")
    x.reserve_halo(2)  # grows every side to at least 2, keeping wider ones
    collective_assert(x.margins == ((2, 2), (2, 2)), f"margins {x.margins}")
    collective_assert(np.array_equal(x.local, block), "the block changed")
    normalized = ((3, 2), (2, 2))
    x.reserve_halo(normalized)
    collective_assert(x.margins == normalized, f"margins {x.margins}")
    assert dt.halo.normalize_widths(normalized, 2) is normalized  # no conversion
    assert dt.halo.normalize_widths(np.int64(1), 2) == ((1, 1), (1, 1))


@pytest.mark.parallel(nprocs=SIZES)
def test_storage_api_errors():
    grid = dt.ProcessGrid((comm.Get_size(),), comm)
    x = dt.DistArray.zeros(dt.Distribution((4, 3), grid))
    with pytest.raises(ValueError, match="exceed the buffer's margins"):
        x.extended(1)
    with pytest.raises(ValueError, match="non-negative"):
        x.reserve_halo(-1)
    with pytest.raises(ValueError, match="one pair per dimension"):
        x.extended(((1, 1), (1, 1), (1, 1)))


def test_replace_gives_the_same_distribution_for_the_same_arguments():
    """A Distribution is immutable: replace keeps what it derived, so the same arguments
    (lists, tuples or NumPy integers alike) give the same object, and other arguments
    another one; arguments it cannot key on are still taken."""
    d = dt.Distribution((10, 7), (2, 3), splits=[[4], None])
    a = d.replace(global_shape=(8, 7), splits=[[3], None])
    assert d.replace(global_shape=[np.int64(8), 7], splits=([3], None)) is a
    assert a.boundaries == ((0, 3, 8), (0, 3, 5, 7))
    b = d.replace(global_shape=(8, 7))
    assert b is not a and b.boundaries == ((0, 4, 8), (0, 3, 5, 7))
    assert d.replace(global_shape=np.array([8, 7])) == b  # an array: not kept, still taken
    for n in range(100):  # what is kept is bounded
        d.replace(global_shape=(n, 7))
    assert len(d.__dict__["_derived"]) <= 64
