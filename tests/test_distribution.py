"""Pure (no MPI) tests of Distribution: block layout, ownership, intersections, bad input.

Every property is checked against an independent reference: NumPy's
``array_split`` / ``unravel_index`` or brute-force counting over the global
index space. A Distribution accepts a grid *shape* instead of a ProcessGrid,
so none of these tests communicates.
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttensor import Distribution, block_boundaries
from disttensor.testing.strategies import distributions, grids

# -------------------------------------------------------------- references


def ref_block_index(rank, grid_shape, dim_axes):
    """Block index per dimension: row-major over the listed grid axes, in the listed order."""
    coords = np.unravel_index(rank, grid_shape)
    return tuple(
        int(np.ravel_multi_index([coords[a] for a in e], [grid_shape[a] for a in e])) if e else 0
        for e in dim_axes
    )


def ref_slices(rank, grid_shape, dim_axes, boundaries):
    bi = ref_block_index(rank, grid_shape, dim_axes)
    return tuple(slice(b[i], b[i + 1]) for b, i in zip(boundaries, bi))


def ref_nreplicas(grid_shape, dim_axes):
    used = {a for e in dim_axes for a in e}
    return math.prod(n for a, n in enumerate(grid_shape) if a not in used)


def split_sizes(n, p_or_cuts):
    """Sizes of numpy.array_split(arange(n), p_or_cuts)."""
    return [len(piece) for piece in np.array_split(np.arange(n), p_or_cuts)]


def check_slice(s, n):
    assert s.step is None
    assert 0 <= s.start <= s.stop <= n, (s, n)


def all_splits(dist):
    """Explicit cut indices that reproduce ``dist.boundaries``."""
    return [list(b[1:-1]) for b in dist.boundaries]


# -------------------------------------------------------------- layout


@given(distributions())
def test_blocks_tile_the_global_array(dist):
    shape, gshape = dist.global_shape, dist.grid_shape
    nrep = ref_nreplicas(gshape, dist.dim_axes)
    assert dist.nreplicas == nrep
    assert dist.nprocs == math.prod(gshape)
    assert dist.ndim == len(shape) and dist.size == math.prod(shape)
    counter = np.zeros(shape, dtype=np.int64)
    for r in range(dist.nprocs):
        sl = dist.local_slices(r)
        assert len(sl) == len(shape)
        for s, n in zip(sl, shape):
            check_slice(s, n)
        assert dist.local_shape(r) == tuple(s.stop - s.start for s in sl)
        assert dist.local_start(r) == tuple(s.start for s in sl)
        counter[sl] += 1
    assert np.all(counter == nrep)
    # every element is held by exactly nreplicas ranks, so the blocks hold nreplicas * size
    total = sum(math.prod(dist.local_shape(r)) for r in range(dist.nprocs))
    assert total == nrep * math.prod(shape)


@given(distributions())
def test_local_slices_follow_grid_coordinates(dist):
    gshape = dist.grid_shape
    for r in range(dist.nprocs):
        assert dist.local_slices(r) == ref_slices(r, gshape, dist.dim_axes, dist.boundaries)
        assert dist.block_index(r) == ref_block_index(r, gshape, dist.dim_axes)
    # normalised axes: a grid axis is used at most once, and unused axes are replicas
    used = [a for e in dist.dim_axes for a in e]
    assert len(used) == len(set(used))
    assert set(dist.replica_axes) == set(range(len(gshape))) - set(used)
    for d, e in enumerate(dist.dim_axes):
        p = math.prod(gshape[a] for a in e)
        assert dist.nblocks[d] == p
        b = dist.boundaries[d]
        assert len(b) == p + 1 and b[0] == 0 and b[-1] == dist.global_shape[d]
        assert all(x <= y for x, y in zip(b, b[1:]))
    assert dist.split_dims == tuple(d for d, p in enumerate(dist.nblocks) if p > 1)


@settings(max_examples=40)
@given(distributions(max_dims=3, max_side=6))
def test_owners_agree_with_local_slices(dist):
    shape = dist.global_shape
    holders = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        holders[idx] = []
    for r in range(dist.nprocs):
        for idx in np.ndindex(*dist.local_shape(r)):
            g = tuple(i + s for i, s in zip(idx, dist.local_start(r)))
            holders[g].append(r)
    for idx in np.ndindex(*shape):
        expected = tuple(sorted(holders[idx]))
        assert len(expected) == dist.nreplicas
        assert dist.owners(idx) == expected
        assert dist.owner(idx) == expected[0]
        # negative indices count from the end, as in NumPy
        neg = tuple(i - n for i, n in zip(idx, shape))
        assert dist.owners(neg) == expected
        for d, i in enumerate(idx):
            blk = dist.block_of(d, i)
            b = dist.boundaries[d]
            assert b[blk] <= i < b[blk + 1]
    for d, n in enumerate(shape):
        out = [0] * len(shape)
        out[d] = n
        with pytest.raises(IndexError):
            dist.owners(tuple(out))
        out[d] = -n - 1
        with pytest.raises(IndexError):
            dist.owners(tuple(out))


@given(st.data())
def test_ranks_of_block_lists_all_replicas(data):
    dist = data.draw(distributions(max_dims=3, max_side=5))
    by_block = {}
    for r in range(dist.nprocs):
        by_block.setdefault(ref_block_index(r, dist.grid_shape, dist.dim_axes), []).append(r)
    assert len(by_block) == math.prod(dist.nblocks)
    for block, ranks in by_block.items():
        assert dist.ranks_of_block(block) == tuple(sorted(ranks))


def _mask(shape, sl):
    m = np.zeros(shape, dtype=bool)
    m[sl] = True
    return m


@st.composite
def distribution_pairs(draw):
    from hypothesis.extra import numpy as hnp

    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7))
    return draw(distributions(shape=shape)), draw(distributions(shape=shape))


@settings(max_examples=40)
@given(distribution_pairs())
def test_intersection_equals_bruteforce(pair):
    a, b = pair
    shape = a.global_shape
    for r, q in itertools.product(range(a.nprocs), range(b.nprocs)):
        overlap = _mask(shape, a.local_slices(r)) & _mask(shape, b.local_slices(q))
        got = a.intersection(b, r, q)
        if not overlap.any():
            assert got is None, (r, q, got)
        else:
            assert got is not None, (r, q)
            for s, n in zip(got, shape):
                check_slice(s, n)
                assert s.start < s.stop
            assert np.array_equal(_mask(shape, got), overlap)
        # symmetric
        assert b.intersection(a, q, r) == got


def test_intersection_needs_same_global_shape():
    a = Distribution((4, 4), (2,))
    b = Distribution((4, 5), (2,))
    with pytest.raises(ValueError, match="global shapes differ"):
        a.intersection(b, 0, 0)


# -------------------------------------------------------------- block sizes


@settings(max_examples=60)
@given(st.integers(0, 40), st.integers(1, 12))
def test_block_boundaries_match_array_split(n, p):
    b = block_boundaries(n, p)
    assert len(b) == p + 1 and b[0] == 0 and b[-1] == n
    assert [y - x for x, y in zip(b, b[1:])] == split_sizes(n, p)
    dist = Distribution((n,), (p,))
    pieces = np.array_split(np.arange(n), p)
    for r in range(p):
        assert np.array_equal(np.arange(n)[dist.local_slices(r)], pieces[r])


@settings(max_examples=60)
@given(st.data())
def test_explicit_splits_follow_array_split(data):
    n = data.draw(st.integers(0, 20))
    p = data.draw(st.integers(1, 6))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=p - 1, max_size=p - 1)))
    dist = Distribution((n,), (p,), splits=[cuts])
    assert dist.boundaries == ((0, *cuts, n),)
    pieces = np.array_split(np.arange(n), cuts)
    for r in range(p):
        got = np.arange(n)[dist.local_slices(r)]
        assert np.array_equal(got, pieces[r]), (cuts, r)
        assert dist.local_shape(r) == (len(pieces[r]),)


@pytest.mark.parametrize(
    "n, cuts",
    [(10, [0]), (10, [10]), (10, [0, 0]), (10, [10, 10]), (10, [3, 3]), (0, [0, 0]), (5, [0, 5])],
)
def test_explicit_splits_with_empty_blocks(n, cuts):
    p = len(cuts) + 1
    dist = Distribution((n,), (p,), splits=[cuts])
    pieces = np.array_split(np.arange(n), cuts)
    sizes = [len(x) for x in pieces]
    assert [dist.local_shape(r)[0] for r in range(p)] == sizes
    for r in range(p):
        assert np.array_equal(np.arange(n)[dist.local_slices(r)], pieces[r])
    for i in range(n):  # empty blocks own nothing
        (owner,) = dist.owners((i,))
        assert sizes[owner] > 0
        assert i in pieces[owner]


def test_splits_in_two_dims_with_permuted_axes():
    a = np.arange(7 * 5).reshape(7, 5)
    dist = Distribution(a.shape, (2, 3), axes=(1, 0), splits=([2, 2], [4]))
    rows = np.array_split(np.arange(7), [2, 2])
    cols = np.array_split(np.arange(5), [4])
    for r in range(6):
        c0, c1 = np.unravel_index(r, (2, 3))
        expected = a[np.ix_(rows[c1], cols[c0])]
        assert np.array_equal(a[dist.local_slices(r)], expected)


# -------------------------------------------------------------- multi-axis splits


def test_multi_axis_split_is_row_major_over_listed_axes():
    d01 = Distribution((8,), (2, 2), axes=[(0, 1)])
    d10 = Distribution((8,), (2, 2), axes=[(1, 0)])
    pieces = np.array_split(np.arange(8), 4)
    for r in range(4):
        c0, c1 = divmod(r, 2)
        assert np.array_equal(np.arange(8)[d01.local_slices(r)], pieces[2 * c0 + c1])
        assert np.array_equal(np.arange(8)[d10.local_slices(r)], pieces[2 * c1 + c0])
    assert d01.axes == ((0, 1),) and d10.axes == ((1, 0),)
    assert d01.nblocks == (4,) and d01.nreplicas == 1
    assert d01 != d10


def test_multi_axis_split_with_replicas_and_second_dim():
    # grid (2, 3, 2): dim 0 split over grid axes (2, 0) -> 4 blocks, dim 1 unsplit,
    # grid axis 1 holds 3 replicas
    dist = Distribution((9, 4), (2, 3, 2), axes=[(2, 0), None])
    assert dist.nblocks == (4, 1) and dist.replica_axes == (1,) and dist.nreplicas == 3
    rows = np.array_split(np.arange(9), 4)
    for r in range(12):
        c = np.unravel_index(r, (2, 3, 2))
        blk = c[2] * 2 + c[0]
        sl = dist.local_slices(r)
        assert np.array_equal(np.arange(9)[sl[0]], rows[blk])
        assert sl[1] == slice(0, 4)
    expected = [r for r in range(12) if np.unravel_index(r, (2, 3, 2))[::2] == (0, 0)]
    assert dist.owners((0, 0)) == tuple(expected) == (0, 2, 4)
    assert dist.owner((8, 3)) == 7  # block 3: c[2] = 1, c[0] = 1 -> ranks 7, 9, 11


def test_multi_axis_split_with_explicit_splits():
    dist = Distribution((10,), (2, 2), axes=[(1, 0)], splits=[[0, 6, 6]])
    pieces = np.array_split(np.arange(10), [0, 6, 6])
    for r in range(4):
        c0, c1 = divmod(r, 2)
        assert np.array_equal(np.arange(10)[dist.local_slices(r)], pieces[2 * c1 + c0])


def test_default_axes():
    assert Distribution((4, 5, 6), (2, 3)).dim_axes == ((0,), (1,), ())
    d = Distribution((4,), (2, 3))
    assert d.dim_axes == ((0,),) and d.replica_axes == (1,) and d.nreplicas == 3
    s = Distribution((), (4,))
    assert s.ndim == 0 and s.nreplicas == 4 and s.local_slices(3) == () and s.owners(()) == (
        0, 1, 2, 3)


def test_int_grid_and_shape_and_numpy_integers():
    d = Distribution(np.int64(10), 3)
    assert d.global_shape == (10,) and d.grid_shape == (3,)
    e = Distribution(
        (np.int32(10),), (np.int64(3),), axes=[np.int64(0)], splits=[[np.int16(2), np.int8(5)]]
    )
    assert e.boundaries == ((0, 2, 5, 10),)
    f = Distribution(np.array([4, 5]), np.array([2, 1]))
    assert f.global_shape == (4, 5) and f.grid_shape == (2, 1)


# -------------------------------------------------------------- equality, hashing


@given(distributions())
def test_rebuilt_distribution_is_equal_and_hashes_equal(dist):
    same = Distribution(dist.global_shape, dist.grid_shape, dist.axes, all_splits(dist))
    assert same == dist and hash(same) == hash(dist)
    assert {dist: 1}[same] == 1
    assert Distribution(dist.global_shape, dist.grid_shape, dist.dim_axes, all_splits(dist)) == dist
    assert dist.with_axes(dist.axes, all_splits(dist)) == dist
    rep = dist.replicated()
    assert rep.nreplicas == dist.nprocs and rep.global_shape == dist.global_shape
    for r in range(dist.nprocs):
        assert rep.local_slices(r) == tuple(slice(0, n) for n in dist.global_shape)


def test_equivalent_specs_are_equal():
    base = Distribution((10, 4), (2, 2))
    same = [
        Distribution([10, 4], [2, 2], axes=[0, 1]),
        Distribution((10, 4), (2, 2), axes=((0,), [1])),
        Distribution((10, 4), (2, 2), splits=[[5], None]),
        Distribution((10, 4), (2, 2), splits=[None, [2]]),
        Distribution((10, 4), (2, 2), axes=[0, 1], splits=[[5], [2]]),
    ]
    for d in same:
        assert d == base and hash(d) == hash(base)
    assert len({base, *same}) == 1


def test_different_distributions_are_unequal():
    base = Distribution((10, 4), (2, 2))
    others = [
        Distribution((10, 5), (2, 2)),
        Distribution((10, 4), (4, 1)),
        Distribution((10, 4), (2, 2), axes=[1, 0]),
        Distribution((10, 4), (2, 2), axes=[0, None]),
        Distribution((10, 4), (2, 2), axes=[(0, 1), None]),
        Distribution((10, 4), (2, 2), splits=[[4], None]),
        Distribution((10, 4), (2, 2, 1)),
    ]
    for d in others:
        assert d != base and not (d == base)
    assert len({base, *others}) == len(others) + 1
    assert base != (10, 4) and base != "Distribution"


def test_distribution_is_immutable():
    d = Distribution((4,), (2,))
    with pytest.raises(AttributeError):
        d.global_shape = (5,)
    with pytest.raises(AttributeError):
        d.anything = 1
    assert d.global_shape == (4,)


def test_repr_mentions_layout():
    r = repr(Distribution((10, 4), (2, 2), splits=[[3], None]))
    assert "(10, 4)" in r and "(2, 2)" in r and "[3]" in r


# -------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # axes
        (dict(shape=(4, 4), grid=(2, 2), axes=[0]), ValueError, "axes has 1 entries"),
        (dict(shape=(4,), grid=(2, 2), axes=[0, 1]), ValueError, "axes has 2 entries"),
        (dict(shape=(4, 4), grid=(2, 2), axes=[0, 2]), ValueError, "grid axis 2 does not exist"),
        (dict(shape=(4,), grid=(2,), axes=[-1]), ValueError, "grid axis -1 does not exist"),
        (dict(shape=(4,), grid=(2, 2), axes=[(0, 5)]), ValueError, "grid axis 5"),
        (dict(shape=(4, 4), grid=(2, 2), axes=[0, 0]), ValueError, "at most one dimension"),
        (dict(shape=(4,), grid=(2, 2), axes=[(1, 1)]), ValueError, "at most one dimension"),
        (dict(shape=(4, 4), grid=(2, 2), axes=[(0, 1), 1]), ValueError, "at most one dimension"),
        (dict(shape=(4,), grid=(2,), axes=[0.5]), TypeError, "grid axis must be an integer"),
        (dict(shape=(4,), grid=(2,), axes=["0"]), TypeError, "grid axis must be an integer"),
        (dict(shape=(4,), grid=(2, 2), axes=[(0, 1.0)]), TypeError, "grid axis must be an integer"),
        # splits
        (dict(shape=(4, 4), grid=(2,), splits=[None]), ValueError, "splits has 1 entries"),
        (dict(shape=(4,), grid=(2,), splits=[None, None]), ValueError, "splits has 2 entries"),
        (dict(shape=(10,), grid=(3,), splits=[[5]]), ValueError, "needs 2 cut indices, got 1"),
        (dict(shape=(10,), grid=(2,), splits=[[2, 5]]), ValueError, "needs 1 cut indices, got 2"),
        (dict(shape=(10, 3), grid=(2,), splits=[None, [1]]), ValueError, "needs 0 cut indices"),
        (dict(shape=(10,), grid=(3,), splits=[[5, 3]]), ValueError, "non-decreasing"),
        (dict(shape=(10,), grid=(2,), splits=[[11]]), ValueError, r"lie in \[0, 10\]"),
        (dict(shape=(10,), grid=(2,), splits=[[-1]]), ValueError, r"lie in \[0, 10\]"),
        (dict(shape=(10,), grid=(3,), splits=[[-2, 4]]), ValueError, "non-decreasing"),
        (dict(shape=(10,), grid=(2,), splits=[[2.5]]), TypeError, "split index must be an integer"),
        (dict(shape=(10,), grid=(2,), splits=[["3"]]), TypeError, "split index must be an int"),
        # global shape
        (dict(shape=(4, -1), grid=(2,)), ValueError, "global shape entries must be >= 0"),
        (dict(shape=(-3,), grid=(2,)), ValueError, "global shape entries must be >= 0"),
        (dict(shape=(4.0, 2), grid=(2,)), TypeError, "global shape entry must be an integer"),
        (dict(shape=(4, "2"), grid=(2,)), TypeError, "global shape entry must be an integer"),
        (dict(shape=(None,), grid=(2,)), TypeError, "global shape entry must be an integer"),
        # grid shape
        (dict(shape=(4,), grid=(0,)), ValueError, "grid shape entries must be >= 1"),
        (dict(shape=(4,), grid=(2, -1)), ValueError, "grid shape entries must be >= 1"),
        (dict(shape=(4,), grid=()), ValueError, "at least one axis"),
        (dict(shape=(4,), grid=(2.5,)), TypeError, "grid shape"),
        (dict(shape=(4,), grid=("2",)), TypeError, "grid shape"),
        (dict(shape=(4,), grid=None), TypeError, "grid shape"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, exc, match):
    kwargs = dict(kwargs)
    with pytest.raises(exc, match=match):
        Distribution(kwargs.pop("shape"), kwargs.pop("grid"), **kwargs)


def test_bad_rank_and_index_queries():
    d = Distribution((10, 4), (2, 2))
    for bad in (-1, 4, 100):
        with pytest.raises(ValueError, match="not in a grid of 4 processes"):
            d.local_slices(bad)
    with pytest.raises(TypeError, match="rank must be an integer"):
        d.local_shape(1.0)
    with pytest.raises(ValueError, match="no ProcessGrid"):
        d.local_slices()  # no grid: rank= is required
    with pytest.raises(IndexError, match="out of bounds"):
        d.block_of(0, 10)
    with pytest.raises(IndexError, match="out of bounds"):
        d.block_of(1, -1)
    with pytest.raises(IndexError, match="does not have 2 entries"):
        d.owners((1,))
    with pytest.raises(IndexError):
        d.owner((10, 0))
    with pytest.raises(TypeError, match="index must be an integer"):
        d.owner((1.5, 0))


@given(grids())
def test_grids_strategy_gives_valid_grid_shapes(gshape):
    assert 1 <= len(gshape) <= 3 and all(n >= 1 for n in gshape) and math.prod(gshape) <= 8
    d = Distribution((3,) * len(gshape), gshape)
    assert d.nprocs == math.prod(gshape) and d.nreplicas == 1
